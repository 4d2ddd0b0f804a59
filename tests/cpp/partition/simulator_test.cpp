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

TEST(ASchedule, PrintsZeroBubbleH1WithWeightBackwardsDeferredByTheStageIndex) {
  EXPECT_EQ(formatSchedule(buildSchedule(ScheduleKind::ZeroBubbleH1, 3, 4)),
            "0: F0 F1 F2 Bi0 W0 F3 Bi1 W1 Bi2 W2 Bi3 W3\n"
            "1: F0 F1 Bi0 F2 Bi1 W0 F3 Bi2 W1 Bi3 W2 W3\n"
            "2: F0 Bi0 F1 Bi1 F2 Bi2 W0 F3 Bi3 W1 W2 W3\n");
  for (int S = 1; S <= 6; ++S) {
    for (int M = 1; M <= 9; ++M) {
      validateSchedule(buildSchedule(ScheduleKind::ZeroBubbleH1, S, M), M);
    }
  }
}

TEST(ASchedule, RejectsAWeightBackwardBeforeItsInputBackward) {
  Schedule bad{{{ActionKind::Forward, 0}, {ActionKind::BackwardWeight, 0}, {ActionKind::BackwardInput, 0}}};
  EXPECT_THROW(validateSchedule(bad, 1), InternalError);
  Schedule twice{{{ActionKind::Forward, 0}, {ActionKind::BackwardInput, 0}, {ActionKind::Backward, 0}}};
  EXPECT_THROW(validateSchedule(twice, 1), InternalError);
}

// [Note: ZB-H1]: with F = B = W = 1 (a backward of 2, half of it weights) the bubble is
// (S - 1)(F + B - W) = S - 1, a third of 1F1B's 3 (S - 1), and no stage holds more
// micro-batches than 1F1B's first stage.
TEST(ASimulator, GivesZeroBubbleH1AThirdOfOneFOneBsBubble) {
  for (int S : {2, 3, 4}) {
    std::vector<SimStage> st = uniform(S, 1, 2);
    for (auto& s : st) s.weight_time = 1;
    const int M = 8;
    SimResult one = simulate(st, ScheduleKind::OneFOneB, M);
    SimResult zb = simulate(st, ScheduleKind::ZeroBubbleH1, M);
    EXPECT_DOUBLE_EQ(one.iteration_time, 3.0 * M + 3.0 * (S - 1)) << S;
    EXPECT_DOUBLE_EQ(zb.iteration_time, 3.0 * M + 1.0 * (S - 1)) << S;
    for (int i = 0; i < S; ++i) {
      EXPECT_LE(zb.peak_in_flight[i], one.peak_in_flight[0]) << S << " stage " << i;
      EXPECT_EQ(zb.peak_in_flight[i], maxInFlight(ScheduleKind::ZeroBubbleH1, i, S, M)) << S << " stage " << i;
    }
  }
}

// Without a weight part (weight_time 0) a split backward is the whole backward: ZB-H1
// is 1F1B.
TEST(ASimulator, GivesZeroBubbleH1OneFOneBsTimeWithoutWeightGradients) {
  std::vector<SimStage> st = uniform(3, 1, 2);
  EXPECT_DOUBLE_EQ(simulate(st, ScheduleKind::ZeroBubbleH1, 6).iteration_time,
                   simulate(st, ScheduleKind::OneFOneB, 6).iteration_time);
}

// [Note: interleaved 1F1B]: every device runs the same (chunk, micro-batch) order, groups
// of `devices` micro-batches through chunk 0 then chunk 1; backwards with the chunks reversed.
TEST(ASchedule, PrintsInterleavedOneFOneBWithChunksPerDevice) {
  EXPECT_EQ(formatSchedule(buildSchedule(ScheduleKind::Interleaved, 2, 2, 2)),
            "0: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0\n"
            "1: F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 B0.0 B1.0\n");
  EXPECT_THROW(buildSchedule(ScheduleKind::Interleaved, 2, 3, 2), InvalidGraphError);  // 3 not a multiple of 2
  EXPECT_THROW(buildSchedule(ScheduleKind::Interleaved, 2, 2, 1), InvalidGraphError);  // one chunk
  EXPECT_THROW(buildSchedule(ScheduleKind::OneFOneB, 2, 2, 2), InvalidGraphError);
}

// Megatron-LM's bubble: with v chunks per device, each stage 1/v of the device's work, the
// fill and drain take (D - 1)(f + b) / v instead of (D - 1)(f + b); the device holds at most
// its warm-up 2 (D - 1 - d) + (v - 1) D plus one forwards of stages 1/v the size.
TEST(ASimulator, GivesInterleavedOneFOneBAFractionOfTheBubblePerChunk) {
  for (int D : {2, 3, 4}) {
    for (int v : {2, 3}) {
      for (int groups : {1, 2, 3}) {
        const int M = groups * D;
        SimResult one = simulate(uniform(D, 1, 2), ScheduleKind::OneFOneB, M);
        SimResult inter = simulate(uniform(D * v, 1.0 / v, 2.0 / v), ScheduleKind::Interleaved, M, v);
        const std::string where = std::to_string(D) + " devices, " + std::to_string(v) + " chunks, M " +
                                  std::to_string(M);
        EXPECT_DOUBLE_EQ(one.iteration_time, 3.0 * M + 3.0 * (D - 1)) << where;
        EXPECT_NEAR(inter.iteration_time, 3.0 * M + 3.0 * (D - 1) / v, 1e-9) << where;
        for (int d = 0; d < D; ++d) {
          EXPECT_NEAR(inter.busy[d], 3.0 * M, 1e-9) << where;
          EXPECT_EQ(inter.peak_in_flight[d], std::min(M * v, 2 * (D - 1 - d) + (v - 1) * D + 1)) << where;
          int held = 0;
          for (int c = 0; c < v; ++c) held = std::max(held, maxInFlight(ScheduleKind::Interleaved, c * D + d, D * v, M, v));
          EXPECT_LE(held, inter.peak_in_flight[d]) << where;
        }
      }
    }
  }
}

// Device memory counts each chunk's stash as it is held: chunks with different activation
// sizes add up to what the device holds at once, with every chunk's static bytes.
TEST(ASimulator, CountsAllChunksOfADeviceInItsMemory) {
  std::vector<SimStage> st = uniform(4, 1, 2);  // 2 devices x 2 chunks
  for (int i = 0; i < 4; ++i) {
    st[i].static_bytes = 1000;
    st[i].stash_bytes = i < 2 ? 10 : 100;  // chunk 0 small, chunk 1 large
  }
  SimResult r = simulate(st, ScheduleKind::Interleaved, 2, 2);
  // device 0: F0.0 F1.0 F0.1 F1.1 (all held) -> 2 x 10 + 2 x 100
  EXPECT_EQ(r.peak_memory[0], 2000 + 220);
  // device 1: F0.0 F1.0 F0.1 B0.1 F1.1 -> at most 2 x 10 + 100 (F1.1 after B0.1)
  EXPECT_EQ(r.peak_memory[1], 2000 + 120);
}

}  // namespace
}  // namespace rannc::partition
