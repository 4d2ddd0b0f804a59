#include "frontend/masked_losses.h"

#include <vector>

#include <torch/csrc/jit/ir/constants.h>

namespace rannc::frontend {
namespace {

using torch::jit::Node;
using JitValue = torch::jit::Value;

// Argument positions shared by cross_entropy_loss and the nll_loss family:
// (self, target, weight, reduction, ignore_index[, label_smoothing]).
// `indexed` = aten::index(base, [mask]) with one boolean mask: the mask, and `base`.
JitValue* boolMaskOf(JitValue* indexed, JitValue** base) {
  Node* index = indexed->node();
  if (index->kind() != c10::aten::index || index->inputs().size() != 2) return nullptr;
  Node* list = index->input(1)->node();
  if (list->kind() != c10::prim::ListConstruct || list->inputs().size() != 1) return nullptr;
  JitValue* mask = list->input(0);
  auto type = mask->type()->cast<c10::TensorType>();
  if (!type || type->scalarType() != at::kBool) return nullptr;
  *base = index->input(0);
  return mask;
}

// The sizes a traced value had, when its type holds them all.
std::optional<std::vector<int64_t>> sizesOf(const JitValue* v) {
  auto type = v->type()->cast<c10::TensorType>();
  if (!type) return std::nullopt;
  return type->sizes().concrete_sizes();
}

// A mask over the leading dimensions of the scores (one class dimension after them) and of
// the targets (all of theirs).
bool masksLeadingDimensions(const JitValue* mask, const JitValue* scores, const JitValue* targets) {
  auto m = sizesOf(mask), s = sizesOf(scores), t = sizesOf(targets);
  if (!m || !s || !t || m->empty() || s->size() != m->size() + 1 || *t != *m) return false;
  return std::equal(m->begin(), m->end(), s->begin());
}

void dropIfUnused(Node* index) {
  if (index->hasUses()) return;
  Node* list = index->input(1)->node();
  index->destroy();
  if (!list->hasUses()) list->destroy();
}

}  // namespace

int rewriteMaskedLosses(torch::jit::Graph& graph) {
  std::vector<Node*> losses;
  for (Node* n : graph.nodes()) {
    const auto k = n->kind();
    if ((k == c10::aten::cross_entropy_loss || k == c10::aten::nll_loss || k == c10::aten::nll_loss_nd) &&
        n->inputs().size() >= 5) {
      losses.push_back(n);
    }
  }
  int rewritten = 0;
  for (Node* loss : losses) {
    JitValue *scores = nullptr, *targets = nullptr;
    JitValue* mask = boolMaskOf(loss->input(0), &scores);
    if (mask == nullptr || boolMaskOf(loss->input(1), &targets) != mask) continue;
    // a mean or a sum (reduction "none" keeps one value per selected token) and a constant
    // ignore_index
    const std::optional<c10::IValue> reduction = torch::jit::toIValue(loss->input(3));
    const std::optional<c10::IValue> ignore = torch::jit::toIValue(loss->input(4));
    if (!reduction || !reduction->isInt() || (reduction->toInt() != 1 && reduction->toInt() != 2)) continue;
    if (!ignore || !ignore->isInt() || !masksLeadingDimensions(mask, scores, targets)) continue;
    Node* scores_index = loss->input(0)->node();
    Node* targets_index = loss->input(1)->node();
    const int64_t k = static_cast<int64_t>(sizesOf(mask)->size());
    torch::jit::WithInsertPoint here(loss);
    std::vector<Node*> made;
    auto insert = [&](c10::Symbol op, std::vector<torch::jit::NamedValue> args) {
      JitValue* out = graph.insert(op, args);
      made.push_back(out->node());
      return out;
    };
    JitValue* kept = insert(c10::aten::where, {mask, targets, loss->input(4)});
    if (k > 1) {
      scores = insert(c10::aten::flatten, {scores, int64_t{0}, k - 1});
      kept = insert(c10::aten::flatten, {kept, int64_t{0}, int64_t{-1}});
    }
    for (Node* n : made) n->copyMetadata(loss);  // the loss's module and source line
    loss->replaceInput(0, scores);
    loss->replaceInput(1, kept);
    dropIfUnused(scores_index);
    dropIfUnused(targets_index);
    ++rewritten;
  }
  return rewritten;
}

}  // namespace rannc::frontend
