#pragma once
// An event simulator of a synchronous pipeline: runs a Schedule over per-stage costs and
// reports the iteration time, per-stage busy time and bubble, and peak memory. The
// planner ranks candidate plans with it, and baselines are scored by the same code.
#include <cstdint>
#include <vector>

#include "partition/sim/schedule.h"

namespace rannc::partition {

// Costs of one stage replica for one micro-batch.
// One stage's times per micro-batch (seconds), as the stage estimate, the plan and the
// simulator share them: copied as one (`static_cast<StageTimes&>(to) = from`).
struct StageTimes {
  double forward_time = 0.0;
  double backward_time = 0.0;       // including recomputation when the stage recomputes
  // The part of backward_time that computes the parameters' gradients (W of a split
  // backward, [Note: ZB-H1] in schedule.h); the rest computes the inputs' gradients.
  double weight_time = 0.0;
  double send_forward_time = 0.0;   // activations to the next stage (overlaps compute)
  double send_backward_time = 0.0;  // gradients to the previous stage (overlaps compute)
  // Gradient all-reduce among the stage's replicas, per iteration. It is bucketed and
  // overlaps the last backward, so only max(0, allreduce - backward) adds to the iteration.
  double allreduce_time = 0.0;
  double update_time = 0.0;   // the optimizer step, after the all-reduce, per iteration
};

// One replica's memory parts (bytes).
struct StageMemory {
  int64_t static_bytes = 0;   // parameters, gradients, optimizer state, buffers
  int64_t stash_bytes = 0;    // kept per in-flight micro-batch from forward to backward
  int64_t working_bytes = 0;  // transient during a backward (recomputed activations)
};

struct SimStage : StageTimes, StageMemory {};

// Per device (a pipeline position; with one chunk per device, a stage).
struct SimResult {
  double iteration_time = 0.0;
  std::vector<double> finish;  // when each device is done (all-reduce and update included)
  std::vector<double> busy;    // compute time of each device
  std::vector<double> bubble;  // iteration time minus busy time
  std::vector<int> peak_in_flight;  // micro-batches held (over all chunks)
  std::vector<int64_t> peak_memory;  // its chunks' static bytes, the most stashes held at once, the largest working bytes
  // Start times of each device's actions, in schedule order (for drawing and tests).
  std::vector<std::vector<double>> start;
};

// How long `kind` takes on a stage with these times.
double actionTime(const StageTimes& stage, ActionKind kind);

// Runs `schedule` (validated first) over `stages` (chunks x devices of them; device d's
// chunk c is stage c x devices + d). A forward of micro-batch m on stage i waits for
// stage i-1's forward of m plus its send; a backward waits for its own forward and for
// stage i+1's backward of m plus its send. Throws InternalError on a schedule that
// deadlocks.
SimResult simulate(const std::vector<SimStage>& stages, const Schedule& schedule,
                   int micro_batches);

// Convenience: builds the schedule of `kind` over stages.size() / chunks devices first.
SimResult simulate(const std::vector<SimStage>& stages, ScheduleKind kind, int micro_batches, int chunks = 1);

}  // namespace rannc::partition
