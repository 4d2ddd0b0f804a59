#include "frontend/no_grad_regions.h"

#include <unordered_map>
#include <vector>

namespace rannc::frontend {
namespace {

using torch::jit::Node;
using torch::jit::Value;

// What the trace recorded of a tensor value's requires_grad (false where it is no tensor).
bool requiredGrad(const Value* v) {
  auto type = v->type()->cast<c10::TensorType>();
  return type && type->requiresGrad().value_or(false);
}

bool floatingTensor(const Value* v) {
  auto type = v->type()->cast<c10::TensorType>();
  if (!type || !type->scalarType()) return false;
  return c10::isFloatingType(*type->scalarType()) || c10::isComplexType(*type->scalarType());
}

// The tensors an op reads: its tensor inputs, and those of a list built for it
// (torch.cat, torch.stack).
std::vector<std::pair<Node*, size_t>> tensorInputs(Node* n) {
  std::vector<std::pair<Node*, size_t>> uses;
  for (size_t i = 0; i < n->inputs().size(); ++i) {
    Value* in = n->input(i);
    Node* maker = in->node();
    if (maker->kind() == c10::prim::ListConstruct && in->uses().size() == 1) {
      for (size_t j = 0; j < maker->inputs().size(); ++j) uses.emplace_back(maker, j);
    } else {
      uses.emplace_back(n, i);
    }
  }
  return uses;
}

// An op that ran with grad disabled: it read a value that required grad and none of its
// floating outputs does.
bool ranWithoutGrad(Node* n) {
  if (n->kind() == c10::aten::detach || n->kind() == c10::prim::ListConstruct) return false;
  bool floating = false;
  for (const Value* out : n->outputs()) {
    if (!floatingTensor(out)) continue;
    if (requiredGrad(out)) return false;
    floating = true;
  }
  if (!floating) return false;
  for (auto [user, i] : tensorInputs(n)) {
    if (requiredGrad(user->input(i))) return true;
  }
  return false;
}

}  // namespace

int detachNoGradInputs(const std::shared_ptr<torch::jit::Graph>& graph) {
  std::unordered_map<Value*, Value*> detached;  // one aten::detach per value
  auto detach = [&](Value* v, Node* reader) {
    auto [it, fresh] = detached.emplace(v, nullptr);
    if (!fresh) return it->second;
    Node* d = graph->create(c10::aten::detach, {v});
    if (v->node()->kind() == c10::prim::Param) {
      d->insertBefore(graph->nodes().front());
    } else {
      d->insertAfter(v->node());
    }
    d->output()->setType(v->type()->cast<c10::TensorType>()->withRequiresGrad(false));
    d->copyMetadata(reader);  // described as the op that ran without grad
    return it->second = d->output();
  };
  int ops = 0;
  std::vector<Node*> nodes(graph->nodes().begin(), graph->nodes().end());
  for (Node* n : nodes) {
    if (!ranWithoutGrad(n)) continue;
    ++ops;
    for (auto [user, i] : tensorInputs(n)) {
      if (requiredGrad(user->input(i))) user->replaceInput(i, detach(user->input(i), n));
    }
  }
  return ops;
}

}  // namespace rannc::frontend
