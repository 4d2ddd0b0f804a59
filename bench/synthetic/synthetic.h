#pragma once
// Synthetic graphs shaped like traced models, for tests and the planner benchmark: no
// torch needed, sizes chosen freely (a 256-layer BERT has 21,267 atomic pieces, as many
// as the traced model would). Every activation carries the batch, so analytic costs scale
// with the rows.
#include <cstdint>
#include <vector>

#include "ir/graph.h"

namespace rannc::partition {

struct SyntheticTransformerOptions {
  int layers = 12;
  int64_t hidden = 768;
  int64_t heads = 12;
  int64_t seq_len = 128;
  int64_t batch_size = 8;  // traced batch size
  int64_t vocab = 30522;
  bool with_mask = true;   // an attention mask computed once and read by every layer
};

// examples/models.py's BERT as the frontend traces it: token and position embeddings and
// a layer norm, `layers` nn.TransformerEncoderLayer's (post-norm, GELU; each traced into
// 86 tasks, 83 non-constant, see [Note: traced encoder layer] in synthetic.cpp), an MLM
// head (dense, GELU, layer norm, decoder tied to the token embedding) and a mean
// cross-entropy over batch x sequence rows. Inputs: input_ids, labels and, with
// `with_mask`, an attention mask (computed once, read by every layer's attention; the
// example has none). Activations carry the batch in dimension 0, in dimension 1 inside
// the sequence-first attention.
ir::Graph syntheticTransformer(const SyntheticTransformerOptions& options);

struct SyntheticGptOptions {
  int layers = 12;
  int64_t hidden = 768;
  int64_t heads = 12;
  int64_t seq_len = 1024;
  int64_t batch_size = 8;  // traced batch size
  int64_t vocab = 50257;
};

// A GPT-2-style decoder: token and position embeddings, `layers` pre-norm decoder layers
// (fused QKV projection sliced into heads, causal self-attention masked by a per-layer
// buffer, GELU feed-forward, residuals), a final layer norm and an LM head tied to the
// token embedding (the same parameter read by the first and the last task), and a mean
// cross-entropy loss. About 30 tasks per layer.
ir::Graph syntheticGpt(const SyntheticGptOptions& options);

struct SyntheticResNetOptions {
  std::vector<int> blocks{3, 8, 36, 3};  // bottleneck blocks per stage: ResNet-152
  int64_t width_factor = 1;  // multiplies every channel count (stem, bottleneck, output)
  int64_t image = 224;
  int64_t batch_size = 8;    // traced batch size
  int64_t classes = 1000;
};

// A ResNet with bottleneck blocks as torchvision builds it (stride on the 3x3 conv,
// projection shortcut on the first block of each stage, convolutions without bias, batch
// norms with running statistics as buffers), widened by `width_factor` on every channel.
// Tasks: conv2d, batch_norm, relu, add, max/avg pooling, flatten, linear, cross_entropy on
// an integer label input. Width 1 with blocks {3, 8, 36, 3} has torchvision's
// resnet152 parameter count (60,192,808).
ir::Graph syntheticResNet(const SyntheticResNetOptions& options);

}  // namespace rannc::partition
