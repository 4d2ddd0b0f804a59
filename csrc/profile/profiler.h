#pragma once
// Measures one piece on the device: forward and backward (with the recomputing forward
// when asked) at a micro-batch of `rows` rows, after warm-up, median of repetitions, and
// the memory the piece holds between its forward and its backward (peak bytes on top).
//
// CPU: wall clock and the counting allocator (memory_counter.h). An allocation past
// ProfilerOptions::memory_limit (the device memory the plan may use) raises c10's
// OutOfMemoryError inside the run; measure() then returns a record marked out_of_memory
// (infinite time), never an exception, so the planner treats the candidate as infeasible.
// CUDA timing (events) and the caching allocator's peak statistics are not written yet
// (the build has no CUDA torch to test them against): a CUDA model is measured with the
// wall clock after synchronising, and its memory from the IR (docs/profile.md).
#include <cstdint>
#include <memory>
#include <string>

#include "frontend/traced_model.h"
#include "ir/subgraph.h"
#include "profile/boundary_inputs.h"

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
};

// What one measurement found. Times in seconds for one micro-batch.
struct ProfileRecord {
  double forward_time = 0.0;
  double backward_time = 0.0;     // with recompute: includes the recomputing forward
  int64_t activation_bytes = 0;   // held from the end of the forward to the backward
  int64_t peak_bytes = 0;         // peak above the inputs over forward and backward,
                                  // without the parameters' gradients
  bool out_of_memory = false;     // did not fit memory_limit: times are infinite
};

class Profiler {
 public:
  Profiler(std::shared_ptr<const frontend::TracedModel> model,
           std::shared_ptr<const BoundaryInputs> inputs, ProfilerOptions options);

  // Runs `piece` at `rows` rows. Throws rannc::Error (naming the op) when the piece fails
  // for another reason than memory.
  ProfileRecord measure(const ir::Subgraph& piece, int64_t rows, bool recompute);

  const ProfilerOptions& options() const { return options_; }
  ProfilerOptions& options() { return options_; }
  // "cpu" (the cache's device kind).
  std::string deviceKind() const { return "cpu"; }

 private:
  ProfileRecord measureOnce(const ir::Subgraph& piece, int64_t rows, bool recompute, int runs);
  ProfileRecord fakeTimes(const ir::Subgraph& piece, int64_t rows, bool recompute) const;

  std::shared_ptr<const frontend::TracedModel> model_;
  std::shared_ptr<const BoundaryInputs> inputs_;
  ProfilerOptions options_;
};

}  // namespace rannc::profile
