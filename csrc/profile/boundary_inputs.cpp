#include "profile/boundary_inputs.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/error.h"
#include "frontend/interpreter.h"

namespace rannc::profile {
namespace {

bool keepValue(const ir::Value& v, const c10::IValue& iv) {
  if (v.role == ir::ValueRole::Input || v.isModelState()) return true;
  if (!iv.isTensor()) return true;
  const at::Tensor& t = iv.toTensor();
  return t.defined() && !t.is_floating_point() && !t.is_complex();
}

at::ScalarType scalarType(ir::DType d) {
  switch (d) {
    case ir::DType::Float32: return at::kFloat;
    case ir::DType::Float64: return at::kDouble;
    case ir::DType::Float16: return at::kHalf;
    case ir::DType::BFloat16: return at::kBFloat16;
    case ir::DType::Int64: return at::kLong;
    case ir::DType::Int32: return at::kInt;
    case ir::DType::Int16: return at::kShort;
    case ir::DType::Int8: return at::kChar;
    case ir::DType::UInt8: return at::kByte;
    case ir::DType::Bool: return at::kBool;
    case ir::DType::Complex64: return at::kComplexFloat;
    case ir::DType::Complex128: return at::kComplexDouble;
    case ir::DType::Undefined: break;
  }
  return at::kFloat;
}

}  // namespace

at::Tensor cycleRows(const at::Tensor& t, int64_t dim, int64_t target_rows) {
  const int64_t have = t.size(dim);
  if (have == target_rows) return t;
  RANNC_CHECK(have > 0, "cannot cycle the rows of an empty tensor");
  at::Tensor index = at::arange(target_rows, at::TensorOptions().dtype(at::kLong)).remainder(have);
  return t.index_select(dim, index.to(t.device()));
}

BoundaryInputs::BoundaryInputs(std::shared_ptr<const frontend::TracedModel> model,
                               const std::vector<at::Tensor>& example)
    : model_(std::move(model)) {
  const ir::Graph& g = model_->graph;
  if (example.size() != g.inputs().size()) {
    throw Error("profiling needs " + std::to_string(g.inputs().size()) +
                " example inputs (parameters, buffers, arguments), got " +
                std::to_string(example.size()));
  }
  std::vector<c10::IValue> inputs;
  for (const auto& t : example) inputs.emplace_back(t);
  auto gen = at::detail::getDefaultCPUGenerator();
  at::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  {
    torch::NoGradGuard no_grad;
    frontend::runGraph(*model_, inputs, [&](ir::ValueId id, const c10::IValue& iv) {
      const ir::Value& v = g.value(id);
      if (v.isConstant() || !keepValue(v, iv)) return;
      // State keeps its requires_grad (read in build); other tensors are detached.
      kept_[id] = iv.isTensor() && !v.isModelState() ? c10::IValue(iv.toTensor().detach()) : iv;
    });
  }
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(rng);
}

c10::IValue BoundaryInputs::build(const ir::Value& v, int64_t rows) const {
  const ir::Graph& g = model_->graph;
  const int64_t batch = g.batchSize();
  if (v.isModelState()) {
    const at::Tensor& t = kept_.at(v.id).toTensor();
    return t.detach().requires_grad_(t.is_floating_point() && t.requires_grad());
  }
  // Sizes and shapes: recomputed for the rows.
  if (!v.int_values.empty() && v.role == ir::ValueRole::Intermediate &&
      (!v.isTensor() || v.shape.empty())) {
    std::vector<int64_t> ints;
    for (size_t i = 0; i < v.int_values.size(); ++i) {
      const int64_t k = i < v.int_batch_multiples.size() ? v.int_batch_multiples[i] : 0;
      ints.push_back(k ? k * rows : v.int_values[i]);
    }
    if (v.kind == ir::ValueKind::Int) return c10::IValue(ints.at(0));
    if (v.kind == ir::ValueKind::IntList) return c10::IValue(ints);
    if (v.isTensor()) return at::scalar_tensor(ints.at(0), at::TensorOptions().dtype(scalarType(v.dtype)));
  }
  auto it = kept_.find(v.id);
  if (it != kept_.end()) {
    const c10::IValue& iv = it->second;
    if (!iv.isTensor()) return iv;
    at::Tensor t = iv.toTensor();
    if (v.isBatch()) t = cycleRows(t, v.batch_dim, v.batch_multiple * rows);
    // Like the runtime's stage leaves: every floating input is a leaf that requires grad.
    return t.is_floating_point() ? t.detach().requires_grad_(true) : t;
  }
  if (!v.isTensor()) {
    throw Error("cannot build the profiling input " + ir::describe(v) + " (a " +
                std::string(ir::valueKindName(v.kind)) + " that was not observed)");
  }
  std::vector<int64_t> shape = v.shape;
  if (v.isBatch() && batch > 0) shape[v.batch_dim] = v.batch_multiple * rows;
  at::Tensor t = at::randn(shape, at::TensorOptions().dtype(scalarType(v.dtype)));
  return t.is_floating_point() ? t.requires_grad_(true) : t;
}

std::vector<c10::IValue> BoundaryInputs::make(const ir::Subgraph& piece, int64_t rows) const {
  std::vector<c10::IValue> out;
  for (ir::ValueId id : frontend::runPieceInputs(*model_, piece)) {
    out.push_back(build(model_->graph.value(id), rows));
  }
  return out;
}

}  // namespace rannc::profile
