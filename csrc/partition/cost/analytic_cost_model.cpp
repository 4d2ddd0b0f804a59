#include "partition/cost/analytic_cost_model.h"

#include <algorithm>
#include <string_view>

namespace rannc::partition {
namespace {

std::string_view baseName(std::string_view op) {
  auto pos = op.rfind("::");
  std::string_view name = pos == std::string_view::npos ? op : op.substr(pos + 2);
  while (!name.empty() && name.back() == '_') name.remove_suffix(1);  // in-place variants
  return name;
}

const ir::Value* tensorInput(const ir::Graph& g, const ir::Task& t, size_t i) {
  if (i >= t.inputs.size()) return nullptr;
  const ir::Value& v = g.value(t.inputs[i]);
  return v.isTensor() && !v.shape.empty() ? &v : nullptr;
}

int64_t outNumel(const ir::Graph& g, const ir::Task& t) {
  int64_t n = 0;
  for (ir::ValueId v : t.outputs) {
    const ir::Value& val = g.value(v);
    if (val.isTensor()) n += val.numel();
  }
  return n;
}

bool isMatmulLike(std::string_view op) {
  return op == "linear" || op == "matmul" || op == "mm" || op == "bmm" || op == "einsum" ||
         op == "addmm" || op == "baddbmm" || op == "addbmm";
}

// The op that sets a task's cost: the task's own, or for a task the frontend fused from
// several ("aten::reshape+aten::linear+aten::view") its matmul-like part, if any.
std::string_view costOp(std::string_view op) {
  if (op.find('+') == std::string_view::npos) return baseName(op);
  std::string_view last;
  while (!op.empty()) {
    const size_t plus = op.find('+');
    last = baseName(op.substr(0, plus));
    if (isMatmulLike(last)) return last;
    op = plus == std::string_view::npos ? std::string_view() : op.substr(plus + 1);
  }
  return last;
}

// Ops whose output aliases their input (no kernel, nothing new to stash).
bool isView(std::string_view op) {
  static constexpr std::string_view kViews[] = {
      "view", "_unsafe_view", "view_as", "transpose", "t", "permute", "select", "slice",
      "narrow", "unsqueeze", "squeeze", "unflatten", "expand", "expand_as", "alias", "detach",
      "as_strided", "split", "chunk", "unbind", "diagonal"};
  for (std::string_view v : kViews) {
    if (op == v) return true;
  }
  return false;
}

// Arithmetic on sizes (aten::size, prim::NumToTensor, aten::Int, prim::ListConstruct, the
// mul of a size by the head count): every output is a non-tensor or a 0-dim integer
// tensor. It runs on the host while the device works, so it costs nothing here.
bool isHostOnly(const ir::Graph& g, const ir::Task& t) {
  for (ir::ValueId v : t.outputs) {
    const ir::Value& val = g.value(v);
    if (val.isTensor() && (!val.shape.empty() || val.is_loss ||
                           (val.dtype != ir::DType::Int64 && val.dtype != ir::DType::Int32))) {
      return false;
    }
  }
  return true;
}

// Forward FLOPs at the traced shapes; elementwise and data-movement ops count one FLOP
// per output element (their time comes from bytes anyway).
double flopsOf(const ir::Graph& g, const ir::Task& t) {
  const std::string_view op = costOp(t.op);
  const double out = static_cast<double>(outNumel(g, t));
  auto lastDim = [&](size_t i) -> double {
    const ir::Value* v = tensorInput(g, t, i);
    return v ? static_cast<double>(v->shape.back()) : 1.0;
  };
  if (op == "linear") {
    // Input features from the weight: a fused task's first input may be a view of
    // another shape.
    for (ir::ValueId v : t.inputs) {
      const ir::Value& w = g.value(v);
      if (w.role == ir::ValueRole::Param && w.shape.size() == 2) return 2.0 * out * static_cast<double>(w.shape[1]);
    }
    return 2.0 * out * lastDim(0);
  }
  if (op == "matmul" || op == "mm" || op == "bmm" || op == "einsum") {
    return 2.0 * out * lastDim(0);
  }
  if (op == "addmm" || op == "baddbmm" || op == "addbmm") return 2.0 * out * lastDim(1);
  if (op == "_convolution" || op == "convolution" || op == "conv1d" || op == "conv2d" ||
      op == "conv3d" || op == "conv_transpose2d") {
    const ir::Value* w = tensorInput(g, t, 1);
    if (w == nullptr) return out;
    // Each output element is a dot product over (in channels / groups) x kernel.
    return 2.0 * out * static_cast<double>(w->numel() / std::max<int64_t>(w->shape[0], 1));
  }
  if (op == "scaled_dot_product_attention" || op == "_scaled_dot_product_attention" ||
      op == "multi_head_attention_forward") {
    const ir::Value* q = tensorInput(g, t, 0);
    const ir::Value* k = tensorInput(g, t, 1);
    if (q == nullptr || k == nullptr || k->shape.size() < 2) return out;
    // Q K^T and A V: two matmuls of L x S x E per head.
    return 4.0 * static_cast<double>(q->numel()) * static_cast<double>(k->shape[k->shape.size() - 2]);
  }
  return out;
}

}  // namespace

AnalyticCostModel::AnalyticCostModel(const ir::Graph& graph, DeviceSpec device,
                                     bool cache_by_content)
    : CostModel(graph, device), tasks_(graph.numTasks()), cache_by_content_(cache_by_content) {
  for (const ir::Task& t : graph.tasks()) {
    TaskCost& c = tasks_[t.id];
    // [Note: free tasks] Views and size arithmetic launch no kernel and allocate nothing:
    // no time, no stash (their outputs alias their inputs or are host scalars). A value
    // of theirs that crosses a stage boundary is still sent at its full size.
    if (isHostOnly(graph, t) || (t.op.find('+') == std::string::npos && isView(baseName(t.op)))) {
      c.free = true;
      continue;
    }
    c.flops = flopsOf(graph, t);
    for (ir::ValueId v : t.outputs) c.flops_scale = c.flops_scale || graph.value(v).isBatch();
    auto addBytes = [&](ir::ValueId id) {
      const ir::Value& v = graph.value(id);
      if (!v.isTensor()) return;
      (v.isBatch() ? c.batch_bytes : c.fixed_bytes) += static_cast<double>(v.bytes());
    };
    for (ir::ValueId v : t.inputs) addBytes(v);
    for (ir::ValueId v : t.outputs) addBytes(v);
    bool params = false, trained = false, grad_inputs = false;
    for (ir::ValueId v : t.inputs) {
      const ir::Value& val = graph.value(v);
      if (val.role == ir::ValueRole::Param) {
        params = true;
        trained = trained || val.requires_grad;
      } else if (val.role != ir::ValueRole::Constant && val.role != ir::ValueRole::Buffer) {
        grad_inputs = grad_inputs || val.requires_grad;
      }
    }
    if (params && !trained) c.backward_factor = grad_inputs ? 1.0 : 0.0;
  }
  values_.resize(graph.numValues());
  for (const ir::Value& v : graph.values()) {
    ValueInfo& info = values_[v.id];
    info.producer = v.producer;
    info.role = v.role;
    info.tensor = v.isTensor();
    info.batch = v.isBatch() && graph.batchSize() > 0;
    info.bytes = v.bytes();
    info.requires_grad = v.requires_grad;
  }
  in_piece_.assign(graph.numTasks(), 0);
  value_seen_.assign(graph.numValues(), 0);
  graph_output_.assign(graph.numValues(), 0);
  for (ir::ValueId v : graph.outputs()) graph_output_[v] = 1;
}

// A piece with parameters whose inputs take no gradient (the first stage: token ids,
// images) has only a weight part when ZB-H1 splits its backward ([Note: split backward] in
// frontend/split_backward.h); elsewhere the stage estimate applies ([Note: weight gradient
// share] in stage/stage_cost.h).
namespace {
void weightPartWithoutGradInputs(PieceCost& c, bool grad_inputs) {
  if (!grad_inputs && c.trainedBytes() > 0) c.weight_time = c.backward_time;
}
}  // namespace

// The same numbers as computeCost(makePiece(...)), from marks instead of a built piece:
// the planner asks for thousands of large pieces, and sorting each would dominate.
bool AnalyticCostModel::computeCostDirect(const std::vector<ir::TaskId>& tasks, int64_t rows,
                                          PieceCost* out) {
  const ir::Graph& g = graph();
  const double scale =
      g.batchSize() > 0 ? static_cast<double>(rows) / static_cast<double>(g.batchSize()) : 1.0;
  ++stamp_;
  for (ir::TaskId t : tasks) in_piece_[t] = stamp_;
  PieceCost c;
  bool grad_inputs = false;
  for (ir::TaskId t : tasks) {
    const double f = forwardTime(tasks_[t], scale);
    c.forward_time += f;
    c.backward_time += tasks_[t].backward_factor * f;
    const ir::Task& task = g.task(t);
    for (ir::ValueId v : task.inputs) {
      const ValueInfo& info = values_[v];
      if ((info.producer != ir::kNoId && in_piece_[info.producer] == stamp_) || value_seen_[v] == stamp_) continue;
      value_seen_[v] = stamp_;
      if (!info.tensor) continue;
      const int64_t bytes = info.batch ? info.bytes * rows / g.batchSize() : info.bytes;
      if (info.role == ir::ValueRole::Param) {
        c.param_bytes += bytes;
        if (!info.requires_grad) c.frozen_bytes += bytes;  // [Note: frozen parameters' memory]
      } else if (info.role == ir::ValueRole::Buffer) {
        c.buffer_bytes += bytes;
      } else if (info.role != ir::ValueRole::Constant) {
        c.input_bytes += bytes;
        c.activation_bytes += bytes;
        grad_inputs = grad_inputs || info.requires_grad;
      }
    }
    const bool stash = pureConstant()[t] == 0 && !tasks_[t].free;
    for (ir::ValueId v : task.outputs) {
      const ValueInfo& info = values_[v];
      if (!info.tensor) continue;
      const int64_t bytes = info.batch ? info.bytes * rows / g.batchSize() : info.bytes;
      if (stash) c.activation_bytes += bytes;
      const bool pure = pureConstant()[t] != 0;
      bool used_outside = graph_output_[v] != 0;
      if (!pure && !used_outside) {
        for (ir::TaskId u : g.value(v).consumers) {
          if (in_piece_[u] != stamp_) {
            used_outside = true;
            break;
          }
        }
      }
      if (used_outside) c.output_bytes += bytes;
    }
  }
  weightPartWithoutGradInputs(c, grad_inputs);
  *out = c;
  return true;
}

double AnalyticCostModel::forwardTime(const TaskCost& t, double scale) const {
  if (t.free) return 0.0;
  const double flops = t.flops * (t.flops_scale ? scale : 1.0);
  const double bytes = t.batch_bytes * scale + t.fixed_bytes;
  return std::max(flops / device().peak_flops, bytes / device().memory_bandwidth) +
         device().kernel_overhead;
}

PieceCost AnalyticCostModel::computeCost(const ir::Subgraph& piece, int64_t rows) {
  const ir::Graph& g = graph();
  const double scale =
      g.batchSize() > 0 ? static_cast<double>(rows) / static_cast<double>(g.batchSize()) : 1.0;
  PieceCost c;
  for (ir::TaskId t : piece.tasks) {
    const double f = forwardTime(tasks_[t], scale);
    c.forward_time += f;
    c.backward_time += tasks_[t].backward_factor * f;  // grads w.r.t. inputs and weights
    if (pureConstant()[t] || tasks_[t].free) continue;  // recomputed from constants, never stashed
    for (ir::ValueId v : g.task(t).outputs) {
      const ir::Value& val = g.value(v);
      if (val.isTensor()) c.activation_bytes += valueBytesAt(g, val, rows);
    }
  }
  bool grad_inputs = false;
  for (ir::ValueId v : piece.inputs) {
    const ir::Value& val = g.value(v);
    if (!val.isTensor()) continue;
    const int64_t bytes = valueBytesAt(g, val, rows);
    if (val.role == ir::ValueRole::Param) {
      c.param_bytes += bytes;
      if (!val.requires_grad) c.frozen_bytes += bytes;  // [Note: frozen parameters' memory]
    } else if (val.role == ir::ValueRole::Buffer) {
      c.buffer_bytes += bytes;
    } else if (val.role != ir::ValueRole::Constant) {
      c.input_bytes += bytes;
      c.activation_bytes += bytes;  // the backward reads the piece's inputs too
      grad_inputs = grad_inputs || val.requires_grad;
    }
  }
  for (ir::ValueId v : piece.outputs) {
    const ir::Value& val = g.value(v);
    if (val.isTensor()) c.output_bytes += valueBytesAt(g, val, rows);
  }
  weightPartWithoutGradInputs(c, grad_inputs);
  return c;
}

}  // namespace rannc::partition
