#include "partition/baseline/baselines.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <unordered_map>

#include "common/error.h"

namespace rannc::partition {
namespace {

void checkShape(int pieces, const PlanContext& ctx, const BaselineShape& s) {
  if (s.stages < 1 || s.stages > pieces) {
    throw InvalidGraphError("a baseline of " + std::to_string(s.stages) + " stages needs 1.." +
                            std::to_string(pieces) + " stages");
  }
  if (static_cast<int64_t>(s.stages) * s.replicas * s.pipelines > ctx.world_size) {
    throw InvalidGraphError("a baseline of " + std::to_string(s.stages) + " stages x " +
                            std::to_string(s.replicas) + " replicas x " +
                            std::to_string(s.pipelines) + " pipelines exceeds the world of " +
                            std::to_string(ctx.world_size));
  }
}

int64_t shapeRows(const PlanContext& ctx, const BaselineShape& s) {
  StageSlot slot;
  slot.devices = s.replicas;
  slot.pipelines = s.pipelines;
  slot.micro_batches = s.micro_batches;
  return std::max<int64_t>(1, stageRows(ctx, slot));
}

Deployment fromRuns(const AtomicPartition& atomic, CostModel& costs, const PlanContext& ctx,
                    const BaselineShape& shape, const std::vector<int>& ends, const std::string& name) {
  std::vector<StageChoice> stages;
  int begin = 0;
  for (int end : ends) {
    StageChoice c;
    c.devices = shape.replicas;
    for (int p = begin; p < end; ++p) {
      c.tasks.insert(c.tasks.end(), atomic.pieces[p].tasks.begin(), atomic.pieces[p].tasks.end());
    }
    stages.push_back(std::move(c));
    begin = end;
  }
  return assembleDeployment(costs, ctx, stages, shape.pipelines, shape.micro_batches, name);
}

}  // namespace

std::vector<int> minMaxContiguousSplit(const std::vector<double>& w, int parts) {
  const int n = static_cast<int>(w.size());
  RANNC_CHECK(parts >= 1 && parts <= n, "split " << n << " weights into " << parts << " parts");
  // Greedy runs under a bound; the least feasible bound by bisection on the run sums.
  auto runs = [&](double bound) {
    std::vector<int> ends;
    double acc = 0.0;
    for (int i = 0; i < n; ++i) {
      if (acc > 0.0 && acc + w[i] > bound) {
        ends.push_back(i);
        acc = 0.0;
      }
      acc += w[i];
    }
    ends.push_back(n);
    return ends;
  };
  double lo = *std::max_element(w.begin(), w.end()), hi = 0.0;
  for (double x : w) hi += x;
  for (int it = 0; it < 100 && hi - lo > 1e-12 * std::max(1.0, hi); ++it) {
    const double mid = 0.5 * (lo + hi);
    (static_cast<int>(runs(mid).size()) <= parts ? hi : lo) = mid;
  }
  std::vector<int> ends = runs(hi);
  // Fewer runs than parts: split the longest runs; splitting never raises the maximum.
  while (static_cast<int>(ends.size()) < parts) {
    int best = -1, best_len = 1, begin = 0;
    for (size_t r = 0; r < ends.size(); ++r) {
      const int len = ends[r] - begin;
      if (len > best_len) best = static_cast<int>(r), best_len = len;
      begin = ends[r];
    }
    const int start = best == 0 ? 0 : ends[best - 1];
    ends.insert(ends.begin() + best, start + best_len / 2);
  }
  return ends;
}

Deployment equalTaskSplit(const AtomicPartition& atomic, CostModel& costs, const PlanContext& ctx,
                          const BaselineShape& shape) {
  const int n = static_cast<int>(atomic.pieces.size());
  checkShape(n, ctx, shape);
  std::vector<int> ends;
  for (int s = 1; s <= shape.stages; ++s) ends.push_back(static_cast<int>(static_cast<int64_t>(n) * s / shape.stages));
  return fromRuns(atomic, costs, ctx, shape, ends, "equal-tasks");
}

Deployment paramBalancedSplit(const AtomicPartition& atomic, CostModel& costs,
                              const PlanContext& ctx, const BaselineShape& shape) {
  const int n = static_cast<int>(atomic.pieces.size());
  checkShape(n, ctx, shape);
  std::vector<double> w(n);
  // A tiny share of the task count keeps parameter-free runs from piling up in one stage.
  for (int p = 0; p < n; ++p) w[p] = static_cast<double>(costs.cost(atomic.pieces[p].tasks, 1).param_bytes) + 1e-3;
  return fromRuns(atomic, costs, ctx, shape, minMaxContiguousSplit(w, shape.stages), "param-balanced");
}

Deployment timeBalancedSplit(const AtomicPartition& atomic, CostModel& costs,
                             const PlanContext& ctx, const BaselineShape& shape) {
  const int n = static_cast<int>(atomic.pieces.size());
  checkShape(n, ctx, shape);
  const int64_t rows = shapeRows(ctx, shape);
  std::vector<double> w(n);
  for (int p = 0; p < n; ++p) {
    const PieceCost c = costs.cost(atomic.pieces[p].tasks, rows);
    w[p] = c.forward_time + c.backward_time;
  }
  return fromRuns(atomic, costs, ctx, shape, minMaxContiguousSplit(w, shape.stages), "time-balanced");
}

Deployment piperSplit(const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                      const BaselineShape& shape, int max_ideals) {
  const int K = static_cast<int>(blocks.blocks.size());
  checkShape(K, ctx, shape);
  if (K > 64) throw InvalidGraphError("the Piper baseline handles at most 64 blocks, got " + std::to_string(K));
  std::vector<uint64_t> preds(K, 0);
  for (int b = 0; b < K; ++b) for (auto [c, bytes] : blocks.succ[b]) preds[c] |= uint64_t{1} << b;
  // Enumerate the ideals by growing each with a block whose predecessors it holds.
  std::vector<uint64_t> ideals{0};
  std::unordered_map<uint64_t, int> index{{0, 0}};
  for (size_t i = 0; i < ideals.size(); ++i) {
    const uint64_t I = ideals[i];
    for (int b = 0; b < K; ++b) {
      const uint64_t bit = uint64_t{1} << b;
      if ((I & bit) || (preds[b] & ~I)) continue;
      if (index.emplace(I | bit, static_cast<int>(ideals.size())).second) {
        ideals.push_back(I | bit);
        if (static_cast<int>(ideals.size()) > max_ideals) {
          throw InvalidGraphError("the block DAG has more than " + std::to_string(max_ideals) +
                                  " ideals; the Piper baseline is meant for small block graphs");
        }
      }
    }
  }
  std::sort(ideals.begin(), ideals.end(), [](uint64_t a, uint64_t b) {
    const int pa = __builtin_popcountll(a), pb = __builtin_popcountll(b);
    return pa != pb ? pa < pb : a < b;
  });
  const int n = static_cast<int>(ideals.size());
  const uint64_t all = K == 64 ? ~uint64_t{0} : (uint64_t{1} << K) - 1;
  const int S = shape.stages;
  const int D = S * shape.replicas;
  const int64_t rows = shapeRows(ctx, shape);
  std::unordered_map<uint64_t, std::vector<ir::TaskId>> task_cache;
  std::unordered_map<uint64_t, PieceCost> cost_cache;
  auto tasksOf = [&](uint64_t set) -> const std::vector<ir::TaskId>& {
    auto it = task_cache.find(set);
    if (it != task_cache.end()) return it->second;
    std::vector<ir::TaskId> t;
    for (int b = 0; b < K; ++b) {
      if (set >> b & 1) t.insert(t.end(), blocks.blocks[b].tasks.begin(), blocks.blocks[b].tasks.end());
    }
    return task_cache.emplace(set, std::move(t)).first->second;
  };
  const double kInf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> F(S + 1, std::vector<double>(n, kInf));
  std::vector<std::vector<int>> from(S + 1, std::vector<int>(n, -1));
  F[0][0] = 0.0;  // ideals[0] is the empty set
  for (int s = 1; s <= S; ++s) {
    for (int i = 1; i < n; ++i) {
      const uint64_t I = ideals[i];
      if (s == S && I != all) continue;
      for (int j = 0; j < i; ++j) {
        const uint64_t J = ideals[j];
        if (F[s - 1][j] == kInf || (J & ~I) || J == I) continue;
        const uint64_t stage = I & ~J;
        auto it = cost_cache.find(stage);
        if (it == cost_cache.end()) it = cost_cache.emplace(stage, costs.cost(tasksOf(stage), rows)).first;
        StageSlot slot{s - 1, S, (s - 1) * shape.replicas, shape.replicas, D, shape.pipelines, shape.micro_batches};
        StageEstimate e = estimateStage(costs, it->second, slot, ctx);
        if (!e.feasible) continue;
        const double v = std::max(F[s - 1][j], e.score);
        if (v < F[s][i]) F[s][i] = v, from[s][i] = j;
      }
    }
  }
  const int last = static_cast<int>(std::find(ideals.begin(), ideals.end(), all) - ideals.begin());
  if (F[S][last] == kInf) {
    throw InfeasiblePlanError("the Piper baseline finds no " + std::to_string(S) +
                              "-stage split that fits memory", 0);
  }
  std::vector<StageChoice> stages(S);
  for (int s = S, i = last; s >= 1; --s) {
    const int j = from[s][i];
    stages[s - 1].tasks = tasksOf(ideals[i] & ~ideals[j]);
    stages[s - 1].devices = shape.replicas;
    i = j;
  }
  return assembleDeployment(costs, ctx, stages, shape.pipelines, shape.micro_batches, "piper");
}

}  // namespace rannc::partition
