#include "partition/stage/refine.h"

#include <algorithm>
#include <limits>

#include "common/error.h"
#include "common/log.h"

namespace rannc::partition {

Deployment refineBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                            int passes) {
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
  for (int pass = 0; pass < passes; ++pass) {
    for (int s = 0; s + 1 < S; ++s) {
      // Smallest cut where the left stage is at least as costly as the right one; the
      // best cut is there or just before it.
      int lo = cut[s] + 1, hi = cut[s + 2] - 1;
      while (lo < hi) {
        const int mid = lo + (hi - lo) / 2;
        if (score(s, cut[s], mid) >= score(s + 1, mid, cut[s + 2])) hi = mid; else lo = mid + 1;
      }
      int best = cut[s + 1];
      double best_v = std::max(score(s, cut[s], best), score(s + 1, best, cut[s + 2]));
      for (int c : {lo - 1, lo}) {
        if (c <= cut[s] || c >= cut[s + 2]) continue;
        const double v = std::max(score(s, cut[s], c), score(s + 1, c, cut[s + 2]));
        if (v < best_v) best = c, best_v = v;
      }
      cut[s + 1] = best;
    }
  }
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
