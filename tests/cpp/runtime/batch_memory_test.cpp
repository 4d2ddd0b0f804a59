// [Note: memory at other batches]: the micro-batch count that keeps a plan within its
// memory limit at batches larger than planned.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/error.h"
#include "partition/plan.h"
#include "runtime/batch_memory.h"

namespace rannc::runtime {
namespace {

// `stages` stages on one rank each, planned at 2 rows per micro-batch: each holds 1000
// bytes of state and stashes 100 bytes per micro-batch in flight; the limit is the planned
// peak (1F1B: stage 0 holds min(stages, M) micro-batches).
partition::Deployment planned(int stages, int micro_batches, partition::ScheduleKind schedule,
                              int chunks = 1) {
  partition::Deployment d;
  d.world_size = stages / chunks;
  d.batch_size = 2 * micro_batches;
  d.micro_batches = micro_batches;
  d.schedule = schedule;
  d.chunks = chunks;
  for (int s = 0; s < stages; ++s) {
    partition::StagePlan st;
    st.ranks = {s % d.world_size};
    st.micro_batch_rows = 2;
    st.forward_time = st.backward_time = 1.0;
    st.static_bytes = 1000;
    st.stash_bytes = 100;
    d.stages.push_back(st);
  }
  d.memory_limit = 1000 + 100 * std::min(stages, micro_batches);
  return d;
}

TEST(PredictedPeaks, ScaleTheStashByTheRowsOfAMicroBatch) {
  auto d = planned(2, 2, partition::ScheduleKind::OneFOneB);
  // local batch 2 on 2 ranks: 4 rows, 2 per micro-batch as planned
  EXPECT_EQ(predictedPeaks(d, 2, 2, 2), (std::vector<int64_t>{1200, 1100}));
  // local batch 8: 8 rows per micro-batch, four times the stash
  EXPECT_EQ(predictedPeaks(d, 2, 8, 2), (std::vector<int64_t>{1800, 1400}));
  // 8 micro-batches of 2 rows: 1F1B keeps 2 in flight on stage 0, as planned
  EXPECT_EQ(predictedPeaks(d, 2, 8, 8), (std::vector<int64_t>{1200, 1100}));
  EXPECT_THROW(predictedPeaks(d, 2, 2, 5), Error);  // 4 rows cannot fill 5 micro-batches
}

TEST(FitMicroBatches, KeepsThePlansCountWhereItFits) {
  auto d = planned(2, 2, partition::ScheduleKind::OneFOneB);
  MicroBatchFit fit = fitMicroBatches(d, 2, 2, 2);
  EXPECT_EQ(fit.micro_batches, 2);
  EXPECT_TRUE(fit.fits);
  EXPECT_EQ(fit.peak_bytes, 1200);
  EXPECT_EQ(fit.stage, 0);
  d.memory_limit = 0;  // no limit known: as planned
  EXPECT_EQ(fitMicroBatches(d, 2, 8, 2).micro_batches, 2);
  EXPECT_TRUE(fitMicroBatches(d, 2, 8, 2).fits);
}

TEST(FitMicroBatches, GrowsTheCountToTheSmallestThatFitsALargerBatch) {
  auto d = planned(2, 2, partition::ScheduleKind::OneFOneB);
  // 16 rows: 6 or 7 micro-batches leave 3-row shares (1300 bytes); 8 is the first that fits
  MicroBatchFit fit = fitMicroBatches(d, 2, 8, 2);
  EXPECT_EQ(fit.micro_batches, 8);
  EXPECT_TRUE(fit.fits);
  EXPECT_EQ(fit.peak_bytes, 1200);
  // a stash twice as large per row (rebindDeployment's scaling at longer sequences)
  for (auto& st : d.stages) st.stash_bytes = 200;
  d.memory_limit = 1000 + 2 * 200;
  fit = fitMicroBatches(d, 2, 4, 2);  // 8 rows: 4 per micro-batch
  EXPECT_EQ(fit.micro_batches, 4);
  EXPECT_TRUE(fit.fits);
}

TEST(FitMicroBatches, SaysSoWhereNoCountFits) {
  // fill-drain keeps every micro-batch in flight: more of them stash as much
  auto d = planned(2, 2, partition::ScheduleKind::FillDrain);
  MicroBatchFit fit = fitMicroBatches(d, 2, 8, 2);
  EXPECT_FALSE(fit.fits);
  EXPECT_EQ(fit.micro_batches, 2);
  EXPECT_EQ(fit.peak_bytes, 1800);
  EXPECT_EQ(fit.stage, 0);
  // 1F1B down to one row per replica still above a limit below the state
  d = planned(2, 2, partition::ScheduleKind::OneFOneB);
  d.memory_limit = 1050;
  fit = fitMicroBatches(d, 2, 8, 2);
  EXPECT_FALSE(fit.fits);
  EXPECT_EQ(fit.peak_bytes, 1100);  // 16 micro-batches of 1 row: the lowest peak
}

TEST(FitMicroBatches, StepsByTheDevicesUnderInterleaving) {
  auto d = planned(4, 2, partition::ScheduleKind::Interleaved, /*chunks=*/2);
  const int64_t planned_peak = predictedPeaks(d, 2, 2, 2)[0];
  d.memory_limit = planned_peak;
  MicroBatchFit fit = fitMicroBatches(d, 2, 16, 2);
  EXPECT_TRUE(fit.fits);
  EXPECT_EQ(fit.micro_batches % 2, 0);
  EXPECT_GT(fit.micro_batches, 2);
  EXPECT_LE(fit.peak_bytes, planned_peak);
}

}  // namespace
}  // namespace rannc::runtime
