#pragma once
// What one stage of a candidate plan costs: the micro-batch rows its replicas run, the
// merged piece's cost at those rows, transfers, the unhidden all-reduce, memory with and
// without recomputation. Shared by the stage DP, the baselines and the final assembly, so
// every plan is judged by the same rules.
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "partition/cost/cost_model.h"
#include "partition/plan.h"
#include "partition/sim/schedule.h"

namespace rannc::partition {

// [Note: weight gradient share] The part of a backward that computes the parameters'
// gradients (W of a split backward, [Note: ZB-H1] in sim/schedule.h) is measured by the
// profiler ([Note: weight part measured] in profile/profiler.cpp); where it is not (the
// analytic cost model), it is estimated as half of the backward of a stage with
// parameters: a linear layer's backward is two matrix products of the same size, one for
// its input, one for its weight.
constexpr double kWeightGradientShare = 0.5;

// Whether stages recompute their activations in the backward instead of keeping them:
// where memory needs it (Auto), never, or every stage (Always).
enum class Recompute { Auto, Never, Always };
const char* recomputeName(Recompute r);
Recompute recomputeFromName(const std::string& name);  // throws for an unknown name

// Fixed for one planning problem.
struct PlanContext {
  int64_t batch_size = 1;       // global batch
  int world_size = 1;
  int devices_per_node = 8;     // node boundaries for links (see effectiveDevicesPerNode)
  int64_t memory_limit = std::numeric_limits<int64_t>::max();  // usable bytes per device
  Optimizer optimizer = Optimizer::Adam;
  int model_copies = 0;         // copies of the parameters and buffers kept beside the model
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  Recompute recompute = Recompute::Auto;
  // Seconds of the optimizer step per parameter byte, measured (RaNNCModule times the
  // user's optimizer); < 0: optimizerUpdateTraffic bytes per byte at the device's memory
  // bandwidth; 0: no step (forward-only plans).
  double update_seconds_per_byte = -1.0;
  // [Note: rows kept together] Tasks that must see every row of the global batch at once:
  // an in-batch contrastive loss pairs the rows, a batch statistic flows back into them, a
  // loss is neither a mean nor a sum of the rows' terms. A replica of a stage computes over
  // its share of the rows only (each pipeline copy over its own), so the stage holding the
  // first of them and every later stage run one replica, in one pipeline copy: the loss is
  // then PyTorch's over the whole batch (stages before it stay replicated). Empty: none.
  std::vector<ir::TaskId> rows_together;
};

// The first of `order`'s parts (task lists, in stage order) holding a task of
// ctx.rows_together; order.size() when none does ([Note: rows kept together]).
int firstPartTogether(const PlanContext& ctx, const std::vector<const std::vector<ir::TaskId>*>& order);

// Where a stage sits: its position, and its devices within each pipeline copy. Copy c
// occupies ranks [c * pipeline_devices, (c + 1) * pipeline_devices).
struct StageSlot {
  int index = 0;
  int num_stages = 1;
  int first_device = 0;
  int devices = 1;           // replicas per pipeline copy
  int pipeline_devices = 1;  // D of Algorithm 1
  int pipelines = 1;         // R of Algorithm 2
  int micro_batches = 1;
};

// Times and memory parts as StageTimes and StageMemory (the optimizer step over the
// stage's parameters; the memory with the chosen recomputation).
struct StageEstimate : StageTimes, StageMemory {
  bool feasible = false;  // rows >= 1 and fits memory (with recomputation if allowed)
  bool recompute = false;
  int64_t rows = 0;       // 0 when the batch has too few rows for the replicas
  PieceCost cost;
  int64_t memory_bytes = 0;      // with the chosen recomputation
  int64_t min_memory_bytes = 0;  // the least this stage can need (recomputing if allowed)
  // The stage's share of the DP objective: (M + S - 1)(f + b), the sends of its boundary
  // as the schedule exposes them, and the all-reduce its last backward cannot hide,
  // max(0, allreduce - b); the pipeline's iteration is about the largest share (see
  // [Note: stage score] in stage_cost.cpp).
  double score = std::numeric_limits<double>::infinity();
};

// Rows one replica runs per micro-batch: ceil(B / (R M d)), or 0 when R M d > B.
int64_t stageRows(const PlanContext& ctx, const StageSlot& slot);

// Devices per node used for links: the device's count, or the whole world when the world
// does not fill whole nodes.
int effectiveDevicesPerNode(const PlanContext& ctx);

// Estimates the stage at `slot` whose merged piece costs `cost` at stageRows(ctx, slot).
// Seconds of the optimizer step over `param_bytes` of parameters (see PlanContext).
double updateTime(const CostModel& costs, const PlanContext& ctx, int64_t param_bytes);

StageEstimate estimateStage(const CostModel& costs, const PieceCost& cost, const StageSlot& slot,
                            const PlanContext& ctx);

// A stage of a candidate plan, before costing.
struct StageChoice {
  std::vector<ir::TaskId> tasks;
  int devices = 1;  // replicas per pipeline copy
  int first_block = -1;
  int last_block = -1;
  // The stage as consecutive parts (blocks, atomic pieces), for a cost model that composes
  // a union from its parts (CostModel::unionCost); empty: costed as one piece.
  std::vector<const std::vector<ir::TaskId>*> parts;
};

// Costs the stages (merged, at their rows), lays out ranks copy-major, simulates the
// schedule and returns the filled Deployment (feasible = every stage fits memory). With
// `chunks` > 1 (interleaved), stage c x G + g shares the devices of stage g (the same
// replica count), and each device holds all its chunks within the memory limit.
Deployment assembleDeployment(CostModel& costs, const PlanContext& ctx,
                              const std::vector<StageChoice>& stages, int pipelines,
                              int micro_batches, const std::string& planner, int chunks = 1);

// `plan` assembled again with every stage costed as one piece (no parts to compose from).
Deployment assembleWhole(CostModel& costs, const PlanContext& ctx, const Deployment& plan);

}  // namespace rannc::partition
