#pragma once
// One stage of the pipeline as this rank runs it: forward and backward of one convex
// piece of the traced model, one micro-batch at a time, with the autograd graph cut at
// the stage boundary.
//
// [Note: activation lifetime] forward() stashes what backward() of the same micro-batch
// needs: the autograd graph of the piece (boundary inputs as detached leaves that require
// grad), or, when recomputing, only the inputs and the RNG state. backward() consumes and
// frees it, so a 1F1B stage i of S holds at most min(S-i, M) stashes.
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include "frontend/split_backward.h"
#include "frontend/traced_model.h"
#include "ir/subgraph.h"

namespace rannc::runtime {

class StageExecutor {
 public:
  // `state` maps the value ids of parameters and buffers to this rank's tensors (the ones
  // the optimizer updates, on `device`); the piece's other non-constant inputs come with
  // each call, on `device` too. The trace's constant devices and tensors are moved there
  // ([Note: traced devices] in frontend/placement.h).
  StageExecutor(std::shared_ptr<const frontend::TracedModel> model, ir::Subgraph piece,
                std::unordered_map<ir::ValueId, at::Tensor> state,
                c10::Device device = c10::Device(c10::kCPU));

  const c10::Device& device() const { return device_; }

  // The non-constant, non-state inputs a forward call takes, in order.
  const std::vector<ir::ValueId>& inputIds() const { return input_ids_; }
  const std::vector<ir::ValueId>& outputIds() const { return piece_.outputs; }

  // Runs the piece for micro-batch `mb` (a key; any int not yet stashed). With
  // `keep_for_backward`, stashes what backward needs (the graph, or with `recompute`
  // only the inputs and RNG state). Returns the piece's outputs (detached from this
  // piece's graph: the next stage's leaves). Throws rannc::Error naming the op on failure.
  std::vector<c10::IValue> forward(int64_t mb, const std::vector<c10::IValue>& inputs,
                                   bool keep_for_backward, bool recompute);

  // Backpropagates the gradients of this piece's outputs (undefined tensors for outputs
  // without one) for micro-batch `mb`, accumulating into the state tensors' .grad, and
  // returns the gradients of inputIds() (undefined where none flows). With `retain`, the
  // stash stays for another backward of the same micro-batch (the user's
  // backward(retain_graph=True), [Note: retained graphs] in engine.h).
  std::vector<at::Tensor> backward(int64_t mb, const std::vector<at::Tensor>& output_grads,
                                   bool retain = false);

  // The backward in two parts ([Note: split backward] in frontend/split_backward.h):
  // backwardInput computes only the gradients of inputIds() (what the previous stage waits
  // for), backwardWeight later the parameters' gradients. Each micro-batch runs either
  // backward or both, in order.
  std::vector<at::Tensor> backwardInput(int64_t mb, const std::vector<at::Tensor>& output_grads);
  void backwardWeight(int64_t mb);

  // The inputs (by value id) that get no gradient: the model's arguments whose tensors do
  // not require grad. The others that are floating become leaves that require grad.
  void setNoGradInputs(std::vector<ir::ValueId> ids);

  // Drops the stashes of the micro-batch keys in [from, to): a forward whose backward will
  // not come ([Note: calls awaiting their backward] in engine.h).
  void discard(int64_t from, int64_t to) {
    std::erase_if(stash_, [&](const auto& kv) { return kv.first >= from && kv.first < to; });
    std::erase_if(pending_weights_, [&](const auto& kv) { return kv.first >= from && kv.first < to; });
    restoreWrittenBuffersIfIdle();
  }

  // Number of micro-batches stashed for backward (or waiting for their weight part).
  size_t stashed() const { return stash_.size() + pending_weights_.size(); }

 private:
  struct Stash {
    std::vector<c10::IValue> inputs;   // leaves (requires grad where differentiable)
    std::vector<c10::IValue> outputs;  // attached to the piece's graph (empty if recompute)
    bool recompute = false;
    at::Tensor rng_state;              // the device's generator state before the forward
  };

  // The generator that dropout on this stage's device draws from.
  at::Generator generator() const;

  // Takes micro-batch `mb`'s stash (with `retain`, a copy, leaving it stashed), recomputing
  // its graph if needed; fills the outputs that get a gradient (`roots`) and their gradients.
  Stash takeForBackward(int64_t mb, const std::vector<at::Tensor>& output_grads,
                        std::vector<at::Tensor>& roots, std::vector<at::Tensor>& grads,
                        bool retain = false);

  // Runs the piece on `inputs` and the state tensors, those in `instead` replaced.
  std::vector<c10::IValue> run(const std::vector<c10::IValue>& inputs,
                               const std::unordered_map<ir::ValueId, at::Tensor>& instead = {});
  std::vector<c10::IValue> leaves(const std::vector<c10::IValue>& inputs) const;
  // [Note: buffers a recompute writes] The first recomputing forward finds them.
  std::vector<c10::IValue> runFindingWrittenBuffers(const std::vector<c10::IValue>& inputs);
  // [Note: buffers a stashed backward reads]
  void rebindWrittenBuffers();
  void restoreWrittenBuffersIfIdle();

  std::shared_ptr<const frontend::TracedModel> model_;
  ir::Subgraph piece_;
  std::unordered_map<ir::ValueId, at::Tensor> state_;
  c10::Device device_;
  std::vector<ir::ValueId> input_ids_;
  std::vector<char> no_grad_;  // per input: gets no gradient (setNoGradInputs)
  std::unordered_map<int64_t, Stash> stash_;
  std::unordered_map<int64_t, std::shared_ptr<frontend::WeightPart>> pending_weights_;
  // the buffers the forward writes (batch norm's statistics), once a recomputing forward
  // found them ([Note: buffers a recompute writes])
  std::optional<std::vector<ir::ValueId>> written_buffers_;
  // the model's own tensors of written buffers that state_ holds copies of while stashed
  // backwards may read them ([Note: buffers a stashed backward reads])
  std::unordered_map<ir::ValueId, at::Tensor> originals_;
};

}  // namespace rannc::runtime
