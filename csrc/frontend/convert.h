#pragma once
// TorchScript graph -> IR. The graph comes from torch.jit.trace of a function whose
// inputs are the flattened tensors of (parameters, buffers, args, kwargs), traced once at
// the example batch size B1 and once at B2 (python/rannc/_trace.py). Conversion checks
// that both traces are the same program, runs the graph at both sizes to record every
// value's dtype and shape, and finds the values that carry the batch dimension.
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "frontend/traced_model.h"

namespace rannc::frontend {

struct GraphInput {
  std::string name;
  ir::ValueRole role;  // Input, Param or Buffer
};

struct TraceExample {
  std::shared_ptr<torch::jit::Graph> graph;  // the trace at this batch size
  std::vector<at::Tensor> inputs;            // in graph input order; buffers are copies
  int64_t batch_size = 0;
  // Inputs to observe values at this batch size: the second example's are the first's
  // trailing rows (cycled where it has more), so that the rows the two share hold the same
  // data (see sharedRowsAgree, [Note: row positions]).
  std::vector<at::Tensor> observe_inputs;
};

// [Note: Functions of several outputs] A torch.autograd.Function is recorded as a
// prim::PythonOp that calls its apply. TorchScript's own operator for it runs only those of
// one output (an internal assert otherwise: "op->outputs().size() == 1"), so one returning
// two tensors could not be traced. The Python side (csrc/bind) sets the factory that runs
// them all, under the program's autocast ([Note: autocast in Python ops] in
// bind/module.cpp); the frontend itself stays free of Python.
using PythonOpFactory = std::function<torch::jit::Operation(const torch::jit::Node*)>;
void setPythonOpFactory(PythonOpFactory factory);

// Builds the traced model from two traces at different batch sizes.
// Throws TraceError when the traces differ (control flow on input data, the batch size
// baked into a shape), naming the op and the module; runs the graph without gradients
// and leaves the given input tensors' contents as the graph leaves them (buffers are
// updated in place by batch norm: pass copies).
std::shared_ptr<TracedModel> buildTracedModel(
    const TraceExample& first, const TraceExample& second, const std::vector<GraphInput>& inputs,
    std::unordered_map<std::string, std::string> module_classes);

}  // namespace rannc::frontend
