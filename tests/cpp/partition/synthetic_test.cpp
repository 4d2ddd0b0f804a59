#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>

#include "ir/subgraph.h"
#include "partition/atomic/atomic.h"
#include "partition/cost/analytic_cost_model.h"
#include "synthetic/synthetic.h"

namespace rannc::partition {
namespace {

int64_t paramCount(const ir::Graph& g) {
  int64_t n = 0;
  for (ir::ValueId v = 0; v < g.numValues(); ++v) {
    if (g.value(v).role == ir::ValueRole::Param) n += g.value(v).numel();
  }
  return n;
}

// Parameters of a bottleneck ResNet with every channel widened by `w`, from the
// architecture alone: convolutions without bias, batch norms with weight and bias, the
// first block of each stage with a 1x1 projection shortcut, a linear classifier.
int64_t resNetParams(const std::vector<int>& blocks, int64_t w, int64_t classes) {
  int64_t c = 64 * w;
  int64_t n = 3 * c * 49 + 2 * c;  // stem conv 7x7 + bn
  for (size_t s = 0; s < blocks.size(); ++s) {
    const int64_t mid = (64 << s) * w, out = 4 * mid;
    for (int i = 0; i < blocks[s]; ++i) {
      n += c * mid + 2 * mid + 9 * mid * mid + 2 * mid + mid * out + 2 * out;
      if (i == 0) n += c * out + 2 * out;
      c = out;
    }
  }
  return n + c * classes + classes;
}

// Every intermediate tensor but the loss carries the batch in dimension 0.
void expectBatchRows(const ir::Graph& g) {
  for (ir::ValueId v = 0; v < g.numValues(); ++v) {
    const ir::Value& val = g.value(v);
    if (val.role != ir::ValueRole::Intermediate || !val.isTensor() || val.is_loss) continue;
    if (val.producer != ir::kNoId && g.task(val.producer).op == "aten::arange") continue;
    if (val.name == "pos_emb") continue;  // position embeddings: one row for every sample
    EXPECT_EQ(val.batch_dim, 0) << val.name;
    EXPECT_EQ(val.shape[0], g.batchSize()) << val.name;
  }
}

// Splitting the atomic pieces into contiguous runs of their (topological) order gives
// convex stages.
void expectTopologicalSplitConvex(const ir::Graph& g, int parts) {
  AtomicPartition a = partitionAtomic(g);
  const size_t n = a.pieces.size();
  for (int p = 0; p < parts; ++p) {
    std::vector<ir::TaskId> anchors;
    for (size_t i = n * p / parts; i < n * (p + 1) / parts; ++i) anchors.push_back(a.pieces[i].anchor);
    EXPECT_TRUE(ir::isConvex(g, anchors)) << "part " << p;
  }
}

SyntheticGptOptions smallGpt(int layers) {
  SyntheticGptOptions o;
  o.layers = layers;
  o.hidden = 64;
  o.heads = 4;
  o.seq_len = 16;
  o.vocab = 100;
  o.batch_size = 2;
  return o;
}

SyntheticTransformerOptions smallBert(int layers, bool mask = true) {
  SyntheticTransformerOptions o;
  o.layers = layers;
  o.hidden = 64;
  o.heads = 4;
  o.seq_len = 16;
  o.vocab = 100;
  o.batch_size = 4;
  o.with_mask = mask;
  return o;
}

// Traced with rannc.trace, examples/models.py's BERT (torch 2.x) has 86 tasks per
// encoder layer, 83 of them atomic pieces (three constant shape lists are cloned), and 19
// pieces around the layers.
TEST(ABertGraph, HasTheTracedLayersEightyThreeAtomicPiecesPerLayer) {
  const ir::Graph one = syntheticTransformer(smallBert(1, false));
  const ir::Graph two = syntheticTransformer(smallBert(2, false));
  EXPECT_EQ(two.numTasks() - one.numTasks(), 86);
  const AtomicPartition a1 = partitionAtomic(one), a2 = partitionAtomic(two);
  EXPECT_EQ(a2.pieces.size() - a1.pieces.size(), 83u);
  EXPECT_EQ(a1.pieces.size(), 19u + 83u);
  // The mask adds its three tasks: 256 layers give 21,270 atomic pieces.
  EXPECT_EQ(partitionAtomic(syntheticTransformer(smallBert(2))).pieces.size(), 22u + 2 * 83u);
}

TEST(ABertGraph, HasTheTracedOpKindsPerLayer) {
  const ir::Graph g = syntheticTransformer(smallBert(2));
  std::map<std::string, int> ops;
  for (const ir::Task& t : g.tasks()) {
    if (t.scope.rfind("encoder.layers.1", 0) == 0) ++ops[t.op];
  }
  const std::map<std::string, int> traced{
      {"aten::Int", 23}, {"prim::ListConstruct", 11}, {"aten::size", 7},
      {"prim::NumToTensor", 7}, {"aten::transpose", 6}, {"aten::view", 6}, {"aten::mul", 4},
      {"aten::linear", 3}, {"aten::select", 3}, {"aten::dropout", 3}, {"aten::add", 2},
      {"aten::layer_norm", 2}, {"aten::div", 1}, {"aten::unflatten", 1},
      {"aten::unsqueeze", 1}, {"aten::squeeze", 1}, {"aten::contiguous", 1},
      {"aten::scaled_dot_product_attention", 1}, {"aten::permute", 1}, {"aten::gelu", 1},
      {"aten::reshape+aten::linear+aten::size+prim::NumToTensor+aten::Int+"
       "prim::ListConstruct+aten::view", 1}};
  EXPECT_EQ(ops, traced);
}

TEST(ABertGraph, HasTheExamplesParameterCountWithATiedDecoder) {
  SyntheticTransformerOptions o = smallBert(2);
  const int64_t H = o.hidden, V = o.vocab, L = o.seq_len;
  const int64_t layer = 4 * H * H + 4 * H + 2 * (4 * H * H) + 5 * H + 4 * H;  // attn, ffn, 2 norms
  EXPECT_EQ(paramCount(syntheticTransformer(o)), V * H + L * H + 2 * H + 2 * layer + H * H + H + 2 * H + V);
}

TEST(ABertGraph, SplitsConvexlyAndCostsViewsAndSizesNothing) {
  const ir::Graph g = syntheticTransformer(smallBert(3));
  for (int parts : {2, 5, 13, 40}) expectTopologicalSplitConvex(g, parts);
  AnalyticCostModel m(g, DeviceSpec{});
  for (const ir::Task& t : g.tasks()) {
    const bool free = t.op == "aten::view" || t.op == "aten::transpose" || t.op == "aten::size" ||
                      t.op == "aten::Int" || t.op == "prim::NumToTensor" || t.op == "aten::select";
    const PieceCost c = m.cost({t.id}, 4);
    if (free) {
      EXPECT_EQ(c.forward_time, 0.0) << t.op;
      // A view's output aliases its input: only the input read counts as stashed.
      EXPECT_EQ(c.activation_bytes, c.input_bytes) << t.op;
    } else if (t.op.find("linear") != std::string::npos) {
      EXPECT_GT(m.taskFlops(t.id), 0.0);
    }
  }
  // The fused out-projection is costed as its linear: 2 x rows x L x H x H FLOPs.
  for (const ir::Task& t : g.tasks()) {
    if (t.op.rfind("aten::reshape+aten::linear", 0) == 0) {
      EXPECT_DOUBLE_EQ(m.taskFlops(t.id), 2.0 * 4 * 16 * 64 * 64);
    }
  }
}

TEST(AGptGraph, HasTwentyNineTasksPerLayerAndEightAround) {
  EXPECT_EQ(syntheticGpt(smallGpt(3)).numTasks() - syntheticGpt(smallGpt(2)).numTasks(), 29);
  EXPECT_EQ(syntheticGpt(smallGpt(2)).numTasks(), 8 + 2 * 29);
}

TEST(AGptGraph, HasGpt2SmallsParameterCount) {
  SyntheticGptOptions o;  // GPT-2 small: 12 layers, 768 hidden, vocab 50257, 1024 positions
  EXPECT_EQ(paramCount(syntheticGpt(o)), 124439808);
}

TEST(AGptGraph, TiesTheLmHeadToTheTokenEmbedding) {
  ir::Graph g = syntheticGpt(smallGpt(2));
  for (ir::ValueId v = 0; v < g.numValues(); ++v) {
    if (g.value(v).name != "transformer.wte.weight") continue;
    ASSERT_EQ(g.value(v).consumers.size(), 2u);
    EXPECT_EQ(g.task(g.value(v).consumers[0]).op, "aten::embedding");
    EXPECT_EQ(g.task(g.value(v).consumers[1]).op, "aten::linear");
    return;
  }
  FAIL() << "no token embedding";
}

TEST(AGptGraph, MarksTheBatchAndSplitsConvexly) {
  ir::Graph g = syntheticGpt(smallGpt(3));
  expectBatchRows(g);
  for (int parts : {2, 5, 13}) expectTopologicalSplitConvex(g, parts);
  AnalyticCostModel m(g, DeviceSpec{});
  AtomicPartition a = partitionAtomic(g);
  std::vector<ir::TaskId> all;
  for (const AtomicPiece& p : a.pieces) all.insert(all.end(), p.tasks.begin(), p.tasks.end());
  EXPECT_GT(m.cost(all, 8).activation_bytes, m.cost(all, 2).activation_bytes);
}

TEST(AResNetGraph, HasTorchvisionsResNet152ParameterCountAtWidthOne) {
  SyntheticResNetOptions o;
  EXPECT_EQ(resNetParams(o.blocks, 1, 1000), 60192808);
  EXPECT_EQ(paramCount(syntheticResNet(o)), 60192808);
}

TEST(AResNetGraph, WidensEveryChannelByTheWidthFactor) {
  SyntheticResNetOptions o;
  o.width_factor = 8;
  const int64_t expected = resNetParams(o.blocks, 8, 1000);
  EXPECT_EQ(paramCount(syntheticResNet(o)), expected);
  // Convolutions grow with the square of the width, the classifier and norms linearly:
  // 3.73 G, a little under 64 x 60.2 M (the RaNNC paper's 3.7 G for ResNet-152 x8).
  EXPECT_EQ(expected, 3728582120);
}

TEST(AResNetGraph, HasTenTasksPerBottleneckTwoPerShortcutAndEightAround) {
  SyntheticResNetOptions o;
  ir::Graph g = syntheticResNet(o);
  // stem conv, bn, relu, maxpool; 50 blocks of 10; 4 shortcuts of 2; avgpool, flatten, fc, loss
  EXPECT_EQ(g.numTasks(), 4 + 50 * 10 + 4 * 2 + 4);
  EXPECT_EQ(static_cast<int>(partitionAtomic(g).pieces.size()), g.numTasks());
}

TEST(AResNetGraph, MarksTheBatchShrinksTheImageAndSplitsConvexly) {
  SyntheticResNetOptions o;
  o.blocks = {2, 2, 2, 2};
  o.width_factor = 2;
  o.batch_size = 4;
  ir::Graph g = syntheticResNet(o);
  expectBatchRows(g);
  for (int parts : {2, 3, 7, 20}) expectTopologicalSplitConvex(g, parts);
  for (ir::ValueId v = 0; v < g.numValues(); ++v) {
    const ir::Value& val = g.value(v);
    if (val.name == "layer4.1.add") {
      EXPECT_EQ(val.shape, (std::vector<int64_t>{4, 2048 * 2, 7, 7}));
    }
  }
  // Convolutions dominate: FLOPs of the whole net at batch 4 are about 4 x 4.1 G x 2 x w^2.
  AnalyticCostModel m(g, DeviceSpec{});
  double flops = 0.0;
  for (ir::TaskId t = 0; t < g.numTasks(); ++t) flops += m.taskFlops(t);
  EXPECT_GT(flops, 1e10);
}

}  // namespace
}  // namespace rannc::partition
