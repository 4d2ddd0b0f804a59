#include "frontend/masked_losses.h"

#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <torch/csrc/jit/ir/constants.h>

namespace rannc::frontend {
namespace {

using torch::jit::Node;
using JitValue = torch::jit::Value;

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

bool sameSizes(const JitValue* a, const JitValue* b) {
  auto x = sizesOf(a), y = sizesOf(b);
  return x && y && *x == *y;
}

// Destroys the nodes, consumers first, whose outputs nothing reads any more (each once:
// the two index nodes of a loss may share their list).
void dropUnused(const std::vector<Node*>& nodes) {
  std::unordered_set<Node*> seen;
  for (Node* n : nodes) {
    if (!seen.insert(n).second) continue;
    bool used = false;
    for (const JitValue* out : n->outputs()) used = used || out->hasUses();
    if (!used) n->destroy();
  }
}

// An index node and its list of indices, consumers first.
std::vector<Node*> withIndices(Node* index) { return {index, index->input(1)->node()}; }

// `a` and `b` as they were before torch.broadcast_tensors (which F.mse_loss and l1_loss
// call first) when that changed nothing: the same sizes. Adds its nodes to `dead`, to drop
// once nothing reads them.
void unbroadcast(JitValue*& a, JitValue*& b, std::vector<Node*>& dead) {
  Node* unpack = a->node();
  if (unpack->kind() != c10::prim::ListUnpack || b->node() != unpack || unpack->outputs().size() != 2 ||
      a != unpack->output(0) || b != unpack->output(1)) {
    return;
  }
  Node* broadcast = unpack->input(0)->node();
  if (broadcast->kind() != c10::aten::broadcast_tensors) return;
  Node* list = broadcast->input(0)->node();
  if (list->kind() != c10::prim::ListConstruct || list->inputs().size() != 2 ||
      !sameSizes(list->input(0), list->input(1))) {
    return;
  }
  a = list->input(0);
  b = list->input(1);
  dead.insert(dead.end(), {unpack, broadcast, list});
}

// Inserts nodes before the insertion point, with the module and source line of `like`.
class Inserter {
 public:
  Inserter(torch::jit::Graph& graph, Node* like) : graph_(graph), like_(like) {}
  JitValue* operator()(c10::Symbol op, std::vector<torch::jit::NamedValue> args,
                       std::vector<torch::jit::NamedValue> kwargs = {}) {
    JitValue* out = graph_.insert(op, args, kwargs);
    out->node()->copyMetadata(like_);
    return out;
  }

 private:
  torch::jit::Graph& graph_;
  Node* like_;
};


std::optional<int64_t> constantInt(const JitValue* v) {
  std::optional<c10::IValue> c = torch::jit::toIValue(v);
  if (!c || !c->isInt()) return std::nullopt;
  return c->toInt();
}

bool isNoneConstant(const JitValue* v) {
  std::optional<c10::IValue> c = torch::jit::toIValue(v);
  return c && c->isNone();
}

// cross_entropy(scores[mask], targets[mask]) -> cross_entropy over all rows, targets where
// the mask is off at ignore_index.
bool rewriteClassLoss(torch::jit::Graph& graph, Node* loss) {
  JitValue *scores = nullptr, *targets = nullptr;
  JitValue* mask = boolMaskOf(loss->input(0), &scores);
  if (mask == nullptr || boolMaskOf(loss->input(1), &targets) != mask) return false;
  // a mean or a sum (reduction "none" keeps one value per selected token), a constant
  // ignore_index
  const std::optional<int64_t> reduction = constantInt(loss->input(3));
  if (!reduction || (*reduction != 1 && *reduction != 2) || !constantInt(loss->input(4)) ||
      !masksLeadingDimensions(mask, scores, targets)) {
    return false;
  }
  Node* scores_index = loss->input(0)->node();
  Node* targets_index = loss->input(1)->node();
  const int64_t k = static_cast<int64_t>(sizesOf(mask)->size());
  torch::jit::WithInsertPoint here(loss);
  Inserter insert(graph, loss);
  JitValue* kept = insert(c10::aten::where, {mask, targets, loss->input(4)});
  if (k > 1) {
    scores = insert(c10::aten::flatten, {scores, int64_t{0}, k - 1});
    kept = insert(c10::aten::flatten, {kept, int64_t{0}, int64_t{-1}});
  }
  loss->replaceInput(0, scores);
  loss->replaceInput(1, kept);
  dropUnused(withIndices(scores_index));
  dropUnused(withIndices(targets_index));
  return true;
}

// Elementwise losses -> (position of reduction, positions that must be None).
struct ElementwiseLoss {
  size_t reduction;
  std::vector<size_t> none;
};
const std::unordered_map<std::string, ElementwiseLoss>& elementwiseLosses() {
  static const std::unordered_map<std::string, ElementwiseLoss> table = {
      {"aten::mse_loss", {2, {}}}, {"aten::l1_loss", {2, {}}}, {"aten::smooth_l1_loss", {2, {}}},
      {"aten::huber_loss", {2, {}}}, {"aten::binary_cross_entropy", {3, {2}}},
      {"aten::binary_cross_entropy_with_logits", {4, {2, 3}}},
  };
  return table;
}

// `value` (a mean or sum over the elements `mask` selects) as where(mask, each, 0).sum(),
// over mask.sum() for a mean: a sum over the batch over a count of its rows.
// `each` is what is summed: `value` itself (a loss made per element in its place) or not.
void replaceBySelectedSum(torch::jit::Graph& graph, Node* at, JitValue* value, JitValue* each,
                          JitValue* mask, bool mean) {
  torch::jit::WithInsertPoint here(at->next());
  Inserter insert(graph, at);
  JitValue* sum = insert(c10::aten::sum, {insert(c10::aten::where, {mask, each, 0.0})});
  JitValue* out = mean ? insert(c10::aten::div, {sum, insert(c10::aten::sum, {mask})}) : sum;
  // readers after it; the inserted nodes still read `value` where it is `each`
  value->replaceAllUsesAfterNodeWith(out->node(), out);
}

// mse_loss(p[mask], t[mask]) and the like, mask as large as p and t -> their elements'
// loss (reduction "none") summed where the mask is on, over mask.sum() for a mean.
bool rewriteElementwiseLoss(torch::jit::Graph& graph, Node* loss, const ElementwiseLoss& form) {
  if (loss->inputs().size() <= form.reduction || loss->outputs().size() != 1) return false;
  JitValue *selected_predicted = loss->input(0), *selected_targets = loss->input(1);
  std::vector<Node*> dead;
  unbroadcast(selected_predicted, selected_targets, dead);
  JitValue *predicted = nullptr, *targets = nullptr;
  JitValue* mask = boolMaskOf(selected_predicted, &predicted);
  if (mask == nullptr || boolMaskOf(selected_targets, &targets) != mask) return false;
  const std::optional<int64_t> reduction = constantInt(loss->input(form.reduction));
  if (!reduction || (*reduction != 1 && *reduction != 2)) return false;
  for (size_t i : form.none) {
    if (!isNoneConstant(loss->input(i))) return false;
  }
  if (!sameSizes(mask, predicted) || !sameSizes(mask, targets)) return false;
  for (Node* index : {selected_predicted->node(), selected_targets->node()}) {
    for (Node* n : withIndices(index)) dead.push_back(n);
  }
  {
    torch::jit::WithInsertPoint here(loss);
    loss->replaceInput(form.reduction, graph.insertConstant(int64_t{0}));
  }
  loss->output()->setType(c10::TensorType::get());  // no longer the traced 0-dim value
  loss->replaceInput(0, predicted);
  loss->replaceInput(1, targets);
  replaceBySelectedSum(graph, loss, loss->output(), loss->output(), mask, *reduction == 1);
  dropUnused(dead);
  return true;
}

// x[mask].mean() with the mask as large as x -> where(mask, x, 0).sum() / mask.sum().
bool rewriteSelectedMean(torch::jit::Graph& graph, Node* mean) {
  if (mean->inputs().size() != 2 || !isNoneConstant(mean->input(1))) return false;  // (self, dtype)
  JitValue* x = nullptr;
  JitValue* mask = boolMaskOf(mean->input(0), &x);
  if (mask == nullptr || !sameSizes(mask, x)) return false;
  Node* index = mean->input(0)->node();
  replaceBySelectedSum(graph, mean, mean->output(), x, mask, /*mean=*/true);
  mean->destroy();
  dropUnused(withIndices(index));
  return true;
}

// target_lengths as `mask.sum(-1)` (or over dimension 1 of a 2-D mask) makes them, through casts.
bool countsEachRow(const JitValue* lengths, const JitValue* mask) {
  const Node* n = lengths->node();
  while (n->kind() == c10::aten::to && n->inputs().size() >= 2) n = n->input(0)->node();
  if (n->kind() != c10::aten::sum || n->inputs().size() != 4 || n->input(0) != mask) return false;
  const Node* dims = n->input(1)->node();  // a list of one constant
  std::optional<c10::IValue> keepdim = torch::jit::toIValue(n->input(2));
  if (dims->kind() != c10::prim::ListConstruct || dims->inputs().size() != 1 || !keepdim ||
      !keepdim->isBool() || keepdim->toBool()) {
    return false;
  }
  const std::optional<int64_t> dim = constantInt(dims->input(0));
  return dim == -1 || dim == 1;
}

// ctc_loss(log_probs, labels.masked_select(mask), input_lengths, mask.sum(-1)) -> ctc_loss
// over labels (N, S) with each row's selected labels moved to its front, in order (a stable
// sort of the mask): the padded form of the same targets.
bool rewriteMaskedCtc(torch::jit::Graph& graph, Node* loss) {
  if (loss->inputs().size() != 7 || loss->outputs().size() != 1) return false;
  Node* select = loss->input(1)->node();
  if (select->kind() != c10::aten::masked_select || select->inputs().size() != 2) return false;
  JitValue* labels = select->input(0);
  JitValue* mask = select->input(1);
  auto mask_type = mask->type()->cast<c10::TensorType>();
  auto labels_type = labels->type()->cast<c10::TensorType>();
  if (!mask_type || mask_type->scalarType() != at::kBool || !labels_type || !labels_type->scalarType() ||
      !c10::isIntegralType(*labels_type->scalarType(), /*includeBool=*/false)) {
    return false;
  }
  const std::optional<std::vector<int64_t>> sizes = sizesOf(mask);
  if (!sizes || sizes->size() != 2 || !sameSizes(mask, labels) || !countsEachRow(loss->input(3), mask)) return false;
  torch::jit::WithInsertPoint here(loss);
  Inserter insert(graph, loss);
  JitValue* order = insert(c10::aten::argsort, {mask},
                           {{"stable", true}, {"dim", int64_t{-1}}, {"descending", true}});
  loss->replaceInput(1, insert(c10::aten::gather, {labels, int64_t{-1}, order}));
  dropUnused({select});
  return true;
}

}  // namespace

int rewriteMaskedLosses(torch::jit::Graph& graph) {
  std::vector<Node*> nodes;
  for (Node* n : graph.nodes()) nodes.push_back(n);
  int rewritten = 0;
  for (Node* n : nodes) {
    const auto k = n->kind();
    if (k == c10::aten::cross_entropy_loss || k == c10::aten::nll_loss || k == c10::aten::nll_loss_nd) {
      rewritten += n->inputs().size() >= 5 && rewriteClassLoss(graph, n);
    } else if (k == c10::aten::ctc_loss) {
      rewritten += rewriteMaskedCtc(graph, n);
    } else if (k == c10::aten::mean) {
      rewritten += rewriteSelectedMean(graph, n);
    } else if (auto it = elementwiseLosses().find(k.toQualString()); it != elementwiseLosses().end()) {
      rewritten += rewriteElementwiseLoss(graph, n, it->second);
    }
  }
  return rewritten;
}

}  // namespace rannc::frontend
