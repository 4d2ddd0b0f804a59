#pragma once
// Executes the tasks of a traced model, one TorchScript operator at a time, under the
// caller's autograd mode: with inputs that require grad, autograd records exactly the ops
// that eager PyTorch would run, so outputs and gradients match the original module.
#include <functional>
#include <vector>

#include "frontend/traced_model.h"
#include "ir/subgraph.h"

namespace rannc::frontend {

// Called with each value as it becomes available (inputs first, then task outputs).
using ValueObserver = std::function<void(ir::ValueId, const c10::IValue&)>;

// Runs the whole graph; `inputs` follow graph.inputs(). Returns graph.outputs().
std::vector<c10::IValue> runGraph(const TracedModel& model, const std::vector<c10::IValue>& inputs,
                                  const ValueObserver& observe = nullptr);

// Runs one piece on its own: `inputs` follow piece.inputs() except constants, which the
// model supplies (pass them or leave them out: see runPieceInputs). Returns piece.outputs.
std::vector<c10::IValue> runPiece(const TracedModel& model, const ir::Subgraph& piece,
                                  const std::vector<c10::IValue>& inputs);

// The non-constant inputs of a piece, the ones a caller must provide, in order.
std::vector<ir::ValueId> runPieceInputs(const TracedModel& model, const ir::Subgraph& piece);

// Runs one task over `env` (indexed by value id; constants come from the model): reads
// its inputs there and writes its outputs there. Throws rannc::Error naming the op.
void runTask(const TracedModel& model, ir::TaskId task, std::vector<c10::IValue>& env);

// Whether the task's operator writes into one of its arguments (aten::add_; its schema
// says so). Running such a task twice on the same inputs does not compute the same thing.
bool writesInputs(const TracedModel& model, ir::TaskId task);

// Chains pieces that cover the graph, in order: each piece sees only the values that cross
// its boundary. Gives the graph outputs; equal to runGraph for any convex split.
std::vector<c10::IValue> runChained(const TracedModel& model,
                                    const std::vector<ir::Subgraph>& pieces,
                                    const std::vector<c10::IValue>& inputs);

}  // namespace rannc::frontend
