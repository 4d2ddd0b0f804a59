#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "common/error.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"
#include "partition/planner.h"
#include "synthetic/synthetic.h"

namespace rannc::partition {
namespace {

using testing::device;

PlannerOptions fixedLayout(int world, std::vector<int> replicas) {
  PlannerOptions o;
  o.world_size = world;
  o.num_blocks = 6;
  o.memory_limit = 1LL << 40;
  o.num_stages = static_cast<int>(replicas.size());
  o.replicas = std::move(replicas);
  return o;
}

TEST(AFixedLayout, PutsThreeStagesWithReplicasTwoOneOneOnFourRanks) {
  ir::Graph g = testing::uniformChain(6, 256, /*batch=*/8);
  AnalyticCostModel m(g, device());
  Deployment d = plan(g, m, fixedLayout(4, {2, 1, 1}));
  ASSERT_EQ(d.numStages(), 3);
  EXPECT_EQ(d.pipelines, 1);
  EXPECT_EQ(d.stages[0].ranks, (std::vector<int>{0, 1}));
  EXPECT_EQ(d.stages[1].ranks, (std::vector<int>{2}));
  EXPECT_EQ(d.stages[2].ranks, (std::vector<int>{3}));
}

TEST(AFixedLayout, RepeatsTheCopyWhenTheReplicasSumToADivisorOfTheWorld) {
  ir::Graph g = testing::uniformChain(6, 256, /*batch=*/8);
  AnalyticCostModel m(g, device());
  Deployment d = plan(g, m, fixedLayout(8, {1, 2, 1}));
  ASSERT_EQ(d.numStages(), 3);
  EXPECT_EQ(d.pipelines, 2);
  EXPECT_EQ(d.stages[0].ranks, (std::vector<int>{0, 4}));
  EXPECT_EQ(d.stages[1].ranks, (std::vector<int>{1, 2, 5, 6}));
  EXPECT_EQ(d.stages[2].ranks, (std::vector<int>{3, 7}));
}

TEST(AFixedLayout, RejectsReplicasThatDoNotMatchTheWorldOrTheStageCount) {
  ir::Graph g = testing::uniformChain(6, 256, /*batch=*/8);
  AnalyticCostModel m(g, device());
  try {
    plan(g, m, fixedLayout(4, {2, 1, 2}));
    FAIL() << "5 devices per copy on a world of 4";
  } catch (const InvalidGraphError& e) {
    EXPECT_NE(std::string(e.what()).find("whose sum divides the world size 4"), std::string::npos) << e.what();
  }
  PlannerOptions o = fixedLayout(4, {2, 1, 1});
  o.num_stages = 2;
  EXPECT_THROW(plan(g, m, o), InvalidGraphError);
  o = fixedLayout(4, {2, 0, 2});
  EXPECT_THROW(plan(g, m, o), InvalidGraphError);
}

// [Note: rows kept together] A uniform chain on four devices plans one stage of four
// replicas; where the last task must see every row (a contrastive loss), the stage
// holding it and every later one have one replica in one pipeline copy, with the other
// devices replicating the stages before, also after refinement; and where the first task
// must, every stage has one.
TEST(AStageSearch, KeepsTheStagesFromARowCouplingTaskOnOneReplica) {
  ir::Graph g = testing::uniformChain(8, 256, /*batch=*/16);
  AnalyticCostModel m(g, device());
  PlannerOptions o;
  o.world_size = 4;
  o.num_blocks = 8;
  o.memory_limit = 1LL << 40;
  o.max_microbatches = 1;
  const Deployment free = plan(g, m, o);
  ASSERT_GT(free.stages.back().ranks.size() / free.pipelines, 1u);  // else nothing to show
  const auto order = g.topologicalOrder();
  for (bool refine : {false, true}) {
    o.refine_boundaries = refine;
    o.rows_together = {order.back()};
    const Deployment d = plan(g, m, o);
    ASSERT_TRUE(d.feasible);
    EXPECT_EQ(d.pipelines, 1);
    EXPECT_EQ(d.stages.back().ranks.size(), 1u);
    size_t used = 0, widest_before = 0;
    for (const StagePlan& s : d.stages) used += s.ranks.size();
    for (size_t i = 0; i + 1 < d.stages.size(); ++i) widest_before = std::max(widest_before, d.stages[i].ranks.size());
    EXPECT_EQ(used, 4u);
    EXPECT_GT(widest_before, 1u);  // the stages before stay replicated
    o.rows_together = {order.front()};
    const Deployment first = plan(g, m, o);
    ASSERT_TRUE(first.feasible);
    for (const StagePlan& s : first.stages) EXPECT_EQ(s.ranks.size(), 1u);
  }
}

// Two nodes of two devices and a model that needs two stages, with a slow link between
// nodes: two pipeline copies all-reduce every stage across nodes, while one copy of two
// stages with two replicas each keeps the all-reduce inside a node. The paper's search
// (first node count with a plan, S in (D_node (n - 1), D_node n]) never tries the latter.
TEST(AStageSearch, LetsAFewStageCopySpanningNodesCompeteWithMoreCopies) {
  ir::Graph g = testing::uniformChain(8, 512, /*batch=*/64);
  DeviceSpec d = device(/*per_node=*/2);
  d.inter_node_bandwidth = 1e7;
  AnalyticCostModel m(g, d);
  PlannerOptions o;
  o.world_size = 4;
  o.num_blocks = 8;
  o.optimizer = Optimizer::Sgd;
  o.recompute = Recompute::Never;
  o.memory_limit = 2 * (512 * 512 * 4) * 5 + (8 << 20);  // four layers fit, eight do not
  o.every_node_count = false;
  Deployment paper = plan(g, m, o);
  o.every_node_count = true;
  Deployment wide = plan(g, m, o);
  EXPECT_EQ(paper.pipelines, 2);
  EXPECT_EQ(wide.pipelines, 1);
  EXPECT_LT(wide.iteration_time, 0.9 * paper.iteration_time);
  for (const StagePlan& s : wide.stages) EXPECT_LE(s.memory_bytes, o.memory_limit);
}

// The micro-batch sweep of a later stage count must not stop because an earlier stage
// count's plan is better than its first candidates: the default patience finds the plan
// the exhaustive search finds on a small, wide ResNet.
TEST(AStageSearch, FindsTheExhaustivePlanOnASmallResNetWithDefaultPatience) {
  ir::Graph g = testing::smallWideResNet();
  DeviceSpec d;
  d.memory_bytes = 2LL << 30;
  d.devices_per_node = 4;
  PlannerOptions o;
  o.world_size = 8;
  o.batch_size = 64;
  AnalyticCostModel a(g, d), b(g, d);
  Deployment patient = plan(g, a, o);
  o.search_patience = 0;
  Deployment exhaustive = plan(g, b, o);
  EXPECT_NEAR(patient.iteration_time, exhaustive.iteration_time, 1e-9 * exhaustive.iteration_time);
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

std::string infeasibleMessage(const ir::Graph& g, const PlannerOptions& o) {
  AnalyticCostModel m(g, testing::device());
  try {
    plan(g, m, o);
  } catch (const InfeasiblePlanError& e) {
    EXPECT_EQ(e.bytesNeeded(), 0);  // not a memory problem
    return e.what();
  }
  ADD_FAILURE() << "expected InfeasiblePlanError";
  return "";
}

TEST(ATooSmallBatch, BlamesTheMicroBatchCountWhenOneMicroBatchWouldHaveRows) {
  // One row per rank on 2 ranks: 2 stages of one replica have a row each, but not four
  // micro-batches of one.
  ir::Graph g = testing::uniformChain(4, 64, /*batch=*/1);
  PlannerOptions o;
  o.world_size = 2;
  o.memory_limit = 1LL << 40;
  o.num_microbatches = 4;
  const std::string msg = infeasibleMessage(g, o);
  EXPECT_NE(msg.find("num_microbatches=4 needs at least 4 rows"), std::string::npos) << msg;
  EXPECT_NE(msg.find("global batch has 2 row(s)"), std::string::npos) << msg;
  EXPECT_NE(msg.find("num_microbatches <= 2"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("one row per device"), std::string::npos) << msg;
}

TEST(ATooSmallBatch, SaysOneRowPerDeviceWhenThatIsTheNeed) {
  // One block cannot be pipelined: its 4 replicas need a row each, the batch has 2.
  ir::Graph g = testing::uniformChain(1, 64, /*batch=*/1);
  PlannerOptions o;
  o.world_size = 4;
  o.batch_size = 2;
  o.memory_limit = 1LL << 40;
  const std::string msg = infeasibleMessage(g, o);
  EXPECT_NE(msg.find("need at least one row per device: 4 rows"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("num_microbatches"), std::string::npos) << msg;
}

}  // namespace
}  // namespace rannc::partition
