#include "frontend/split_backward.h"

#include <functional>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace rannc::frontend {

// [Note: split backward] in split_backward.h.
struct WeightPart {
  // A node where a path to a parameter leaves the paths to the inputs, the gradient that
  // arrived at it in the input part, and its next edges that lead to an input.
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
  std::vector<at::Tensor> roots;  // keep the graph alive until the weight part
};

namespace {

// Records the gradient arriving at a junction node during the input part.
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

std::vector<at::Tensor> backwardInputPart(const std::vector<at::Tensor>& roots,
                                          const std::vector<at::Tensor>& grads,
                                          const std::vector<at::Tensor>& inputs,
                                          std::shared_ptr<WeightPart>* weight) {
  using torch::autograd::Edge;
  using torch::autograd::Node;
  auto pending = std::make_shared<WeightPart>();
  pending->roots = roots;

  // The edges the input gradients arrive at, and every node that reaches one of them.
  torch::autograd::edge_list input_edges;
  std::vector<int> input_index;  // per input edge: its position in `inputs`
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (inputs[i].defined() && inputs[i].requires_grad()) {
      input_edges.push_back(torch::autograd::impl::gradient_edge(inputs[i]));
      input_index.push_back(static_cast<int>(i));
    }
  }
  torch::autograd::edge_list root_edges;
  for (const auto& r : roots) root_edges.push_back(torch::autograd::impl::gradient_edge(r));
  *weight = pending;
  if (input_edges.empty()) {
    // No input takes a gradient (the first stage): the whole backward is the weight part.
    pending->direct_roots = std::move(root_edges);
    pending->direct_grads = grads;
    return std::vector<at::Tensor>(inputs.size());
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
    auto junction = std::make_shared<WeightPart::Junction>();
    junction->node = n->getptr();
    junction->towards_inputs = std::move(towards_inputs);
    std::weak_ptr<WeightPart::Junction> weak = junction;
    n->add_pre_hook(std::make_unique<CaptureArriving>([weak](const torch::autograd::variable_list& g) {
      auto j = weak.lock();
      if (j && !j->captured) {
        j->arrived = g;
        j->captured = true;
      }
    }));
    pending->junctions.push_back(std::move(junction));
  }

  std::vector<at::Tensor> input_grads(inputs.size());
  if (!root_edges.empty()) {
    auto computed = torch::autograd::Engine::get_default_engine().execute(
        root_edges, grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, input_edges);
    for (size_t k = 0; k < computed.size(); ++k) input_grads[input_index[k]] = computed[k];
  }
  return input_grads;
}

void backwardWeightPart(WeightPart& pending) {
  using torch::autograd::Edge;
  torch::autograd::edge_list roots = pending.direct_roots;
  torch::autograd::variable_list grads = pending.direct_grads;
  for (const auto& j : pending.junctions) {
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
  if (!roots.empty()) {
    torch::autograd::Engine::get_default_engine().execute(roots, grads, /*keep_graph=*/false,
                                                          /*create_graph=*/false, /*accumulate_grad=*/true);
  }
  pending = WeightPart();  // frees the graph and the captured gradients
}

}  // namespace rannc::frontend
