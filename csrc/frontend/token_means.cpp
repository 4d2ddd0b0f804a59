#include "frontend/token_means.h"

#include <algorithm>
#include <set>

#include <ATen/core/Reduction.h>

#include "common/error.h"
#include "frontend/dtypes.h"
#include "frontend/interpreter.h"

namespace rannc::frontend {
namespace {

// Argument positions shared by cross_entropy_loss and the nll_loss family:
// (self, target, weight, reduction, ignore_index[, label_smoothing]).
constexpr size_t kSelf = 0, kTarget = 1, kWeight = 2, kReduction = 3, kIgnoreIndex = 4;

size_t argumentCount(const std::string& op) {
  if (op == "aten::cross_entropy_loss") return 6;
  if (op == "aten::nll_loss" || op == "aten::nll_loss_nd" || op == "aten::nll_loss2d") return 5;
  return 0;
}

thread_local double share_rows = 0.0;

// The share's sum over (global count * the share's rows / global rows) when the scale is on
// and the engine names the share ([Note: token-mean losses]), else the op as traced.
torch::jit::Operation shareScaled(torch::jit::Operation op, size_t nargs,
                                  std::shared_ptr<const ShareScale> scale) {
  return torch::jit::Operation([op = std::move(op), nargs, scale](torch::jit::Stack& stack) mutable {
    const double rows = ShareRows::current();
    if (!scale->on || rows <= 0.0) {
      op(stack);
      return;
    }
    const size_t base = stack.size() - nargs;
    at::Tensor weight = stack[base + kWeight].isTensor() ? stack[base + kWeight].toTensor() : at::Tensor();
    // a sum over many tokens overflows float16 where their mean does not
    const bool half = stack[base + kSelf].toTensor().scalar_type() == at::kHalf;
    if (half) stack[base + kSelf] = stack[base + kSelf].toTensor().to(at::kFloat);
    stack[base + kReduction] = c10::IValue(static_cast<int64_t>(at::Reduction::Sum));
    op(stack);
    at::Tensor share = stack.back().toTensor() / rows;
    if (scale->global_class_counts.defined()) {  // the global count is the kept targets' weights
      at::Tensor counts = scale->global_class_counts.to(weight.device());  // there already
      share = share / (weight.detach().to(at::kDouble) * counts).sum().to(share.scalar_type());
    } else {
      share = share / scale->global_count;
    }
    stack.back() = half ? share.to(at::kHalf) : share;
  });
}

// The numerator over (global count * the share's rows / global rows), as shareScaled.
torch::jit::Operation countedScaled(torch::jit::Operation op, std::shared_ptr<const ShareScale> scale) {
  return torch::jit::Operation([op = std::move(op), scale](torch::jit::Stack& stack) mutable {
    const double rows = ShareRows::current();
    if (!scale->on || rows <= 0.0) {
      op(stack);
      return;
    }
    const at::Tensor count = stack.back().toTensor();
    stack.pop_back();
    const at::Tensor sum = stack.back().toTensor();
    stack.back() = sum.to(at::result_type(sum, count)) / (scale->global_count * rows);
  });
}

// Scales input `input` by the share's rows to the power `power` points to ([Note: mixed terms]).
torch::jit::Operation termScaled(torch::jit::Operation op, size_t nargs, size_t input,
                                 std::shared_ptr<const int> power) {
  return torch::jit::Operation([op = std::move(op), nargs, input, power](torch::jit::Stack& stack) mutable {
    const double rows = ShareRows::current();
    if (*power != 0 && rows > 0.0 && rows < 1.0) {
      const double factor = *power > 0 ? rows : 1.0 / rows;
      c10::IValue& term = stack[stack.size() - nargs + input];
      if (term.isTensor()) {
        term = term.toTensor() * factor;
      } else if (term.isDouble() || term.isInt()) {
        term = c10::IValue(term.toScalar().toDouble() * factor);
      }
    }
    op(stack);
  });
}

// [Note: shapes read by counts] A count written over a tensor's shape
// (`(se * mask).sum() / mask.expand_as(se).sum()`, `(mask * torch.ones_like(se)).sum()`:
// an inpainting loss over the masked pixels of every channel) reads only the shape of what
// the model computed, not its value. The count's program (run on each rank's arguments
// before the step) takes a stand-in of that shape instead: before, the count depended on
// the model's parameters through it, and the loss was weighted by rows (3.1% off).
bool readsShapeOnly(const std::string& op, size_t input) {
  if (input == 1) return op == "aten::expand_as" || op == "aten::view_as" || op == "aten::reshape_as";
  return input == 0 && (op == "aten::ones_like" || op == "aten::zeros_like" || op == "aten::full_like" ||
                        op == "aten::empty_like" || op == "aten::size");
}

class Finder {
 public:
  explicit Finder(const TracedModel& model) : model_(model), g_(model.graph) {
    for (size_t i = 0; i < model.order.size(); ++i) position_[model.order[i]] = i;
  }

  TokenMeanLosses find() {
    TokenMeanLosses out;
    std::set<size_t> program;  // positions in model.order
    for (ir::TaskId t : model_.order) {
      const ir::Task& task = g_.task(t);
      const size_t nargs = argumentCount(task.op);
      if (nargs == 0 || task.inputs.size() != nargs || task.outputs.size() != 1) continue;
      const ir::Value& reduction = g_.value(task.inputs[kReduction]);
      if (!reduction.isConstant() || !model_.constants[reduction.id].isInt() ||
          model_.constants[reduction.id].toInt() != static_cast<int64_t>(at::Reduction::Mean)) {
        continue;
      }
      const ir::Value& target = g_.value(task.inputs[kTarget]);
      if (!target.isBatch() || target.dtype == ir::DType::Undefined ||
          !c10::isIntegralType(toScalarType(target.dtype), /*includeBool=*/false)) {
        continue;  // no count over the batch, or class probabilities as targets
      }
      TokenMeanLoss loss;
      loss.task = t;
      loss.target = target.id;
      std::vector<ir::TaskId> makes_target;
      std::string why = checkArguments(task, loss);
      if (why.empty()) why = usedAsATerm(task.outputs[0]);
      if (why.empty()) why = targetProgram(target.id, "target", makes_target);
      if (!why.empty()) {
        out.row_weighted.push_back(model_.describeTask(t) + ": " + why);
        continue;
      }
      for (ir::TaskId p : makes_target) program.insert(position_.at(p));
      loss.scale = std::make_shared<ShareScale>();
      model_.operations[t] = shareScaled(model_.operations[t], nargs, loss.scale);
      out.exact.push_back(std::move(loss));
    }
    for (ir::TaskId t : model_.order) {
      findCountedMean(t, out, program);
      findSelection(t, out);
    }
    for (size_t i : program) out.program.push_back(model_.order[i]);
    std::set<ir::ValueId> computed;
    for (ir::TaskId t : out.program) {
      for (ir::ValueId o : g_.task(t).outputs) computed.insert(o);
    }
    for (ir::ValueId v : shapes_read_) {
      if (!computed.count(v)) out.shapes_read.push_back(v);  // [Note: shapes read by counts]
    }
    findMixedTerms(out);
    return out;
  }

 private:
  // A scalar term of the outputs made inside one task from the elements a mask selects
  // ([Note: masked losses] could not read it as a mask): its count is the data's, and it
  // is weighted by rows; say so.
  void findSelection(ir::TaskId t, TokenMeanLosses& out) const {
    const ir::Task& task = g_.task(t);
    if (!ir::selectsByData(g_, task)) return;
    for (ir::ValueId v : task.outputs) {
      const ir::Value& value = g_.value(v);
      if (value.isTensor() && value.shape.empty() && value.batch_dependent && usedAsATerm(v).empty()) {
        out.row_weighted.push_back(model_.describeTask(t) + ": its value comes from the elements a "
                                   "boolean mask selects, as many as the data decides (a mean over "
                                   "them is exact written as ignore_index targets or as a sum over "
                                   "mask.sum(); a sum, with option loss_reduction=\"sum\")");
        return;
      }
    }
  }

  // The terms of scalar outputs that add terms of several kinds, their + and - wrapped to
  // scale them ([Note: mixed terms]); those whose reduction the graph does not show, logged
  // where the other terms tell how the output combines.
  void findMixedTerms(TokenMeanLosses& out) const {
    std::set<std::pair<ir::TaskId, size_t>> wrapped;  // an addition two outputs share: once
    for (size_t i = 0; i < g_.outputs().size(); ++i) {
      const ir::ValueId o = g_.outputs()[i];
      const ir::Value& v = g_.value(o);
      if (!v.isTensor() || !v.shape.empty() || !v.batch_dependent) continue;
      std::vector<ir::OutputTerm> terms = ir::outputTerms(g_, o);
      if (terms.size() < 2) continue;
      const bool known = ir::outputReduction(terms) != ir::BatchReduction::Unknown;
      for (const ir::OutputTerm& t : terms) {
        if (!wrapped.insert({t.task, t.input}).second) continue;
        LossTerm term{o, t, std::make_shared<int>(0)};
        const size_t nargs = g_.task(t.task).inputs.size();
        model_.operations[t.task] = termScaled(model_.operations[t.task], nargs, t.input, term.power);
        out.terms.push_back(std::move(term));
        if (known && !t.fixed && t.reduction == ir::BatchReduction::Unknown) {
          out.unknown_terms.push_back(describeTerm(model_, t) + " of output #" + std::to_string(i) +
                                      (v.name.empty() ? "" : " (" + v.name + ")"));
        }
      }
    }
  }

  // A division of a sum over the batch by a count over its rows, a loss term.
  void findCountedMean(ir::TaskId t, TokenMeanLosses& out, std::set<size_t>& program) const {
    const ir::Task& task = g_.task(t);
    if (task.op != "aten::div" || task.inputs.size() != 2 || task.outputs.size() != 1) return;
    const ir::Value& quotient = g_.value(task.outputs[0]);
    const ir::Value& sum = g_.value(task.inputs[0]);
    if (!quotient.isTensor() || !quotient.shape.empty() || !sum.isTensor() ||
        sum.dtype == ir::DType::Undefined || !at::isFloatingType(toScalarType(sum.dtype))) {
      return;
    }
    std::optional<ir::BatchCount> count = ir::batchCount(g_, task.inputs[1]);
    if (!count || ir::batchReduction(g_, sum.id) != ir::BatchReduction::Sum) return;
    TokenMeanLoss loss;
    loss.task = t;
    loss.target = count->counted;
    loss.count = count;
    std::vector<ir::TaskId> makes_count;
    std::string why = usedAsATerm(quotient.id);
    if (why.empty()) why = targetProgram(count->counted, "count", makes_count);
    if (!why.empty()) {
      out.row_weighted.push_back(model_.describeTask(t) + " (a sum over a count of the batch): " + why);
      return;
    }
    for (ir::TaskId p : makes_count) program.insert(position_.at(p));
    loss.scale = std::make_shared<ShareScale>();
    model_.operations[t] = countedScaled(model_.operations[t], loss.scale);
    out.exact.push_back(std::move(loss));
  }

  std::string usedAsATerm(ir::ValueId mean) const {
    return ir::reachesOutputsLinearly(g_, mean) ? "" : "its value is used otherwise than as a term of the outputs";
  }

  // Empty when ignore_index is a constant and the classes are known, else why not.
  std::string checkArguments(const ir::Task& task, TokenMeanLoss& loss) const {
    const ir::Value& ignore = g_.value(task.inputs[kIgnoreIndex]);
    if (!ignore.isConstant() || !model_.constants[ignore.id].isInt()) {
      return "its ignore_index is computed, not a constant";
    }
    loss.ignore_index = model_.constants[ignore.id].toInt();
    if (g_.value(task.inputs[kWeight]).kind == ir::ValueKind::None) return "";
    // the class dimension of the scores: (C), (N, C) or (N, C, d1, ...)
    const std::vector<int64_t>& scores = g_.value(task.inputs[kSelf]).shape;
    if (scores.empty()) return "the number of its classes is unknown";
    loss.classes = scores.size() == 1 ? scores[0] : scores[1];
    return "";
  }

  // The tasks that make `target` from the model's arguments, in order; a reason ("its
  // <noun> depends on ...") when it needs the model's state, a random draw or an in-place
  // write.
  std::string targetProgram(ir::ValueId target, const std::string& noun, std::vector<ir::TaskId>& program) const {
    std::set<size_t> found;
    std::set<ir::ValueId> shapes;  // [Note: shapes read by counts]
    std::vector<ir::ValueId> todo{target};
    std::set<ir::ValueId> seen{target};
    while (!todo.empty()) {
      const ir::Value& v = g_.value(todo.back());
      todo.pop_back();
      if (v.isModelState()) return "its " + noun + " depends on '" + v.name + "'";
      if (v.producer == ir::kNoId) continue;
      const ir::Task& task = g_.task(v.producer);
      if (ir::drawsAtRandom(task.op)) return "its " + noun + " is drawn at random (" + model_.describeTask(task.id) + ")";
      if (writesInputs(model_, task.id)) {
        return "its " + noun + " is written in place (" + model_.describeTask(task.id) + ")";
      }
      found.insert(position_.at(task.id));
      for (size_t i = 0; i < task.inputs.size(); ++i) {
        const ir::ValueId in = task.inputs[i];
        const ir::Value& read = g_.value(in);
        if (readsShapeOnly(task.op, i) && read.isTensor() && read.dtype != ir::DType::Undefined) {
          shapes.insert(in);
        } else if (seen.insert(in).second) {
          todo.push_back(in);
        }
      }
    }
    for (size_t i : found) program.push_back(model_.order[i]);
    shapes_read_.insert(shapes.begin(), shapes.end());
    return "";
  }

  const TracedModel& model_;
  const ir::Graph& g_;
  std::unordered_map<ir::TaskId, size_t> position_;
  mutable std::set<ir::ValueId> shapes_read_;
};

}  // namespace

ShareRows::ShareRows(double fraction) : previous_(share_rows) { share_rows = fraction; }
ShareRows::~ShareRows() { share_rows = previous_; }
double ShareRows::current() { return share_rows; }

const TokenMeanLosses& tokenMeanLosses(const TracedModel& model) {
  if (!model.token_means) model.token_means = std::make_shared<const TokenMeanLosses>(Finder(model).find());
  return *model.token_means;
}

std::string describeTerm(const TracedModel& model, const ir::OutputTerm& t) {
  const ir::Value& term = model.graph.value(model.graph.task(t.task).inputs[t.input]);
  const std::string made = term.producer == ir::kNoId ? "" : " (" + model.describeTask(term.producer) + ")";
  return "term '" + (term.name.empty() ? "%" + std::to_string(term.id) : term.name) + "'" + made;
}

void setTermPowers(const TokenMeanLosses& losses, const std::set<ir::ValueId>& summed_outputs) {
  for (const LossTerm& t : losses.terms) {
    const bool sum_term = !t.term.fixed && t.term.reduction == ir::BatchReduction::Sum;
    if (summed_outputs.count(t.output) > 0) {
      *t.power = sum_term ? 0 : 1;  // the shares add up: all but sums weighed by rows
    } else {
      *t.power = sum_term ? -1 : 0;  // weighted by rows: sums divided by them
    }
  }
}

at::Tensor localTargetCounts(const TracedModel& model, const TokenMeanLosses& losses,
                             const std::map<ir::ValueId, c10::IValue>& local) {
  at::NoGradGuard no_grad;
  std::vector<c10::IValue> env(model.graph.numValues());
  for (const auto& [id, value] : local) env[id] = value;
  if (!losses.shapes_read.empty()) {  // [Note: shapes read by counts]
    // the rank's rows and device, from its batch arguments
    int64_t rows = -1;
    c10::Device device = c10::kCPU;
    for (const auto& [id, value] : local) {
      const ir::Value& v = model.graph.value(id);
      if (!value.isTensor() || !v.isBatch()) continue;
      const at::Tensor& t = value.toTensor();
      rows = t.size(v.batch_dim) / std::max<int64_t>(v.batch_multiple, 1);
      device = t.device();
      break;
    }
    for (ir::ValueId id : losses.shapes_read) {
      if (!env[id].isNone()) continue;
      const ir::Value& v = model.graph.value(id);
      std::vector<int64_t> shape = v.shape;
      if (v.isBatch()) {
        RANNC_CHECK(rows >= 0, "no batch argument gives the rows of " << ir::describe(v));
        shape[v.batch_dim] = v.batch_multiple * rows;
      }
      env[id] = at::zeros({}, at::TensorOptions(toScalarType(v.dtype)).device(device)).expand(shape);
    }
  }
  for (ir::TaskId t : losses.program) runTask(model, t, env);
  std::vector<at::Tensor> counts;
  for (const TokenMeanLoss& loss : losses.exact) {
    RANNC_CHECK(env[loss.target].isTensor(), "the target of " << model.describeTask(loss.task) << " was not computed");
    const at::Tensor target = env[loss.target].toTensor();
    if (loss.count) {  // a counted mean's count, before its clamp
      const at::Tensor counted = loss.count->nonzero ? target.ne(0) : target;
      counts.push_back(counted.sum(at::kDouble).reshape({1}) * loss.count->inner);
      continue;
    }
    const at::Tensor kept = target.ne(loss.ignore_index);
    counts.push_back(kept.sum().to(at::kDouble).reshape({1}));
    if (loss.classes > 0) {
      // a target out of range fails in the op itself, naming it
      at::Tensor per_class = at::bincount(target.masked_select(kept).clamp(0, loss.classes - 1).flatten(),
                                          {}, loss.classes);
      counts.push_back(per_class.to(at::kDouble));
    }
  }
  return at::cat(counts).to(at::kCPU);  // one copy from a GPU
}

void setShareScales(const TokenMeanLosses& losses, const at::Tensor* global_counts,
                    c10::Device device) {
  int64_t pos = 0;
  for (const TokenMeanLoss& loss : losses.exact) {
    ShareScale& s = *loss.scale;
    s.on = global_counts != nullptr;
    if (!s.on) continue;
    auto c = global_counts->accessor<double, 1>();
    s.global_count = c[pos++];
    if (loss.count && loss.count->clamp_min) s.global_count = std::max(s.global_count, *loss.count->clamp_min);
    if (loss.count) s.global_count *= loss.count->outer;
    if (loss.classes > 0) {
      // once per step, not once per micro-batch
      s.global_class_counts = global_counts->narrow(0, pos, loss.classes).to(device, /*non_blocking=*/false, /*copy=*/true);
      pos += loss.classes;
    }
  }
}

}  // namespace rannc::frontend
