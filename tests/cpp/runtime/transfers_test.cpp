// The transfer plan and the step program, checked without ranks: every rank's view of a
// deployment is computed here, and the two ends of every channel must agree.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>

#include "common/error.h"
#include "partition/partition_graphs.h"
#include "partition/plan.h"
#include "runtime/step_program.h"
#include "runtime/transfers.h"

namespace rannc::runtime {
namespace {

using partition::testing::linearChain;

// A deployment of linearChain's tasks cut into stages at `cuts` (task index where each stage
// after the first begins), with `ranks[s]` per stage.
partition::Deployment deploymentOf(const ir::Graph& g, std::vector<size_t> cuts,
                                   std::vector<std::vector<int>> ranks, int pipelines, int M,
                                   int world) {
  partition::Deployment d;
  d.graph_hash = g.contentHash();
  d.world_size = world;
  d.pipelines = pipelines;
  d.micro_batches = M;
  cuts.insert(cuts.begin(), 0);
  cuts.push_back(g.tasks().size());
  for (size_t s = 0; s + 1 < cuts.size(); ++s) {
    partition::StagePlan st;
    for (size_t t = cuts[s]; t < cuts[s + 1]; ++t) st.tasks.push_back(static_cast<ir::TaskId>(t));
    st.ranks = ranks.at(s);
    d.stages.push_back(st);
  }
  return d;
}

std::vector<ir::Subgraph> piecesOf(const ir::Graph& g, const partition::Deployment& d) {
  std::vector<ir::Subgraph> pieces;
  for (const auto& s : d.stages) pieces.push_back(partition::stageSubgraph(g, s));
  return pieces;
}

TEST(Layout, SplitsRowsOverCopiesMicroBatchesAndReplicas) {
  ir::Graph g = linearChain({8, 8});
  auto d = deploymentOf(g, {1}, {{0, 1, 2, 3}, {4, 5}}, /*pipelines=*/2, /*M=*/2, 6);
  Layout L(d, 6, 4);
  EXPECT_EQ(L.globalBatch(), 24);
  EXPECT_EQ(L.replicas(0), 2);
  EXPECT_EQ(L.replicas(1), 1);
  EXPECT_EQ(L.microBatchRows(1, 0), (Rows{12, 18}));
  EXPECT_EQ(L.share(0, 1, 0, 1), (Rows{15, 18}));
  EXPECT_EQ(L.rankOf(0, 1, 1), 3);
  Place p = L.place(3);
  EXPECT_EQ(std::make_tuple(p.stage, p.copy, p.replica), std::make_tuple(0, 1, 1));
  EXPECT_EQ(L.owned(5), (Rows{20, 24}));
}

TEST(Layout, NamesTheRowsATooSmallBatchLacksAndCapsWhenAsked) {
  ir::Graph g = linearChain({8});
  auto d = deploymentOf(g, {}, {{0, 1}}, 1, 4, 2);
  try {
    Layout(d, 2, 2);
    FAIL() << "a batch of 4 rows cannot feed 4 micro-batches of 2 replicas";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("need at least 8 rows"), std::string::npos) << e.what();
  }
  Layout capped(d, 2, 2, /*cap_micro_batches=*/true);
  EXPECT_EQ(capped.microBatches(), 2);
  try {  // capped, one micro-batch is the least: each replica needs a row
    Layout(d, 2, 0, /*cap_micro_batches=*/true);
    FAIL() << "a batch of 0 rows cannot feed 2 replicas";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("1 micro-batch with up to 2 replicas per stage need at least 2 rows"),
              std::string::npos) << msg;
    EXPECT_EQ(msg.find("num_microbatches"), std::string::npos) << msg;
  }
}

// Sender's and receiver's order of every channel, over a whole step, from every rank's plan.
void expectChannelsAgree(const ir::Graph& g, const partition::Deployment& d, int world, int64_t batch) {
  Layout L(d, world, batch);
  auto pieces = piecesOf(g, d);
  std::map<std::tuple<int, int, int>, std::vector<Transfer>> sent, received;
  for (int r = 0; r < world; ++r) {
    TransferPlan p = planTransfers(g, pieces, L, r, nullptr);
    for (int m = 0; m < L.microBatches(); ++m) {
      for (const auto& [vid, list] : p.recv[m]) {
        for (const auto& t : list) {
          EXPECT_EQ(t.dst, r);
          if (t.src != r) received[{t.src, r, 0}].push_back(t);
        }
      }
      for (const auto& [vid, list] : p.send[m]) {
        for (const auto& t : list) sent[{r, t.dst, 0}].push_back(t);
      }
      for (const auto& [vid, list] : p.out_send[m]) {
        for (const auto& t : list) {
          if (t.dst != r) sent[{r, t.dst, 1}].push_back(t);
        }
      }
    }
    for (const auto& t : p.input_sends) sent[{r, t.dst, 0}].push_back(t);
    for (const auto& [vid, list] : p.out_recv) {
      for (const auto& t : list) {
        if (t.src != r) received[{t.src, r, 1}].push_back(t);
      }
    }
  }
  EXPECT_EQ(sent, received);
}

TEST(TransferPlan, MovesEachRowOnceBetweenStagesOfDifferentReplicaCounts) {
  ir::Graph g = linearChain({8, 8, 8});
  auto d = deploymentOf(g, {1, 2}, {{0, 1}, {2}, {3, 4, 5}}, 1, 2, 6);
  Layout L(d, 6, 2);  // 12 rows, 6 per micro-batch
  auto pieces = piecesOf(g, d);
  TransferPlan p2 = planTransfers(g, pieces, L, 2, nullptr);
  // stage 1 (rank 2) gets micro-batch 1's rows [6, 12) of h0 from both replicas of stage 0
  ir::ValueId h0 = pieces[0].outputs.at(0);
  const auto& in = p2.recv[1].at(h0);
  ASSERT_EQ(in.size(), 2u);
  EXPECT_EQ(in[0].src, 0);
  EXPECT_EQ(in[0].rows, (Rows{6, 9}));
  EXPECT_EQ(in[1].src, 1);
  EXPECT_EQ(in[1].rows, (Rows{9, 12}));
  EXPECT_EQ(in[1].dst_start, 6);
  // the graph input x: rank 2 owns rows [4, 6), which stage 0 runs, so it sends them
  TransferPlan p0 = planTransfers(g, pieces, L, 0, nullptr);
  ir::ValueId x = g.inputs().at(0);
  EXPECT_TRUE(p2.recv[0].count(x) == 0);
  EXPECT_FALSE(p2.input_sends.empty());
  // rank 0 runs micro-batch 0 rows [0, 3): its own [0, 2) and rank 1's [2, 3)
  const auto& xin = p0.recv[0].at(x);
  ASSERT_EQ(xin.size(), 2u);
  EXPECT_EQ(xin[0].src, 0);
  EXPECT_EQ(xin[1].src, 1);
  EXPECT_EQ(xin[1].rows, (Rows{2, 3}));
  expectChannelsAgree(g, d, 6, 2);
}

TEST(TransferPlan, BothEndsOfEveryChannelAgreeOnEveryLayout) {
  ir::Graph g = linearChain({8, 8, 8, 8});
  expectChannelsAgree(g, deploymentOf(g, {}, {{0, 1, 2}}, 1, 3, 3), 3, 4);
  expectChannelsAgree(g, deploymentOf(g, {2}, {{0}, {1, 2, 3}}, 1, 4, 4), 4, 5);
  expectChannelsAgree(g, deploymentOf(g, {1, 2, 3}, {{0}, {1}, {2}, {3}}, 1, 4, 4), 4, 2);
  expectChannelsAgree(g, deploymentOf(g, {2}, {{0, 2}, {1, 3}}, 2, 2, 4), 4, 3);
}

TEST(TransferPlan, ListsDeviceChannelsBothWays) {
  ir::Graph g = linearChain({8, 8});
  auto d = deploymentOf(g, {1}, {{0}, {1}}, 1, 2, 2);
  Layout L(d, 2, 4);
  auto pieces = piecesOf(g, d);
  auto channels = planTransfers(g, pieces, L, 0, nullptr).deviceChannels(g);
  std::vector<ChannelKey> expected = {{0, 1, Channel::Activation}, {1, 0, Channel::Gradient},
                                      {1, 0, Channel::BatchOutput}, {0, 1, Channel::OutputGradient}};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(channels, expected);
}

TEST(TransferPlan, GroupsTheRanksSharingEachParameter) {
  ir::Graph g = linearChain({8, 8});
  auto d = deploymentOf(g, {1}, {{0, 1}, {2}}, 1, 2, 3);
  Layout L(d, 3, 4);
  std::vector<ir::ValueId> state;
  for (const auto& v : g.values()) {
    if (v.isModelState()) state.push_back(v.id);
  }
  auto groups = gradientGroups(piecesOf(g, d), L, state);
  ASSERT_EQ(groups.size(), 2u);
  EXPECT_EQ(groups[0].first, (std::vector<int>{0, 1}));
  EXPECT_EQ(groups[1].first, (std::vector<int>{2}));
}

// Rank 1's step on the last of 2 stages of a 2-layer chain (2 micro-batches, batch 4
// over `world` ranks; `ranks`: each stage's ranks) under `kind`, with the all-reduce.
StepProgram lastStageProgram(partition::ScheduleKind kind, const std::vector<std::vector<int>>& ranks, int world) {
  static const ir::Graph g = linearChain({8, 8});
  auto d = deploymentOf(g, {1}, ranks, 1, 2, world);
  Layout L(d, world, 4);
  auto pieces = piecesOf(g, d);
  TransferPlan p1 = planTransfers(g, pieces, L, 1, nullptr);
  auto schedule = partition::buildSchedule(kind, 2, 2);
  StageBoundary boundary{pieces[1].inputs, pieces[1].outputs};
  boundary.input_ids.erase(std::remove_if(boundary.input_ids.begin(), boundary.input_ids.end(),
                                          [&](ir::ValueId v) { return g.value(v).isModelState(); }),
                           boundary.input_ids.end());
  return lowerStep(schedule[1], p1, g, boundary, {}, /*all_reduce=*/true);
}

// "F0", "recv1", "arm-allreduce", ...
std::vector<std::string> actionNames(const StepProgram& prog) {
  std::vector<std::string> names;
  for (const auto& a : prog.actions) {
    names.push_back(stepActionName(a.kind) + (a.micro_batch >= 0 ? std::to_string(a.micro_batch) : ""));
  }
  return names;
}

TEST(StepProgram, PostsReceivesOneActionAheadAndArmsTheAllReduceBeforeTheLastBackward) {
  StepProgram prog = lastStageProgram(partition::ScheduleKind::OneFOneB, {{0}, {1, 2}}, 3);
  std::vector<std::string> kinds = actionNames(prog);
  // rank 1 owns rows [4, 8) of x, which stage 0 (rank 0) runs: it sends them first
  std::vector<std::string> expected = {"send-input-rows", "recv0", "recv0", "F0", "send0", "recv1", "B0", "send0",
                                       "recv1", "F1", "send1", "arm-allreduce", "B1", "send1",
                                       "collect-outputs", "finish"};
  EXPECT_EQ(kinds, expected) << prog.str();
  // F0's receive: rows [0, 4) of micro-batch 0 from stage 0 (rank 0), over the activation channel
  const auto& recv = prog.actions[1];
  ASSERT_EQ(recv.transfers.size(), 1u);
  EXPECT_EQ(recv.transfers[0].channel, Channel::Activation);
  EXPECT_EQ(recv.transfers[0].transfer.rows, (Rows{0, 3}));
  EXPECT_NE(prog.str().find("recv F0: activation"), std::string::npos) << prog.str();
}

// ZB-H1 on the last of 2 stages: F0 Bi0 F1 Bi1 W0 W1. A weight part neither receives nor
// sends, the receive of the next transferring action is posted one compute action ahead
// of it (F1's before Bi0), and the all-reduce is armed before the last weight part.
TEST(StepProgram, LowersASplitBackwardWithTheWeightPartsWithoutTransfers) {
  StepProgram prog = lastStageProgram(partition::ScheduleKind::ZeroBubbleH1, {{0}, {1}}, 2);
  std::vector<std::string> kinds = actionNames(prog);
  std::vector<std::string> expected = {"send-input-rows", "recv0", "recv0", "F0", "send0", "recv1", "Bi0", "send0",
                                       "recv1", "F1", "send1", "Bi1", "send1", "W0",
                                       "arm-allreduce", "W1", "collect-outputs", "finish"};
  EXPECT_EQ(kinds, expected) << prog.str();
  EXPECT_NE(prog.str().find("recv Bi0:"), std::string::npos) << prog.str();
  for (const auto& a : prog.actions) {
    if (a.kind == StepActionKind::BackwardWeight) EXPECT_TRUE(a.transfers.empty()) << a.str();
  }
}

// [Note: interleaved 1F1B]: a rank holding several stages lowers one program over its
// chunks, each with its stage's transfers. Every device runs the same order of (chunk,
// micro-batch), so the two ends of each channel meet the same transfers in the same order:
// checked here in program order, not only as sets, with one replica and with two per stage.
// Channel keys for the check below: (src, dst, channel, lane).
using ChannelOf = std::tuple<int, int, int, int>;

// The programs of every rank for `g` cut into chunks x D stages at equal task counts
// (stage s on device_ranks[s % D]) under interleaved 1F1B.
std::map<int, StepProgram> interleavedPrograms(const ir::Graph& g, const std::vector<std::vector<int>>& device_ranks,
                                               int chunks, int M, int world, int pipelines = 1) {
  const int D = static_cast<int>(device_ranks.size());
  std::vector<size_t> cuts;
  std::vector<std::vector<int>> ranks;
  const int S = D * chunks;
  for (int s = 0; s < S; ++s) {
    if (s > 0) cuts.push_back(static_cast<size_t>(s) * g.tasks().size() / S);
    ranks.push_back(device_ranks[s % D]);
  }
  auto d = deploymentOf(g, cuts, ranks, pipelines, M, world);
  d.chunks = chunks;
  const Layout L(d, world, 4);
  auto pieces = piecesOf(g, d);
  auto schedule = partition::buildSchedule(partition::ScheduleKind::Interleaved, D, M, chunks);
  std::map<int, StepProgram> programs;
  for (int dev = 0; dev < D; ++dev) {
    for (int r : device_ranks[dev]) {
      EXPECT_EQ(L.places(r).size(), static_cast<size_t>(chunks));
      std::vector<TransferPlan> plans;
      std::vector<StageBoundary> boundaries;
      for (const Place& p : L.places(r)) {
        plans.push_back(planTransfers(g, pieces, L, r, nullptr, p.stage));
        StageBoundary b{{}, pieces[p.stage].outputs};
        for (ir::ValueId v : pieces[p.stage].inputs) {
          if (!g.value(v).isModelState()) b.input_ids.push_back(v);
        }
        boundaries.push_back(b);
      }
      std::vector<const TransferPlan*> views;
      for (const auto& p : plans) views.push_back(&p);
      programs[r] = lowerStep(schedule[dev], views, g, boundaries, {}, /*all_reduce=*/true);
    }
  }
  return programs;
}

// [Note: interleaved 1F1B]: a rank holding several stages lowers one program over its
// chunks, each with its stage's transfers. Every device runs the same order of (chunk,
// micro-batch), so the two ends of each channel between stages meet the same transfers in
// the same order; the arguments' rows, sent all at once, agree within each chunk's lane
// ([Note: channel lanes]). Checked here in program order, not only as sets.
void expectInterleavedChannelsAgree(const ir::Graph& g, const std::vector<std::vector<int>>& device_ranks,
                                    int chunks, int M, int world, int pipelines = 1) {
  std::map<ChannelOf, std::vector<std::string>> sent, received;
  for (const auto& [r, prog] : interleavedPrograms(g, device_ranks, chunks, M, world, pipelines)) {
    for (const StepAction& a : prog.actions) {
      for (const ChannelTransfer& t : a.transfers) {
        if (t.local || (t.channel != Channel::Activation && t.channel != Channel::Gradient &&
                        t.channel != Channel::InputRows)) {
          continue;
        }
        const int channel = static_cast<int>(t.channel);
        const int lane = t.transfer.lane;
        if (a.kind == StepActionKind::Receive) {
          // a backward receives the gradient of what it sent: the reverse direction
          const ChannelOf key = a.feeds == partition::ActionKind::Forward ? ChannelOf{t.transfer.src, r, channel, lane}
                                                                         : ChannelOf{t.transfer.dst, r, channel, lane};
          received[key].push_back(t.transfer.str());
        } else {
          const ChannelOf key = t.transfer.src == r ? ChannelOf{r, t.transfer.dst, channel, lane}
                                                    : ChannelOf{r, t.transfer.src, channel, lane};
          sent[key].push_back(t.transfer.str());
        }
      }
    }
  }
  EXPECT_FALSE(sent.empty());
  EXPECT_EQ(sent, received);
}

TEST(TransferPlan, AgreesOnEveryChannelUnderAnInterleavedSchedule) {
  static const ir::Graph g = linearChain({8, 8, 8, 8, 8, 8, 8, 8});
  expectInterleavedChannelsAgree(g, {{0}, {1}}, 2, 4, 2);
  expectInterleavedChannelsAgree(g, {{0}, {1}, {2}}, 2, 6, 3);
  expectInterleavedChannelsAgree(g, {{0}, {1}}, 3, 2, 2);
  expectInterleavedChannelsAgree(g, {{0, 1}, {2, 3}}, 2, 4, 4);  // two replicas per stage
  expectInterleavedChannelsAgree(g, {{0, 1}, {2}}, 2, 2, 3);     // replicas 2 and 1: rows redistributed
  expectInterleavedChannelsAgree(g, {{0, 2}, {1, 3}}, 2, 2, 4, /*pipelines=*/2);  // 2 pipeline copies
}

// x -> l0 -> h0 -> ... -> l4 -> h4 (linear layers) with task `add_at` an aten::add of the
// chain's value and the earlier values `skips` (h indices; -1: x).
ir::Graph chainWithSkips(int add_at, const std::vector<int>& skips) {
  using partition::testing::act;
  using partition::testing::param;
  ir::Graph g;
  g.setBatchSize(8);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  std::vector<ir::ValueId> h;
  ir::ValueId cur = x;
  for (int i = 0; i < 5; ++i) {
    ir::ValueId out = act(g, "h" + std::to_string(i), 8);
    if (i == add_at) {
      std::vector<ir::ValueId> ins{cur};
      for (int k : skips) ins.push_back(k < 0 ? x : h.at(k));
      g.addTask("aten::add", ins, {out}, "add");
    } else {
      g.addTask("aten::linear", {cur, param(g, "w" + std::to_string(i), {8, 8})}, {out}, "layer" + std::to_string(i));
    }
    g.mutableValue(out).requires_grad = true;
    h.push_back(out);
    cur = out;
  }
  g.setOutputs({cur});
  return g;
}

// Cut into 4 stages (the last two tasks together) on 2 ranks, stage 2 (rank 0's second
// chunk) adds h0 from stage 0 on the same rank, and x, which stage 0 reads too.
ir::Graph skipGraph() { return chainWithSkips(2, {0, -1}); }

// Stage 3 adds h0: it goes from rank 0 to both of rank 1's chunks (stages 1 and 3), which
// take its micro-batches at different times, so each pair of chunks needs a lane of its own.
ir::Graph twoChunkReaderGraph() { return chainWithSkips(3, {0}); }

TEST(TransferPlan, AgreesOnEveryChannelWhenValuesSkipToAnotherChunk) {
  for (const ir::Graph& g : {skipGraph(), twoChunkReaderGraph()}) {
    expectInterleavedChannelsAgree(g, {{0}, {1}}, 2, 2, 2);
    expectInterleavedChannelsAgree(g, {{0}, {1}}, 2, 4, 2);
    expectInterleavedChannelsAgree(g, {{0, 1}, {2, 3}}, 2, 2, 4);
    expectInterleavedChannelsAgree(g, {{0, 2}, {1, 3}}, 2, 2, 4, /*pipelines=*/2);
  }
}

// [Note: chunks on a rank]: h0 goes from stage 0 to stage 2 on rank 0 without a send; its
// gradient comes back from stage 2's backward the same way. The backward of each
// micro-batch on stage 2 comes before stage 0's, whose gradient it needs.
TEST(StepProgram, PassesValuesBetweenChunksOfARankLocally) {
  static const ir::Graph g = skipGraph();
  const ir::ValueId h0 = g.tasks()[0].outputs[0];
  auto programs = interleavedPrograms(g, {{0}, {1}}, 2, 2, 2);
  const StepProgram& prog = programs.at(0);
  int local_forward = 0, local_gradient_in = 0, local_gradient_out = 0;
  std::map<int, int> backward_chunk1_at;
  for (size_t i = 0; i < prog.actions.size(); ++i) {
    const StepAction& a = prog.actions[i];
    if (a.kind == StepActionKind::Backward) {
      if (a.chunk == 1) backward_chunk1_at[a.micro_batch] = static_cast<int>(i);
      if (a.chunk == 0) EXPECT_TRUE(backward_chunk1_at.count(a.micro_batch)) << prog.str();
    }
    for (const ChannelTransfer& t : a.transfers) {
      if (t.transfer.value != h0) continue;
      const bool to_self = t.transfer.src == 0 && t.transfer.dst == 0;
      EXPECT_EQ(t.local, to_self) << a.str();
      if (a.kind == StepActionKind::Send && a.feeds == partition::ActionKind::Forward) {
        EXPECT_FALSE(to_self) << "sent to itself: " << a.str();
      }
      if (!to_self) continue;
      if (a.kind == StepActionKind::Receive && a.feeds == partition::ActionKind::Forward) ++local_forward;
      if (a.kind == StepActionKind::Receive && a.feeds == partition::ActionKind::Backward) ++local_gradient_in;
      if (a.kind == StepActionKind::Send && a.feeds == partition::ActionKind::Backward) ++local_gradient_out;
    }
  }
  EXPECT_EQ(local_forward, 2) << prog.str();  // one per micro-batch
  EXPECT_EQ(local_gradient_in, 2) << prog.str();
  EXPECT_EQ(local_gradient_out, 2) << prog.str();
}

// Rank 1 owns half of x's rows; stages 0 and 2 (rank 0's chunks 0 and 1) both read them,
// each on its chunk's lane.
TEST(TransferPlan, SendsEachChunksArgumentRowsOnItsLane) {
  static const ir::Graph g = skipGraph();
  auto programs = interleavedPrograms(g, {{0}, {1}}, 2, 2, 2);
  std::set<int> lanes;
  for (const StepAction& a : programs.at(1).actions) {
    if (a.kind != StepActionKind::SendInputRows) continue;
    for (const ChannelTransfer& t : a.transfers) lanes.insert(t.transfer.lane);
  }
  EXPECT_EQ(lanes, (std::set<int>{0, 1}));
}

TEST(TransferPlan, GivesARankOfSeveralStagesItsArgumentRowsOnce) {
  static const ir::Graph g = linearChain({8, 8, 8, 8});
  auto d = deploymentOf(g, {1, 2, 3}, {{0}, {1}, {0}, {1}}, 1, 2, 2);
  Layout L(d, 2, 4);
  auto pieces = piecesOf(g, d);
  EXPECT_EQ(L.place(1).stage, 1);
  ASSERT_EQ(L.places(1).size(), 2u);
  EXPECT_EQ(L.places(1)[1].stage, 3);
  TransferPlan chunk0 = planTransfers(g, pieces, L, 1, nullptr, 1);
  TransferPlan chunk1 = planTransfers(g, pieces, L, 1, nullptr, 3);
  EXPECT_FALSE(chunk0.input_sends.empty());  // rank 1's rows of x go to stage 0 on rank 0
  EXPECT_TRUE(chunk1.input_sends.empty());
  // the rows of the output (stage 3's) that rank 1 owns arrive once, with its first stage;
  // stage 3 sends them, stage 1 sends only its own output
  EXPECT_FALSE(chunk0.out_recv.empty());
  EXPECT_TRUE(chunk1.out_recv.empty());
  for (int m = 0; m < 2; ++m) {
    EXPECT_TRUE(chunk0.out_send[m].empty());
    EXPECT_FALSE(chunk1.out_send[m].empty());
    for (const auto& [vid, list] : chunk0.send[m]) {
      for (const Transfer& t : list) EXPECT_EQ(t.dst, 0) << t.str();  // stage 1 -> stage 2 on rank 0
    }
    EXPECT_TRUE(chunk1.send[m].empty());  // the last stage sends no activation
  }
}

}  // namespace
}  // namespace rannc::runtime
