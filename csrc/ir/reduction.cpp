#include "ir/reduction.h"

#include <algorithm>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace rannc::ir {
namespace {

// Loss ops -> the position of their `reduction` argument (0 none, 1 mean, 2 sum).
const std::unordered_map<std::string, size_t>& lossReductionArgument() {
  static const std::unordered_map<std::string, size_t> table = {
      {"aten::cross_entropy_loss", 3}, {"aten::nll_loss", 3}, {"aten::nll_loss_nd", 3},
      {"aten::nll_loss2d", 3}, {"aten::mse_loss", 2}, {"aten::l1_loss", 2},
      {"aten::smooth_l1_loss", 2}, {"aten::huber_loss", 2}, {"aten::kl_div", 2},
      {"aten::soft_margin_loss", 2}, {"aten::multilabel_margin_loss", 2},
      {"aten::binary_cross_entropy", 3}, {"aten::hinge_embedding_loss", 3},
      {"aten::binary_cross_entropy_with_logits", 4}, {"aten::margin_ranking_loss", 4},
      {"aten::cosine_embedding_loss", 4}, {"aten::poisson_nll_loss", 5},
      {"aten::multi_margin_loss", 5}, {"aten::triplet_margin_loss", 7},
      {"aten::ctc_loss", 5},  // "mean": over the rows of each row's loss per target
  };
  return table;
}

bool passesThrough(const std::string& op) {
  for (const char* p : {"aten::neg", "aten::to", "aten::type_as", "aten::clone", "aten::contiguous",
                        "aten::view", "aten::reshape", "aten::squeeze", "aten::unsqueeze",
                        "aten::flatten", "aten::float", "aten::double", "aten::detach"}) {
    if (op == p) return true;
  }
  return false;
}

// A size that is k * the batch size (aten::size(x, 0), its tensor form).
bool isBatchSize(const Value& v) {
  return v.int_batch_multiples.size() == 1 && v.int_batch_multiples[0] != 0;
}

bool isScalarTensor(const Value& v) { return v.isOneElementTensor() && !v.isBatch(); }

// A number that is the same for any rows: a constant, or a size of another dimension than
// the batch's (the trace's NumToTensor of x.size(1) too); nullopt otherwise.
std::optional<double> fixedNumber(const Value& v) {
  if (v.isConstant() && (v.kind == ValueKind::Int || v.kind == ValueKind::Float)) {
    try {
      return std::stod(v.constant);
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  if (!v.batch_dependent && v.int_values.size() == 1 && v.int_batch_multiples.size() == 1 &&
      v.int_batch_multiples[0] == 0 && !v.isBatch()) {
    return static_cast<double>(v.int_values[0]);
  }
  return std::nullopt;
}

BatchReduction combine(BatchReduction a, BatchReduction b) { return a == b ? a : BatchReduction::Unknown; }

class Classifier {
 public:
  explicit Classifier(const Graph& g) : g_(g) {}

  BatchReduction of(ValueId id, int depth = 0) {
    const Value& v = g_.value(id);
    if (!fromRows(id) || v.isBatch() || v.producer == kNoId || depth > 64) return BatchReduction::Unknown;
    const Task& t = g_.task(v.producer);
    std::vector<ValueId> batch_inputs;  // the inputs computed from the batch's rows
    for (ValueId in : t.inputs) {
      if (fromRows(in)) batch_inputs.push_back(in);
    }
    if (batch_inputs.empty()) return BatchReduction::Unknown;
    const bool reduces_a_batch_tensor = g_.value(t.inputs[0]).isBatch();
    auto loss = lossReductionArgument().find(t.op);
    if (loss != lossReductionArgument().end()) {
      // over a value without rows (sets' rows pooled into one row per set by an index,
      // a mean of the rows): a function of a statistic, no mean of the rows' terms (a
      // DeepSets classifier read as a mean: micro-batches each pooled part of a set)
      if (!reduces_a_batch_tensor || t.inputs.size() <= loss->second) return BatchReduction::Unknown;
      const Value& r = g_.value(t.inputs[loss->second]);
      if (!r.isConstant()) return BatchReduction::Unknown;
      return r.constant == "1" ? BatchReduction::Mean
             : r.constant == "2" ? BatchReduction::Sum : BatchReduction::Unknown;
    }
    if (reduces_a_batch_tensor && t.op == "aten::mean") return BatchReduction::Mean;
    if (reduces_a_batch_tensor && t.op == "aten::sum") return BatchReduction::Sum;
    // torch.dot(per_row, weights): the sum of the rows' products (a weighted loss written so
    // read as a term of no known kind: each replica then divided by its own weights)
    if (t.op == "aten::dot" && t.inputs.size() == 2 && g_.value(t.inputs[0]).isBatch() &&
        g_.value(t.inputs[1]).isBatch()) {
      return BatchReduction::Sum;
    }
    // x.t() @ y of two batch tensors into a value without rows (a confusion count made from
    // one-hot rows): the batch is the contracted dimension, so a sum over the rows
    if ((t.op == "aten::mm" || t.op == "aten::matmul") && t.inputs.size() == 2 &&
        g_.value(t.inputs[0]).isBatch() && g_.value(t.inputs[1]).isBatch() && !v.isBatch()) {
      return BatchReduction::Sum;
    }
    if (t.op == "aten::add" || t.op == "aten::sub") {
      BatchReduction r = of(batch_inputs[0], depth + 1);
      for (size_t i = 1; i < batch_inputs.size(); ++i) r = combine(r, of(batch_inputs[i], depth + 1));
      return r;
    }
    if (t.op == "aten::mul") {
      return batch_inputs.size() == 1 ? of(batch_inputs[0], depth + 1) : BatchReduction::Unknown;
    }
    if (t.op == "aten::div" && t.inputs.size() >= 2) {
      const Value& num = g_.value(t.inputs[0]);
      const Value& den = g_.value(t.inputs[1]);
      if (!fromRows(num.id)) return BatchReduction::Unknown;
      if (!fromRows(den.id)) return of(num.id, depth + 1);
      // a sum over the batch divided by its size, or by a count over its rows, is a mean
      const bool counts_rows = isBatchSize(den) || batchCount(g_, den.id).has_value();
      return counts_rows && of(num.id, depth + 1) == BatchReduction::Sum ? BatchReduction::Mean
                                                                        : BatchReduction::Unknown;
    }
    if (passesThrough(t.op) && fromRows(t.inputs[0])) return of(t.inputs[0], depth + 1);
    return BatchReduction::Unknown;
  }

  // See outputTerms: the terms of `id`, which `consumer`'s input `input` reads.
  void terms(ValueId id, TaskId consumer, size_t input, std::vector<OutputTerm>& out, int depth = 0) {
    const Value& v = g_.value(id);
    if (!fromRows(id)) {
      out.push_back({consumer, input, BatchReduction::Unknown, /*fixed=*/true});
      return;
    }
    if (v.producer != kNoId && depth < 64 && isScalarTensor(v)) {
      const Task& t = g_.task(v.producer);
      if ((t.op == "aten::add" || t.op == "aten::sub") && t.inputs.size() >= 2) {
        for (size_t i = 0; i < 2; ++i) terms(t.inputs[i], t.id, i, out, depth + 1);
        return;
      }
      // the one operand that depends on the rows, as a term scaled by the others
      std::optional<size_t> linear;
      if (passesThrough(t.op) && !t.inputs.empty()) linear = 0;
      if (t.op == "aten::mul" && t.inputs.size() == 2 && fromRows(t.inputs[0]) != fromRows(t.inputs[1])) {
        linear = fromRows(t.inputs[0]) ? 0 : 1;
      }
      if (t.op == "aten::div" && t.inputs.size() == 2 && !fromRows(t.inputs[1])) linear = 0;
      if (linear) {
        terms(t.inputs[*linear], consumer, input, out, depth + 1);
        return;
      }
    }
    out.push_back({consumer, input, of(id), /*fixed=*/false});
  }

  // See reachesOutputsLinearly.
  bool linearToOutputs(ValueId id) {
    std::unordered_set<ValueId> seen{id};
    std::vector<ValueId> todo{id};
    while (!todo.empty()) {
      const Value& v = g_.value(todo.back());
      todo.pop_back();
      for (TaskId c : v.consumers) {
        const Task& t = g_.task(c);
        if (t.outputs.size() != 1 || !isScalarTensor(g_.value(t.outputs[0]))) return false;
        bool linear = t.op == "aten::add" || t.op == "aten::sub" || (passesThrough(t.op) && t.inputs[0] == v.id);
        if (t.op == "aten::mul" || (t.op == "aten::div" && t.inputs[0] == v.id)) {
          // by what does not depend on the rows (v * v is not linear)
          linear = std::count(t.inputs.begin(), t.inputs.end(), v.id) == 1;
          for (ValueId in : t.inputs) linear = linear && (in == v.id || !fromRows(in));
        }
        if (!linear) return false;
        if (seen.insert(t.outputs[0]).second) todo.push_back(t.outputs[0]);
      }
    }
    return true;
  }

 private:
  // Computed from a batch tensor (a value the same for any rows, such as an argument
  // without a batch dimension, a count passed in, or a constant, is not; nor is a size
  // that is not the batch's: fairseq's label smoothing weighs its terms by
  // eps / (lprobs.size(-1) - 1), which made its loss a term of no known kind).
  bool fromRows(ValueId id) {
    if (from_rows_.empty()) {  // once, along a topological order (no recursion over the model)
      from_rows_.resize(g_.numValues());
      for (const Value& v : g_.values()) from_rows_[v.id] = v.isBatch();
      for (TaskId t : g_.topologicalOrder()) {
        bool any = false;
        for (ValueId in : g_.task(t).inputs) any = any || from_rows_[in];
        for (ValueId out : g_.task(t).outputs) {
          from_rows_[out] = from_rows_[out] || (any && !aSizeOfOtherDimensions(g_.value(out)));
        }
      }
    }
    return from_rows_[id];
  }

  // A number the trace found the same at both batch sizes, no multiple of the batch: a size
  // or a shape of dimensions other than the batch's ([Note: batch values]).
  static bool aSizeOfOtherDimensions(const Value& v) {
    if (v.isTensor() || v.batch_dependent || v.int_values.empty()) return false;
    return std::all_of(v.int_batch_multiples.begin(), v.int_batch_multiples.end(),
                       [](int64_t k) { return k == 0; });
  }

 private:
  const Graph& g_;
  std::vector<char> from_rows_;
};

}  // namespace

std::string_view batchReductionName(BatchReduction r) {
  switch (r) {
    case BatchReduction::Mean: return "mean";
    case BatchReduction::Sum: return "sum";
    case BatchReduction::Unknown: break;
  }
  return "unknown";
}

BatchReduction batchReduction(const Graph& g, ValueId value) {
  Classifier c(g);
  return c.of(value);
}

std::optional<BatchCount> batchCount(const Graph& g, ValueId value) {
  BatchCount count;
  for (int depth = 0; depth < 16; ++depth) {
    const Value& v = g.value(value);
    if (!isScalarTensor(v) || v.producer == kNoId) return std::nullopt;
    const Task& t = g.task(v.producer);
    if (t.inputs.empty()) return std::nullopt;
    const Value& in = g.value(t.inputs[0]);
    if (t.op == "aten::sum" || t.op == "aten::count_nonzero") {
      if (!in.isBatch()) return std::nullopt;
      count.counted = in.id;
      count.nonzero = t.op == "aten::count_nonzero";
      return count;
    }
    const bool clamp = t.op == "aten::clamp" || t.op == "aten::clamp_min";
    if (t.op == "aten::mul" && t.inputs.size() == 2) {  // by a number the same for any rows
      const std::optional<double> k0 = fixedNumber(g.value(t.inputs[0]));
      const std::optional<double> k1 = fixedNumber(g.value(t.inputs[1]));
      if (k0.has_value() == k1.has_value()) return std::nullopt;
      (count.clamp_min ? count.inner : count.outer) *= k0 ? *k0 : *k1;
      value = k0 ? t.inputs[1] : t.inputs[0];
      continue;
    }
    if (clamp) {
      // clamp(self, min, max=None) or clamp_min(self, min), min a constant number, once
      if (count.clamp_min || t.inputs.size() < 2) return std::nullopt;
      const Value& min = g.value(t.inputs[1]);
      if (!min.isConstant() || (min.kind != ValueKind::Int && min.kind != ValueKind::Float)) return std::nullopt;
      if (t.op == "aten::clamp" && (t.inputs.size() != 3 || g.value(t.inputs[2]).kind != ValueKind::None)) {
        return std::nullopt;
      }
      try {
        count.clamp_min = std::stod(min.constant);
      } catch (const std::exception&) {
        return std::nullopt;
      }
    } else if (!passesThrough(t.op) || t.op == "aten::neg") {
      return std::nullopt;
    }
    value = in.id;
  }
  return std::nullopt;
}

std::vector<OutputTerm> outputTerms(const Graph& g, ValueId output) {
  Classifier c(g);
  std::vector<OutputTerm> out;
  c.terms(output, kNoId, 0, out);
  return out;
}

BatchReduction outputReduction(const std::vector<OutputTerm>& terms) {
  bool sum = false, mean = false;
  for (const OutputTerm& t : terms) {
    if (t.fixed) continue;
    sum = sum || t.reduction == BatchReduction::Sum;
    mean = mean || t.reduction == BatchReduction::Mean;
  }
  if (sum) return BatchReduction::Sum;
  return mean ? BatchReduction::Mean : BatchReduction::Unknown;
}

bool drawsAtRandom(std::string_view op) {
  for (const char* word : {"rand", "bernoulli", "dropout", "multinomial", "normal", "poisson",
                           "uniform", "exponential", "geometric", "cauchy"}) {
    if (op.find(word) != std::string_view::npos) return true;
  }
  return false;
}

bool selectsByData(const Graph& g, const Task& task) {
  for (const char* op : {"aten::nonzero", "aten::argwhere", "aten::masked_select", "aten::_unique2",
                         "aten::unique_dim", "aten::unique_consecutive", "aten::nonzero_numpy"}) {
    if (task.runs(op)) return true;
  }
  if (!task.runs("aten::index")) return false;
  // indexed by a boolean (or byte) mask: the mask, or its list (the task may hold the
  // list's construction, and its inputs are then in no fixed order)
  auto isMask = [&](ValueId v) {
    const DType d = g.value(v).dtype;
    return g.value(v).isTensor() && (d == DType::Bool || d == DType::UInt8);
  };
  // The list built in the task: its items and the tensor indexed are all inputs. A boolean
  // tensor indexed by integers (transformers' padding_mask[batch_idx, kv_idx], which glued
  // every layer of a Llama given an attention_mask into one task) selects nothing by the
  // data: where the output is boolean, one boolean input is what is indexed.
  if (task.op == "prim::ListConstruct+aten::index" && !task.outputs.empty()) {
    const int masks = static_cast<int>(std::count_if(task.inputs.begin(), task.inputs.end(), isMask));
    return masks >= (isMask(task.outputs[0]) ? 2 : 1);
  }
  for (ValueId id : task.inputs) {
    const Value& in = g.value(id);
    if (isMask(id)) return true;
    if (in.kind == ValueKind::TensorList && in.producer != kNoId) {
      const std::vector<ValueId>& items = g.task(in.producer).inputs;
      if (std::any_of(items.begin(), items.end(), isMask)) return true;
    }
  }
  return false;
}

bool reachesOutputsLinearly(const Graph& g, ValueId value) {
  Classifier c(g);
  return c.linearToOutputs(value);
}

}  // namespace rannc::ir
