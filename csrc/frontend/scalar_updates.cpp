#include "frontend/scalar_updates.h"

#include <torch/csrc/jit/passes/remove_mutation.h>

namespace rannc::frontend {
namespace {

bool writesAScalar(const torch::jit::Node* n) {
  if (n->inputs().empty()) return false;
  auto type = n->input(0)->type()->cast<c10::TensorType>();
  if (!type) return false;
  const std::optional<size_t> dims = type->sizes().size();
  return dims && *dims == 0;
}

int inPlaceScalarOps(const torch::jit::Graph& graph) {
  int n = 0;
  for (const torch::jit::Node* node : graph.nodes()) {
    const c10::FunctionSchema* schema = node->maybeSchema();
    n += schema != nullptr && schema->is_mutable() && writesAScalar(node);
  }
  return n;
}

}  // namespace

int functionalScalarUpdates(const std::shared_ptr<torch::jit::Graph>& graph) {
  const int before = inPlaceScalarOps(*graph);
  if (before == 0) return 0;
  torch::jit::RemoveTensorMutation(graph, [](torch::jit::Node* n) { return writesAScalar(n); });
  return before - inPlaceScalarOps(*graph);
}

}  // namespace rannc::frontend
