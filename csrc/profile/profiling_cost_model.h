#pragma once
// The planner's cost interface answered by measuring (partition/cost/cost_model.h).
//
// [Note: parallel profiling] Rank 0 plans; the other ranks serve. When the planner
// announces a batch of pieces (prefetch), rank 0 broadcasts the ones the cache lacks
// (task ids; every rank traced the same graph), every rank measures the pieces i with
// (i + 1) mod size == rank (rank 0, which also searches, gets the smallest share), and an
// all-gather gives every rank all records. So the planner's
// own control flow runs on one rank only and may depend on measured times freely; the
// other ranks only follow broadcast commands until rank 0 calls finish(). Pieces the
// planner asks for without announcing them are measured by rank 0 alone.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
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

  // [Note: composed costs] Measuring every candidate union whole made planning slow: the
  // stage DP asks for every range of blocks (k(k+1)/2 pieces per micro-batch size, each
  // as long as its range), and coarsening for every pair it considers merging. With
  // composition on, a union costs the sum of its parts' measurements: times add, what the
  // forward holds adds, and the peak is the largest of (held by the parts before + a
  // part's own peak), the backward running while the earlier parts still hold theirs.
  // Parts come from earlier compositions (coarsening's groups) first, then from the cache
  // of measurements (or fitted records), and are measured otherwise; a piece announced
  // for measurement as itself (prefetch: atoms, blocks) drops its composition there, so a
  // group that later becomes a block costs the same in a second plan, which finds the
  // block's measurement in the cache from the start (tested under a noisy fake clock). A union is
  // composed even where the cache holds it measured whole, so that a second plan from
  // the cache costs it as the first did. Atoms and blocks are measured as themselves, and
  // the finalists' stages whole ([Note: verified finalists] in partition/planner.cpp).
  void setComposeUnions(bool on) { compose_ = on; }
  bool composesUnions() const override { return compose_; }
  partition::PieceCost unionCost(const std::vector<const std::vector<ir::TaskId>*>& parts,
                                 int64_t rows) override;

  // [Note: fitted rows] A piece's time and memory grow about linearly with its rows on
  // a device that is busy (a CPU; a GPU past small batches), and measuring every block at
  // every row count the search tries cost most of the planning time. With a tolerance > 0,
  // a batch at rows r between the fewest rows the planner will ask for (expectRows) and
  // a row count measured before is fitted: the pieces are measured at the fewest rows,
  // and each piece's record at r is interpolated between that and its nearest row count
  // above whose batch was measured, not fitted. The batch's piece that takes longest there is measured at r as the
  // check (a second plan finds it in the cache and checks on it again); when its fit is
  // off by more than the tolerance (a GPU's flat region at small rows), the whole batch
  // is measured instead. A line checked once is not checked again at other rows between
  // its ends (GPT-2 small for 8 devices: checks at 4, 3 and 2 rows cost 4 s of 20; the
  // line's error there was 0.9%, 2.4% and 1.2%). Fitted records are not saved to the cache.
  void setFitTolerance(double tolerance) { fit_tolerance_ = tolerance; }
  void expectRows(int64_t min_rows) override { min_rows_ = min_rows; }
  int64_t fitted() const { return static_cast<int64_t>(fitted_.size()); }

  void setProgress(ProgressFn progress) { progress_ = std::move(progress); }
  // Pieces measured on this rank, and the seconds their measurements took (inputs,
  // warm-up and timed runs; also the waits for the other ranks' shares).
  int64_t measured() const { return measured_; }
  double measuringSeconds() const { return measuring_seconds_; }
  // Unions costed by composition instead of a measurement.
  int64_t composed() const { return static_cast<int64_t>(composed_.size()); }
  const std::string& dtype() const { return dtype_; }

 protected:
  partition::PieceCost computeCost(const ir::Subgraph& piece, int64_t rows) override;

 private:
  // The batch protocol: every rank measures its share of `pieces` and all get all.
  void runBatch(const std::vector<ir::Subgraph>& pieces, int64_t rows);
  // Measures `pieces` at `rows` (spread over the ranks) into the cache.
  void measureBatch(const std::vector<ir::Subgraph>& pieces, int64_t rows);
  // The pieces of `pieces` whose records at `rows` are unknown and cannot be fitted
  // ([Note: fitted rows]). Without `may_measure`, only notes a check the cache answers.
  std::vector<ir::Subgraph> fitRows(const std::vector<ir::Subgraph>& pieces, int64_t rows, bool may_measure);
  // A measured or fitted record.
  std::optional<ProfileRecord> known(const ProfileKey& k) const;
  // A part of a union: composed before, measured, or measured now.
  ProfileRecord partRecord(const std::vector<ir::TaskId>& tasks, int64_t rows);

  std::shared_ptr<const frontend::TracedModel> model_;
  std::shared_ptr<Profiler> profiler_;
  std::shared_ptr<ProfileCache> cache_;
  std::shared_ptr<comm::Communicator> comm_;
  std::string dtype_;
  ProgressFn progress_;
  int64_t measured_ = 0;
  double measuring_seconds_ = 0.0;
  bool finished_ = false;
  bool compose_ = false;
  std::unordered_map<ProfileKey, ProfileRecord, ProfileKeyHash> composed_;
  double fit_tolerance_ = 0.0;
  int64_t min_rows_ = 0;
  std::set<int64_t> whole_rows_;  // row counts whose batches were measured, none fitted
  std::unordered_map<ProfileKey, ProfileRecord, ProfileKeyHash> fitted_;
  std::set<std::pair<int64_t, int64_t>> checked_lines_;  // (lo, hi) rows whose check held
};

// The record at `rows` on the line through `lo` (at lo_rows) and `hi` (at hi_rows).
ProfileRecord interpolateRecords(const ProfileRecord& lo, int64_t lo_rows, const ProfileRecord& hi,
                                 int64_t hi_rows, int64_t rows);

// The record of running `parts` one after another (forward in order, backward in reverse):
// [Note: composed costs]. Out of memory when any part is.
ProfileRecord composeRecords(const std::vector<ProfileRecord>& parts);

// PieceCost from a measurement: times from the record, parameter/buffer/boundary bytes
// from the IR, activations = what the forward holds plus the piece's inputs (the
// backward reads them), at least the measured peak.
partition::PieceCost pieceCostFrom(const ir::Graph& graph, const ir::Subgraph& piece, int64_t rows,
                                   const ProfileRecord& record);

}  // namespace rannc::profile
