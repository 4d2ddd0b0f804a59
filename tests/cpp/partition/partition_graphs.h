#pragma once
// Hand-made graphs for the planner tests: every activation carries the batch in
// dimension 0, so costs scale with the micro-batch rows.
#include <string>
#include <vector>

#include "ir/graph.h"
#include "partition/cost/cost_model.h"
#include "synthetic/synthetic.h"

namespace rannc::partition::testing {

inline ir::ValueId act(ir::Graph& g, const std::string& name, int64_t width = 8,
                       ir::ValueRole role = ir::ValueRole::Intermediate) {
  ir::Value v;
  v.name = name;
  v.role = role;
  v.dtype = ir::DType::Float32;
  v.requires_grad = role != ir::ValueRole::Input;  // as traced: activations carry gradients, arguments not
  v.shape = {g.batchSize(), width};
  v.batch_dim = 0;
  v.batch_multiple = 1;
  v.batch_dependent = true;
  return g.addValue(v);
}

inline ir::ValueId param(ir::Graph& g, const std::string& name, std::vector<int64_t> shape) {
  ir::Value v;
  v.name = name;
  v.role = ir::ValueRole::Param;
  v.dtype = ir::DType::Float32;
  v.shape = std::move(shape);
  v.requires_grad = true;
  return g.addValue(v);
}

inline ir::ValueId constant(ir::Graph& g, const std::string& text) {
  ir::Value v;
  v.name = "const_" + text;
  v.kind = ir::ValueKind::Tensor;
  v.role = ir::ValueRole::Constant;
  v.dtype = ir::DType::Float32;
  v.shape = {8, 8};
  v.constant = text;
  return g.addValue(v);
}

// x -> linear_0 -> ... -> linear_{n-1}; layer i has width widths[i] (output features).
inline ir::Graph linearChain(const std::vector<int64_t>& widths, int64_t batch = 8,
                             int64_t in_width = 16) {
  ir::Graph g;
  g.setBatchSize(batch);
  ir::ValueId cur = act(g, "x", in_width, ir::ValueRole::Input);
  g.setInputs({cur});
  int64_t prev = in_width;
  for (size_t i = 0; i < widths.size(); ++i) {
    ir::ValueId w = param(g, "w" + std::to_string(i), {widths[i], prev});
    ir::ValueId out = act(g, "h" + std::to_string(i), widths[i]);
    g.addTask("aten::linear", {cur, w}, {out}, "layer" + std::to_string(i));
    cur = out;
    prev = widths[i];
  }
  g.setOutputs({cur});
  return g;
}

inline ir::Graph uniformChain(int n, int64_t width = 64, int64_t batch = 8) {
  return linearChain(std::vector<int64_t>(n, width), batch, width);
}

// A small device for planner tests: fast enough that stage times are milliseconds.
inline DeviceSpec device(int per_node = 8) {
  DeviceSpec d;
  d.peak_flops = 1e12;
  d.memory_bandwidth = 1e11;
  d.intra_node_bandwidth = 1e10;
  d.inter_node_bandwidth = 1e9;
  d.devices_per_node = per_node;
  return d;
}

// A small, wide ResNet (blocks 1/2/2/1, width x4, 64-pixel images): cheap to plan, with the
// parameter-heavy tail that makes replica choices matter.
inline ir::Graph smallWideResNet() {
  SyntheticResNetOptions r;
  r.blocks = {1, 2, 2, 1};
  r.width_factor = 4;
  r.image = 64;
  return syntheticResNet(r);
}

// A small transformer (12 layers, hidden 128, 32 tokens): plans in milliseconds, with
// enough layers that stage boundaries and micro-batch counts have real choices.
inline ir::Graph smallTransformer() {
  SyntheticTransformerOptions t;
  t.layers = 12;
  t.hidden = 128;
  t.heads = 4;
  t.seq_len = 32;
  t.vocab = 500;
  return syntheticTransformer(t);
}

}  // namespace rannc::partition::testing
