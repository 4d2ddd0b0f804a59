#pragma once
// The planner's cost interface answered by measuring (partition/cost/cost_model.h).
//
// [Note: parallel profiling] Rank 0 plans; the other ranks serve. When the planner
// announces a batch of pieces (prefetch), rank 0 broadcasts the ones the cache lacks
// (task ids; every rank traced the same graph), every rank measures the pieces i with
// i mod size == rank, and an all-gather gives every rank all records. So the planner's
// own control flow runs on one rank only and may depend on measured times freely; the
// other ranks only follow broadcast commands until rank 0 calls finish(). Pieces the
// planner asks for without announcing them are measured by rank 0 alone.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "frontend/traced_model.h"
#include "partition/cost/cost_model.h"
#include "profile/profile_cache.h"
#include "profile/profiler.h"

namespace rannc::comm {
class Communicator;
}

namespace rannc::profile {

// Called with (pieces measured, pieces to measure) during a batch.
using ProgressFn = std::function<void(int64_t done, int64_t total)>;

class ProfilingCostModel : public partition::CostModel {
 public:
  // `comm`: the ranks sharing the work (nullptr or one rank: measure alone). Every rank
  // builds one over the same traced graph; rank 0 plans, the others call serve().
  ProfilingCostModel(std::shared_ptr<const frontend::TracedModel> model,
                     std::shared_ptr<Profiler> profiler, std::shared_ptr<ProfileCache> cache,
                     partition::DeviceSpec device,
                     std::shared_ptr<comm::Communicator> comm = nullptr);
  ~ProfilingCostModel() override;

  void prefetch(const std::vector<std::vector<ir::TaskId>>& pieces, int64_t rows) override;

  // Rank 0: releases the serving ranks (call once planning is over, also on failure).
  void finish();
  // Ranks other than 0: measures shares of the batches rank 0 announces until finish().
  // Throws rannc::Error when rank 0 sends something this rank cannot run.
  void serve();

  // Measures (or finds in the cache) one piece on this rank alone.
  ProfileRecord record(const ir::Subgraph& piece, int64_t rows, bool recompute);
  ProfileKey key(const ir::Subgraph& piece, int64_t rows, bool recompute) const;

  void setProgress(ProgressFn progress) { progress_ = std::move(progress); }
  // Pieces measured on this rank / found in the cache.
  int64_t measured() const { return measured_; }
  const std::string& dtype() const { return dtype_; }

 protected:
  partition::PieceCost computeCost(const ir::Subgraph& piece, int64_t rows) override;

 private:
  // The batch protocol: every rank measures its share of `pieces` and all get all.
  void runBatch(const std::vector<ir::Subgraph>& pieces, int64_t rows);

  std::shared_ptr<const frontend::TracedModel> model_;
  std::shared_ptr<Profiler> profiler_;
  std::shared_ptr<ProfileCache> cache_;
  std::shared_ptr<comm::Communicator> comm_;
  std::string dtype_;
  ProgressFn progress_;
  int64_t measured_ = 0;
  bool finished_ = false;
};

// PieceCost from a measurement: times from the record, parameter/buffer/boundary bytes
// from the IR, activations = what the forward holds plus the piece's inputs (the
// backward reads them), at least the measured peak.
partition::PieceCost pieceCostFrom(const ir::Graph& graph, const ir::Subgraph& piece, int64_t rows,
                                   const ProfileRecord& record);

}  // namespace rannc::profile
