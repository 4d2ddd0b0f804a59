#pragma once
// Who runs what under a deployment: the stages, pipeline copies and replicas of each
// rank, and the batch rows each of them holds. Plain C++ (no torch): the transfer plan and
// its tests build on it.
//
// [Note: row ownership] The global batch is the concatenation of the ranks' local batches
// (rank r owns global rows [r*b, (r+1)*b)). Pipeline copy c takes a contiguous share of
// the global rows, micro-batch m a contiguous share of the copy's rows, and replica j of a
// stage a contiguous share of the micro-batch's rows. A batch value (IR batch_dim d,
// batch_multiple k) of a row interval [s, t) has (t-s)*k entries along d.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "partition/plan.h"

namespace rannc::runtime {

// A half-open interval of global batch rows.
struct Rows {
  int64_t start = 0;
  int64_t stop = 0;

  int64_t size() const { return stop - start; }
  std::optional<Rows> overlap(const Rows& other) const;
  bool operator==(const Rows& o) const { return start == o.start && stop == o.stop; }
  std::string str() const;  // "[4, 8)"
};

// Split points of n items into `parts` contiguous, nearly equal parts (parts + 1 entries).
std::vector<int64_t> splitBounds(int64_t n, int64_t parts);

// Where a rank sits in the deployment.
struct Place {
  int stage = -1;
  int copy = 0;
  int replica = 0;
};

class Layout {
 public:
  // Throws rannc::Error when the global batch (world_size x local_batch) cannot give every
  // replica of every stage a row of each micro-batch. With `cap_micro_batches`, a batch
  // too small for the plan's micro-batch count runs as many as its rows allow (a short
  // last batch of an epoch) instead.
  Layout(const partition::Deployment& deployment, int world_size, int64_t local_batch,
         bool cap_micro_batches = false);

  int worldSize() const { return world_size_; }
  int64_t localBatch() const { return local_batch_; }
  int64_t globalBatch() const { return global_batch_; }
  int pipelines() const { return pipelines_; }
  int microBatches() const { return micro_batches_; }
  int numStages() const { return static_cast<int>(stage_ranks_.size()); }
  const std::vector<int>& stageRanks(int stage) const { return stage_ranks_.at(stage); }
  int replicas(int stage) const { return replicas_.at(stage); }

  int rankOf(int stage, int copy, int replica) const;
  // Throws InternalError for a rank outside every stage. A rank holding several stages
  // (chunks of an interleaved schedule, [Note: interleaved 1F1B] in sim/schedule.h) is
  // placed at each; place() gives its first stage.
  Place place(int rank) const;
  const std::vector<Place>& places(int rank) const;
  Rows microBatchRows(int copy, int micro_batch) const;
  Rows share(int stage, int copy, int micro_batch, int replica) const;
  Rows owned(int rank) const;

 private:
  int world_size_ = 1;
  int64_t local_batch_ = 0;
  int64_t global_batch_ = 0;
  int pipelines_ = 1;
  int micro_batches_ = 1;
  std::vector<std::vector<int>> stage_ranks_;
  std::vector<int> replicas_;
  std::vector<int64_t> copy_bounds_;
  std::vector<std::vector<Place>> places_;  // by rank, stages ascending
};

}  // namespace rannc::runtime
