#include "partition/stage/refine.h"

#include <algorithm>
#include <limits>

#include "common/error.h"
#include "common/log_fmt.h"

namespace rannc::partition {

Deployment refineBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx) {
  const int S = plan.numStages();
  if (S < 2) return plan;
  // Pieces in block order, and each stage's cut in that sequence.
  std::vector<int> seq;
  std::vector<int> block_start;
  for (const Block& b : blocks.blocks) {
    block_start.push_back(static_cast<int>(seq.size()));
    seq.insert(seq.end(), b.atoms.begin(), b.atoms.end());
  }
  block_start.push_back(static_cast<int>(seq.size()));
  std::vector<int> cut(S + 1, 0), devices(S);
  int D = 0;
  for (int s = 0; s < S; ++s) {
    const StagePlan& st = plan.stages[s];
    if (st.first_block < 0 || st.last_block <= st.first_block) return plan;
    cut[s] = block_start[st.first_block];
    cut[s + 1] = block_start[st.last_block];
    devices[s] = static_cast<int>(st.ranks.size()) / std::max(1, plan.pipelines);
    D += devices[s];
  }
  std::vector<int> offsets(S, 0);
  for (int s = 1; s < S; ++s) offsets[s] = offsets[s - 1] + devices[s - 1];

  auto tasksOf = [&](int lo, int hi) {
    std::vector<ir::TaskId> t;
    for (int i = lo; i < hi; ++i) {
      const auto& p = atomic.pieces[seq[i]].tasks;
      t.insert(t.end(), p.begin(), p.end());
    }
    return t;
  };
  const double kInf = std::numeric_limits<double>::infinity();
  auto score = [&](int s, int lo, int hi) {
    if (hi <= lo) return kInf;
    StageSlot slot{s, S, offsets[s], devices[s], D, plan.pipelines, plan.micro_batches};
    const int64_t rows = stageRows(ctx, slot);
    if (rows == 0) return kInf;
    StageEstimate e = estimateStage(costs, costs.cost(tasksOf(lo, hi), rows), slot, ctx);
    return e.feasible ? e.score : kInf;
  };
  // Min-max over all cuts at once: for a bound T, each stage greedily takes the longest
  // run whose score stays within T (scores grow with the run, and a later start only
  // helps the following stages, so greedy is exact); bisect on T.
  const int n = static_cast<int>(seq.size());
  auto greedy = [&](double bound, std::vector<int>* cuts) {
    std::vector<int> c(S + 1, 0);
    for (int st = 0; st < S; ++st) {
      const int lo = c[st];
      if (st + 1 == S) {
        if (lo >= n || score(st, lo, n) > bound) return false;
        c[S] = n;
        break;
      }
      // Leave at least one piece for each later stage.
      int a = lo + 1, b = n - (S - 1 - st);
      if (a > b || score(st, lo, a) > bound) return false;
      while (a < b) {
        const int mid = a + (b - a + 1) / 2;
        if (score(st, lo, mid) <= bound) a = mid; else b = mid - 1;
      }
      c[st + 1] = a;
    }
    if (cuts) *cuts = c;
    return true;
  };
  double hi_bound = 0.0;
  for (int st = 0; st < S; ++st) hi_bound = std::max(hi_bound, score(st, cut[st], cut[st + 1]));
  if (hi_bound == kInf || !greedy(hi_bound, nullptr)) return plan;
  double lo_bound = 0.0;
  for (int it = 0; it < 40 && hi_bound - lo_bound > 1e-6 * hi_bound; ++it) {
    const double mid = 0.5 * (lo_bound + hi_bound);
    (greedy(mid, nullptr) ? hi_bound : lo_bound) = mid;
  }
  greedy(hi_bound, &cut);
  std::vector<StageChoice> stages(S);
  for (int s = 0; s < S; ++s) {
    stages[s].tasks = tasksOf(cut[s], cut[s + 1]);
    stages[s].devices = devices[s];
  }
  Deployment refined = assembleDeployment(costs, ctx, stages, plan.pipelines, plan.micro_batches, plan.planner);
  if (!refined.feasible || refined.iteration_time >= plan.iteration_time) return plan;
  logger().info("boundary refinement: {:.3f} ms -> {:.3f} ms per iteration", plan.iteration_time * 1e3,
                refined.iteration_time * 1e3);
  return refined;
}

}  // namespace rannc::partition
