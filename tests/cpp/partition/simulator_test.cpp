#include <gtest/gtest.h>

#include "common/error.h"
#include "partition/sim/simulator.h"

namespace rannc::partition {
namespace {

std::vector<SimStage> uniform(int stages, double fwd, double bwd) {
  SimStage s;
  s.forward_time = fwd;
  s.backward_time = bwd;
  return std::vector<SimStage>(stages, s);
}

TEST(ASchedule, PrintsOneFOneBWithWarmUpPerStage) {
  EXPECT_EQ(formatSchedule(buildSchedule(ScheduleKind::OneFOneB, 2, 4)),
            "0: F0 F1 B0 F2 B1 F3 B2 B3\n"
            "1: F0 B0 F1 B1 F2 B2 F3 B3\n");
  EXPECT_EQ(formatSchedule(buildSchedule(ScheduleKind::FillDrain, 2, 2)),
            "0: F0 F1 B0 B1\n"
            "1: F0 F1 B0 B1\n");
  // Fewer micro-batches than stages: warm-up is capped by the micro-batches.
  EXPECT_EQ(formatSchedule(buildSchedule(ScheduleKind::OneFOneB, 3, 1)),
            "0: F0 B0\n1: F0 B0\n2: F0 B0\n");
}

TEST(ASchedule, RejectsABackwardBeforeItsForward) {
  Schedule bad{{{ActionKind::Backward, 0}, {ActionKind::Forward, 0}}};
  EXPECT_THROW(validateSchedule(bad, 1), InternalError);
}

// 2 stages, 4 micro-batches, fwd = 1, bwd = 2, no communication. By hand:
//   s0: F0[0,1] F1[1,2]            B0[4,6] F2[6,7] B1[7,9] F3[9,10] B2[10,12] B3[13,15]
//   s1:   F0[1,2] B0[2,4] F1[4,5] B1[5,7] F2[7,8] B2[8,10] F3[10,11] B3[11,13]
// so the iteration takes 15 = (M + S - 1) (f + b); s0 holds 2 micro-batches, s1 one.
TEST(ASimulator, MatchesAHandComputedOneFOneBTimeline) {
  SimResult r = simulate(uniform(2, 1, 2), ScheduleKind::OneFOneB, 4);
  EXPECT_DOUBLE_EQ(r.iteration_time, 15.0);
  EXPECT_EQ(r.start[0], (std::vector<double>{0, 1, 4, 6, 7, 9, 10, 13}));
  EXPECT_EQ(r.start[1], (std::vector<double>{1, 2, 4, 5, 7, 8, 10, 11}));
  EXPECT_DOUBLE_EQ(r.busy[0], 12.0);
  EXPECT_DOUBLE_EQ(r.bubble[0], 3.0);
  EXPECT_EQ(r.peak_in_flight, (std::vector<int>{2, 1}));
}

// Fill-drain over the same costs: s0 F0..F3 in [0,4]; s1 F0..F3 in [1,5]; s1 B0..B3 in
// [5,13]; s0 B_m waits for s1 B_m: B0[7,9] B1[9,11] B2[11,13] B3[13,15]. Same 15, but
// every stage holds all four micro-batches.
TEST(ASimulator, MatchesAHandComputedFillDrainTimeline) {
  SimStage s;
  s.forward_time = 1;
  s.backward_time = 2;
  s.static_bytes = 100;
  s.stash_bytes = 10;
  std::vector<SimStage> st(2, s);
  SimResult r = simulate(st, ScheduleKind::FillDrain, 4);
  EXPECT_DOUBLE_EQ(r.iteration_time, 15.0);
  EXPECT_EQ(r.start[0], (std::vector<double>{0, 1, 2, 3, 7, 9, 11, 13}));
  EXPECT_EQ(r.peak_in_flight, (std::vector<int>{4, 4}));
  EXPECT_EQ(r.peak_memory[0], 140);
  SimResult one = simulate(st, ScheduleKind::OneFOneB, 4);
  EXPECT_EQ(one.peak_memory[0], 120);
  EXPECT_EQ(one.peak_memory[1], 110);
}

// 2 stages, 2 micro-batches, f = 1, b = 2, each send 0.5, stage 0 all-reduces for 3:
//   s0: F0[0,1] F1[1,2] B0[5,7] B1[8,10]      (B0 waits for s1 B0 end 4.5 + 0.5)
//   s1: F0[1.5,2.5] B0[2.5,4.5] F1[4.5,5.5] B1[5.5,7.5]
// s0 finishes its backwards at 10; the all-reduce overlaps the last backward (2 of 3),
// so the iteration takes 11.
TEST(ASimulator, DelaysByTransfersAndTheUnhiddenAllReduce) {
  std::vector<SimStage> st = uniform(2, 1, 2);
  for (auto& s : st) s.send_forward_time = s.send_backward_time = 0.5;
  st[0].allreduce_time = 3;
  SimResult r = simulate(st, ScheduleKind::OneFOneB, 2);
  EXPECT_EQ(r.start[0], (std::vector<double>{0, 1, 5, 8}));
  EXPECT_EQ(r.start[1], (std::vector<double>{1.5, 2.5, 4.5, 5.5}));
  EXPECT_DOUBLE_EQ(r.finish[0], 11.0);
  EXPECT_DOUBLE_EQ(r.iteration_time, 11.0);
}

TEST(ASimulator, FollowsTheSlowestStageInTheSteadyState) {
  std::vector<SimStage> st = uniform(3, 1, 2);
  st[1].forward_time = 2;
  st[1].backward_time = 4;
  // Bottleneck 6 per micro-batch over 8 micro-batches, plus fill and drain of the others.
  SimResult r = simulate(st, ScheduleKind::OneFOneB, 8);
  EXPECT_GE(r.iteration_time, 8 * 6.0);
  EXPECT_LE(r.iteration_time, 8 * 6.0 + 2 * 3.0 + 1e-9);
}

}  // namespace
}  // namespace rannc::partition
