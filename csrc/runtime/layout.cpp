#include "runtime/layout.h"

#include <algorithm>
#include <sstream>

#include "common/error.h"

namespace rannc::runtime {

std::optional<Rows> Rows::overlap(const Rows& other) const {
  Rows o{std::max(start, other.start), std::min(stop, other.stop)};
  if (o.start < o.stop) return o;
  return std::nullopt;
}

std::string Rows::str() const {
  return "[" + std::to_string(start) + ", " + std::to_string(stop) + ")";
}

std::vector<int64_t> splitBounds(int64_t n, int64_t parts) {
  std::vector<int64_t> out;
  out.reserve(parts + 1);
  for (int64_t i = 0; i <= parts; ++i) out.push_back(n * i / parts);
  return out;
}

Layout::Layout(const partition::Deployment& deployment, int world_size, int64_t local_batch,
               bool cap_micro_batches)
    : world_size_(world_size),
      local_batch_(local_batch),
      global_batch_(world_size * local_batch),
      pipelines_(deployment.pipelines),
      micro_batches_(deployment.micro_batches) {
  RANNC_CHECK(pipelines_ >= 1 && micro_batches_ >= 1 && !deployment.stages.empty(),
              "a deployment needs stages, pipeline copies and micro-batches");
  places_.assign(world_size, {});
  for (const auto& stage : deployment.stages) {
    RANNC_CHECK(!stage.ranks.empty() && stage.ranks.size() % pipelines_ == 0,
                "a stage's " << stage.ranks.size() << " ranks do not split into " << pipelines_
                             << " pipeline copies");
    stage_ranks_.push_back(stage.ranks);
    replicas_.push_back(static_cast<int>(stage.ranks.size()) / pipelines_);
  }
  copy_bounds_ = splitBounds(global_batch_, pipelines_);
  int64_t smallest = global_batch_;
  for (int c = 0; c < pipelines_; ++c) smallest = std::min(smallest, copy_bounds_[c + 1] - copy_bounds_[c]);
  int most_replicas = *std::max_element(replicas_.begin(), replicas_.end());
  // Every replica of every stage needs at least one row of each micro-batch.
  int64_t fits = smallest / most_replicas;
  if (cap_micro_batches && fits >= 1 && fits < micro_batches_) micro_batches_ = static_cast<int>(fits);
  if (fits < micro_batches_) {
    std::ostringstream msg;
    // where the micro-batches shrink to fit, one micro-batch is what the rows must fill
    const int needed_micro_batches = cap_micro_batches ? 1 : micro_batches_;
    msg << "a global batch of " << global_batch_ << " rows (" << world_size << " ranks x "
        << local_batch << ") is too small for this plan: " << pipelines_ << " pipeline copies x "
        << needed_micro_batches << " micro-batch" << (needed_micro_batches > 1 ? "es" : "")
        << " with up to " << most_replicas << " replicas per stage need at least "
        << int64_t(pipelines_) * needed_micro_batches * most_replicas << " rows; use a larger batch"
        << (cap_micro_batches ? "" : " or fewer micro-batches (option num_microbatches)");
    throw Error(msg.str());
  }
  for (int s = 0; s < numStages(); ++s) {
    for (size_t i = 0; i < stage_ranks_[s].size(); ++i) {
      int r = stage_ranks_[s][i];
      RANNC_CHECK(r >= 0 && r < world_size, "stage " << s << " names rank " << r
                                                     << " outside a world of " << world_size);
      places_[r].push_back(Place{s, static_cast<int>(i) / replicas_[s], static_cast<int>(i) % replicas_[s]});
    }
  }
}

int Layout::rankOf(int stage, int copy, int replica) const {
  return stage_ranks_.at(stage).at(copy * replicas_.at(stage) + replica);
}

Place Layout::place(int rank) const { return places(rank).front(); }

const std::vector<Place>& Layout::places(int rank) const {
  RANNC_CHECK(rank >= 0 && rank < world_size_ && !places_[rank].empty(),
              "rank " << rank << " runs no stage of the plan");
  return places_[rank];
}

Rows Layout::microBatchRows(int copy, int micro_batch) const {
  int64_t lo = copy_bounds_.at(copy), hi = copy_bounds_.at(copy + 1);
  auto b = splitBounds(hi - lo, micro_batches_);
  return Rows{lo + b.at(micro_batch), lo + b.at(micro_batch + 1)};
}

Rows Layout::share(int stage, int copy, int micro_batch, int replica) const {
  Rows mb = microBatchRows(copy, micro_batch);
  auto b = splitBounds(mb.size(), replicas_.at(stage));
  return Rows{mb.start + b.at(replica), mb.start + b.at(replica + 1)};
}

Rows Layout::owned(int rank) const { return Rows{rank * local_batch_, (rank + 1) * local_batch_}; }

}  // namespace rannc::runtime
