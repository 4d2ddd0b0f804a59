#include "partition/atomic/atomic.h"

#include <algorithm>
#include <map>

#include "common/log_fmt.h"

namespace rannc::partition {

AtomicPartition partitionAtomic(const ir::Graph& graph, ConstantPolicy policy) {
  const std::vector<ir::TaskId> order = graph.topologicalOrder();
  std::vector<int> pos(graph.numTasks());
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<int>(i);

  // Forward pass: mark what depends on the seeds.
  std::vector<char> depends(graph.numValues(), 0);
  for (const ir::Value& v : graph.values()) {
    const bool seed = v.role == ir::ValueRole::Input ||
                      (policy == ConstantPolicy::IndependentOfState && v.isModelState());
    if (seed) depends[v.id] = 1;
  }
  for (ir::ValueId v : graph.inputs()) depends[v] = 1;  // listed inputs, whatever their role
  AtomicPartition out;
  out.constant.assign(graph.numTasks(), 1);
  out.piece_of.assign(graph.numTasks(), -1);
  for (ir::TaskId t : order) {
    const ir::Task& task = graph.task(t);
    const bool dep = std::any_of(task.inputs.begin(), task.inputs.end(),
                                 [&](ir::ValueId v) { return depends[v] != 0; });
    if (!dep) continue;
    out.constant[t] = 0;
    for (ir::ValueId v : task.outputs) depends[v] = 1;
  }

  // Backward pass (any order works: each piece is its anchor plus the constant closure
  // above it). A constant task consumed by a non-constant task is covered by that piece.
  std::vector<char> covered(graph.numTasks(), 0);
  auto closure = [&](ir::TaskId anchor) {
    std::vector<ir::TaskId> tasks{anchor};
    std::vector<ir::TaskId> stack{anchor};
    std::vector<ir::TaskId> seen{anchor};
    while (!stack.empty()) {
      ir::TaskId t = stack.back();
      stack.pop_back();
      for (ir::ValueId v : graph.task(t).inputs) {
        ir::TaskId p = graph.value(v).producer;
        if (p == ir::kNoId || !out.constant[p]) continue;
        if (std::find(seen.begin(), seen.end(), p) != seen.end()) continue;
        seen.push_back(p);
        tasks.push_back(p);
        stack.push_back(p);
        covered[p] = 1;
      }
    }
    std::sort(tasks.begin(), tasks.end(), [&](ir::TaskId a, ir::TaskId b) { return pos[a] < pos[b]; });
    return tasks;
  };
  std::vector<ir::TaskId> anchors;
  for (ir::TaskId t : order) {
    if (!out.constant[t]) anchors.push_back(t);
  }
  std::vector<std::vector<ir::TaskId>> bodies;
  for (ir::TaskId t : anchors) bodies.push_back(closure(t));
  // Constant tasks nobody non-constant reads: anchor the last of each such chain.
  int orphans = 0;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const ir::TaskId t = *it;
    if (!out.constant[t] || covered[t]) continue;
    anchors.push_back(t);
    bodies.push_back(closure(t));
    covered[t] = 1;
    ++orphans;
  }
  // Keep pieces in topological order of their anchors.
  std::vector<size_t> idx(anchors.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return pos[anchors[a]] < pos[anchors[b]]; });
  for (size_t i : idx) {
    out.piece_of[anchors[i]] = static_cast<int>(out.pieces.size());
    out.pieces.push_back(AtomicPiece{anchors[i], std::move(bodies[i])});
  }

  // Piece DAG: only anchors consume non-constant values, so edges run anchor to anchor.
  const int n = static_cast<int>(out.pieces.size());
  out.succ.assign(n, {});
  out.pred.assign(n, {});
  for (int p = 0; p < n; ++p) {
    std::map<int, int64_t> targets;
    const ir::TaskId a = out.pieces[p].anchor;
    if (out.constant[a]) continue;
    for (ir::ValueId v : graph.task(a).outputs) {
      const ir::Value& val = graph.value(v);
      for (ir::TaskId c : val.consumers) {
        const int q = out.piece_of[c];
        if (q >= 0 && q != p) targets[q] += val.isTensor() ? val.bytes() : 0;
      }
    }
    for (auto [q, bytes] : targets) {
      out.succ[p].emplace_back(q, bytes);
      out.pred[q].emplace_back(p, bytes);
    }
  }
  logger().debug("atomic partitioning: {} tasks -> {} pieces ({} constant tasks, {} orphan)",
                 graph.numTasks(), n,
                 std::count(out.constant.begin(), out.constant.end(), char{1}), orphans);
  return out;
}

}  // namespace rannc::partition
