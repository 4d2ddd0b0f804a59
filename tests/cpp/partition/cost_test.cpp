#include <gtest/gtest.h>

#include "partition/cost/analytic_cost_model.h"
#include "partition/cost/memory.h"
#include "partition/partition_graphs.h"
#include "synthetic/synthetic.h"

namespace rannc::partition {
namespace {

using testing::act;
using testing::linearChain;
using testing::uniformChain;

DeviceSpec flopBound() {
  DeviceSpec d;
  d.peak_flops = 1e9;
  d.memory_bandwidth = 1e30;  // bytes never dominate
  return d;
}

TEST(AnAnalyticCostModel, CountsLinearFlopsAtTheMicroBatchRows) {
  ir::Graph g = linearChain({32}, /*batch=*/8, /*in_width=*/16);
  AnalyticCostModel m(g, flopBound());
  // 2 * rows * out * in FLOPs at 1e9 FLOP/s.
  EXPECT_DOUBLE_EQ(m.cost({0}, 8).forward_time, 2.0 * 8 * 32 * 16 / 1e9);
  EXPECT_DOUBLE_EQ(m.cost({0}, 2).forward_time, 2.0 * 2 * 32 * 16 / 1e9);
}

TEST(AnAnalyticCostModel, ChargesTheBackwardTwiceTheForward) {
  ir::Graph g = uniformChain(3);
  AnalyticCostModel m(g, flopBound());
  PieceCost c = m.cost({0, 1, 2}, 4);
  EXPECT_DOUBLE_EQ(c.backward_time, 2.0 * c.forward_time);
}

TEST(AnAnalyticCostModel, ReportsParametersBoundaryAndStashedBytes) {
  ir::Graph g = linearChain({32, 8}, /*batch=*/8, /*in_width=*/16);
  AnalyticCostModel m(g, flopBound());
  PieceCost c = m.cost({1}, 2);
  EXPECT_EQ(c.param_bytes, 8 * 32 * 4);
  EXPECT_EQ(c.input_bytes, 2 * 32 * 4);   // h0 at 2 rows
  EXPECT_EQ(c.output_bytes, 2 * 8 * 4);   // h1 is a graph output
  EXPECT_EQ(c.activation_bytes, 2 * 32 * 4 + 2 * 8 * 4);
  PieceCost both = m.cost({0, 1}, 2);
  EXPECT_EQ(both.param_bytes, (32 * 16 + 8 * 32) * 4);
  EXPECT_EQ(both.input_bytes, 2 * 16 * 4);
}

// [Note: split backward] A piece whose inputs take no gradient (token ids, images) has only
// a weight part; elsewhere the weight part is left to the stage estimate.
TEST(AnAnalyticCostModel, GivesAPieceWithoutGradientInputsOnlyAWeightPart) {
  ir::Graph g = linearChain({32, 8}, /*batch=*/8, /*in_width=*/16);
  ASSERT_FALSE(g.value(g.inputs()[0]).requires_grad);  // the model's argument
  AnalyticCostModel m(g, flopBound());
  const PieceCost first = m.cost({0}, 2), both = m.cost({0, 1}, 2);
  EXPECT_GT(first.backward_time, 0.0);
  EXPECT_DOUBLE_EQ(first.weight_time, first.backward_time);
  EXPECT_DOUBLE_EQ(both.weight_time, both.backward_time);
  EXPECT_LT(m.cost({1}, 2).weight_time, 0.0);
}

TEST(AnAnalyticCostModel, IsMemoryBoundOnElementwiseOps) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 100, ir::ValueRole::Input);
  ir::ValueId y = act(g, "y", 100);
  g.addTask("aten::relu", {x}, {y});
  DeviceSpec d;
  d.peak_flops = 1e30;
  d.memory_bandwidth = 1e6;
  AnalyticCostModel m(g, d);
  EXPECT_DOUBLE_EQ(m.cost({0}, 4).forward_time, 2.0 * 4 * 100 * 4 / 1e6);
}

TEST(ACostModel, AnswersRepeatedQueriesFromItsCache) {
  ir::Graph g = uniformChain(4);
  AnalyticCostModel m(g, flopBound());
  m.cost({0, 1}, 4);
  m.cost({1, 0}, 4);     // same set, other order
  m.cost({0, 1, 1}, 4);  // duplicates (clones) do not change the set
  EXPECT_EQ(m.queries(), 3);
  EXPECT_EQ(m.misses(), 1);
  m.cost({0, 1}, 2);
  EXPECT_EQ(m.misses(), 2);
}

TEST(ACostModel, SharesOneQueryBetweenIdenticalLayersWhenCachingByContent) {
  ir::Graph g = uniformChain(4);
  AnalyticCostModel m(g, flopBound(), /*cache_by_content=*/true);
  PieceCost a = m.cost({1}, 4);
  PieceCost b = m.cost({2}, 4);
  EXPECT_EQ(m.misses(), 1);
  EXPECT_DOUBLE_EQ(a.forward_time, b.forward_time);
}

TEST(ACostModel, TimesTransfersAndRingAllReducesByLink) {
  ir::Graph g = uniformChain(1);
  DeviceSpec d;
  d.intra_node_bandwidth = 100;
  d.inter_node_bandwidth = 10;
  AnalyticCostModel m(g, d);
  EXPECT_DOUBLE_EQ(m.commTime(1000, Link::IntraNode), 10.0);
  EXPECT_DOUBLE_EQ(m.commTime(1000, Link::InterNode), 100.0);
  EXPECT_DOUBLE_EQ(m.allReduceTime(1000, 1, Link::IntraNode), 0.0);
  EXPECT_DOUBLE_EQ(m.allReduceTime(1000, 4, Link::IntraNode), 2.0 * 3 / 4 * 1000 / 100);
}

TEST(AReplicaMemory, AddsOptimizerStateAndInFlightActivations) {
  PieceCost c;
  c.param_bytes = 100;
  c.activation_bytes = 10;
  c.input_bytes = 2;
  EXPECT_EQ(replicaMemory(c, Optimizer::Adam, 3, false), 400 + 30);
  EXPECT_EQ(replicaMemory(c, Optimizer::SgdMomentum, 3, false), 300 + 30);
  EXPECT_EQ(replicaMemory(c, Optimizer::Sgd, 3, false), 200 + 30);
  EXPECT_EQ(replicaMemory(c, Optimizer::Sgd, 3, true), 200 + 6 + 10);
  c.buffer_bytes = 5;  // a copy of the model beside it: its parameters and buffers
  EXPECT_EQ(replicaMemory(c, Optimizer::Adam, 3, false, 1), 500 + 10 + 30);
  EXPECT_EQ(stateMemory(c, Optimizer::Sgd, 2), 400 + 15);
}

// [Note: frozen parameters' memory] A frozen parameter holds its weights only.
TEST(AReplicaMemory, ChargesFrozenParametersTheirWeightsOnly) {
  PieceCost c;
  c.param_bytes = 100;
  c.frozen_bytes = 60;  // a LoRA model's base: 40 bytes train
  c.activation_bytes = 10;
  EXPECT_EQ(stateMemory(c, Optimizer::Adam), 100 + 40 * 3);
  EXPECT_EQ(replicaMemory(c, Optimizer::Sgd, 3, false), 100 + 40 + 30);
  EXPECT_EQ(stateMemory(c, Optimizer::Adam, 1), 200 + 40 * 3);  // a copy holds weights
  c.frozen_bytes = 100;
  EXPECT_EQ(stateMemory(c, Optimizer::Adam), 100);
}

TEST(AnAnalyticCostModel, CountsTheFrozenParametersOfAPiece) {
  ir::Graph g = uniformChain(4, 16);
  AnalyticCostModel trained(g, DeviceSpec{});
  std::vector<ir::TaskId> all;
  for (ir::TaskId t = 0; t < static_cast<ir::TaskId>(g.numTasks()); ++t) all.push_back(t);
  const PieceCost before = trained.cost(all, g.batchSize());
  EXPECT_EQ(before.frozen_bytes, 0);
  int64_t frozen = 0;
  for (ir::ValueId v = 0; v < static_cast<ir::ValueId>(g.numValues()); ++v) {
    if (g.value(v).role == ir::ValueRole::Param && frozen == 0) {
      g.mutableValue(v).requires_grad = false;
      frozen = g.value(v).bytes();
    }
  }
  ASSERT_GT(frozen, 0);
  AnalyticCostModel m(g, DeviceSpec{});
  const PieceCost after = m.cost(all, g.batchSize());
  EXPECT_EQ(after.param_bytes, before.param_bytes);
  EXPECT_EQ(after.frozen_bytes, frozen);
  EXPECT_EQ(after.trainedBytes(), before.param_bytes - frozen);
  // the task of the frozen weight computes its input's gradient alone, or nothing
  EXPECT_LT(after.backward_time, before.backward_time);
  EXPECT_DOUBLE_EQ(after.forward_time, before.forward_time);
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

// The fast path (marks) and the piece path (makePiece + computeCost) must agree.
TEST(AnAnalyticCostModel, GivesTheSameCostsWithAndWithoutContentCaching) {
  SyntheticTransformerOptions t;
  t.layers = 3;
  t.hidden = 32;
  t.heads = 2;
  t.seq_len = 8;
  t.vocab = 50;
  ir::Graph g = syntheticTransformer(t);
  AnalyticCostModel fast(g, DeviceSpec{}), hashed(g, DeviceSpec{}, /*cache_by_content=*/true);
  const std::vector<ir::TaskId> order = g.topologicalOrder();
  for (size_t begin = 0; begin < order.size(); begin += 7) {
    for (size_t len : {1, 5, 30}) {
      std::vector<ir::TaskId> piece(order.begin() + begin,
                                    order.begin() + std::min(order.size(), begin + len));
      for (int64_t rows : {1, 3}) {
        PieceCost a = fast.cost(piece, rows), b = hashed.cost(piece, rows);
        EXPECT_DOUBLE_EQ(a.forward_time, b.forward_time);
        EXPECT_EQ(a.activation_bytes, b.activation_bytes);
        EXPECT_EQ(a.param_bytes, b.param_bytes);
        EXPECT_EQ(a.input_bytes, b.input_bytes);
        EXPECT_EQ(a.output_bytes, b.output_bytes) << "piece at " << begin << " of " << len;
      }
    }
  }
}

}  // namespace
}  // namespace rannc::partition
