#include <gtest/gtest.h>

#include <algorithm>

#include "partition/atomic/atomic.h"
#include "partition/partition_graphs.h"

namespace rannc::partition {
namespace {

using testing::act;
using testing::constant;
using testing::param;
using testing::uniformChain;

bool holds(const AtomicPiece& p, ir::TaskId t) {
  return std::find(p.tasks.begin(), p.tasks.end(), t) != p.tasks.end();
}

TEST(AnAtomicPartition, FormsOnePiecePerNonConstantTaskOfAChain) {
  ir::Graph g = uniformChain(5);
  AtomicPartition a = partitionAtomic(g);
  ASSERT_EQ(a.pieces.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(a.pieces[i].anchor, i);
    EXPECT_EQ(a.pieces[i].tasks, std::vector<ir::TaskId>{i});
  }
  ASSERT_EQ(a.succ[0].size(), 1u);
  EXPECT_EQ(a.succ[0][0].first, 1);
  EXPECT_EQ(a.succ[0][0].second, 8 * 64 * 4);
}

// c -> k = mul(c, c) (constant) -> read by both t1 = add(x, k) and t2 = add(t1, k).
TEST(AnAtomicPartition, ClonesAConstantPredecessorIntoEveryConsumer) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId c = constant(g, "c");
  ir::ValueId k = g.addValue(g.value(c));
  g.mutableValue(k).role = ir::ValueRole::Intermediate;
  ir::ValueId h1 = act(g, "h1"), h2 = act(g, "h2");
  const ir::TaskId tk = g.addTask("aten::mul", {c, c}, {k});
  const ir::TaskId t1 = g.addTask("aten::add", {x, k}, {h1});
  const ir::TaskId t2 = g.addTask("aten::add", {h1, k}, {h2});
  g.setOutputs({h2});
  AtomicPartition a = partitionAtomic(g);
  EXPECT_TRUE(a.constant[tk]);
  ASSERT_EQ(a.pieces.size(), 2u);
  EXPECT_EQ(a.pieces[0].anchor, t1);
  EXPECT_EQ(a.pieces[1].anchor, t2);
  EXPECT_TRUE(holds(a.pieces[0], tk));
  EXPECT_TRUE(holds(a.pieces[1], tk));
  EXPECT_EQ(a.piece_of[tk], -1);
}

// w -> t = transpose(w) -> mm(x, t): constant in the paper's sense only.
TEST(AnAtomicPartition, TreatsParameterOnlyTasksAsConstantOnlyUnderThePapersPolicy) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId w = param(g, "w", {8, 8});
  ir::ValueId wt = g.addValue(g.value(w));
  g.mutableValue(wt).role = ir::ValueRole::Intermediate;
  ir::ValueId y = act(g, "y");
  const ir::TaskId tt = g.addTask("aten::t", {w}, {wt});
  const ir::TaskId tm = g.addTask("aten::mm", {x, wt}, {y});
  g.setOutputs({y});

  AtomicPartition state = partitionAtomic(g, ConstantPolicy::IndependentOfState);
  EXPECT_EQ(state.pieces.size(), 2u);
  EXPECT_FALSE(state.constant[tt]);

  AtomicPartition paper = partitionAtomic(g, ConstantPolicy::IndependentOfInputs);
  ASSERT_EQ(paper.pieces.size(), 1u);
  EXPECT_EQ(paper.pieces[0].anchor, tm);
  EXPECT_EQ(paper.pieces[0].tasks, (std::vector<ir::TaskId>{tt, tm}));
}

TEST(AnAtomicPartition, GivesAConstantTaskThatFeedsOnlyOutputsItsOwnPiece) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId c = constant(g, "c");
  ir::ValueId k = g.addValue(g.value(c));
  g.mutableValue(k).role = ir::ValueRole::Intermediate;
  ir::ValueId y = act(g, "y");
  g.addTask("aten::relu", {x}, {y});
  const ir::TaskId tk = g.addTask("aten::neg", {c}, {k});
  g.setOutputs({y, k});
  AtomicPartition a = partitionAtomic(g);
  ASSERT_EQ(a.pieces.size(), 2u);
  EXPECT_TRUE(a.pieces[0].anchor == tk || a.pieces[1].anchor == tk);
}

}  // namespace
}  // namespace rannc::partition
