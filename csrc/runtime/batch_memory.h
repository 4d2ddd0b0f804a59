#pragma once
// The micro-batch count that keeps a plan within its memory at another batch size or other
// input shapes. Plain C++ (no torch): GoogleTest checks it without ranks.
//
// [Note: memory at other batches] The planner fits a plan's memory at the batch and input
// shapes of the first call: each stage stashes micro-batches of `micro_batch_rows` rows
// while they are in flight. A later call with more rows per micro-batch (a larger batch)
// or larger rows (longer sequences: rebindDeployment scales each stage's stash by its bytes
// per row) would stash more, and on a GPU run out of memory in the middle of a step. So,
// before such a batch runs, the micro-batch count grows until the simulator's peak of
// every device is within the plan's memory limit again: the same stages and replicas,
// smaller micro-batches, and the same results (micro-batches add up exactly). Where no
// count down to one row per replica fits (a fill-drain schedule keeps every micro-batch in
// flight, so more of them do not help), the count with the lowest peak runs and the fit
// says so. A plan that did not fit its limit when made is left as it is.
#include <cstdint>
#include <vector>

#include "partition/plan.h"

namespace rannc::runtime {

struct MicroBatchFit {
  int micro_batches = 1;
  bool fits = true;         // every device's peak within the plan's memory limit
  int64_t peak_bytes = 0;   // the highest device peak predicted at `micro_batches`
  int stage = -1;           // a stage on that device
};

// Predicted peak bytes per stage (its device's, with chunks) when local batches of
// `local_batch` rows run in `micro_batches` micro-batches: the plan's stash and working
// bytes scaled by the rows each replica then runs against the planned micro_batch_rows.
// Throws rannc::Error when the batch cannot give every replica a row of each micro-batch.
std::vector<int64_t> predictedPeaks(const partition::Deployment& d, int world_size,
                                    int64_t local_batch, int micro_batches);

// The smallest micro-batch count from `micro_batches` up whose predicted peaks fit the
// plan's memory limit ([Note: memory at other batches]).
MicroBatchFit fitMicroBatches(const partition::Deployment& d, int world_size, int64_t local_batch,
                              int micro_batches);

}  // namespace rannc::runtime
