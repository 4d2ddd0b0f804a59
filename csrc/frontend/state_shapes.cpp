#include "frontend/state_shapes.h"

#include <torch/csrc/jit/ir/constants.h>

namespace rannc::frontend {

int foldStateShapes(torch::jit::Graph& graph, const std::vector<GraphInput>& roles,
                    const std::vector<at::Tensor>& inputs) {
  std::unordered_map<const torch::jit::Value*, at::IntArrayRef> state_sizes;
  for (size_t i = 0; i < graph.inputs().size() && i < roles.size() && i < inputs.size(); ++i) {
    if ((roles[i].role == ir::ValueRole::Param || roles[i].role == ir::ValueRole::Buffer) &&
        inputs[i].defined()) {
      state_sizes.emplace(graph.inputs()[i], inputs[i].sizes());
    }
  }
  std::vector<torch::jit::Node*> reads;
  for (torch::jit::Node* node : graph.nodes()) {
    if (node->kind() == c10::aten::size && !node->inputs().empty() &&
        state_sizes.count(node->input(0)) > 0 && node->outputs().size() == 1) {
      reads.push_back(node);
    }
  }
  if (reads.empty()) return 0;
  int folded = 0;
  torch::jit::WithInsertPoint front(graph.block()->nodes().front());
  for (torch::jit::Node* node : reads) {
    const at::IntArrayRef sizes = state_sizes.at(node->input(0));
    c10::IValue value;
    if (node->inputs().size() == 1) {
      value = c10::IValue(sizes.vec());
    } else {
      const std::optional<c10::IValue> dim = torch::jit::toIValue(node->input(1));
      if (!dim || !dim->isInt()) continue;  // a dimension computed at run time
      int64_t d = dim->toInt();
      const auto rank = static_cast<int64_t>(sizes.size());
      if (d < 0) d += rank;
      if (d < 0 || d >= rank) continue;  // PyTorch's own error at run time
      value = c10::IValue(sizes[static_cast<size_t>(d)]);
    }
    node->output()->replaceAllUsesWith(graph.insertConstant(value));
    node->destroy();
    ++folded;
  }
  return folded;
}

}  // namespace rannc::frontend
