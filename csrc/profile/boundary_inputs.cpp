#include "profile/boundary_inputs.h"

#include <algorithm>
#include <chrono>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/error.h"
#include "common/log.h"
#include "frontend/dtypes.h"
#include "frontend/interpreter.h"

namespace rannc::profile {
namespace {

bool keepValue(const ir::Value& v, const c10::IValue& iv) {
  if (v.role == ir::ValueRole::Input || v.isModelState()) return true;
  if (!iv.isTensor()) return true;
  const at::Tensor& t = iv.toTensor();
  return t.defined() && !t.is_floating_point() && !t.is_complex();
}

// The shape of `v` at `rows` rows (its batch dimension scaled).
std::vector<int64_t> shapeAt(const ir::Value& v, int64_t rows) {
  std::vector<int64_t> shape = v.shape;
  if (v.isBatch()) shape[v.batch_dim] = v.batch_multiple * rows;
  return shape;
}

// Restores the CPU generator's state when it goes out of scope: building inputs must not
// change the random numbers the user's training draws next.
class KeepCpuRng {
 public:
  KeepCpuRng() : gen_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    state_ = gen_.get_state();
  }
  ~KeepCpuRng() {
    std::lock_guard<std::mutex> lock(gen_.mutex());
    gen_.set_state(state_);
  }
  KeepCpuRng(const KeepCpuRng&) = delete;
  KeepCpuRng& operator=(const KeepCpuRng&) = delete;

 private:
  at::Generator gen_;
  at::Tensor state_;
};

// Like the runtime's stage leaves (runtime/stage.h): every floating input requires grad,
// except the model's own arguments, whose tensors usually do not (an image's gradient
// would cost a whole backward-data convolution that training never runs).
// Whether a floating boundary value is made a leaf that requires grad: where the stage's
// would. A value without gradient (a mask, a detached teacher's output: [Note: no_grad
// in forward] in _trace.py) given one timed a backward that never runs, and a buffer
// updated in place from it (an EMA) took autograd history that the piece's next run
// backpropagated again.
bool leafNeedsGrad(const ir::Value& v) { return v.requires_grad && v.role != ir::ValueRole::Input; }

}  // namespace

at::Tensor cycleRows(const at::Tensor& t, int64_t dim, int64_t target_rows) {
  const int64_t have = t.size(dim);
  if (have == target_rows) return t;
  RANNC_CHECK(have > 0, "cannot cycle the rows of an empty tensor");
  at::Tensor index = at::arange(target_rows, at::TensorOptions().dtype(at::kLong)).remainder(have);
  return t.index_select(dim, index.to(t.device()));
}

bool BoundaryInputs::isData(const ir::Value& v) { return !v.requires_grad; }

BoundaryInputs::BoundaryInputs(std::shared_ptr<const frontend::TracedModel> model,
                               const std::vector<at::Tensor>& example)
    : model_(std::move(model)) {
  const ir::Graph& g = model_->graph;
  if (example.size() != g.inputs().size()) {
    throw Error("profiling needs " + std::to_string(g.inputs().size()) +
                " example inputs (parameters, buffers, arguments), got " +
                std::to_string(example.size()));
  }
  for (const auto& t : example) {
    if (t.defined()) {
      home_ = t.device();
      break;
    }
  }
  std::vector<c10::IValue> inputs;
  for (const auto& t : example) inputs.emplace_back(t);
  {
    KeepCpuRng keep;
    torch::NoGradGuard no_grad;
    frontend::runGraph(*model_, inputs, [&](ir::ValueId id, const c10::IValue& iv) {
      const ir::Value& v = g.value(id);
      if (v.isConstant() || !keepValue(v, iv)) return;
      // State keeps its requires_grad (read in build); other tensors are detached.
      // Copies: a later in-place op (aten::add_) would change an alias.
      kept_[id] = iv.isTensor() && !v.isModelState() ? c10::IValue(iv.toTensor().detach().clone()) : iv;
    });
  }
  for (ir::TaskId t : model_->order) {
    for (ir::ValueId out : g.task(t).outputs) {
      if (isData(g.value(out))) {
        data_tasks_.push_back(t);
        break;
      }
    }
  }
}

std::shared_ptr<const BoundaryInputs::DataValues> BoundaryInputs::dataAt(int64_t rows) const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [r, values] : passes_) {
      if (r == rows) return values;
    }
  }
  auto values = runDataPass(rows);
  std::lock_guard<std::mutex> lock(mutex_);
  passes_.emplace_front(rows, values);
  if (passes_.size() > 2) passes_.pop_back();
  return values;
}

std::shared_ptr<const BoundaryInputs::DataValues> BoundaryInputs::runDataPass(int64_t rows) const {
  const auto started = std::chrono::steady_clock::now();
  const ir::Graph& g = model_->graph;
  std::vector<c10::IValue> env(g.numValues());
  std::vector<char> ready(g.numValues(), 0);
  for (ir::ValueId id : g.inputs()) {
    const ir::Value& v = g.value(id);
    auto it = kept_.find(id);
    if (it == kept_.end()) continue;  // a floating argument that requires grad: an activation
    if (v.isModelState() || !it->second.isTensor()) {
      env[id] = it->second;
    } else {
      at::Tensor t = it->second.toTensor();
      env[id] = v.isBatch() ? cycleRows(t, v.batch_dim, v.batch_multiple * rows) : t;
    }
    ready[id] = 1;
  }
  // An activation read by a data task (its size, its dtype): zeros of its shape that take
  // no memory. Values without a known shape or of other kinds cannot stand in.
  auto placeholder = [&](const ir::Value& v) -> bool {
    if (!v.isTensor() || !ir::isDifferentiable(v.dtype)) return false;
    if (!v.shape.empty() && std::find(v.shape.begin(), v.shape.end(), 0) != v.shape.end()) return false;
    env[v.id] = at::zeros({}, at::TensorOptions().dtype(frontend::toScalarType(v.dtype)).device(home_))
                    .expand(shapeAt(v, rows));
    ready[v.id] = 1;
    return true;
  };
  KeepCpuRng keep;
  torch::NoGradGuard no_grad;
  for (ir::TaskId t : data_tasks_) {
    const ir::Task& task = g.task(t);
    bool runnable = true;
    for (ir::ValueId in : task.inputs) {
      const ir::Value& v = g.value(in);
      if (v.isConstant() || ready[in]) continue;
      if (isData(v) || !placeholder(v)) {
        runnable = false;  // a data value the pass could not compute, or an unknown shape
        break;
      }
    }
    if (!runnable) continue;
    // An op that writes into an input (aten::add_) gets a copy: the input keeps the value
    // it had when produced, which is what a piece that takes it as an input must see.
    std::vector<std::pair<ir::ValueId, c10::IValue>> saved;
    if (frontend::writesInputs(*model_, t)) {
      for (ir::ValueId in : task.inputs) {
        if (!g.value(in).isConstant() && env[in].isTensor()) {
          saved.emplace_back(in, env[in]);
          env[in] = env[in].toTensor().clone();
        }
      }
    }
    bool ran = true;
    try {
      frontend::runTask(*model_, t, env);
    } catch (const std::exception&) {
      ran = false;  // an op that needs real activations: its outputs fall back (build)
    }
    for (auto& [in, value] : saved) env[in] = std::move(value);
    if (!ran) continue;
    for (ir::ValueId out : task.outputs) ready[out] = 1;
  }
  auto values = std::make_shared<DataValues>();
  for (ir::ValueId id = 0; id < static_cast<ir::ValueId>(g.numValues()); ++id) {
    const ir::Value& v = g.value(id);
    if (ready[id] && isData(v) && !v.isConstant() && !v.isModelState()) {
      (*values)[id] = std::move(env[id]);
    }
  }
  logDebug("profiling: data pass at " + std::to_string(rows) + " rows: " +
           std::to_string(values->size()) + " data values from " +
           std::to_string(data_tasks_.size()) + " tasks in " +
           std::to_string(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()) +
           " s");
  return values;
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
    if (v.kind == ir::ValueKind::IntList) return c10::IValue(ints);
    if (v.isTensor()) return at::scalar_tensor(ints.at(0), at::TensorOptions().dtype(frontend::toScalarType(v.dtype)));
    // An int, or a number typed Scalar (aten::ScalarImplicit of a size feeding arange).
    return c10::IValue(ints.at(0));
  }
  if (isData(v)) {
    auto values = dataAt(rows);
    auto found = values->find(v.id);
    if (found != values->end()) {
      const c10::IValue& iv = found->second;
      if (!iv.isTensor()) return iv;
      // Shared with later pieces: a piece that writes into its inputs runs on copies
      // (Profiler::measureOnce); floating ones become leaves of their own (detach).
      const at::Tensor& t = iv.toTensor();
      if (!t.defined()) return iv;
      return t.is_floating_point() ? t.detach().requires_grad_(leafNeedsGrad(v)) : t;
    }
  }
  auto it = kept_.find(v.id);
  if (it != kept_.end()) {
    const c10::IValue& iv = it->second;
    if (!iv.isTensor()) return iv;
    at::Tensor t = iv.toTensor();
    if (v.isBatch()) t = cycleRows(t, v.batch_dim, v.batch_multiple * rows);
    return t.is_floating_point() ? t.detach().requires_grad_(leafNeedsGrad(v)) : t;
  }
  if (!v.isTensor()) {
    throw Error("cannot build the profiling input " + ir::describe(v) + " (a " +
                std::string(ir::valueKindName(v.kind)) + " that was not observed)");
  }
  // Uniform in [0, 1): the time is the same, and ops that take probabilities accept them
  // (binary_cross_entropy after a sigmoid failed on normal draws, "all elements of input
  // should be between 0 and 1"; multinomial refuses negative weights).
  at::Tensor t = at::rand(batch > 0 ? shapeAt(v, rows) : v.shape,
                          at::TensorOptions().dtype(frontend::toScalarType(v.dtype)));
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
