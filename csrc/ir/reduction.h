#pragma once
// How a scalar output reduces over the batch: a mean (the loss of one process does not grow
// with the batch) or a sum (it does: reduction="sum", x.sum(), a sum divided by a count the
// caller passes in, as transformers' num_items_in_batch). The runtime combines the
// micro-batches' and replicas' values of a mean weighted by their rows and those of a sum
// added up (DESIGN.md §1; option loss_reduction). Plain C++ over the IR.
#include <optional>
#include <string_view>
#include <vector>

#include "ir/graph.h"

namespace rannc::ir {

enum class BatchReduction { Mean, Sum, Unknown };

std::string_view batchReductionName(BatchReduction r);  // "mean", "sum", "unknown"

// Follows `value` back through scalar arithmetic (+, -, * and / by what does not depend on
// the batch, casts, views) to the ops that reduce a batch tensor to it: aten::mean and the
// loss ops with reduction "mean" are means; aten::sum and the loss ops with reduction
// "sum" are sums, and a sum divided by the batch size or by a count over the batch
// (batchCount) is a mean. Unknown where the terms disagree or an op is none of these (a
// value that does not depend on the batch: Unknown).
BatchReduction batchReduction(const Graph& g, ValueId value);

// A term of a scalar output: a value that + or - adds to it, through casts and products
// with what does not depend on the rows, that is not itself such a sum.
// `loss_sum / num_items + coef * aux_mean + 1e-4 * weights.pow(2).sum()` has three.
struct OutputTerm {
  TaskId task = kNoId;  // the + or - that adds it (kNoId: the output is one term)
  size_t input = 0;     // its position among that task's inputs
  BatchReduction reduction = BatchReduction::Unknown;  // of the term (batchReduction)
  bool fixed = false;  // the same for any rows: a penalty on parameters, a constant
};
std::vector<OutputTerm> outputTerms(const Graph& g, ValueId output);

// How a scalar output combines over shares by default (option loss_reduction "auto"): as a
// sum where a term is a sum over the batch, else as a mean where a term is a mean (terms of
// no known kind are then weighted by rows, as a mean's), Unknown where no term is either.
// The runtime scales the terms that differ ([Note: mixed terms] in
// csrc/frontend/token_means.h).
BatchReduction outputReduction(const std::vector<OutputTerm>& terms);

// A scalar that counts over the batch's rows, as the denominator of a mean written by hand
// (`(loss * mask).sum() / mask.sum().clamp(min=1)`, `/ (labels != -100).sum()`,
// `/ (mask.sum() * channels)`): aten::sum or aten::count_nonzero of a batch tensor down to
// a scalar, through casts, products with numbers the same for any rows (a constant, a size
// of another dimension) and at most one clamp from below by a constant. Over the global
// batch it is outer * max(inner * (the sum of the shares' counts), clamp_min).
struct BatchCount {
  ValueId counted = kNoId;  // the batch tensor summed (or whose nonzeros are counted)
  bool nonzero = false;     // count_nonzero: its nonzero elements, not its sum
  std::optional<double> clamp_min;
  double inner = 1.0;  // the factors applied before the clamp
  double outer = 1.0;  // and after it
};
std::optional<BatchCount> batchCount(const Graph& g, ValueId value);

// Whether `task` makes a value as large as the data selects: nonzero, argwhere,
// masked_select, unique, or x[mask] with a boolean (or byte) mask ([Note: data-sized
// values] in csrc/frontend/convert.cpp).
bool selectsByData(const Graph& g, const Task& task);

// Whether operator `op` (or a glued task's "+"-joined ops) draws random numbers: rand*,
// bernoulli, dropout, multinomial, normal, poisson, uniform_ and the other in-place draws.
bool drawsAtRandom(std::string_view op);

// Whether each use of scalar `value` reaches the graph's outputs only through scalar +, -,
// casts, and * or / by values that do not depend on the rows, so that an output combined
// over shares weighs `value`'s shares as it weighs the output's (a loss term: yes; a
// normaliser of activations: no).
bool reachesOutputsLinearly(const Graph& g, ValueId value);

}  // namespace rannc::ir
