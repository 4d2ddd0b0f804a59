#pragma once
// Tasks of the IR: one operator application each (an aten op, or a prim op that builds
// lists and tuples), with the module it was called in and its source location.
#include <string>
#include <string_view>
#include <vector>

#include "ir/value.h"

namespace rannc::ir {

struct Task {
  TaskId id = kNoId;
  std::string op;  // qualified operator name, "aten::linear"; a glued task's joined by "+"
  std::vector<ValueId> inputs;
  std::vector<ValueId> outputs;
  std::string scope;   // module path that called it, "encoder.layers.3.self_attn"
  std::string source;  // file:line of the Python code that called it

  // Whether it runs operator `name` ("aten::index"): its op, or one of a glued task's
  // ("prim::ListConstruct+aten::index").
  bool runs(std::string_view name) const {
    return ("+" + op + "+").find("+" + std::string(name) + "+") != std::string::npos;
  }
};

}  // namespace rannc::ir
