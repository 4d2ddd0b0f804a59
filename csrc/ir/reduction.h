#pragma once
// How a scalar output reduces over the batch: a mean (the loss of one process does not grow
// with the batch) or a sum (it does: reduction="sum", x.sum(), a sum divided by a count the
// caller passes in, as transformers' num_items_in_batch). The runtime combines the
// micro-batches' and replicas' values of a mean weighted by their rows and those of a sum
// added up (DESIGN.md §1; option loss_reduction). Plain C++ over the IR.
#include <string_view>

#include "ir/graph.h"

namespace rannc::ir {

enum class BatchReduction { Mean, Sum, Unknown };

std::string_view batchReductionName(BatchReduction r);  // "mean", "sum", "unknown"

// Follows `value` back through scalar arithmetic (+, -, * and / by what does not depend on
// the batch, casts, views) to the ops that reduce a batch tensor to it: aten::mean and the
// loss ops with reduction "mean" are means; aten::sum and the loss ops with reduction
// "sum" are sums, and a sum divided by the batch size is a mean. Unknown where the terms
// disagree or an op is none of these (a value that does not depend on the batch: Unknown).
BatchReduction batchReduction(const Graph& g, ValueId value);

}  // namespace rannc::ir
