#pragma once
// Refinement after stage partitioning (beyond the paper): blocks make the stage search
// small, but a stage boundary can then only sit between blocks, and with ~4 blocks per
// stage that costs up to a quarter of a stage's time. This pass re-cuts the stages piece
// by piece along the blocks' topological order (every interval of it is convex),
// minimising the largest merged stage score for the planned replicas; then, optionally,
// moves one replica at a time between stages and changes the micro-batch count
// (re-cutting after each move), since the best replica and micro-batch counts at piece
// granularity need not be those of the block DP. Every step
// is kept only when the simulator says the iteration got faster.
#include "partition/atomic/atomic.h"
#include "partition/block/block.h"
#include "partition/plan.h"
#include "partition/stage/preference.h"
#include "partition/stage/stage_cost.h"

namespace rannc::partition {

struct RefineOptions {
  // Move replicas between stages (devices per copy stay the same); off for a fixed layout.
  bool move_replicas = true;
  // At most this many accepted replica moves.
  int max_moves = 8;
  // Every pair of stages trades replicas up to this many stages, and beyond it while
  // pairs x pieces stays within all_pairs_budget (each trial re-cuts every piece); other
  // plans trade between neighbouring stages only. The budget reaches 20 stages on
  // ResNet-152 (516 pieces), where a 9-stage plan on 16 GB devices needs a move between
  // stages that are not neighbours (1.202 -> 1.138 s), but not the 9-stage plans of the
  // 128-layer BERT (10,646 pieces; planning took 15 s instead of 9 s for nothing).
  int all_pairs_up_to = 8;
  double all_pairs_budget = 2e5;
  // Replicas moved at once: 1, 2, 4, ... up to this (two at a time can pass a layout
  // that one at a time cannot: ResNet-152 x8 reaches 1.134 s instead of 1.156 s).
  int max_move_size = 2;
  // Also change the micro-batch count (up to max_microbatches and the rows of a copy).
  bool move_micro_batches = true;
  int max_microbatches = 256;
  // Rounds of micro-batch moves followed by replica moves after the first replica moves.
  int max_rounds = 3;
};

// `plan` must come from the blocks of `blocks` (first_block/last_block set, contiguous).
// Returns the fastest plan found, `plan` unchanged when no refinement helps. Pipelines stay
// as planned; so do the replicas and micro-batches unless options.move_replicas /
// move_micro_batches. Moves are kept when the simulator says the iteration got faster at
// all; `visited`, when given, is offered `plan` and every plan the refinement kept on the
// way, so the caller can prefer a simpler one within the tolerance ([Note: plan
// tolerance] in stage/preference.h) to the fastest.
Deployment refineBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                            const RefineOptions& options = {}, PreferredPlan* visited = nullptr);

// Moves each stage boundary of `plan` (left to right, the others fixed) to where the fewest
// bytes cross (the fastest of such positions) among the positions whose simulated
// iteration stays within `time_bound` ([Note: settled boundaries] in refine.cpp). Measured costs carry noise,
// and the fastest cut moves with it by a few pieces between runs; the cut with the least
// traffic inside the tolerance does not, because bytes come from shapes. The stages' pieces
// must be contiguous runs of the blocks' order (as the DP and refineBoundaries make them);
// returns `plan` unchanged otherwise, or when it has one stage.
Deployment settleBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                            double time_bound);

}  // namespace rannc::partition
