#pragma once
// Losses over the tokens a boolean mask selects, rewritten so that the mask ignores them.
//
// [Note: masked losses] `F.cross_entropy(logits[mask], labels[mask])` (the token
// classification and masked-LM loss that older transformers and many training loops write)
// selects a number of rows that the data decides: aten::index with a boolean mask. Rows
// selected that way cannot be cut apart between stages, so the index, the loss and what
// lies between are glued into one task whose scalar output is combined weighted by rows,
// which is not the mean over the global batch's selected tokens. The same loss reads
//     F.cross_entropy(logits.flatten(0, k - 1), torch.where(mask, labels, ignore_index).flatten())
// for a k-dimensional mask over the leading dimensions of logits (k + 1 dimensions) and of
// labels (k dimensions): the mean over the kept targets, which [Note: token-mean losses]
// makes exact across micro-batches, replicas and stages; the reduction "sum" adds up as a
// sum. The forward and the gradients are those of the masked form (log-softmax then runs
// over every row, the unselected ones getting a zero gradient).
#include <torch/csrc/jit/ir/ir.h>

namespace rannc::frontend {

// Rewrites each cross_entropy_loss, nll_loss and nll_loss_nd of `graph` whose scores and
// targets are indexed by the same boolean mask as above; drops index nodes left unused.
// Returns the number of losses rewritten.
int rewriteMaskedLosses(torch::jit::Graph& graph);

}  // namespace rannc::frontend
