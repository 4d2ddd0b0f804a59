#pragma once
// The sizes of parameters and buffers, read as constants.
//
// [Note: shapes of the model's state] nanoGPT's LayerNorm calls
// `F.layer_norm(x, self.weight.shape, self.weight, self.bias)`: the trace reads the
// weight's size (aten::size) where the norm's shape list is built, apart from the norm.
// Where the stages were cut between the two, the first stage held the weight for its size
// alone and the second used it: two stages held the parameter, one of which never updated
// it, and state_dict() served that stale copy (2% off after 3 AdamW steps) while the
// optimizer's state_dict() lost its state. A parameter's size is fixed for the model's
// life (a module that changes it is traced again), so the trace's sizes of state tensors
// become constants before the IR is built, and a stage holds a parameter only to compute
// with its values.
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/csrc/jit/ir/ir.h>

#include "frontend/convert.h"

namespace rannc::frontend {

// Replaces the aten::size of `graph`'s parameter and buffer inputs (`roles`, values
// `inputs`, both in graph input order) with constants. Returns how many.
int foldStateShapes(torch::jit::Graph& graph, const std::vector<GraphInput>& roles,
                    const std::vector<at::Tensor>& inputs);

}  // namespace rannc::frontend
