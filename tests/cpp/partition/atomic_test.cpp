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

// A 0-dim value computed from the batch: each replica's own share of it.
ir::ValueId shareScalar(ir::Graph& g, const std::string& name) {
  ir::Value v;
  v.name = name;
  v.dtype = ir::DType::Float32;
  v.batch_dependent = true;  // no batch dimension
  return g.addValue(v);
}

// [Note: share scalars] x -> e = embed(x); s = mean(e); h = body(e) -> body(h); the loss
// adds mean(h2) and s: the mean of e and the adds that read it are one piece, the body not.
TEST(AnAtomicPartition, JoinsAShareScalarsProducerWithItsReadersAndNothingElse) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId e = act(g, "e"), h1 = act(g, "h1"), h2 = act(g, "h2");
  ir::ValueId s = shareScalar(g, "s"), m = shareScalar(g, "m"), loss = shareScalar(g, "loss");
  const ir::TaskId embed = g.addTask("aten::relu", {x}, {e});
  const ir::TaskId mean_e = g.addTask("aten::mean", {e}, {s});
  const ir::TaskId body1 = g.addTask("aten::tanh", {e}, {h1});
  const ir::TaskId body2 = g.addTask("aten::tanh", {h1}, {h2});
  const ir::TaskId mean_h = g.addTask("aten::mean", {h2}, {m});
  const ir::TaskId add = g.addTask("aten::add", {m, s}, {loss});
  g.setOutputs({loss});
  AtomicPartition a = partitionAtomic(g);
  EXPECT_EQ(a.joined, 2);  // mean_e and mean_h into add's piece
  ASSERT_EQ(a.pieces.size(), 4u);
  const int joined = a.piece_of[add];
  EXPECT_EQ(a.piece_of[mean_e], joined);
  EXPECT_EQ(a.piece_of[mean_h], joined);
  EXPECT_NE(a.piece_of[body1], joined);
  EXPECT_NE(a.piece_of[body2], joined);
  EXPECT_NE(a.piece_of[embed], joined);
  EXPECT_EQ(a.pieces[joined].tasks, (std::vector<ir::TaskId>{mean_e, mean_h, add}));
  EXPECT_EQ(a.pieces[joined].anchor, mean_e);
  // the pieces stay in a topological order of the DAG, whose edges all point forward
  for (size_t p = 0; p < a.pieces.size(); ++p) {
    for (auto [q, bytes] : a.succ[p]) EXPECT_GT(q, static_cast<int>(p));
  }
  EXPECT_EQ(a.piece_of[body2] + 1, joined);  // after the body it reads
}

// A path between the producer and a reader runs through a task of its own: joined too,
// or the piece would not be convex (it would both feed and read that task).
TEST(AnAtomicPartition, JoinsWhatLiesOnAPathBetweenAShareScalarAndItsReader) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId s = shareScalar(g, "s"), y = act(g, "y"), out = act(g, "out");
  const ir::TaskId mean = g.addTask("aten::mean", {x}, {s});
  const ir::TaskId scale = g.addTask("aten::mul", {x, s}, {y});  // reads s: joined
  const ir::TaskId last = g.addTask("aten::add", {y, s}, {out});
  g.setOutputs({out});
  AtomicPartition a = partitionAtomic(g);
  ASSERT_EQ(a.pieces.size(), 1u);
  EXPECT_EQ(a.pieces[0].tasks, (std::vector<ir::TaskId>{mean, scale, last}));

  // mean -> s read by the last task only; a task between them on a path from mean: joined
  ir::Graph h;
  h.setBatchSize(4);
  ir::ValueId hx = act(h, "x", 8, ir::ValueRole::Input);
  h.setInputs({hx});
  ir::ValueId hs = shareScalar(h, "s"), m = act(h, "m"), hy = act(h, "y"), hout = act(h, "out");
  const ir::TaskId hmean = h.addTask("aten::mean", {hx}, {hs});
  const ir::TaskId other = h.addTask("aten::relu", {hx}, {hy});  // not on a path: stays
  const ir::TaskId between = h.addTask("aten::mul", {hx, hs}, {m});
  const ir::TaskId hlast = h.addTask("aten::add", {m, hy}, {hout});
  h.addTask("aten::add", {hout, hs}, {act(h, "final")});
  h.setOutputs({hout});
  AtomicPartition b = partitionAtomic(h);
  EXPECT_EQ(b.piece_of[hmean], b.piece_of[between]);
  EXPECT_EQ(b.piece_of[hmean], b.piece_of[hlast]);  // on the path mean -> m -> out -> final
  EXPECT_NE(b.piece_of[other], b.piece_of[hmean]);
}

// Two joined groups each feeding the other (a1 -> b1, b2 -> a2) would make the piece DAG
// cyclic though each group is convex: they become one piece.
TEST(AnAtomicPartition, JoinsGroupsThatWouldFeedEachOther) {
  ir::Graph g;
  g.setBatchSize(4);
  ir::ValueId x = act(g, "x", 8, ir::ValueRole::Input);
  g.setInputs({x});
  ir::ValueId sa = shareScalar(g, "sa"), sb = shareScalar(g, "sb");
  ir::ValueId ya = act(g, "ya"), yb = act(g, "yb"), ob = act(g, "ob"), oa = act(g, "oa");
  const ir::TaskId a1 = g.addTask("aten::var_mean", {x}, {sa, ya});
  const ir::TaskId b2 = g.addTask("aten::var_mean", {x}, {sb, yb});
  const ir::TaskId b1 = g.addTask("aten::mul", {ya, sb}, {ob});
  const ir::TaskId a2 = g.addTask("aten::mul", {yb, sa}, {oa});
  g.setOutputs({ob, oa});
  AtomicPartition a = partitionAtomic(g);
  ASSERT_EQ(a.pieces.size(), 1u);
  EXPECT_EQ(a.pieces[0].tasks, (std::vector<ir::TaskId>{a1, b2, b1, a2}));
  EXPECT_EQ(a.joined, 3);
}

}  // namespace
}  // namespace rannc::partition
