#include "runtime/batch_memory.h"

#include <algorithm>
#include <cmath>

#include "runtime/layout.h"

namespace rannc::runtime {

std::vector<int64_t> predictedPeaks(const partition::Deployment& d, int world_size,
                                    int64_t local_batch, int micro_batches) {
  partition::Deployment at = d;
  at.micro_batches = micro_batches;
  const Layout layout(at, world_size, local_batch);  // throws when a replica gets no row
  auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  // the largest copy, micro-batch and share (splitBounds' parts differ by at most one row)
  const int64_t micro_batch = ceil_div(ceil_div(layout.globalBatch(), layout.pipelines()), micro_batches);
  for (int s = 0; s < at.numStages(); ++s) {
    partition::StagePlan& stage = at.stages[s];
    if (stage.micro_batch_rows <= 0) continue;
    const int64_t rows = ceil_div(micro_batch, layout.replicas(s));
    const double scale = double(rows) / double(stage.micro_batch_rows);
    stage.stash_bytes = std::llround(double(stage.stash_bytes) * scale);
    stage.working_bytes = std::llround(double(stage.working_bytes) * scale);
  }
  const partition::SimResult sim = partition::simulateDeployment(at, at.schedule);
  const int groups = at.deviceGroups();
  std::vector<int64_t> peaks;
  for (int s = 0; s < at.numStages(); ++s) peaks.push_back(sim.peak_memory.at(s % groups));
  return peaks;
}

namespace {

MicroBatchFit fitAt(const partition::Deployment& d, int world_size, int64_t local_batch, int m) {
  const std::vector<int64_t> peaks = predictedPeaks(d, world_size, local_batch, m);
  const auto top = std::max_element(peaks.begin(), peaks.end());
  MicroBatchFit fit;
  fit.micro_batches = m;
  fit.peak_bytes = *top;
  fit.stage = static_cast<int>(top - peaks.begin());
  fit.fits = d.memory_limit <= 0 || fit.peak_bytes <= d.memory_limit;
  return fit;
}

}  // namespace

MicroBatchFit fitMicroBatches(const partition::Deployment& d, int world_size, int64_t local_batch,
                              int micro_batches) {
  MicroBatchFit start = fitAt(d, world_size, local_batch, micro_batches);
  if (start.fits || !d.feasible) return start;
  // the most micro-batches that still give every replica of every stage a row of each
  int most_replicas = 1;
  for (const auto& stage : d.stages) {
    most_replicas = std::max(most_replicas, static_cast<int>(stage.ranks.size()) / d.pipelines);
  }
  const int64_t rows_per_copy = int64_t(world_size) * local_batch / d.pipelines;
  // Interleaved 1F1B runs micro-batches in groups of its devices: counts step by that.
  const int step = d.schedule == partition::ScheduleKind::Interleaved ? d.deviceGroups() : 1;
  const int64_t first = std::max(1, micro_batches / step);
  const int64_t most = std::max<int64_t>(first, rows_per_copy / most_replicas / step);
  auto at = [&](int64_t units) { return fitAt(d, world_size, local_batch, static_cast<int>(units * step)); };
  // Peaks fall as micro-batches grow past the stages in flight: double until one fits,
  // then bisect for the smallest count that does.
  MicroBatchFit best = start;
  for (int64_t u = first; u < most;) {
    const int64_t next = std::min(u * 2, most);  // u >= 1: grows
    MicroBatchFit fit = at(next);
    if (fit.fits) {
      int64_t lo = u, hi = next;  // lo does not fit, hi does
      best = fit;
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        MicroBatchFit probe = at(mid);
        if (probe.fits) {
          hi = mid;
          best = probe;
        } else {
          lo = mid;
        }
      }
      return best;
    }
    if (fit.peak_bytes < best.peak_bytes) best = fit;
    u = next;
  }
  return best;
}

}  // namespace rannc::runtime
