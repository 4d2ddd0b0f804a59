#include "partition/block/block.h"

#include <algorithm>
#include <queue>
#include <unordered_map>

#include "common/error.h"
#include "common/log_fmt.h"
#include "partition/cost/memory.h"

namespace rannc::partition {
namespace {

// A group of atomic pieces during coarsening; ids < n are the pieces themselves, every
// merge appends a new group whose children are the two it replaced (the merge forest the
// uncoarsening walks back down).
struct Group {
  std::vector<int> atoms;
  std::vector<ir::TaskId> tasks;
  double time = 0.0;
  int64_t memory = 0;
  std::unordered_map<int, int64_t> succ, pred;  // quotient edges with bytes
  bool alive = true;
  int child_a = -1, child_b = -1;
};

class BlockPartitioner {
 public:
  BlockPartitioner(const AtomicPartition& atomic, CostModel& costs, const BlockOptions& options)
      : atomic_(atomic), costs_(costs), options_(options),
        task_mark_(costs.graph().numTasks(), 0) {}

  BlockPartition run() {
    const int n = static_cast<int>(atomic_.pieces.size());
    if (n == 0) throw InvalidGraphError("cannot partition a graph without tasks");
    init();
    coarsen();
    top_.assign(n, -1);
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (!groups_[g].alive) continue;
      for (int a : groups_[g].atoms) top_[a] = static_cast<int>(g);
    }
    if (options_.uncoarsen) uncoarsen();
    return finish();
  }

 private:
  // ---- helpers ------------------------------------------------------------------
  std::vector<ir::TaskId> unionTasks(const std::vector<const std::vector<ir::TaskId>*>& parts) {
    ++task_stamp_;
    std::vector<ir::TaskId> out;
    for (const auto* p : parts) {
      for (ir::TaskId t : *p) {
        if (task_mark_[t] == task_stamp_) continue;
        task_mark_[t] = task_stamp_;
        out.push_back(t);
      }
    }
    return out;
  }
  int64_t memoryRows() const { return options_.memory_rows > 0 ? options_.memory_rows : options_.rows; }
  // Time at `rows` and memory at `memory_rows` of the union of `parts` (listed in a
  // topological order), which a measuring cost model may compose from the parts.
  std::pair<double, int64_t> evaluate(const std::vector<const std::vector<ir::TaskId>*>& parts) {
    const PieceCost c = costs_.unionCost(parts, options_.rows);
    const int64_t mem_rows = memoryRows();
    const PieceCost m = mem_rows == options_.rows ? c : costs_.unionCost(parts, mem_rows);
    return {c.forward_time + c.backward_time, replicaMemory(m, options_.optimizer, 1, false, options_.model_copies)};
  }
  std::pair<double, int64_t> evaluateAtoms(std::vector<int> atoms) {
    std::sort(atoms.begin(), atoms.end());  // atoms are numbered in a topological order
    std::vector<const std::vector<ir::TaskId>*> parts;
    parts.reserve(atoms.size());
    for (int a : atoms) parts.push_back(&atomic_.pieces[a].tasks);
    return evaluate(parts);
  }
  std::vector<ir::TaskId> atomsTasks(const std::vector<int>& atoms) {
    std::vector<const std::vector<ir::TaskId>*> parts;
    for (int a : atoms) parts.push_back(&atomic_.pieces[a].tasks);
    return unionTasks(parts);
  }

  void init() {
    const int n = static_cast<int>(atomic_.pieces.size());
    std::vector<std::vector<ir::TaskId>> all;
    for (const AtomicPiece& p : atomic_.pieces) all.push_back(p.tasks);
    costs_.prefetch(all, options_.rows);
    // Merged groups are composed from the atoms at both row counts ([Note: composed costs]).
    if (costs_.composesUnions() && memoryRows() != options_.rows) costs_.prefetch(all, memoryRows());
    groups_.resize(n);
    for (int a = 0; a < n; ++a) {
      Group& g = groups_[a];
      g.atoms = {a};
      g.tasks = atomic_.pieces[a].tasks;
      std::tie(g.time, g.memory) = evaluate({&g.tasks});
      for (auto [q, b] : atomic_.succ[a]) g.succ[q] += b;
      for (auto [q, b] : atomic_.pred[a]) g.pred[q] += b;
    }
    // Pieces are numbered in a topological order of their anchors, so of the piece DAG.
    order_.resize(n);
    pos_.resize(n);
    for (int a = 0; a < n; ++a) order_[a] = pos_[a] = a;
    alive_ = n;
  }

  // ---- coarsening ---------------------------------------------------------------
  // Merging `first` -> `second` (an edge of the quotient DAG) keeps it acyclic iff no other
  // path leads from first to second. Such a path only visits groups placed between them
  // in the maintained topological order, so the search stays local. Fills `between` with
  // the groups reachable from `first` in that window (they must move after the merge).
  bool mergeKeepsAcyclic(int first, int second, std::vector<int>& between) {
    between.clear();
    ++group_stamp_;
    if (group_mark_.size() < groups_.size()) group_mark_.resize(groups_.size() * 2 + 16, 0);
    std::vector<int> stack;
    const int limit = pos_[second];
    for (const auto& [y, b] : groups_[first].succ) {
      if (y == second || pos_[y] > limit) continue;
      group_mark_[y] = group_stamp_;
      stack.push_back(y);
    }
    while (!stack.empty()) {
      const int y = stack.back();
      stack.pop_back();
      between.push_back(y);
      for (const auto& [z, b] : groups_[y].succ) {
        if (z == second) return false;
        if (pos_[z] > limit || group_mark_[z] == group_stamp_) continue;
        group_mark_[z] = group_stamp_;
        stack.push_back(z);
      }
    }
    return true;
  }

  int merge(int first, int second, std::vector<int>& between, std::vector<ir::TaskId> tasks,
            double time, int64_t memory) {
    const int id = static_cast<int>(groups_.size());
    Group ng;
    Group& f = groups_[first];
    Group& s = groups_[second];
    ng.atoms = f.atoms;
    ng.atoms.insert(ng.atoms.end(), s.atoms.begin(), s.atoms.end());
    ng.tasks = std::move(tasks);
    ng.time = time;
    ng.memory = memory;
    ng.child_a = first;
    ng.child_b = second;
    for (const auto& [y, b] : f.succ) if (y != second) ng.succ[y] += b;
    for (const auto& [y, b] : s.succ) ng.succ[y] += b;
    for (const auto& [y, b] : f.pred) ng.pred[y] += b;
    for (const auto& [y, b] : s.pred) if (y != first) ng.pred[y] += b;
    f.alive = s.alive = false;
    f.succ.clear(); f.pred.clear(); s.succ.clear(); s.pred.clear();
    f.tasks.clear(); f.tasks.shrink_to_fit(); s.tasks.clear(); s.tasks.shrink_to_fit();
    groups_.push_back(std::move(ng));
    Group& g = groups_.back();
    for (const auto& [y, b] : g.succ) {
      auto& p = groups_[y].pred;
      p.erase(first); p.erase(second); p[id] = b;
    }
    for (const auto& [y, b] : g.pred) {
      auto& sc = groups_[y].succ;
      sc.erase(first); sc.erase(second); sc[id] = b;
    }
    // New order of the window [first, second]: the untouched groups, the merged group,
    // then the groups that depend on `first` (already in a valid relative order).
    const int lo = pos_[first], hi = pos_[second];
    std::sort(between.begin(), between.end(), [&](int a, int b) { return pos_[a] < pos_[b]; });
    ++group_stamp_;
    for (int r : between) group_mark_[r] = group_stamp_;
    std::vector<int> seq;
    for (int i = lo; i <= hi; ++i) {
      const int y = order_[i];
      if (y < 0 || y == first || y == second || group_mark_[y] == group_stamp_) continue;
      seq.push_back(y);
    }
    seq.push_back(id);
    seq.insert(seq.end(), between.begin(), between.end());
    pos_.push_back(0);
    for (int i = lo; i <= hi; ++i) {
      const int k = i - lo;
      order_[i] = k < static_cast<int>(seq.size()) ? seq[k] : -1;
      if (order_[i] >= 0) pos_[order_[i]] = i;
    }
    --alive_;
    return id;
  }

  void coarsen() {
    const int k = std::max(1, options_.num_blocks);
    std::vector<int> matched_level;
    std::vector<int> between;
    for (int level = 1; alive_ > k; ++level) {
      std::vector<int> cand;
      for (size_t g = 0; g < groups_.size(); ++g) if (groups_[g].alive) cand.push_back(static_cast<int>(g));
      std::stable_sort(cand.begin(), cand.end(),
                       [&](int a, int b) { return groups_[a].time < groups_[b].time; });
      matched_level.resize(groups_.size() + cand.size(), 0);
      int merges = 0;
      for (int v : cand) {
        if (alive_ <= k) break;
        if (!groups_[v].alive || matched_level[v] == level) continue;
        struct Option { int w; double time; int64_t memory; std::vector<ir::TaskId> tasks; };
        std::vector<Option> options;
        auto consider = [&](int w) {
          if (!groups_[w].alive || matched_level[w] == level) return;
          auto tasks = unionTasks({&groups_[v].tasks, &groups_[w].tasks});
          const bool v_first = groups_[v].succ.count(w) > 0;
          auto [time, memory] = v_first ? evaluate({&groups_[v].tasks, &groups_[w].tasks})
                                        : evaluate({&groups_[w].tasks, &groups_[v].tasks});
          options.push_back(Option{w, time, memory, std::move(tasks)});
        };
        for (const auto& [w, b] : groups_[v].succ) consider(w);
        for (const auto& [w, b] : groups_[v].pred) consider(w);
        std::sort(options.begin(), options.end(), [](const Option& a, const Option& b) {
          return a.time != b.time ? a.time < b.time : a.w < b.w;
        });
        for (Option& o : options) {
          if (o.memory > options_.memory_limit) continue;
          const bool forward = groups_[v].succ.count(o.w) > 0;
          const int first = forward ? v : o.w, second = forward ? o.w : v;
          if (!mergeKeepsAcyclic(first, second, between)) continue;
          const int id = merge(first, second, between, std::move(o.tasks), o.time, o.memory);
          matched_level.resize(groups_.size() + 1, 0);
          matched_level[v] = matched_level[o.w] = matched_level[id] = level;
          ++merges;
          break;
        }
      }
      // Drop the holes merges left in the order.
      std::vector<int> packed;
      for (int y : order_) if (y >= 0) packed.push_back(y);
      order_ = std::move(packed);
      for (size_t i = 0; i < order_.size(); ++i) pos_[order_[i]] = static_cast<int>(i);
      levels_ = level;
      if (merges == 0) break;
    }
  }

  // ---- uncoarsening -------------------------------------------------------------
  std::vector<int> leaves(int g) const {
    std::vector<int> out, stack{g};
    while (!stack.empty()) {
      const int x = stack.back();
      stack.pop_back();
      if (groups_[x].child_a < 0) {
        out.push_back(x);
      } else {
        stack.push_back(groups_[x].child_a);
        stack.push_back(groups_[x].child_b);
      }
    }
    return out;
  }

  void bump(int from, int to, int delta) {
    auto& m = tsucc_[from];
    const int v = (m[to] += delta);
    RANNC_CHECK(v >= 0, "negative edge count between groups " << from << " and " << to);
    if (v == 0) m.erase(to);
  }

  // Moves `atoms` (marked with atom_stamp_) from group `from` to `to`, keeping the counts
  // of atom edges between top groups.
  void move(const std::vector<int>& atoms, int from, int to) {
    for (int a : atoms) {
      for (auto [q, b] : atomic_.succ[a]) {
        if (atom_mark_[q] == atom_stamp_) continue;
        const int tq = top_[q];
        if (tq != from) bump(from, tq, -1);
        if (tq != to) bump(to, tq, +1);
      }
      for (auto [q, b] : atomic_.pred[a]) {
        if (atom_mark_[q] == atom_stamp_) continue;
        const int tq = top_[q];
        if (tq != from) bump(tq, from, -1);
        if (tq != to) bump(tq, to, +1);
      }
    }
    for (int a : atoms) top_[a] = to;
    auto& src = top_atoms_[from];
    src.erase(std::remove_if(src.begin(), src.end(),
                             [&](int a) { return atom_mark_[a] == atom_stamp_; }),
              src.end());
    top_atoms_[to].insert(top_atoms_[to].end(), atoms.begin(), atoms.end());
  }

  bool topAcyclic() const {
    std::unordered_map<int, int> indeg;
    for (int g : top_ids_) indeg[g] = 0;
    for (int g : top_ids_) for (const auto& [h, c] : tsucc_[g]) ++indeg[h];
    std::vector<int> ready;
    for (int g : top_ids_) if (indeg[g] == 0) ready.push_back(g);
    size_t seen = 0;
    while (!ready.empty()) {
      const int g = ready.back();
      ready.pop_back();
      ++seen;
      for (const auto& [h, c] : tsucc_[g]) if (--indeg[h] == 0) ready.push_back(h);
    }
    return seen == top_ids_.size();
  }

  // Paper §III-B: walk the merges back from the last level; move one side of a merge
  // into an adjacent group when that cuts the bytes crossing group boundaries, keeps the
  // groups acyclic (hence convex) and fits memory. The target may not grow beyond the
  // largest group, so balance from coarsening survives.
  void uncoarsen() {
    const int n = static_cast<int>(atomic_.pieces.size());
    tsucc_.assign(groups_.size(), {});
    top_atoms_.assign(groups_.size(), {});
    atom_mark_.assign(n, 0);
    double max_time = 0.0;
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (!groups_[g].alive) continue;
      top_ids_.push_back(static_cast<int>(g));
      top_atoms_[g] = groups_[g].atoms;
      max_time = std::max(max_time, groups_[g].time);
    }
    for (int a = 0; a < n; ++a) {
      for (auto [q, b] : atomic_.succ[a]) if (top_[a] != top_[q]) bump(top_[a], top_[q], +1);
    }
    for (int g = static_cast<int>(groups_.size()) - 1; g >= n; --g) {
      for (int c : {groups_[g].child_a, groups_[g].child_b}) tryMove(leaves(c), max_time);
    }
  }

  void tryMove(const std::vector<int>& atoms, double max_time) {
    const int from = top_[atoms.front()];
    if (top_atoms_[from].size() <= atoms.size()) return;
    ++atom_stamp_;
    for (int a : atoms) {
      if (top_[a] != from) return;  // split by an earlier move of a part of it
      atom_mark_[a] = atom_stamp_;
    }
    std::unordered_map<int, int64_t> conn;
    for (int a : atoms) {
      for (const auto* adj : {&atomic_.succ[a], &atomic_.pred[a]}) {
        for (auto [q, b] : *adj) {
          if (atom_mark_[q] != atom_stamp_) conn[top_[q]] += b;
        }
      }
    }
    const int64_t internal = conn.count(from) ? conn[from] : 0;
    int best = -1;
    int64_t best_gain = 0;
    for (const auto& [t, b] : conn) {
      if (t != from && b - internal > best_gain) best = t, best_gain = b - internal;
    }
    if (best < 0) return;
    std::vector<int> merged_atoms = top_atoms_[best];
    merged_atoms.insert(merged_atoms.end(), atoms.begin(), atoms.end());
    auto [time, memory] = evaluateAtoms(merged_atoms);
    if (memory > options_.memory_limit || time > max_time) return;
    move(atoms, from, best);
    if (!topAcyclic()) {
      move(atoms, best, from);
      return;
    }
    ++moves_;
  }

  // ---- compaction and result ------------------------------------------------------
  BlockPartition finish() {
    const int n = static_cast<int>(atomic_.pieces.size());
    std::unordered_map<int, std::vector<int>> members;
    for (int a = 0; a < n; ++a) members[top_[a]].push_back(a);
    // Topological order of the groups (ties: smallest first piece, so stable).
    std::unordered_map<int, std::unordered_map<int, int>> edges;
    std::unordered_map<int, int> indeg;
    for (auto& [g, atoms] : members) indeg[g] = 0;
    for (int a = 0; a < n; ++a) {
      for (auto [q, b] : atomic_.succ[a]) {
        if (top_[a] != top_[q] && edges[top_[a]][top_[q]]++ == 0) ++indeg[top_[q]];
      }
    }
    using Entry = std::pair<int, int>;  // (first piece, group)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> ready;
    for (auto& [g, d] : indeg) if (d == 0) ready.emplace(members[g].front(), g);
    std::vector<Block> list;
    while (!ready.empty()) {
      const int g = ready.top().second;
      ready.pop();
      Block b;
      b.atoms = members[g];
      list.push_back(std::move(b));
      for (auto& [h, c] : edges[g]) if (--indeg[h] == 0) ready.emplace(members[h].front(), h);
    }
    RANNC_CHECK(list.size() == members.size(), "block groups form a cycle");
    for (Block& b : list) {
      b.tasks = atomsTasks(b.atoms);
      std::tie(b.time, b.memory) = evaluateAtoms(b.atoms);
    }
    if (options_.compact) compact(list);

    BlockPartition out;
    const auto& pos = costs_.topoPosition();
    for (Block& b : list) {
      std::sort(b.atoms.begin(), b.atoms.end());
      std::sort(b.tasks.begin(), b.tasks.end(), [&](ir::TaskId x, ir::TaskId y) { return pos[x] < pos[y]; });
    }
    std::vector<int> block_of(n);
    for (size_t i = 0; i < list.size(); ++i) for (int a : list[i].atoms) block_of[a] = static_cast<int>(i);
    out.succ.assign(list.size(), {});
    std::vector<std::unordered_map<int, int64_t>> agg(list.size());
    for (int a = 0; a < n; ++a) {
      for (auto [q, b] : atomic_.succ[a]) {
        if (block_of[a] != block_of[q]) agg[block_of[a]][block_of[q]] += b;
      }
    }
    for (size_t i = 0; i < list.size(); ++i) {
      for (auto [c, b] : agg[i]) {
        RANNC_CHECK(c > static_cast<int>(i), "block DAG edge " << i << " -> " << c << " runs backwards");
        out.succ[i].emplace_back(c, b);
      }
      std::sort(out.succ[i].begin(), out.succ[i].end());
    }
    out.blocks = std::move(list);
    out.levels = levels_;
    out.moves = moves_;
    logger().info("block partitioning: {} atomic pieces -> {} blocks ({} levels, {} moves, {} cost queries)",
                  n, out.blocks.size(), out.levels, out.moves, costs_.queries());
    return out;
  }

  // Paper §III-B compaction: neighbours in a topological order merge convexly; take the
  // cheapest block and merge it with its cheaper neighbour while memory allows.
  void compact(std::vector<Block>& list) {
    const size_t k = static_cast<size_t>(std::max(1, options_.num_blocks));
    std::vector<char> stuck(list.size(), 0);
    while (list.size() > k) {
      int v = -1;
      for (size_t i = 0; i < list.size(); ++i) {
        if (!stuck[i] && (v < 0 || list[i].time < list[v].time)) v = static_cast<int>(i);
      }
      if (v < 0) break;
      std::vector<int> sides;
      if (v > 0) sides.push_back(v - 1);
      if (v + 1 < static_cast<int>(list.size())) sides.push_back(v + 1);
      std::sort(sides.begin(), sides.end(), [&](int a, int b) { return list[a].time < list[b].time; });
      bool merged = false;
      for (int w : sides) {
        const int lo = std::min(v, w), hi = std::max(v, w);
        std::vector<int> atoms = list[lo].atoms;
        atoms.insert(atoms.end(), list[hi].atoms.begin(), list[hi].atoms.end());
        auto tasks = atomsTasks(atoms);
        auto [time, memory] = evaluateAtoms(atoms);
        if (memory > options_.memory_limit) continue;
        list[lo] = Block{std::move(atoms), std::move(tasks), time, memory};
        list.erase(list.begin() + hi);
        stuck.erase(stuck.begin() + hi);
        stuck[lo] = 0;
        merged = true;
        break;
      }
      if (!merged) stuck[v] = 1;
    }
  }

  const AtomicPartition& atomic_;
  CostModel& costs_;
  BlockOptions options_;
  std::vector<Group> groups_;
  std::vector<int> order_, pos_;
  int alive_ = 0;
  int levels_ = 0;
  int moves_ = 0;
  std::vector<int> task_mark_;
  int task_stamp_ = 0;
  std::vector<int> group_mark_;
  int group_stamp_ = 0;
  // Uncoarsening state.
  std::vector<int> top_;
  std::vector<int> top_ids_;
  std::vector<std::vector<int>> top_atoms_;
  std::vector<std::unordered_map<int, int>> tsucc_;
  std::vector<int> atom_mark_;
  int atom_stamp_ = 0;
};

}  // namespace

BlockPartition partitionBlocks(const AtomicPartition& atomic, CostModel& costs,
                               const BlockOptions& options) {
  return BlockPartitioner(atomic, costs, options).run();
}

std::vector<ir::TaskId> blockRangeTasks(const BlockPartition& blocks, int first, int last,
                                        const std::vector<int>& topo_pos) {
  RANNC_CHECK(0 <= first && first < last && last <= static_cast<int>(blocks.blocks.size()),
              "block range [" << first << ", " << last << ")");
  std::vector<ir::TaskId> out;
  for (int b = first; b < last; ++b) {
    out.insert(out.end(), blocks.blocks[b].tasks.begin(), blocks.blocks[b].tasks.end());
  }
  std::sort(out.begin(), out.end(), [&](ir::TaskId x, ir::TaskId y) {
    return topo_pos[x] != topo_pos[y] ? topo_pos[x] < topo_pos[y] : x < y;
  });
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

}  // namespace rannc::partition
