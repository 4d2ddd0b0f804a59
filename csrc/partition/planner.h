#pragma once
// The planner end to end: atomic pieces -> blocks -> stages -> Deployment. One Options
// struct with named defaults (read once from kwargs and RANNC_* variables at the Python
// edge); this is the entry point the binding layer calls.
#include <cstdint>
#include <vector>

#include "partition/atomic/atomic.h"
#include "partition/block/block.h"
#include "partition/cost/cost_model.h"
#include "partition/plan.h"
#include "partition/stage/preference.h"
#include "partition/stage/refine.h"
#include "partition/stage/stage_dp.h"

namespace rannc::partition {

struct PlannerOptions {
  int world_size = 1;             // devices (ranks) to plan for; may differ from the real world (dry run)
  int64_t batch_size = 0;         // global batch; 0: the graph's traced batch size x world_size
  int num_blocks = 32;            // k of block partitioning
  double memory_margin = 0.1;     // keep this fraction of device memory free
  int64_t memory_limit = 0;       // usable bytes per device; 0: device memory x (1 - margin)
  Optimizer optimizer = Optimizer::Adam;
  // Copies of the parameters and buffers kept beside the model (an EMA, a reference model):
  // memory only.
  int model_copies = 0;
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  int chunks = 2;  // schedule interleaved: stages per device ([Note: interleaved search])
  Recompute recompute = Recompute::Auto;  // recompute activations where memory needs it, never, always
  double update_seconds_per_byte = -1.0;  // optimizer step per parameter byte (PlanContext)
  ConstantPolicy constant_policy = ConstantPolicy::IndependentOfState;
  int num_stages = 0;           // > 0: override the stage-count search
  int num_microbatches = 0;    // > 0: override the micro-batch search
  // Not empty (with num_stages = its size): the replicas of each stage within one
  // pipeline copy; world_size / sum copies. Forces the layout, say 3 stages with replicas
  // 2/1/1 on 4 ranks; the sum must divide world_size.
  std::vector<int> replicas;
  int max_microbatches = 256;
  int search_patience = 3;        // stop raising M (S) after this many non-improving candidates; 0: exhaustive
  bool refine_boundaries = true;  // slide stage boundaries piece by piece after the block-level DP
  int refine_candidates = 6;      // refine the best plans of this many pipeline shapes, keep the fastest
  bool refine_replicas = true;    // refinement also moves replicas between stages
  bool every_node_count = true;   // all node counts compete (false: the paper's first one with a plan)
  // Plans within this fraction of the fastest count as equally fast: the simplest wins
  // (fewer stages, then micro-batches, then pipeline copies) and stage boundaries settle
  // where the fewest bytes cross, so noise in measured costs does not change the plan
  // ([Note: plan tolerance] in stage/preference.h). 0: the fastest.
  double plan_tolerance = kDefaultPlanTolerance;
  // [Note: verified finalists] With a cost model that composes unions, the preferred plan
  // and the fastest plans of up to this many - 1 other shapes within kFinalistMargin of
  // the fastest are costed again with every stage measured whole, and the preference
  // picks among those costs. 0 or 1: the composed costs decide.
  int verify_finalists = 2;
  // [Note: rows kept together] in stage/stage_cost.h: the tasks that must see every row of
  // the batch at once; the stage holding the first and every later one run one replica,
  // in one pipeline copy.
  std::vector<ir::TaskId> rows_together;
};

// Throws rannc::Error naming the option (as the user spells it) whose value is out of range.
void checkOptions(const PlannerOptions& options);

// The context the options describe for `graph` on `costs`' device.
PlanContext planContext(const ir::Graph& graph, const CostModel& costs, const PlannerOptions& options);

// Every phase's result, for tests, reports and benchmarks.
struct PlanTrace {
  AtomicPartition atomic;
  BlockPartition blocks;
  Deployment deployment;
};

// Plans `graph` with costs from `costs` (built over the same graph). Throws
// InfeasiblePlanError (bytesNeeded: the least usable memory per device some plan needs)
// when nothing fits, InvalidGraphError on an empty or cyclic graph.
PlanTrace planTrace(const ir::Graph& graph, CostModel& costs, const PlannerOptions& options);

// planTrace(...).deployment.
Deployment plan(const ir::Graph& graph, CostModel& costs, const PlannerOptions& options);

}  // namespace rannc::partition
