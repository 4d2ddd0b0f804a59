#include "partition/atomic/atomic.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <map>
#include <queue>
#include <set>

#include "common/error.h"
#include "common/log_fmt.h"

namespace rannc::partition {

namespace {

struct UnionFind {
  std::vector<int> parent;
  explicit UnionFind(size_t n) : parent(n) {
    for (size_t i = 0; i < n; ++i) parent[i] = static_cast<int>(i);
  }
  int find(int x) {
    while (parent[x] != x) x = parent[x] = parent[parent[x]];
    return x;
  }
  bool unite(int a, int b) {
    a = find(a);
    b = find(b);
    if (a == b) return false;
    parent[std::max(a, b)] = std::min(a, b);
    return true;
  }
};

// A value each replica computes over its own rows and sends whole ([Note: share scalars]).
bool isShareScalar(const ir::Value& v) {
  return v.isTensor() && v.batch_dependent && !v.isBatch() && v.int_values.empty();
}

// The anchor DAG: per anchor index, the anchor indices reading its outputs.
std::vector<std::set<int>> anchorSuccessors(const ir::Graph& graph, const std::vector<int>& owner,
                                            const std::vector<ir::TaskId>& anchors) {
  std::vector<std::set<int>> succ(anchors.size());
  for (size_t i = 0; i < anchors.size(); ++i) {
    for (ir::ValueId v : graph.task(anchors[i]).outputs) {
      for (ir::TaskId c : graph.value(v).consumers) {
        if (owner[c] >= 0 && owner[c] != static_cast<int>(i)) succ[i].insert(owner[c]);
      }
    }
  }
  return succ;
}

// Strongly connected components of the quotient of `succ` by `uf`'s sets (Kosaraju, with
// explicit stacks: graphs have thousands of anchors). Unites each component's sets;
// returns whether any were united.
bool uniteCycles(const std::vector<std::set<int>>& succ, UnionFind& uf) {
  const int n = static_cast<int>(succ.size());
  std::vector<std::set<int>> out(n), in(n);
  for (int i = 0; i < n; ++i) {
    for (int j : succ[i]) {
      const int a = uf.find(i), b = uf.find(j);
      if (a != b) {
        out[a].insert(b);
        in[b].insert(a);
      }
    }
  }
  std::vector<int> finish;
  std::vector<char> seen(n, 0);
  for (int r = 0; r < n; ++r) {
    if (uf.find(r) != r || seen[r]) continue;
    std::vector<std::pair<int, std::set<int>::const_iterator>> stack{{r, out[r].begin()}};
    seen[r] = 1;
    while (!stack.empty()) {
      auto& [node, it] = stack.back();
      if (it == out[node].end()) {
        finish.push_back(node);
        stack.pop_back();
        continue;
      }
      const int next = *it++;
      if (!seen[next]) {
        seen[next] = 1;
        stack.push_back({next, out[next].begin()});
      }
    }
  }
  bool united = false;
  std::vector<char> assigned(n, 0);
  for (auto r = finish.rbegin(); r != finish.rend(); ++r) {
    if (assigned[*r]) continue;
    std::vector<int> stack{*r};
    assigned[*r] = 1;
    while (!stack.empty()) {
      const int node = stack.back();
      stack.pop_back();
      for (int prev : in[node]) {
        if (assigned[prev]) continue;
        assigned[prev] = 1;
        united |= uf.unite(*r, prev);
        stack.push_back(prev);
      }
    }
  }
  return united;
}

// [Note: share scalars] Group id per anchor index (dense, 0..): the anchors a share scalar
// links, closed so that each group is convex and the groups' quotient is acyclic.
std::vector<int> shareScalarGroups(const ir::Graph& graph, const std::vector<char>& constant,
                                   const std::vector<ir::TaskId>& anchors) {
  const size_t n = anchors.size();
  std::vector<int> owner(graph.numTasks(), -1);
  for (size_t i = 0; i < n; ++i) {
    if (!constant[anchors[i]]) owner[anchors[i]] = static_cast<int>(i);
  }
  UnionFind uf(n);
  bool any = false;
  for (const ir::Value& v : graph.values()) {
    if (!isShareScalar(v) || v.producer == ir::kNoId || owner[v.producer] < 0) continue;
    for (ir::TaskId c : v.consumers) {
      if (owner[c] >= 0) any |= uf.unite(owner[v.producer], owner[c]);
    }
  }
  std::vector<int> dense(n);
  if (any) {
    const std::vector<std::set<int>> succ = anchorSuccessors(graph, owner, anchors);
    std::vector<std::vector<int>> pred(n);
    for (size_t i = 0; i < n; ++i) {
      for (int j : succ[i]) pred[j].push_back(static_cast<int>(i));
    }
    // Anchor indices follow a topological order until the orphans (which link nothing),
    // so a path between two members stays between their indices.
    for (bool changed = true; changed;) {
      changed = false;
      std::map<int, std::vector<int>> groups;
      for (size_t i = 0; i < n; ++i) groups[uf.find(static_cast<int>(i))].push_back(static_cast<int>(i));
      for (const auto& [root, m] : groups) {
        if (m.size() < 2) continue;
        const int lo = m.front(), hi = m.back();
        std::vector<char> ahead(n, 0), behind(n, 0);
        std::vector<int> stack(m.begin(), m.end());
        for (int i : m) ahead[i] = 1;
        while (!stack.empty()) {
          const int i = stack.back();
          stack.pop_back();
          for (int j : succ[i]) {
            if (j <= hi && !ahead[j]) ahead[j] = 1, stack.push_back(j);
          }
        }
        stack.assign(m.begin(), m.end());
        for (int i : m) behind[i] = 1;
        while (!stack.empty()) {
          const int i = stack.back();
          stack.pop_back();
          for (int j : pred[i]) {
            if (j >= lo && !behind[j]) behind[j] = 1, stack.push_back(j);
          }
        }
        for (int i = lo; i <= hi; ++i) {
          if (ahead[i] && behind[i]) changed |= uf.unite(root, i);
        }
      }
      changed |= uniteCycles(succ, uf);
    }
  }
  std::map<int, int> ids;
  for (size_t i = 0; i < n; ++i) {
    dense[i] = ids.emplace(uf.find(static_cast<int>(i)), static_cast<int>(ids.size())).first->second;
  }
  return dense;
}

// The groups in a topological order of their quotient DAG, the earliest anchor first among
// the ready ones (with no joins: the anchors' own order).
std::vector<int> topologicalGroups(const ir::Graph& graph, const std::vector<char>& constant,
                                   const std::vector<ir::TaskId>& anchors,
                                   const std::vector<int>& group, const std::vector<int>& pos) {
  const int n_groups = group.empty() ? 0 : *std::max_element(group.begin(), group.end()) + 1;
  if (n_groups == static_cast<int>(anchors.size())) {  // nothing joined: the anchors' order
    std::vector<int> index(anchors.size()), order;
    for (size_t i = 0; i < index.size(); ++i) index[i] = static_cast<int>(i);
    std::sort(index.begin(), index.end(), [&](int a, int b) { return pos[anchors[a]] < pos[anchors[b]]; });
    for (int i : index) order.push_back(group[i]);
    return order;
  }
  std::vector<int> owner(graph.numTasks(), -1), first(n_groups, std::numeric_limits<int>::max());
  for (size_t i = 0; i < anchors.size(); ++i) {
    if (!constant[anchors[i]]) owner[anchors[i]] = static_cast<int>(i);
    first[group[i]] = std::min(first[group[i]], pos[anchors[i]]);
  }
  std::vector<std::set<int>> succ(n_groups);
  std::vector<int> indegree(n_groups, 0);
  const std::vector<std::set<int>> anchor_succ = anchorSuccessors(graph, owner, anchors);
  for (size_t i = 0; i < anchors.size(); ++i) {
    for (int j : anchor_succ[i]) {
      if (group[i] != group[j] && succ[group[i]].insert(group[j]).second) ++indegree[group[j]];
    }
  }
  using Ready = std::pair<int, int>;  // (first position, group)
  std::priority_queue<Ready, std::vector<Ready>, std::greater<Ready>> ready;
  for (int g = 0; g < n_groups; ++g) {
    if (indegree[g] == 0) ready.push({first[g], g});
  }
  std::vector<int> order;
  while (!ready.empty()) {
    const int g = ready.top().second;
    ready.pop();
    order.push_back(g);
    for (int h : succ[g]) {
      if (--indegree[h] == 0) ready.push({first[h], h});
    }
  }
  if (static_cast<int>(order.size()) != n_groups) {
    throw InternalError("atomic partitioning: the joined pieces form a cycle");
  }
  return order;
}

}  // namespace

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
  // [Note: share scalars] join the anchors that a share scalar links, then form one piece
  // per group, in a topological order of the groups.
  const std::vector<int> group = shareScalarGroups(graph, out.constant, anchors);
  const int n_groups = group.empty() ? 0 : *std::max_element(group.begin(), group.end()) + 1;
  std::vector<std::vector<size_t>> members(n_groups);
  for (size_t i = 0; i < anchors.size(); ++i) members[group[i]].push_back(i);
  for (auto& m : members) {
    std::sort(m.begin(), m.end(), [&](size_t a, size_t b) { return pos[anchors[a]] < pos[anchors[b]]; });
  }
  for (int g : topologicalGroups(graph, out.constant, anchors, group, pos)) {
    const int piece = static_cast<int>(out.pieces.size());
    std::vector<ir::TaskId> tasks;
    for (size_t i : members[g]) {
      out.piece_of[anchors[i]] = piece;  // an orphan constant anchors a piece of its own
      tasks.insert(tasks.end(), bodies[i].begin(), bodies[i].end());
    }
    std::sort(tasks.begin(), tasks.end(), [&](ir::TaskId a, ir::TaskId b) { return pos[a] < pos[b]; });
    tasks.erase(std::unique(tasks.begin(), tasks.end()), tasks.end());
    out.joined += static_cast<int>(members[g].size()) - 1;
    out.pieces.push_back(AtomicPiece{anchors[members[g].front()], std::move(tasks)});
  }

  // Piece DAG: only non-constant tasks consume non-constant values.
  const int n = static_cast<int>(out.pieces.size());
  out.succ.assign(n, {});
  out.pred.assign(n, {});
  for (int p = 0; p < n; ++p) {
    std::map<int, int64_t> targets;
    for (ir::TaskId t : out.pieces[p].tasks) {
      if (out.constant[t]) continue;
      for (ir::ValueId v : graph.task(t).outputs) {
        const ir::Value& val = graph.value(v);
        for (ir::TaskId c : val.consumers) {
          const int q = out.piece_of[c];
          if (q >= 0 && q != p) targets[q] += val.isTensor() ? val.bytes() : 0;
        }
      }
    }
    for (auto [q, bytes] : targets) {
      out.succ[p].emplace_back(q, bytes);
      out.pred[q].emplace_back(p, bytes);
    }
  }
  logger().debug("atomic partitioning: {} tasks -> {} pieces ({} constant tasks, {} orphan, "
                 "{} joined by share scalars)",
                 graph.numTasks(), n,
                 std::count(out.constant.begin(), out.constant.end(), char{1}), orphans,
                 out.joined);
  return out;
}

}  // namespace rannc::partition
