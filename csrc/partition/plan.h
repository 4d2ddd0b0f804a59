#pragma once
// The plan the planner hands to the runtime: which tasks each stage runs, which ranks hold
// its replicas, the micro-batch count and schedule, the recomputation choice, and what the
// cost model and simulator predict. Saved in the framed file format of ir/serialize.h
// together with the graph's content hash, so a plan never loads against another model.
#include <cstdint>
#include <string>
#include <vector>

#include "ir/graph.h"
#include "partition/cost/cost_model.h"
#include "partition/sim/schedule.h"
#include "partition/sim/simulator.h"

namespace rannc::partition {

// 2: stages carry the optimizer step's time; 3: the schedules schedule=auto tried.
inline constexpr uint32_t kDeploymentFormatVersion = 3;

struct StagePlan : StageTimes, StageMemory {
  // [Note: stage tasks] Tasks in topological order. Constant tasks are cloned into every
  // stage that reads them, so one constant task may be listed by several stages; the
  // non-constant tasks of the stages are disjoint and each stage is convex over them.
  std::vector<ir::TaskId> tasks;
  // Ranks holding a replica: pipeline copy c first, then c+1 (copy-major, so replica j of
  // copy c is ranks[c * replicas_per_pipeline + j]).
  std::vector<int> ranks;
  int first_block = -1;  // [first_block, last_block) of the block partition, -1 if none
  int last_block = -1;
  bool recompute = false;         // rebuild activations during the backward
  int64_t micro_batch_rows = 0;   // rows one replica runs per micro-batch (the largest share)
  // Predictions for one replica: StageTimes per micro-batch (all-reduce and optimizer
  // step per iteration) and StageMemory's parts of the peak.
  int64_t param_bytes = 0;
  int64_t memory_bytes = 0;       // predicted peak per replica (with chunks: its device's)
  double busy_time = 0.0;         // per iteration (simulated)
  double bubble_time = 0.0;
};

// The best plan the search found under one schedule (schedule=auto: one per schedule
// tried, in the plan's report).
struct ScheduleCandidate {
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  double iteration_time = 0.0;
  double bubble = 0.0;  // Deployment::bubbleFraction
  bool feasible = false;
};

struct Deployment {
  uint64_t graph_hash = 0;   // ir::Graph::contentHash() of the planned graph
  std::string planner;       // "rannc", "equal-tasks", "param-balanced", ...
  int world_size = 0;
  int64_t batch_size = 0;    // global batch
  int pipelines = 1;         // copies of the pipeline (R of the paper's Algorithm 2)
  int micro_batches = 1;     // per pipeline copy and iteration
  ScheduleKind schedule = ScheduleKind::OneFOneB;
  // Stages per device group (interleaved schedules, [Note: interleaved 1F1B] in
  // sim/schedule.h): with G = stages / chunks groups, stage c x G + g runs on the ranks of
  // stage g. 1: every stage on ranks of its own.
  int chunks = 1;
  Optimizer optimizer = Optimizer::Adam;
  int64_t memory_limit = 0;  // usable bytes per device the plan was made for
  std::vector<StagePlan> stages;
  double iteration_time = 0.0;  // simulated seconds per iteration
  bool feasible = true;         // every stage fits memory_limit
  // schedule=auto: the best plan of each schedule tried (the chosen one included). Saved,
  // but not part of the plan hash: it tells how the plan was found, not what runs.
  std::vector<ScheduleCandidate> schedule_candidates;

  int numStages() const { return static_cast<int>(stages.size()); }
  // Groups of devices a micro-batch crosses once per chunk: numStages() / chunks.
  int deviceGroups() const { return numStages() / std::max(1, chunks); }
  // The pipeline bubble: the fraction of the stages' time in an iteration spent idle,
  // 1 - sum(busy) / (stages x iteration_time), busy = micro-batches x (forward + backward)
  // + optimizer step; what the all-reduce does not hide counts as idle.
  double bubbleFraction() const;
  // Stage whose replicas include `rank`, or -1.
  int stageOfRank(int rank) const;
  // [Note: plan hash] 8 hex digits of FNV-1a over the binary encoding of what the
  // runtime executes: the graph hash, world, batch, copies, micro-batches, schedule,
  // optimizer and each stage's tasks, ranks, rows and recomputation. The predictions are
  // left out on purpose: profiled times differ between runs that make the same plan, and
  // the hash is there to tell whether two runs train with the same plan.
  std::string hash() const;
  // One line for logs: "plan 9f3a1c2e: 2 stages, replicas 2/2, 4 micro-batches, 1 pipeline
  // copy, 1f1b, predicted 12.345 ms per iteration".
  std::string summary() const;
  // A table for people: stages, blocks, tasks, ranks, rows, recompute, times, memory; the
  // first line names the plan's hash.
  std::string report() const;
};

// Re-runs the simulator over the deployment's stored per-stage predictions under
// `schedule` (say, to compare fill-drain with the planned 1F1B); with the deployment's
// chunks, so the result is per device group.
SimResult simulateDeployment(const Deployment& deployment, ScheduleKind schedule);

// Fills `deployment` from its simulation: the iteration time, each stage's busy and bubble
// time and peak memory (with chunks, its device's, over all chunks); infeasible where a
// peak exceeds its memory_limit.
void applySimulation(Deployment& deployment, const SimResult& result);

// What the simulator needs of a stage: its per-micro-batch times and memory parts.
SimStage simStage(const StagePlan& stage);

// The piece a stage runs, without ir::extractSubgraph's convexity check (a constant clone
// may make the full set look non-convex although its non-constant tasks are convex):
// tasks in topological order, inputs, and outputs read by other stages or the graph's
// outputs (purely constant outputs excluded: every reader holds its own clone).
ir::Subgraph stageSubgraph(const ir::Graph& graph, const StagePlan& stage);

// Checks `deployment` against `graph` (the verify-partitioning option): graph hash, every
// task in some stage and every non-constant task in exactly one, stages convex over their
// non-constant tasks and in a pipeline order (no value flows from a later stage to an
// earlier one), ranks distinct and below world_size (stages of one device group share its
// ranks when chunks > 1). Throws InvalidGraphError naming the first violation.
void validateDeployment(const ir::Graph& graph, const Deployment& deployment);

// [Note: new input shapes] The plan of `planned` for `graph`, a trace of the same model at
// other input shapes (a sequence of another length): the same stages, replicas, micro-batches
// and schedule, since the ops are the same and only their sizes differ. Checks that `graph`
// is the same program: the same tasks (op, inputs, outputs) in the same order and values of
// the same kind, dtype, role and batch dimension. Throws TraceError naming the first task that
// differs otherwise. The predictions (times, peaks) stay those of the planned shapes, but
// each stage's stash and working bytes scale by its bytes per row ([Note: memory at other
// batches] in runtime/batch_memory.h).
Deployment rebindDeployment(const Deployment& plan, const ir::Graph& planned, const ir::Graph& graph);

// The framed bytes of `deployment` (kind "deployment", kDeploymentFormatVersion).
std::string serializeDeployment(const Deployment& deployment);
// Reads a deployment and checks it was made for `graph` (content hash), only names tasks
// of it, and holds values a planner could have written (counts within the bytes and the
// world, rows consistent with the batch, micro-batches, times finite and >= 0, bytes >= 0).
// `batch_size` / `world_size` > 0: the global batch and world it must be for (0: any).
// Throws SerializationError "<origin>: ... <field>: <what is wrong>" otherwise.
Deployment deserializeDeployment(const std::string& bytes, const ir::Graph& graph,
                                 const std::string& origin = "<memory>", int64_t batch_size = 0,
                                 int world_size = 0);
void saveDeployment(const Deployment& deployment, const std::string& path);
Deployment loadDeployment(const std::string& path, const ir::Graph& graph, int64_t batch_size = 0,
                          int world_size = 0);

}  // namespace rannc::partition
