#include <gtest/gtest.h>

#include "common/error.h"
#include "ir/subgraph.h"
#include "partition/baseline/baselines.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"

namespace rannc::partition {
namespace {

using testing::act;
using testing::linearChain;
using testing::param;

DeviceSpec flopBound() {
  DeviceSpec d;
  d.peak_flops = 1e9;
  d.memory_bandwidth = 1e30;
  d.intra_node_bandwidth = 1e30;
  d.inter_node_bandwidth = 1e30;
  return d;
}

PlanContext context(int world, int64_t batch) {
  PlanContext ctx;
  ctx.world_size = world;
  ctx.batch_size = batch;
  return ctx;
}

size_t taskCount(const Deployment& d, int s) { return d.stages[s].tasks.size(); }

TEST(AMinMaxSplit, FindsTheBestContiguousRuns) {
  EXPECT_EQ(minMaxContiguousSplit({1, 1, 1, 1}, 2), (std::vector<int>{2, 4}));
  EXPECT_EQ(minMaxContiguousSplit({5, 1, 1, 1, 1, 1}, 2), (std::vector<int>{1, 6}));
  EXPECT_EQ(minMaxContiguousSplit({1, 2, 3}, 3), (std::vector<int>{1, 2, 3}));
  // Fewer natural runs than parts: the long run is split, the maximum stays 10.
  std::vector<int> ends = minMaxContiguousSplit({10, 1, 1}, 3);
  EXPECT_EQ(ends, (std::vector<int>{1, 2, 3}));
}

// One wide layer then seven narrow ones: equal counts overload stage 0.
TEST(ABaseline, BalancesTimeBetterThanEqualCountsOnASkewedChain) {
  ir::Graph g = linearChain({512, 32, 32, 32, 32, 32, 32, 32}, /*batch=*/8, /*in_width=*/512);
  AnalyticCostModel m(g, flopBound());
  AtomicPartition a = partitionAtomic(g);
  PlanContext ctx = context(2, 16);
  BaselineShape shape{2, 1, 1, 4};
  Deployment equal = equalTaskSplit(a, m, ctx, shape);
  Deployment timed = timeBalancedSplit(a, m, ctx, shape);
  Deployment params = paramBalancedSplit(a, m, ctx, shape);
  EXPECT_EQ(taskCount(equal, 0), 4u);
  EXPECT_EQ(taskCount(timed, 0), 1u);   // the wide layer alone
  EXPECT_EQ(taskCount(params, 0), 1u);  // it also holds most parameters
  EXPECT_LT(timed.iteration_time, equal.iteration_time);
  EXPECT_EQ(equal.planner, "equal-tasks");
  EXPECT_EQ(timed.planner, "time-balanced");
  EXPECT_EQ(params.planner, "param-balanced");
}

// a -> (b, c) -> d with times 1, 1, 3, 3: intervals of the order a b c d split at best
// 5 | 3, the ideals {a, c} | {b, d} split 4 | 4.
TEST(APiperBaseline, SplitsADiamondAlongIdealsNotOnlyIntervals) {
  ir::Graph g;
  g.setBatchSize(8);
  ir::ValueId x = act(g, "x", 64, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId ha = act(g, "a", 64), hb = act(g, "b", 64), hc = act(g, "c", 192);
  ir::ValueId hd = act(g, "d1", 64), out = act(g, "d", 64);
  g.addTask("aten::linear", {x, param(g, "wa", {64, 64})}, {ha});      // 0: a
  g.addTask("aten::linear", {ha, param(g, "wb", {64, 64})}, {hb});     // 1: b
  g.addTask("aten::linear", {ha, param(g, "wc", {192, 64})}, {hc});    // 2: c (3x)
  g.addTask("aten::linear", {hc, param(g, "wd", {64, 192})}, {hd});    // 3: d1 (3x)
  g.addTask("aten::add", {hb, hd}, {out});                             // 4: d2
  g.setOutputs({out});
  AnalyticCostModel m(g, flopBound());
  BlockPartition blocks;
  blocks.blocks.resize(4);
  blocks.blocks[0].tasks = {0};
  blocks.blocks[1].tasks = {1};
  blocks.blocks[2].tasks = {2};
  blocks.blocks[3].tasks = {3, 4};
  blocks.succ = {{{1, 0}, {2, 0}}, {{3, 0}}, {{3, 0}}, {}};
  PlanContext ctx = context(2, 64);
  BaselineShape shape{2, 1, 1, 8};  // enough micro-batches for the bottleneck to matter
  Deployment d = piperSplit(blocks, m, ctx, shape);
  ASSERT_EQ(d.numStages(), 2);
  EXPECT_EQ(d.stages[0].tasks, (std::vector<ir::TaskId>{0, 2}));
  EXPECT_EQ(d.stages[1].tasks, (std::vector<ir::TaskId>{1, 3, 4}));
  EXPECT_TRUE(ir::isConvex(g, d.stages[0].tasks));
  EXPECT_TRUE(ir::isConvex(g, d.stages[1].tasks));
  // The best interval split for comparison: {a, b, c} | {d}.
  AtomicPartition a = partitionAtomic(g);
  Deployment interval = timeBalancedSplit(a, m, ctx, shape);
  EXPECT_LT(d.iteration_time, interval.iteration_time);
}

TEST(APiperBaseline, RefusesABlockGraphWithTooManyIdeals) {
  ir::Graph g = linearChain(std::vector<int64_t>(12, 8));
  AnalyticCostModel m(g, flopBound());
  BlockPartition blocks;
  blocks.blocks.resize(12);
  for (int b = 0; b < 12; ++b) blocks.blocks[b].tasks = {b};
  blocks.succ.assign(12, {});  // no edges: every subset is an ideal
  EXPECT_THROW(piperSplit(blocks, m, context(2, 8), BaselineShape{2, 1, 1, 1}, 1000),
               InvalidGraphError);
}

TEST(ABaseline, RejectsAShapeLargerThanTheWorld) {
  ir::Graph g = linearChain({8, 8, 8});
  AnalyticCostModel m(g, flopBound());
  AtomicPartition a = partitionAtomic(g);
  EXPECT_THROW(equalTaskSplit(a, m, context(2, 8), BaselineShape{3, 1, 1, 1}), InvalidGraphError);
  EXPECT_THROW(equalTaskSplit(a, m, context(8, 8), BaselineShape{4, 1, 1, 1}), InvalidGraphError);
}

}  // namespace
}  // namespace rannc::partition
