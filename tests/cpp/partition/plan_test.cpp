#include <gtest/gtest.h>

#include <cstdio>

#include "common/error.h"
#include "ir/serialize.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"
#include "partition/planner.h"
#include "synthetic/synthetic.h"

namespace rannc::partition {
namespace {

using testing::uniformChain;

Deployment planChain(const ir::Graph& g, CostModel& m) {
  PlannerOptions o;
  o.world_size = 4;
  o.num_blocks = 8;
  o.num_stages = 2;
  o.memory_limit = 1LL << 40;
  return plan(g, m, o);
}

TEST(ADeployment, SurvivesASerialisationRoundTrip) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  Deployment d = planChain(g, m);
  d.stages[1].recompute = true;  // a flag the plan did not choose still round-trips
  d.schedule_candidates = {{ScheduleKind::OneFOneB, 0.5, 0.25, true}, {ScheduleKind::ZeroBubbleH1, 0.4, 0.1, false}};
  Deployment back = deserializeDeployment(serializeDeployment(d), g);
  EXPECT_EQ(back.graph_hash, g.contentHash());
  EXPECT_EQ(back.planner, "rannc");
  EXPECT_EQ(back.world_size, 4);
  EXPECT_EQ(back.batch_size, d.batch_size);
  EXPECT_EQ(back.micro_batches, d.micro_batches);
  EXPECT_EQ(back.pipelines, d.pipelines);
  EXPECT_EQ(back.schedule, d.schedule);
  EXPECT_EQ(back.optimizer, d.optimizer);
  EXPECT_DOUBLE_EQ(back.iteration_time, d.iteration_time);
  ASSERT_EQ(back.numStages(), 2);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(back.stages[s].tasks, d.stages[s].tasks);
    EXPECT_EQ(back.stages[s].ranks, d.stages[s].ranks);
    EXPECT_EQ(back.stages[s].recompute, d.stages[s].recompute);
    EXPECT_EQ(back.stages[s].memory_bytes, d.stages[s].memory_bytes);
    EXPECT_DOUBLE_EQ(back.stages[s].forward_time, d.stages[s].forward_time);
    EXPECT_DOUBLE_EQ(back.stages[s].bubble_time, d.stages[s].bubble_time);
  }
  ASSERT_EQ(back.schedule_candidates.size(), 2u);
  EXPECT_EQ(back.schedule_candidates[1].schedule, ScheduleKind::ZeroBubbleH1);
  EXPECT_DOUBLE_EQ(back.schedule_candidates[1].iteration_time, 0.4);
  EXPECT_DOUBLE_EQ(back.schedule_candidates[1].bubble, 0.1);
  EXPECT_FALSE(back.schedule_candidates[1].feasible);
  EXPECT_EQ(back.hash(), d.hash());
  EXPECT_EQ(serializeDeployment(back), serializeDeployment(d));
}

TEST(ADeployment, RefusesToLoadForAnotherGraph) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  const std::string bytes = serializeDeployment(planChain(g, m));
  ir::Graph other = uniformChain(9);
  try {
    deserializeDeployment(bytes, other, "plan.rannc");
    FAIL() << "expected SerializationError";
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("plan.rannc"), std::string::npos) << msg;
    EXPECT_NE(msg.find("plan again"), std::string::npos) << msg;
  }
}

TEST(ADeployment, RefusesACorruptOrForeignFile) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  std::string bytes = serializeDeployment(planChain(g, m));
  std::string flipped = bytes;
  flipped[flipped.size() / 2] ^= 0x5a;
  EXPECT_THROW(deserializeDeployment(flipped, g), SerializationError);
  EXPECT_THROW(deserializeDeployment(bytes.substr(0, bytes.size() - 3), g), SerializationError);
  EXPECT_THROW(deserializeDeployment(ir::serializeGraph(g), g), SerializationError);
}

TEST(ADeployment, SavesToAndLoadsFromAFile) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  Deployment d = planChain(g, m);
  const std::string path = ::testing::TempDir() + "/rannc_plan_test.deployment";
  saveDeployment(d, path);
  Deployment back = loadDeployment(path, g);
  EXPECT_EQ(back.stages[0].tasks, d.stages[0].tasks);
  std::remove(path.c_str());
}

TEST(ADeployment, ReportsStagesRanksAndPredictions) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  Deployment d = planChain(g, m);
  const std::string r = d.report();
  EXPECT_NE(r.find("2 stage(s) on 4 rank(s)"), std::string::npos) << r;
  EXPECT_NE(r.find("predicted iteration"), std::string::npos) << r;
  // Rank runs print compactly ("1-3"), whichever stage holds several ranks.
  bool run_found = false;
  for (const StagePlan& st : d.stages) {
    if (st.ranks.size() < 2) continue;
    const std::string run = std::to_string(st.ranks.front()) + "-" + std::to_string(st.ranks.back());
    EXPECT_NE(r.find(run), std::string::npos) << r;
    run_found = true;
  }
  EXPECT_TRUE(run_found) << r;
  EXPECT_EQ(d.stageOfRank(0), 0);
  EXPECT_EQ(d.stageOfRank(3), 1);
  EXPECT_EQ(d.stageOfRank(4), -1);
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

TEST(ADeployment, PassesValidationAsPlanned) {
  ir::Graph g = testing::uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  Deployment d = planChain(g, m);
  EXPECT_NO_THROW(validateDeployment(g, d));
  ir::Subgraph piece = stageSubgraph(g, d.stages[0]);
  EXPECT_EQ(piece.tasks, d.stages[0].tasks);
  ASSERT_EQ(piece.outputs.size(), 1u);  // the activation sent to stage 1
}

TEST(ADeployment, FailsValidationWhenATaskIsMissingDuplicatedOrOutOfOrder) {
  ir::Graph g = testing::uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  const Deployment good = planChain(g, m);

  Deployment missing = good;
  missing.stages[1].tasks.pop_back();
  EXPECT_THROW(validateDeployment(g, missing), InvalidGraphError);

  Deployment twice = good;
  twice.stages[1].tasks.push_back(twice.stages[0].tasks.front());
  EXPECT_THROW(validateDeployment(g, twice), InvalidGraphError);

  Deployment swapped = good;
  std::swap(swapped.stages[0].tasks, swapped.stages[1].tasks);
  EXPECT_THROW(validateDeployment(g, swapped), InvalidGraphError);

  Deployment shared_rank = good;
  shared_rank.stages[1].ranks[0] = shared_rank.stages[0].ranks[0];
  EXPECT_THROW(validateDeployment(g, shared_rank), InvalidGraphError);
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

TEST(ADeployment, ReSimulatesToItsOwnPredictionAndUnderFillDrain) {
  ir::Graph g = testing::uniformChain(8, 256);
  AnalyticCostModel m(g, DeviceSpec{});
  PlannerOptions o;
  o.world_size = 2;
  o.num_blocks = 8;
  o.num_stages = 2;
  o.num_microbatches = 4;
  o.memory_limit = 1LL << 40;
  Deployment d = plan(g, m, o);
  SimResult same = simulateDeployment(deserializeDeployment(serializeDeployment(d), g), d.schedule);
  EXPECT_DOUBLE_EQ(same.iteration_time, d.iteration_time);
  for (int s = 0; s < 2; ++s) EXPECT_EQ(same.peak_memory[s], d.stages[s].memory_bytes);
  SimResult gpipe = simulateDeployment(d, ScheduleKind::FillDrain);
  EXPECT_GT(gpipe.peak_memory[0], same.peak_memory[0]);  // fill-drain stashes all four
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

// Ranks may plan on their own; the same inputs must give the same bytes.
TEST(ADeployment, IsTheSameEveryTimeTheSameGraphIsPlanned) {
  ir::Graph g = testing::smallTransformer();
  PlannerOptions o;
  o.world_size = 8;
  o.num_blocks = 10;
  o.memory_limit = 8 << 20;
  AnalyticCostModel a(g, DeviceSpec{}), b(g, DeviceSpec{});
  EXPECT_EQ(serializeDeployment(plan(g, a, o)), serializeDeployment(plan(g, b, o)));
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

TEST(APlanHash, IsInTheReportAndTheSameForTheSamePlan) {
  ir::Graph g = testing::uniformChain(8);
  AnalyticCostModel a(g, DeviceSpec{}), b(g, DeviceSpec{});
  const Deployment d = planChain(g, a);
  EXPECT_EQ(d.hash().size(), 8u);
  EXPECT_EQ(d.hash(), planChain(g, b).hash());
  const std::string report = d.report();
  EXPECT_EQ(report.substr(0, report.find('\n')).find("plan " + d.hash()), 0u) << report;
  EXPECT_EQ(d.summary().rfind("plan " + d.hash() + ": 2 stages, replicas ", 0), 0u) << d.summary();
  // Read back, the same plan.
  EXPECT_EQ(deserializeDeployment(serializeDeployment(d), g).hash(), d.hash());
}

TEST(APlanHash, NamesWhatRunsNotWhatWasPredicted) {
  ir::Graph g = testing::uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  const Deployment d = planChain(g, m);
  // Measured times differ between runs that make the same plan: same hash.
  Deployment remeasured = d;
  remeasured.iteration_time *= 1.03;
  remeasured.stages[0].forward_time *= 0.97;
  remeasured.stages[1].memory_bytes += 1024;
  EXPECT_EQ(remeasured.hash(), d.hash());
  // Another micro-batch count, another boundary, another rank: another plan.
  PlannerOptions o;
  o.world_size = 4;
  o.num_blocks = 8;
  o.num_stages = 2;
  o.memory_limit = 1LL << 40;
  o.num_microbatches = d.micro_batches == 2 ? 4 : 2;
  EXPECT_NE(plan(g, m, o).hash(), d.hash());
  Deployment moved = d;
  moved.stages[1].tasks.insert(moved.stages[1].tasks.begin(), moved.stages[0].tasks.back());
  moved.stages[0].tasks.pop_back();
  EXPECT_NE(moved.hash(), d.hash());
  Deployment swapped = d;
  std::swap(swapped.stages[0].ranks, swapped.stages[1].ranks);
  EXPECT_NE(swapped.hash(), d.hash());
}

// [Note: interleaved 1F1B]: 4 stages as 2 chunks on 2 device groups of 2 ranks each.
Deployment interleavedChain(const ir::Graph& g, CostModel& m) {
  PlannerOptions o;
  o.world_size = 4;
  o.num_blocks = 8;
  o.num_stages = 4;
  o.replicas = {1, 1, 1, 1};
  o.num_microbatches = 2;
  o.memory_limit = 1LL << 40;
  Deployment d = plan(g, m, o);
  d.schedule = ScheduleKind::Interleaved;
  d.chunks = 2;
  d.world_size = 2;
  d.stages[0].ranks = d.stages[2].ranks = {0};
  d.stages[1].ranks = d.stages[3].ranks = {1};
  for (auto& st : d.stages) st.micro_batch_rows = d.batch_size / 2;
  d.batch_size = 2 * d.stages[0].micro_batch_rows;
  return d;
}

TEST(ADeployment, RunsSeveralChunksOnADeviceGroupAndSurvivesARoundTrip) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  Deployment d = interleavedChain(g, m);
  EXPECT_EQ(d.deviceGroups(), 2);
  validateDeployment(g, d);
  Deployment back = deserializeDeployment(serializeDeployment(d), g);
  EXPECT_EQ(back.chunks, 2);
  EXPECT_EQ(back.schedule, ScheduleKind::Interleaved);
  EXPECT_EQ(back.hash(), d.hash());
  // the simulator runs it per device group
  SimResult r = simulateDeployment(d, ScheduleKind::Interleaved);
  EXPECT_EQ(r.busy.size(), 2u);
  Deployment one = d;
  one.chunks = 1;
  EXPECT_NE(one.hash(), d.hash());
}

TEST(ADeployment, RefusesChunksThatDoNotShareTheirGroupsRanks) {
  ir::Graph g = uniformChain(8);
  AnalyticCostModel m(g, DeviceSpec{});
  Deployment d = interleavedChain(g, m);
  d.stages[3].ranks = {0};
  EXPECT_THROW(validateDeployment(g, d), InvalidGraphError);
  try {
    deserializeDeployment(serializeDeployment(d), g, "plan.rannc");
    FAIL() << "expected SerializationError";
  } catch (const SerializationError& e) {
    EXPECT_NE(std::string(e.what()).find("stages[3].ranks"), std::string::npos) << e.what();
  }
  Deployment mixed = interleavedChain(g, m);
  mixed.schedule = ScheduleKind::OneFOneB;  // chunks need an interleaved schedule
  EXPECT_THROW(validateDeployment(g, mixed), InvalidGraphError);
  EXPECT_THROW(deserializeDeployment(serializeDeployment(mixed), g), SerializationError);
}


// [Note: new input shapes] A trace at other input shapes runs the plan of the first one when
// it is the same program; otherwise the error names the first op that differs.
std::string rebindRefusal(const Deployment& d, const ir::Graph& planned, const ir::Graph& now) {
  try {
    rebindDeployment(d, planned, now);
  } catch (const TraceError& e) {
    return e.what();
  }
  return "";
}

TEST(ARebindDeployment, RunsThePlanOnTheSameProgramAtOtherShapes) {
  ir::Graph planned = uniformChain(8, 64);
  ir::Graph wider = uniformChain(8, 32);  // the same ops on other sizes
  ASSERT_NE(planned.contentHash(), wider.contentHash());
  AnalyticCostModel m(planned, DeviceSpec{});
  Deployment d = planChain(planned, m);
  Deployment r = rebindDeployment(d, planned, wider);
  EXPECT_EQ(r.graph_hash, wider.contentHash());
  ASSERT_EQ(r.numStages(), d.numStages());
  for (int s = 0; s < d.numStages(); ++s) {
    EXPECT_EQ(r.stages[s].tasks, d.stages[s].tasks);
    EXPECT_EQ(r.stages[s].ranks, d.stages[s].ranks);
  }
  EXPECT_EQ(r.micro_batches, d.micro_batches);
  EXPECT_EQ(r.pipelines, d.pipelines);
  for (int s = 0; s < d.numStages(); ++s) {  // rows of half the bytes stash half as much
    EXPECT_NEAR(double(r.stages[s].stash_bytes), 0.5 * double(d.stages[s].stash_bytes), 1.0);
    EXPECT_NEAR(double(r.stages[s].working_bytes), 0.5 * double(d.stages[s].working_bytes), 1.0);
    EXPECT_EQ(r.stages[s].memory_bytes, d.stages[s].memory_bytes);  // as planned
  }
  EXPECT_NO_THROW(validateDeployment(wider, r));
  // it loads against the new graph, and not against the planned one
  EXPECT_NO_THROW(deserializeDeployment(serializeDeployment(r), wider));
  EXPECT_THROW(deserializeDeployment(serializeDeployment(r), planned), SerializationError);
}

// [Note: frozen parameters' memory] A plan made with frozen parameters charges them their
// weights only; the same program with them unfrozen runs the plan, each stage holding a
// gradient and the optimizer's state for what thawed.
TEST(ARebindDeployment, ChargesParametersUnfrozenSinceThePlan) {
  ir::Graph trained = uniformChain(8, 64);
  ir::Graph frozen = trained;
  for (ir::ValueId v = 0; v < static_cast<ir::ValueId>(frozen.numValues()); ++v) {
    if (frozen.value(v).role == ir::ValueRole::Param) frozen.mutableValue(v).requires_grad = false;
  }
  AnalyticCostModel mt(trained, DeviceSpec{}), mf(frozen, DeviceSpec{});
  Deployment dt = planChain(trained, mt), df = planChain(frozen, mf);
  const int factor = 1 + optimizerStateFactor(df.optimizer);
  Deployment thawed = rebindDeployment(df, frozen, trained);
  for (int s = 0; s < df.numStages(); ++s) {
    const int64_t params = df.stages[s].param_bytes;
    ASSERT_GT(params, 0);
    EXPECT_EQ(thawed.stages[s].static_bytes - df.stages[s].static_bytes, params * factor) << s;
    EXPECT_EQ(df.stages[s].update_time, 0.0) << s;  // nothing to update
    EXPECT_GT(dt.stages[s].update_time, 0.0) << s;
  }
  Deployment back = rebindDeployment(dt, trained, frozen);  // frozen again: given back
  for (int s = 0; s < dt.numStages(); ++s) {
    EXPECT_EQ(dt.stages[s].static_bytes - back.stages[s].static_bytes, dt.stages[s].param_bytes * factor) << s;
  }
}

TEST(ARebindDeployment, NamesTheFirstOpThatDiffers) {
  ir::Graph planned = uniformChain(8, 64);
  AnalyticCostModel m(planned, DeviceSpec{});
  Deployment d = planChain(planned, m);

  ir::Graph longer = uniformChain(9, 64);
  EXPECT_NE(rebindRefusal(d, planned, longer).find("9 ops instead of 8, from task 8 (aten::linear (module 'layer8')) on"),
            std::string::npos)
      << rebindRefusal(d, planned, longer);

  // uniformChain(8, 64) with layer 3 another op
  ir::Graph other;
  other.setBatchSize(8);
  ir::ValueId cur = testing::act(other, "x", 64, ir::ValueRole::Input);
  other.setInputs({cur});
  for (int i = 0; i < 8; ++i) {
    ir::ValueId w = testing::param(other, "w" + std::to_string(i), {64, 64});
    ir::ValueId out = testing::act(other, "h" + std::to_string(i), 64);
    other.addTask(i == 3 ? "aten::matmul" : "aten::linear", {cur, w}, {out}, "layer" + std::to_string(i));
    cur = out;
  }
  other.setOutputs({cur});
  const std::string why = rebindRefusal(d, planned, other);
  EXPECT_NE(why.find("at the new input shapes the model is another program than the one planned: task 3 is "
                     "aten::matmul (module 'layer3') but was aten::linear (module 'layer3')"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("Pad the inputs to one length"), std::string::npos) << why;

  ir::Graph unbatched = uniformChain(8, 64);
  unbatched.mutableValue(unbatched.task(2).outputs[0]).batch_dim = 1;
  EXPECT_NE(rebindRefusal(d, planned, unbatched).find("is batch dimension 1 instead of 0"), std::string::npos)
      << rebindRefusal(d, planned, unbatched);

  // a plan of another graph is a caller's mistake, not the model's
  EXPECT_THROW(rebindDeployment(d, other, planned), Error);
}

}  // namespace
}  // namespace rannc::partition
