#pragma once
// Losses over the elements a boolean mask selects, rewritten so that the mask weighs them.
//
// [Note: masked losses] `F.cross_entropy(logits[mask], labels[mask])` (the token
// classification and masked-LM loss that older transformers and many training loops write),
// `per_token[mask].mean()` and `F.mse_loss(pred[mask], target[mask])` select a number of
// elements that the data decides: aten::index with a boolean mask. Rows selected that way
// cannot be cut apart between stages, so the index, the loss and what lies between are
// glued into one task whose scalar output is combined weighted by rows, which is not the
// loss over the global batch's selected elements. The same losses read
//     F.cross_entropy(logits.flatten(0, k - 1), torch.where(mask, labels, ignore_index).flatten())
//         for a k-dimensional mask over the leading dimensions of logits (k + 1 of them)
//         and of labels (k), and likewise nll_loss: a mean over the kept targets, which
//         [Note: token-mean losses] makes exact across micro-batches, replicas and stages;
//     torch.where(mask, x, 0).sum() / mask.sum()  for x[mask].mean(), mask as large as x;
//     torch.where(mask, F.mse_loss(pred, target, reduction="none"), 0).sum() / mask.sum()
//         for mse, l1, smooth l1, huber and binary cross entropy (without weights), mask
//         as large as both: a sum over a count of the batch, exact the same way.
//     F.ctc_loss(log_probs, labels.masked_select(mask), lengths, mask.sum(-1))
//         (transformers' Wav2Vec2ForCTC and its kin; mask and labels (N, S)) as ctc_loss
//         over labels.gather(-1, mask.argsort(-1, stable, descending)): each row's
//         selected labels at its front, in order, the padded form of the same targets,
//         whose "sum" and "mean" (per row, over its target length) read;
// Reduction "sum" drops the division and adds up as a sum over the batch. The values and
// gradients are those of the masked form; the loss is computed over the unselected
// elements too (a non-finite value there gives a non-finite gradient).
#include <torch/csrc/jit/ir/ir.h>

namespace rannc::frontend {

// Rewrites the losses of `graph` over a boolean mask's elements as above (both arguments
// indexed by the same mask value); drops index nodes left unused. Returns their number.
int rewriteMaskedLosses(torch::jit::Graph& graph);

}  // namespace rannc::frontend
