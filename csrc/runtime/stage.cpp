#include "runtime/stage.h"

#include <algorithm>

#include <ATen/Context.h>
#include <functional>
#include <unordered_set>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "common/error.h"
#include "frontend/interpreter.h"
#include "frontend/placement.h"

namespace rannc::runtime {
namespace {

bool differentiable(const at::Tensor& t) {
  return t.defined() && (t.is_floating_point() || t.is_complex());
}

}  // namespace

StageExecutor::StageExecutor(std::shared_ptr<const frontend::TracedModel> model,
                             ir::Subgraph piece,
                             std::unordered_map<ir::ValueId, at::Tensor> state,
                             c10::Device device)
    : model_(frontend::onDevice(std::move(model), device)),
      piece_(std::move(piece)),
      state_(std::move(state)),
      device_(device) {
  for (ir::ValueId id : frontend::runPieceInputs(*model_, piece_)) {
    if (model_->graph.value(id).isModelState()) {
      if (!state_.count(id)) {
        throw Error("stage is missing the tensor of " + ir::describe(model_->graph.value(id)));
      }
    } else {
      input_ids_.push_back(id);
    }
  }
  no_grad_.assign(input_ids_.size(), 0);
}

void StageExecutor::setNoGradInputs(std::vector<ir::ValueId> ids) {
  std::sort(ids.begin(), ids.end());
  for (size_t i = 0; i < input_ids_.size(); ++i) {
    no_grad_[i] = std::binary_search(ids.begin(), ids.end(), input_ids_[i]);
  }
}

at::Generator StageExecutor::generator() const {
  return at::globalContext().defaultGenerator(device_);
}

std::vector<c10::IValue> StageExecutor::run(const std::vector<c10::IValue>& inputs,
                                            const std::unordered_map<ir::ValueId, at::Tensor>& instead) {
  std::vector<c10::IValue> all;
  size_t next = 0;
  for (ir::ValueId id : frontend::runPieceInputs(*model_, piece_)) {
    auto replaced = instead.find(id);
    auto it = replaced != instead.end() ? replaced : state_.find(id);
    all.push_back(it != state_.end() ? c10::IValue(it->second) : inputs[next++]);
  }
  return frontend::runPiece(*model_, piece_, all);
}

// [Note: buffers a recompute writes] A forward that writes into buffers (batch norm's
// running statistics and its counter, an EMA center) wrote them again when a recomputing
// stage rebuilt its graph in backward: under recomputation (recompute="always", or "auto"
// where memory asks for it) batch norm's statistics moved twice per micro-batch, and
// num_batches_tracked counted two, without a word. The first recomputing forward finds the
// buffers it writes by their values (batch norm's kernels bump no version counter), and
// each rebuild runs on copies of them, which the rebuilt graph keeps for its backward.
std::vector<c10::IValue> StageExecutor::runFindingWrittenBuffers(const std::vector<c10::IValue>& inputs) {
  std::vector<std::pair<ir::ValueId, at::Tensor>> before;
  for (const auto& [id, t] : state_) {
    if (model_->graph.value(id).role == ir::ValueRole::Buffer && t.defined()) {
      before.emplace_back(id, t.clone());
    }
  }
  std::vector<c10::IValue> outputs = run(inputs);
  written_buffers_.emplace();
  for (const auto& [id, old] : before) {
    const at::Tensor& now = state_.at(id);
    if (now.sizes() != old.sizes() || !now.equal(old)) written_buffers_->push_back(id);
  }
  return outputs;
}

std::vector<c10::IValue> StageExecutor::leaves(const std::vector<c10::IValue>& inputs) const {
  // Cut the autograd graph at the boundary: each differentiable tensor input becomes a
  // leaf whose .grad is what backward returns to the previous stage.
  std::vector<c10::IValue> out;
  out.reserve(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const c10::IValue& v = inputs[i];
    if (v.isTensor() && differentiable(v.toTensor())) {
      out.emplace_back(v.toTensor().detach().requires_grad_(!no_grad_[i]));
    } else {
      out.push_back(v);
    }
  }
  return out;
}

std::vector<c10::IValue> StageExecutor::forward(int64_t mb, const std::vector<c10::IValue>& inputs,
                                                bool keep_for_backward, bool recompute) {
  if (inputs.size() != input_ids_.size()) {
    throw Error("stage forward takes " + std::to_string(input_ids_.size()) + " inputs, got " +
                std::to_string(inputs.size()));
  }
  if (!keep_for_backward) {
    torch::NoGradGuard no_grad;
    return run(inputs);
  }
  RANNC_CHECK(!stash_.count(mb), "micro-batch " << mb << " is already stashed");
  Stash stash;
  stash.recompute = recompute;
  std::vector<c10::IValue> outputs;
  if (recompute) {
    // Keep the inputs and the RNG state; the graph is rebuilt in backward().
    stash.inputs = inputs;
    at::Generator gen = generator();
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      stash.rng_state = gen.get_state();
    }
    torch::NoGradGuard no_grad;
    outputs = written_buffers_ ? run(inputs) : runFindingWrittenBuffers(inputs);
  } else {
    stash.inputs = leaves(inputs);
    if (!written_buffers_) {
      outputs = runFindingWrittenBuffers(stash.inputs);
    } else {
      if (stashed() > 0) rebindWrittenBuffers();  // [Note: buffers a stashed backward reads]
      outputs = run(stash.inputs);
    }
    stash.outputs = outputs;
  }
  stash_.emplace(mb, std::move(stash));
  // What leaves the stage is detached: the next stage makes its own leaves.
  for (auto& v : outputs) {
    if (v.isTensor()) v = v.toTensor().detach();
  }
  return outputs;
}

// [Note: buffers a stashed backward reads] A forward may write a buffer in place that a
// differentiable op of it reads (`self.scale.copy_(h.max())` under no_grad, then
// `h / self.scale`): the op saves the buffer for backward. One process runs that backward
// before the next forward writes it again; a stage that runs several micro-batches'
// forwards before their backwards (1F1B's first stages, fill-drain) wrote it under the
// saved graph, and the backward failed on the version counter ("modified by an inplace
// operation"). So a forward that follows a stashed one writes into a copy of each buffer
// the forward writes (found at its first forward), leaving the tensor the stashed graph
// holds alone; once no backward is pending, the model's own buffer takes the last value.
void StageExecutor::rebindWrittenBuffers() {
  torch::NoGradGuard no_grad;
  for (ir::ValueId id : *written_buffers_) {
    at::Tensor& current = state_.at(id);
    originals_.try_emplace(id, current);
    current = current.clone();
  }
}

void StageExecutor::restoreWrittenBuffersIfIdle() {
  if (originals_.empty() || stashed() > 0) return;
  torch::NoGradGuard no_grad;
  for (auto& [id, original] : originals_) {
    original.copy_(state_.at(id));
    state_.at(id) = original;
  }
  originals_.clear();
}

StageExecutor::Stash StageExecutor::takeForBackward(int64_t mb, const std::vector<at::Tensor>& output_grads,
                                                    std::vector<at::Tensor>& roots,
                                                    std::vector<at::Tensor>& grads, bool retain) {
  auto it = stash_.find(mb);
  if (it == stash_.end()) {
    throw Error("backward of micro-batch " + std::to_string(mb) + " without a stashed forward");
  }
  Stash stash = retain ? it->second : std::move(it->second);
  if (!retain) stash_.erase(it);
  if (output_grads.size() != piece_.outputs.size()) {
    throw Error("stage backward takes " + std::to_string(piece_.outputs.size()) +
                " output gradients, got " + std::to_string(output_grads.size()));
  }
  if (stash.recompute) {
    // Same inputs, same RNG state: dropout draws the same masks as the first forward.
    at::Generator gen = generator();
    at::Tensor current;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      current = gen.get_state();
      gen.set_state(stash.rng_state);
    }
    stash.inputs = leaves(stash.inputs);
    std::unordered_map<ir::ValueId, at::Tensor> copies;  // [Note: buffers a recompute writes]
    if (written_buffers_) {
      for (ir::ValueId id : *written_buffers_) copies.emplace(id, state_.at(id).clone());
    }
    torch::AutoGradMode grad(true);
    stash.outputs = run(stash.inputs, copies);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(current);
  }
  for (size_t i = 0; i < stash.outputs.size(); ++i) {
    const auto& v = stash.outputs[i];
    if (!v.isTensor() || !output_grads[i].defined()) continue;
    const at::Tensor& t = v.toTensor();
    if (!t.requires_grad()) continue;
    roots.push_back(t);
    grads.push_back(output_grads[i]);
  }
  return stash;
}

std::vector<at::Tensor> StageExecutor::backward(int64_t mb, const std::vector<at::Tensor>& output_grads,
                                                bool retain) {
  std::vector<at::Tensor> roots, grads;
  Stash stash = takeForBackward(mb, output_grads, roots, grads, retain);
  if (!roots.empty()) {
    torch::autograd::backward(roots, grads, /*retain_graph=*/retain && !stash.recompute,
                              /*create_graph=*/false);
  }
  std::vector<at::Tensor> input_grads;
  for (const auto& v : stash.inputs) {
    if (!v.isTensor() || !v.toTensor().requires_grad()) {
      input_grads.emplace_back();
      continue;
    }
    at::Tensor leaf = v.toTensor();
    input_grads.push_back(leaf.grad());
    if (retain) leaf.mutable_grad().reset();  // the stashed leaf's next backward starts afresh
  }
  stash = Stash();  // its graph no longer holds the buffers it read
  restoreWrittenBuffersIfIdle();
  return input_grads;
}

// [Note: split backward] in frontend/split_backward.h.
std::vector<at::Tensor> StageExecutor::backwardInput(int64_t mb, const std::vector<at::Tensor>& output_grads) {
  std::vector<at::Tensor> roots, grads;
  Stash stash = takeForBackward(mb, output_grads, roots, grads);
  std::vector<at::Tensor> inputs(stash.inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (stash.inputs[i].isTensor()) inputs[i] = stash.inputs[i].toTensor();
  }
  std::shared_ptr<frontend::WeightPart> weight;
  std::vector<at::Tensor> input_grads = frontend::backwardInputPart(roots, grads, inputs, &weight);
  pending_weights_[mb] = std::move(weight);
  return input_grads;
}

void StageExecutor::backwardWeight(int64_t mb) {
  auto it = pending_weights_.find(mb);
  if (it == pending_weights_.end()) {
    throw Error("weight backward of micro-batch " + std::to_string(mb) + " without its input backward");
  }
  std::shared_ptr<frontend::WeightPart> weight = std::move(it->second);
  pending_weights_.erase(it);
  frontend::backwardWeightPart(*weight);
  weight.reset();
  restoreWrittenBuffersIfIdle();
}

}  // namespace rannc::runtime
