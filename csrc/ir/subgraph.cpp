#include "ir/subgraph.h"

#include <algorithm>
#include <unordered_map>

#include "common/error.h"
#include "common/hash.h"

namespace rannc::ir {
namespace {

std::vector<char> membership(const Graph& graph, const std::vector<TaskId>& tasks) {
  std::vector<char> in(graph.numTasks(), 0);
  for (TaskId t : tasks) {
    graph.task(t);  // throws on unknown ids
    if (in[t]) {
      throw InvalidGraphError("task " + std::to_string(t) + " (" + graph.task(t).op +
                              ") is listed twice in a piece");
    }
    in[t] = 1;
  }
  return in;
}

// A task outside the set that is reachable from the set and reaches back into it,
// or kNoId when the set is convex.
TaskId findReentry(const Graph& graph, const std::vector<char>& in) {
  // Forward search from the set through outside tasks only: reaching an inside task
  // again means a path left the set and came back.
  std::vector<char> seen(graph.numTasks(), 0);
  std::vector<std::pair<TaskId, TaskId>> stack;  // (outside task, first outside task)
  for (const Task& t : graph.tasks()) {
    if (!in[t.id]) continue;
    for (ValueId v : t.outputs) {
      for (TaskId c : graph.value(v).consumers) {
        if (!in[c] && !seen[c]) {
          seen[c] = 1;
          stack.emplace_back(c, c);
        }
      }
    }
  }
  while (!stack.empty()) {
    auto [t, first] = stack.back();
    stack.pop_back();
    for (ValueId v : graph.task(t).outputs) {
      for (TaskId c : graph.value(v).consumers) {
        if (in[c]) return first;
        if (!seen[c]) {
          seen[c] = 1;
          stack.emplace_back(c, first);
        }
      }
    }
  }
  return kNoId;
}

}  // namespace

bool isConvex(const Graph& graph, const std::vector<TaskId>& tasks) {
  return findReentry(graph, membership(graph, tasks)) == kNoId;
}

Subgraph extractSubgraph(const Graph& graph, const std::vector<TaskId>& tasks) {
  if (tasks.empty()) throw InvalidGraphError("a piece needs at least one task");
  std::vector<char> in = membership(graph, tasks);
  TaskId bad = findReentry(graph, in);
  if (bad != kNoId) {
    const Task& t = graph.task(bad);
    throw InvalidGraphError("the piece is not convex: task " + std::to_string(bad) + " (" + t.op +
                            (t.scope.empty() ? "" : " in " + t.scope) +
                            ") lies outside it on a path that leaves and re-enters it");
  }
  Subgraph piece;
  for (TaskId t : graph.topologicalOrder()) {
    if (in[t]) piece.tasks.push_back(t);
  }
  std::vector<char> is_graph_output(graph.numValues(), 0);
  for (ValueId v : graph.outputs()) is_graph_output[v] = 1;
  std::vector<char> listed(graph.numValues(), 0);
  for (TaskId t : piece.tasks) {
    for (ValueId v : graph.task(t).inputs) {
      const Value& val = graph.value(v);
      if ((val.producer == kNoId || !in[val.producer]) && !listed[v]) {
        listed[v] = 1;
        piece.inputs.push_back(v);
      }
    }
  }
  for (TaskId t : piece.tasks) {
    for (ValueId v : graph.task(t).outputs) {
      const Value& val = graph.value(v);
      bool used_outside = is_graph_output[v] ||
                          std::any_of(val.consumers.begin(), val.consumers.end(),
                                      [&](TaskId c) { return !in[c]; });
      if (used_outside) piece.outputs.push_back(v);
    }
  }
  return piece;
}

uint64_t contentHash(const Graph& graph, const Subgraph& piece) {
  Fnv1a h;
  std::unordered_map<ValueId, int64_t> local;
  auto describeValue = [&](const Value& v) {
    h.u64(static_cast<uint64_t>(v.kind)).u64(static_cast<uint64_t>(v.dtype));
    h.u64(v.shape.size());
    for (int64_t d : v.shape) h.i64(d);
    h.i64(v.batch_dim).i64(v.batch_multiple).u64(v.batch_dependent).u64(v.is_loss);
    h.u64(v.requires_grad);
    for (int64_t x : v.int_batch_multiples) h.i64(x);
  };
  auto ref = [&](ValueId id) {
    auto it = local.find(id);
    if (it != local.end()) {
      h.i64(it->second);
      return;
    }
    const Value& v = graph.value(id);
    const int64_t idx = static_cast<int64_t>(local.size());
    local.emplace(id, idx);
    // Model inputs and intermediates are both activations to a piece: hash them alike.
    const ValueRole role = v.role == ValueRole::Input ? ValueRole::Intermediate : v.role;
    h.i64(-1).u64(static_cast<uint64_t>(role)).str(v.constant);
    describeValue(v);
  };
  h.u64(piece.tasks.size());
  for (TaskId tid : piece.tasks) {
    const Task& t = graph.task(tid);
    h.str(t.op).u64(t.inputs.size());
    for (ValueId v : t.inputs) ref(v);
    h.u64(t.outputs.size());
    for (ValueId v : t.outputs) {
      local.emplace(v, static_cast<int64_t>(local.size()));
      describeValue(graph.value(v));
    }
  }
  h.u64(piece.outputs.size());
  for (ValueId v : piece.outputs) ref(v);
  return h.digest();
}

std::vector<Subgraph> splitTopological(const Graph& graph, int k) {
  const int n = graph.numTasks();
  if (k < 1 || k > n) {
    throw InvalidGraphError("cannot cut a graph of " + std::to_string(n) + " tasks into " +
                            std::to_string(k) + " pieces (need 1 <= k <= " + std::to_string(n) +
                            ")");
  }
  // [Note: contiguous pieces are convex] A path a -> c -> b visits c between a and b in
  // any topological order, so an interval of that order cannot be left and re-entered.
  std::vector<TaskId> order = graph.topologicalOrder();
  std::vector<int> pos(n);
  for (int i = 0; i < n; ++i) pos[order[i]] = i;
  // Last position at which each value is read, to know what crosses a cut.
  std::vector<int> last_use(graph.numValues(), -1);
  for (int i = 0; i < n; ++i) {
    for (ValueId v : graph.task(order[i]).inputs) last_use[v] = std::max(last_use[v], i);
  }
  // A cut before position `cut` is clean when no list or tuple that carries gradients
  // crosses it: a stage boundary passes tensors, whose gradients flow back one by one.
  auto clean = [&](int cut) {
    for (int i = 0; i < cut; ++i) {
      for (ValueId v : graph.task(order[i]).outputs) {
        const Value& val = graph.value(v);
        if (last_use[v] >= cut && val.requires_grad && !val.isTensor()) return false;
      }
    }
    return true;
  };
  std::vector<int> cuts{0};
  for (int i = 1; i < k; ++i) {
    int cut = std::max(static_cast<int>((static_cast<int64_t>(n) * i) / k), cuts.back() + 1);
    const int limit = n - (k - i);  // leave at least one task per remaining piece
    int moved = cut;
    while (moved < limit && !clean(moved)) ++moved;
    cuts.push_back(moved <= limit && clean(moved) ? moved : cut);
  }
  cuts.push_back(n);
  std::vector<Subgraph> pieces;
  for (int i = 0; i < k; ++i) {
    pieces.push_back(extractSubgraph(
        graph, std::vector<TaskId>(order.begin() + cuts[i], order.begin() + cuts[i + 1])));
  }
  return pieces;
}

}  // namespace rannc::ir
