#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "ir/subgraph.h"
#include "partition/block/block.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"
#include "synthetic/synthetic.h"

namespace rannc::partition {
namespace {

using testing::uniformChain;

DeviceSpec device() {
  DeviceSpec d;
  d.peak_flops = 1e12;
  d.memory_bandwidth = 1e11;
  return d;
}

// Every block, and every interval of blocks, is convex over the non-constant tasks
// (constant clones may sit in several blocks).
void expectConvex(const ir::Graph& g, const AtomicPartition& a, const BlockPartition& p) {
  std::vector<ir::TaskId> prefix;
  for (const Block& b : p.blocks) {
    std::vector<ir::TaskId> anchors;
    for (int atom : b.atoms) anchors.push_back(a.pieces[atom].anchor);
    EXPECT_TRUE(ir::isConvex(g, anchors));
    prefix.insert(prefix.end(), anchors.begin(), anchors.end());
    EXPECT_TRUE(ir::isConvex(g, prefix));
  }
}

void expectCoversEachPieceOnce(const AtomicPartition& a, const BlockPartition& p) {
  std::vector<int> seen(a.pieces.size(), 0);
  for (const Block& b : p.blocks) for (int atom : b.atoms) ++seen[atom];
  for (int s : seen) EXPECT_EQ(s, 1);
}

int64_t cutBytes(const AtomicPartition& a, const BlockPartition& p) {
  std::vector<int> block_of(a.pieces.size());
  for (size_t i = 0; i < p.blocks.size(); ++i) for (int atom : p.blocks[i].atoms) block_of[atom] = i;
  int64_t cut = 0;
  for (size_t x = 0; x < a.succ.size(); ++x) {
    for (auto [y, bytes] : a.succ[x]) if (block_of[x] != block_of[y]) cut += bytes;
  }
  return cut;
}

TEST(ABlockPartition, CutsAUniformChainIntoEqualContiguousBlocks) {
  ir::Graph g = uniformChain(64);
  AnalyticCostModel m(g, device());
  AtomicPartition a = partitionAtomic(g);
  BlockOptions o;
  o.num_blocks = 8;
  o.rows = 8;
  BlockPartition p = partitionBlocks(a, m, o);
  ASSERT_EQ(p.blocks.size(), 8u);
  int next = 0;
  for (const Block& b : p.blocks) {
    ASSERT_EQ(b.atoms.size(), 8u);
    for (int atom : b.atoms) EXPECT_EQ(atom, next++);
  }
}

TEST(ABlockPartition, StopsMergingWhereMemoryWouldOverflow) {
  ir::Graph g = uniformChain(16);
  AnalyticCostModel m(g, device());
  AtomicPartition a = partitionAtomic(g);
  BlockOptions o;
  o.num_blocks = 1;
  o.rows = 8;
  const PieceCost one = m.cost({0}, 8);
  // Room for the state of four layers and a few activations, not for five layers.
  o.memory_limit = 4 * 4 * one.param_bytes + 16 * one.activation_bytes;
  BlockPartition p = partitionBlocks(a, m, o);
  EXPECT_GE(p.blocks.size(), 4u);
  for (const Block& b : p.blocks) EXPECT_LE(b.memory, o.memory_limit);
  expectCoversEachPieceOnce(a, p);
}

TEST(ABlockPartition, KeepsEveryBlockOfATransformerConvex) {
  SyntheticTransformerOptions t;
  t.layers = 6;
  t.hidden = 64;
  t.heads = 4;
  t.seq_len = 16;
  t.vocab = 100;
  ir::Graph g = syntheticTransformer(t);
  AnalyticCostModel m(g, device());
  AtomicPartition a = partitionAtomic(g);
  for (int k : {1, 3, 7, 16}) {
    BlockOptions o;
    o.num_blocks = k;
    o.rows = 2;
    BlockPartition p = partitionBlocks(a, m, o);
    EXPECT_EQ(p.blocks.size(), static_cast<size_t>(k));
    expectConvex(g, a, p);
    expectCoversEachPieceOnce(a, p);
    for (size_t b = 0; b < p.blocks.size(); ++b) {
      for (auto [c, bytes] : p.succ[b]) EXPECT_GT(c, static_cast<int>(b));
    }
  }
}

TEST(ABlockPartition, NeverIncreasesTheCutWhenUncoarsening) {
  SyntheticTransformerOptions t;
  t.layers = 4;
  t.hidden = 64;
  t.heads = 4;
  t.seq_len = 16;
  t.vocab = 100;
  ir::Graph g = syntheticTransformer(t);
  AnalyticCostModel m(g, device());
  AtomicPartition a = partitionAtomic(g);
  BlockOptions o;
  o.num_blocks = 6;
  o.rows = 2;
  o.compact = false;
  o.uncoarsen = false;
  BlockPartition plain = partitionBlocks(a, m, o);
  o.uncoarsen = true;
  BlockPartition refined = partitionBlocks(a, m, o);
  EXPECT_LE(cutBytes(a, refined), cutBytes(a, plain));
  expectConvex(g, a, refined);
}

TEST(ABlockPartition, GroupsFifteenThousandPiecesIntoThirtyTwoBlocks) {
  SyntheticTransformerOptions t;
  t.layers = 181;  // 83 atomic pieces per layer: 15,045
  t.hidden = 64;
  t.heads = 4;
  t.seq_len = 16;
  t.vocab = 100;
  ir::Graph g = syntheticTransformer(t);
  AnalyticCostModel m(g, device());
  AtomicPartition a = partitionAtomic(g);
  EXPECT_GE(a.pieces.size(), 15000u);
  BlockOptions o;
  o.num_blocks = 32;
  o.rows = 2;
  BlockPartition p = partitionBlocks(a, m, o);
  ASSERT_EQ(p.blocks.size(), 32u);
  expectCoversEachPieceOnce(a, p);
  expectConvex(g, a, p);
  double total = 0, worst = 0;
  for (const Block& b : p.blocks) total += b.time, worst = std::max(worst, b.time);
  EXPECT_LT(worst, 2.0 * total / 32);  // balanced within a factor of two of the mean
}

// Random DAGs stress the incremental convexity check and the maintained order: each task
// reads one to three earlier values, some far back (skip connections).
TEST(ABlockPartition, KeepsBlocksOfRandomDagsConvex) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 30; ++trial) {
    ir::Graph g;
    g.setBatchSize(4);
    std::vector<ir::ValueId> vals{testing::act(g, "x", 16, ir::ValueRole::Input)};
    g.setInputs({vals[0]});
    const int n = 20 + static_cast<int>(rng() % 200);
    for (int i = 0; i < n; ++i) {
      std::vector<ir::ValueId> in;
      const int fan = 1 + static_cast<int>(rng() % 3);
      for (int f = 0; f < fan; ++f) {
        const size_t back = rng() % 4 == 0 ? rng() % vals.size() : std::min<size_t>(vals.size() - 1, rng() % 3);
        in.push_back(vals[vals.size() - 1 - back]);
      }
      std::sort(in.begin(), in.end());
      in.erase(std::unique(in.begin(), in.end()), in.end());
      ir::ValueId out = testing::act(g, "v" + std::to_string(i), 8 + static_cast<int64_t>(rng() % 64));
      g.addTask(rng() % 2 ? "aten::add" : "aten::mul", in, {out});
      vals.push_back(out);
    }
    g.setOutputs({vals.back()});
    AnalyticCostModel m(g, device());
    AtomicPartition a = partitionAtomic(g);
    for (int k : {1, 2, 5, 13}) {
      BlockOptions o;
      o.num_blocks = k;
      o.rows = 4;
      BlockPartition p = partitionBlocks(a, m, o);
      EXPECT_EQ(p.blocks.size(), static_cast<size_t>(k)) << "trial " << trial;
      expectConvex(g, a, p);
      expectCoversEachPieceOnce(a, p);
    }
  }
}

}  // namespace
}  // namespace rannc::partition
