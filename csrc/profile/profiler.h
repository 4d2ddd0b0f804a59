#pragma once
// Measures one piece on the device: forward and backward (with the recomputing forward
// when asked) at a micro-batch of `rows` rows, after warm-up, median of repetitions, and
// the memory the piece holds between its forward and its backward (peak bytes on top).
//
// The clock and the memory counters come from a DeviceMeter (device_meter.h):
// CPU: the calling thread's CPU time when torch runs one intra-op thread, else the wall
// clock ([Note: CPU clock]), and the counting allocator (memory_counter.h). An allocation past
// ProfilerOptions::memory_limit (the device memory the plan may use) raises c10's
// OutOfMemoryError inside the run.
// CUDA (builds against CUDA torch): the piece's parameters and inputs are copied to the
// device, times come from CUDA events, memory from the caching allocator's allocated-bytes
// statistics (peak reset before each run); a peak past the limit, or the allocator's own
// OutOfMemoryError, makes the piece out of memory (the cache is emptied after an OOM).
// Either way measure() then returns a record marked out_of_memory (infinite time), never
// an exception, so the planner treats the candidate as infeasible.
#include <cstdint>
#include <memory>
#include <string>

#include <c10/core/Device.h>

#include "frontend/traced_model.h"
#include "ir/subgraph.h"
#include "profile/boundary_inputs.h"
#include "profile/device_meter.h"

namespace rannc::profile {

struct ProfilerOptions {
  int warmup = 1;            // untimed runs before measuring
  int repetitions = 3;       // timed runs at most; the median is kept
  // Stop timing a piece once its timed runs took this many seconds (at least one run):
  // large pieces on a slow device need no more repetitions to beat the noise. 0: off.
  double time_budget = 0.5;
  int64_t memory_limit = 0;  // bytes a piece may allocate (0: no limit)
  // Deterministic times computed from the piece's shapes instead of the clock (tests of
  // parallel profiling compare plans that must not depend on timing noise).
  bool fake_timer = false;
  // With fake_timer: each measurement's times scaled by a factor drawn anew in
  // [1 - fake_noise, 1 + fake_noise] from (fake_seed, the piece, its rows, how many
  // measurements came before), so that tests see the run-to-run noise of a real clock
  // reproducibly (a second plan from the cache must not measure what the first did).
  double fake_noise = 0.0;
  uint64_t fake_seed = 0;
  // Where pieces run: "cpu", "cuda" (the current CUDA device) or "cuda:N".
  std::string device = "cpu";
  // The clock of CPU measurements ([Note: CPU clock] in device_meter.h).
  CpuClock cpu_clock = CpuClock::Auto;
  // Forward only, without autograd (plans for eval/no_grad): no backward time, nothing
  // held for a backward. Some ops have no derivative (the transformer fast path of eval).
  bool forward_only = false;
  // Time the weight part of a split backward too (plans that may run ZB-H1: schedule zb_h1
  // or auto; [Note: weight part measured] in profiler.cpp). Off, weight_time stays -1.
  bool measure_weight_part = false;
};

// What one measurement found. Times in seconds for one micro-batch.
struct ProfileRecord {
  double forward_time = 0.0;
  double backward_time = 0.0;     // with recompute: includes the recomputing forward
  int64_t activation_bytes = 0;   // held from the end of the forward to the backward
  int64_t peak_bytes = 0;         // peak above the inputs over forward and backward,
                                  // without the parameters' gradients
  bool out_of_memory = false;     // did not fit memory_limit: times are infinite
  // The weight part of the backward split as ZB-H1 runs it ([Note: split backward] in
  // frontend/split_backward.h): the parameters' gradients; 0 without parameters, the whole
  // backward where no input takes a gradient. < 0: not measured (the planner estimates it).
  double weight_time = -1.0;
};

class Profiler {
 public:
  // Throws rannc::Error for a device this build or machine cannot measure on
  // (device_meter.h: parseProfileDevice).
  Profiler(std::shared_ptr<const frontend::TracedModel> model,
           std::shared_ptr<const BoundaryInputs> inputs, ProfilerOptions options);

  // Runs `piece` at `rows` rows. Throws rannc::Error (naming the piece and the op) when it fails
  // for another reason than memory.
  ProfileRecord measure(const ir::Subgraph& piece, int64_t rows, bool recompute);

  const ProfilerOptions& options() const { return options_; }
  ProfilerOptions& options() { return options_; }
  const c10::Device& device() const { return device_; }
  // The cache's device kind: "cpu" or "cuda:<device name>" (device_meter.h).
  const std::string& deviceKind() const { return device_kind_; }

 private:
  ProfileRecord measureOnce(DeviceMeter& meter, const ir::Subgraph& piece, int64_t rows,
                            bool recompute, int runs);
  ProfileRecord fakeTimes(const ir::Subgraph& piece, int64_t rows, bool recompute) const;
  uint64_t fake_draws_ = 0;  // measurements drawn noise for (options_.fake_noise)
  // "the piece of N tasks from task a (op, module, source) to task b (...)", for errors.
  std::string describePiece(const ir::Subgraph& piece) const;

  std::shared_ptr<const frontend::TracedModel> model_;
  // model_ with its constant devices and tensors on device_ ([Note: traced devices] in frontend/placement.h).
  std::shared_ptr<const frontend::TracedModel> run_model_;
  std::shared_ptr<const BoundaryInputs> inputs_;
  ProfilerOptions options_;
  c10::Device device_;
  std::string device_kind_;
};

}  // namespace rannc::profile
