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

std::vector<c10::IValue> StageExecutor::run(const std::vector<c10::IValue>& inputs) {
  std::vector<c10::IValue> all;
  size_t next = 0;
  for (ir::ValueId id : frontend::runPieceInputs(*model_, piece_)) {
    auto it = state_.find(id);
    all.push_back(it != state_.end() ? c10::IValue(it->second) : inputs[next++]);
  }
  return frontend::runPiece(*model_, piece_, all);
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
    outputs = run(inputs);
  } else {
    stash.inputs = leaves(inputs);
    outputs = run(stash.inputs);
    stash.outputs = outputs;
  }
  stash_.emplace(mb, std::move(stash));
  // What leaves the stage is detached: the next stage makes its own leaves.
  for (auto& v : outputs) {
    if (v.isTensor()) v = v.toTensor().detach();
  }
  return outputs;
}

StageExecutor::Stash StageExecutor::takeForBackward(int64_t mb, const std::vector<at::Tensor>& output_grads,
                                                    std::vector<at::Tensor>& roots,
                                                    std::vector<at::Tensor>& grads) {
  auto it = stash_.find(mb);
  if (it == stash_.end()) {
    throw Error("backward of micro-batch " + std::to_string(mb) + " without a stashed forward");
  }
  Stash stash = std::move(it->second);
  stash_.erase(it);
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
    torch::AutoGradMode grad(true);
    stash.outputs = run(stash.inputs);
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

std::vector<at::Tensor> StageExecutor::backward(int64_t mb, const std::vector<at::Tensor>& output_grads) {
  std::vector<at::Tensor> roots, grads;
  Stash stash = takeForBackward(mb, output_grads, roots, grads);
  if (!roots.empty()) {
    torch::autograd::backward(roots, grads, /*retain_graph=*/false, /*create_graph=*/false);
  }
  std::vector<at::Tensor> input_grads;
  for (const auto& v : stash.inputs) {
    input_grads.push_back(v.isTensor() && v.toTensor().requires_grad() ? v.toTensor().grad()
                                                                      : at::Tensor());
  }
  return input_grads;
}

// [Note: split backward] in stage.h.
struct StageExecutor::PendingWeight {
  // A node where a path to a parameter leaves the paths to the inputs, the gradient that
  // arrived at it in backwardInput, and its next edges that lead to an input.
  struct Junction {
    decltype(torch::autograd::Edge::function) node;  // shared_ptr or intrusive_ptr by torch version
    torch::autograd::variable_list arrived;
    bool captured = false;
    std::vector<size_t> towards_inputs;
  };
  std::vector<std::shared_ptr<Junction>> junctions;
  // Outputs whose graph reaches no input: the weight part starts from them directly.
  torch::autograd::edge_list direct_roots;
  torch::autograd::variable_list direct_grads;
  std::vector<c10::IValue> outputs;  // keeps the graph alive until the weight part
};

namespace {

// Records the gradient arriving at a junction node during backwardInput.
class CaptureArriving : public torch::autograd::FunctionPreHook {
 public:
  explicit CaptureArriving(std::function<void(const torch::autograd::variable_list&)> record)
      : record_(std::move(record)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    record_(grads);
    return grads;
  }

 private:
  std::function<void(const torch::autograd::variable_list&)> record_;
};

}  // namespace

std::vector<at::Tensor> StageExecutor::backwardInput(int64_t mb, const std::vector<at::Tensor>& output_grads) {
  using torch::autograd::Edge;
  using torch::autograd::Node;
  std::vector<at::Tensor> roots, grads;
  Stash stash = takeForBackward(mb, output_grads, roots, grads);
  auto pending = std::make_shared<PendingWeight>();
  pending->outputs = stash.outputs;

  // The edges the input gradients arrive at, and every node that reaches one of them.
  torch::autograd::edge_list input_edges;
  std::vector<int> input_index;  // per input edge: its position in stash.inputs
  for (size_t i = 0; i < stash.inputs.size(); ++i) {
    const auto& v = stash.inputs[i];
    if (v.isTensor() && v.toTensor().requires_grad()) {
      input_edges.push_back(torch::autograd::impl::gradient_edge(v.toTensor()));
      input_index.push_back(static_cast<int>(i));
    }
  }
  torch::autograd::edge_list root_edges;
  for (const auto& r : roots) root_edges.push_back(torch::autograd::impl::gradient_edge(r));
  if (input_edges.empty()) {
    // No input takes a gradient (the first stage): the whole backward is the weight part.
    pending->direct_roots = std::move(root_edges);
    pending->direct_grads = std::move(grads);
    pending_weights_[mb] = std::move(pending);
    return std::vector<at::Tensor>(stash.inputs.size());
  }
  std::unordered_map<Node*, std::vector<Node*>> parents;  // reverse edges of the graph
  std::vector<Node*> order;
  {
    std::vector<Node*> todo;
    std::unordered_set<Node*> seen;
    for (const Edge& e : root_edges) {
      if (e.function && seen.insert(e.function.get()).second) todo.push_back(e.function.get());
    }
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      order.push_back(n);
      for (const Edge& e : n->next_edges()) {
        if (!e.function) continue;
        parents[e.function.get()].push_back(n);
        if (seen.insert(e.function.get()).second) todo.push_back(e.function.get());
      }
    }
  }
  std::unordered_set<Node*> to_inputs;  // nodes with a path to an input edge
  {
    std::vector<Node*> todo;
    for (const Edge& e : input_edges) {
      if (e.function && to_inputs.insert(e.function.get()).second) todo.push_back(e.function.get());
    }
    while (!todo.empty()) {
      Node* n = todo.back();
      todo.pop_back();
      for (Node* p : parents[n]) {
        if (to_inputs.insert(p).second) todo.push_back(p);
      }
    }
  }
  for (size_t r = 0; r < root_edges.size(); ++r) {
    if (!to_inputs.count(root_edges[r].function.get())) {
      pending->direct_roots.push_back(root_edges[r]);
      pending->direct_grads.push_back(grads[r]);
    }
  }
  for (Node* n : order) {
    if (!to_inputs.count(n)) continue;
    std::vector<size_t> towards_inputs;
    bool leaves_inputs = false;
    const auto& next = n->next_edges();
    for (size_t k = 0; k < next.size(); ++k) {
      if (!next[k].function) continue;
      if (to_inputs.count(next[k].function.get())) {
        towards_inputs.push_back(k);
      } else {
        leaves_inputs = true;
      }
    }
    if (!leaves_inputs) continue;
    auto junction = std::make_shared<PendingWeight::Junction>();
    junction->node = n->getptr();
    junction->towards_inputs = std::move(towards_inputs);
    std::weak_ptr<PendingWeight::Junction> weak = junction;
    n->add_pre_hook(std::make_unique<CaptureArriving>([weak](const torch::autograd::variable_list& g) {
      auto j = weak.lock();
      if (j && !j->captured) {
        j->arrived = g;
        j->captured = true;
      }
    }));
    pending->junctions.push_back(std::move(junction));
  }

  std::vector<at::Tensor> input_grads(stash.inputs.size());
  if (!root_edges.empty()) {
    auto computed = torch::autograd::Engine::get_default_engine().execute(
        root_edges, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, input_edges);
    for (size_t k = 0; k < computed.size(); ++k) input_grads[input_index[k]] = computed[k];
  }
  pending_weights_[mb] = std::move(pending);
  return input_grads;
}

void StageExecutor::backwardWeight(int64_t mb) {
  using torch::autograd::Edge;
  auto it = pending_weights_.find(mb);
  if (it == pending_weights_.end()) {
    throw Error("weight backward of micro-batch " + std::to_string(mb) + " without its input backward");
  }
  std::shared_ptr<PendingWeight> pending = std::move(it->second);
  pending_weights_.erase(it);
  torch::autograd::edge_list roots = pending->direct_roots;
  torch::autograd::variable_list grads = pending->direct_grads;
  for (const auto& j : pending->junctions) {
    if (!j->captured) continue;  // no gradient reached it
    // Cut the edges towards the inputs: their part is done, and the node then computes
    // only the gradients that lead to parameters.
    for (size_t k : j->towards_inputs) j->node->next_edges()[k] = Edge();  // (set_next_edge refuses a node with parents)
    for (size_t i = 0; i < j->arrived.size(); ++i) {
      if (!j->arrived[i].defined()) continue;
      roots.emplace_back(j->node, static_cast<uint32_t>(i));
      grads.push_back(j->arrived[i]);
    }
  }
  if (roots.empty()) return;
  torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                        /*create_graph=*/false, /*accumulate_grad=*/true);
}

}  // namespace rannc::runtime
