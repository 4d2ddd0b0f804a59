#pragma once
// Tiny hand-made graphs shared by the IR tests.
#include "ir/graph.h"

namespace rannc::ir::testing {

inline ValueId tensor(Graph& g, const std::string& name, ValueRole role = ValueRole::Intermediate,
                      std::vector<int64_t> shape = {4, 8}) {
  Value v;
  v.name = name;
  v.role = role;
  v.dtype = DType::Float32;
  v.shape = std::move(shape);
  return g.addValue(v);
}

// x -> a -> b -> c -> ... (n tasks), each with its own weight.
inline Graph chain(int n) {
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input);
  g.setInputs({x});
  ValueId cur = x;
  for (int i = 0; i < n; ++i) {
    ValueId w = tensor(g, "w" + std::to_string(i), ValueRole::Param, {8, 8});
    ValueId out = tensor(g, "h" + std::to_string(i));
    g.addTask("aten::linear", {cur, w}, {out}, "layer" + std::to_string(i));
    cur = out;
  }
  g.setOutputs({cur});
  return g;
}

// x -> t0 -> (t1, t2) -> t3: a diamond.
inline Graph diamond() {
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input);
  ValueId a = tensor(g, "a"), b = tensor(g, "b"), c = tensor(g, "c"), d = tensor(g, "d");
  g.setInputs({x});
  g.addTask("aten::relu", {x}, {a});
  g.addTask("aten::sin", {a}, {b});
  g.addTask("aten::cos", {a}, {c});
  g.addTask("aten::add", {b, c}, {d});
  g.setOutputs({d});
  return g;
}

// x -> t0 -> t1 -> t2 -> t3, with a skip edge t0 -> t3 (a residual block).
inline Graph skip() {
  Graph g;
  ValueId x = tensor(g, "x", ValueRole::Input);
  ValueId a = tensor(g, "a"), b = tensor(g, "b"), c = tensor(g, "c"), d = tensor(g, "d");
  g.setInputs({x});
  g.addTask("aten::relu", {x}, {a});
  g.addTask("aten::sin", {a}, {b});
  g.addTask("aten::cos", {b}, {c});
  g.addTask("aten::add", {a, c}, {d});
  g.setOutputs({d});
  return g;
}

}  // namespace rannc::ir::testing
