#pragma once
// Losses accumulated in place, rewritten as the functional ops they mean.
//
// [Note: scalar updates] Training code adds loss terms in place: `loss += aux_weight * aux`
// (transformers' mixture-of-experts models), `total = torch.zeros(()); total += l` over
// the tasks of a multi-task model. An in-place write glues the written value, its producer
// and its readers into one task ([Note: in-place writes] in convert.cpp), so
// `cross_entropy + add_` is one op that neither [Note: token-mean losses] nor the reading
// of the output's reduction over the batch (ir::batchReduction) can see into: the loss is
// weighted by rows and, when it is a sum, wrongly. A 0-dim tensor made inside the graph
// that nothing else aliases holds no memory worth saving, so its in-place arithmetic
// becomes functional (torch's RemoveTensorMutation, which proves there is no alias)
// before the IR is built.
#include <memory>

#include <torch/csrc/jit/ir/ir.h>

namespace rannc::frontend {

// Rewrites in-place ops on 0-dim tensors of `graph` (add_, sub_, mul_, div_, ...) as their
// functional forms where no alias can see the difference. Returns their number.
int functionalScalarUpdates(const std::shared_ptr<torch::jit::Graph>& graph);

}  // namespace rannc::frontend
