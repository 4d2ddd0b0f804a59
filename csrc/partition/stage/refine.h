#pragma once
// Boundary refinement after stage partitioning (beyond the paper): blocks make the stage
// search small, but a stage boundary can then only sit between blocks, and with ~4 blocks
// per stage that costs up to a quarter of a stage's time. This pass re-cuts the stages
// piece by piece along the blocks' topological order (every interval of it is convex),
// minimising the largest merged stage score for the planned replicas, and keeps the
// result only when the simulator says the iteration got faster.
#include "partition/atomic/atomic.h"
#include "partition/block/block.h"
#include "partition/plan.h"
#include "partition/stage/stage_cost.h"

namespace rannc::partition {

// `plan` must come from the blocks of `blocks` (first_block/last_block set, contiguous).
// Returns `plan` unchanged when no refinement helps. Ranks, replicas, pipelines and
// micro-batches stay as planned.
Deployment refineBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx);

}  // namespace rannc::partition
