#pragma once
// Baseline partitioners from the literature, scored by the same cost model and simulator
// as RaNNC's plans (assembleDeployment), so comparisons measure the partitioning alone.
//   equal-tasks     GPipe / Megatron: the same number of atomic pieces per stage
//   param-balanced  DeepSpeed's default: contiguous, balancing parameter bytes
//   time-balanced   torchgpipe balance_by_time / AutoPipe: contiguous, balancing summed
//                   per-piece compute time (min-max)
//   piper           Piper / Tarnawski et al.: DP over ideals (downsets) of the block DAG,
//                   so stages need not be intervals of one topological order; no replicas
#include <string>

#include "partition/atomic/atomic.h"
#include "partition/block/block.h"
#include "partition/plan.h"
#include "partition/stage/stage_cost.h"

namespace rannc::partition {

// The pipeline shape every baseline fills: `stages` stages of `replicas` devices each per
// pipeline copy, `pipelines` copies, `micro_batches` micro-batches.
struct BaselineShape {
  int stages = 1;
  int replicas = 1;
  int pipelines = 1;
  int micro_batches = 1;
};

// Contiguous runs of the atomic pieces (in topological order) with equal counts.
Deployment equalTaskSplit(const AtomicPartition& atomic, CostModel& costs, const PlanContext& ctx,
                          const BaselineShape& shape);

// Contiguous runs minimising the largest parameter bytes of a stage.
Deployment paramBalancedSplit(const AtomicPartition& atomic, CostModel& costs,
                              const PlanContext& ctx, const BaselineShape& shape);

// Contiguous runs minimising the largest summed forward + backward time of a stage, each
// piece timed alone at the stage rows (as the profilers of these systems do).
Deployment timeBalancedSplit(const AtomicPartition& atomic, CostModel& costs,
                             const PlanContext& ctx, const BaselineShape& shape);

// DP over the ideals of the block DAG: stage s is I_s \ I_{s-1} for a chain of ideals,
// costed merged, minimising the largest StageEstimate::score under the memory limit.
// Throws InvalidGraphError when the block DAG has more than `max_ideals` ideals (the
// method is exponential in the DAG's width) or more than 64 blocks; InfeasiblePlanError
// when no split fits memory.
Deployment piperSplit(const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                      const BaselineShape& shape, int max_ideals = 5000);

// The contiguous split of `weights` into exactly `parts` non-empty runs minimising the
// largest run sum; returns the end index of each run. Needs 1 <= parts <= weights.size().
std::vector<int> minMaxContiguousSplit(const std::vector<double>& weights, int parts);

}  // namespace rannc::partition
