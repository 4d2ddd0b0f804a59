#include "frontend/interpreter.h"

#include "common/error.h"
#include "frontend/dtypes.h"

namespace rannc::frontend {
namespace {

std::string joinShape(c10::IntArrayRef sizes) {
  std::string out;
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out;
}

// The arguments a failed task ran on against what the trace saw, so that an error names
// the one that differs (a dtype autocast did not cast, a device, a shape): "Float32[4, 8]
// on cuda:0 (traced BFloat16[4, 8])".
std::string describeArguments(const TracedModel& model, const ir::Task& task,
                              const std::vector<c10::IValue>& env) {
  std::string out;
  for (size_t i = 0; i < task.inputs.size(); ++i) {
    const ir::Value& traced = model.graph.value(task.inputs[i]);
    const c10::IValue& v = traced.isConstant() ? model.constants[task.inputs[i]] : env[task.inputs[i]];
    std::string item;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      item = t.defined() ? std::string(ir::dtypeName(toDType(t.scalar_type()))) + "[" + joinShape(t.sizes()) +
                               "] on " + t.device().str()
                         : "undefined tensor";
      if (traced.kind == ir::ValueKind::Tensor && traced.dtype != ir::DType::Undefined) {
        item += " (traced " + std::string(ir::dtypeName(traced.dtype)) + "[" + joinShape(traced.shape) + "])";
      }
    } else if (traced.isConstant()) {
      continue;
    } else {
      item = v.tagKind();
    }
    out += (out.empty() ? "" : ", ") + ("#" + std::to_string(i) + " " + item);
  }
  return out.empty() ? "" : "; its arguments: " + out;
}

void runTaskOn(const TracedModel& model, ir::TaskId t, std::vector<c10::IValue>& env,
               torch::jit::Stack& stack, const ValueObserver& observe) {
  const ir::Task& task = model.graph.task(t);
  stack.clear();
  for (ir::ValueId in : task.inputs) {
    const c10::IValue& v = model.graph.value(in).isConstant() ? model.constants[in] : env[in];
    stack.push_back(v);
  }
  try {
    model.operations[t](stack);
  } catch (const c10::Error& e) {
    throw Error("running " + model.describeTask(t) + " failed: " + e.what_without_backtrace() +
                describeArguments(model, task, env));
  }
  RANNC_CHECK(stack.size() == task.outputs.size(),
              model.describeTask(t) << " left " << stack.size() << " values, expected "
                                    << task.outputs.size());
  for (size_t i = 0; i < task.outputs.size(); ++i) {
    env[task.outputs[i]] = std::move(stack[i]);
    if (observe) observe(task.outputs[i], env[task.outputs[i]]);
  }
}

// Runs `tasks` over an environment indexed by value id.
void runTasks(const TracedModel& model, const std::vector<ir::TaskId>& tasks,
              std::vector<c10::IValue>& env, const ValueObserver& observe) {
  torch::jit::Stack stack;
  for (ir::TaskId t : tasks) runTaskOn(model, t, env, stack, observe);
}

c10::IValue fetch(const TracedModel& model, const std::vector<c10::IValue>& env, ir::ValueId id) {
  return model.graph.value(id).isConstant() ? model.constants[id] : env[id];
}

}  // namespace

bool writesInputs(const TracedModel& model, ir::TaskId task) {
  const c10::FunctionSchema* schema = model.task_nodes.at(task)->maybeSchema();
  return schema != nullptr && schema->is_mutable();
}

void runTask(const TracedModel& model, ir::TaskId task, std::vector<c10::IValue>& env) {
  torch::jit::Stack stack;
  runTaskOn(model, task, env, stack, nullptr);
}

std::vector<c10::IValue> runGraph(const TracedModel& model, const std::vector<c10::IValue>& inputs,
                                  const ValueObserver& observe) {
  const ir::Graph& g = model.graph;
  if (inputs.size() != g.inputs().size()) {
    throw Error("the graph takes " + std::to_string(g.inputs().size()) + " inputs, got " +
                std::to_string(inputs.size()));
  }
  std::vector<c10::IValue> env(g.numValues());
  for (size_t i = 0; i < inputs.size(); ++i) {
    env[g.inputs()[i]] = inputs[i];
    if (observe) observe(g.inputs()[i], inputs[i]);
  }
  runTasks(model, model.order, env, observe);
  std::vector<c10::IValue> outs;
  for (ir::ValueId id : g.outputs()) outs.push_back(fetch(model, env, id));
  return outs;
}

std::vector<ir::ValueId> runPieceInputs(const TracedModel& model, const ir::Subgraph& piece) {
  std::vector<ir::ValueId> ids;
  for (ir::ValueId id : piece.inputs) {
    if (!model.graph.value(id).isConstant()) ids.push_back(id);
  }
  return ids;
}

std::vector<c10::IValue> runPiece(const TracedModel& model, const ir::Subgraph& piece,
                                  const std::vector<c10::IValue>& inputs) {
  std::vector<ir::ValueId> needed = runPieceInputs(model, piece);
  if (inputs.size() != needed.size()) {
    throw Error("the piece takes " + std::to_string(needed.size()) + " inputs, got " +
                std::to_string(inputs.size()));
  }
  std::vector<c10::IValue> env(model.graph.numValues());
  for (size_t i = 0; i < needed.size(); ++i) env[needed[i]] = inputs[i];
  runTasks(model, piece.tasks, env, nullptr);
  std::vector<c10::IValue> outs;
  for (ir::ValueId id : piece.outputs) outs.push_back(env[id]);
  return outs;
}

std::vector<c10::IValue> runChained(const TracedModel& model,
                                    const std::vector<ir::Subgraph>& pieces,
                                    const std::vector<c10::IValue>& inputs) {
  const ir::Graph& g = model.graph;
  if (inputs.size() != g.inputs().size()) {
    throw Error("the graph takes " + std::to_string(g.inputs().size()) + " inputs, got " +
                std::to_string(inputs.size()));
  }
  // What has crossed a boundary so far: graph inputs and the outputs of earlier pieces.
  std::vector<c10::IValue> available(g.numValues());
  for (size_t i = 0; i < inputs.size(); ++i) available[g.inputs()[i]] = inputs[i];
  for (const ir::Subgraph& piece : pieces) {
    std::vector<c10::IValue> ins;
    for (ir::ValueId id : runPieceInputs(model, piece)) {
      RANNC_CHECK(!available[id].isNone() || g.value(id).kind == ir::ValueKind::None,
                  "piece input " << ir::describe(g.value(id)) << " is not produced by an earlier piece");
      ins.push_back(available[id]);
    }
    std::vector<c10::IValue> outs = runPiece(model, piece, ins);
    for (size_t i = 0; i < outs.size(); ++i) available[piece.outputs[i]] = std::move(outs[i]);
  }
  std::vector<c10::IValue> outs;
  for (ir::ValueId id : g.outputs()) outs.push_back(fetch(model, available, id));
  return outs;
}

}  // namespace rannc::frontend
