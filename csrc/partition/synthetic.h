#pragma once
// Synthetic graphs shaped like traced models, for tests and the planner benchmark: no
// torch needed, sizes chosen freely (a 256-layer BERT has ~15,000 atomic pieces).
#include <cstdint>

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

// A BERT-like encoder: embedding, `layers` post-norm encoder layers (self-attention with
// a shared mask, GELU feed-forward, residuals, layer norms), a vocabulary head and a mean
// loss. Every activation carries the batch in dimension 0. About 26 tasks per layer.
ir::Graph syntheticTransformer(const SyntheticTransformerOptions& options);

}  // namespace rannc::partition
