#include "frontend/convert.h"

#include <sstream>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/error.h"
#include "common/hash.h"
#include "common/log.h"
#include "frontend/interpreter.h"

namespace rannc::frontend {
namespace {

using torch::jit::Node;
using JitValue = torch::jit::Value;

// The module path of a node: TorchScript scopes read "layers.0/layers.0.self_attn".
std::string modulePath(const Node* node_in) {
  Node* node = const_cast<Node*>(node_in);  // scope() is not const in TorchScript
  if (!node->scope()) return {};
  std::string name = node->scope()->namesFromRoot();
  auto slash = name.rfind('/');
  return slash == std::string::npos ? name : name.substr(slash + 1);
}

bool isLibraryFrame(const std::string& file) {
  return file.find("/site-packages/torch/") != std::string::npos ||
         file.find("/dist-packages/torch/") != std::string::npos ||
         file.find("rannc/_trace.py") != std::string::npos;
}

// file:line of the innermost Python frame outside torch that led to the node.
std::string sourceLocation(const Node* node) {
  const auto& range = node->sourceRange();
  if (!range.source()) return {};
  std::istringstream lines(range.source()->text_str().str());
  std::string line, first;
  while (std::getline(lines, line)) {
    // Traced ranges hold a Python traceback, innermost first: "path(line): function".
    auto open = line.rfind('(');
    auto close = line.find("):", open == std::string::npos ? 0 : open);
    if (open == std::string::npos || close == std::string::npos) continue;
    std::string loc = line.substr(0, open) + ":" + line.substr(open + 1, close - open - 1);
    if (first.empty()) first = loc;
    if (!isLibraryFrame(line.substr(0, open))) return loc;
  }
  return first;
}

std::string describeNodeIn(const Node* node,
                           const std::unordered_map<std::string, std::string>& classes) {
  std::ostringstream os;
  os << "op " << node->kind().toQualString();
  std::string path = modulePath(node);
  auto it = classes.find(path);
  if (!path.empty() || it != classes.end()) {
    os << " in module '" << (path.empty() ? "<root>" : path) << "'";
    if (it != classes.end()) os << " (" << it->second << ")";
  }
  std::string loc = sourceLocation(node);
  if (!loc.empty()) os << " at " << loc;
  return os.str();
}

ir::DType toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ir::DType::Float32;
    case at::kDouble: return ir::DType::Float64;
    case at::kHalf: return ir::DType::Float16;
    case at::kBFloat16: return ir::DType::BFloat16;
    case at::kLong: return ir::DType::Int64;
    case at::kInt: return ir::DType::Int32;
    case at::kShort: return ir::DType::Int16;
    case at::kChar: return ir::DType::Int8;
    case at::kByte: return ir::DType::UInt8;
    case at::kBool: return ir::DType::Bool;
    case at::kComplexFloat: return ir::DType::Complex64;
    case at::kComplexDouble: return ir::DType::Complex128;
    default: return ir::DType::Undefined;
  }
}

ir::ValueKind toKind(const c10::TypePtr& type) {
  using c10::TypeKind;
  switch (type->kind()) {
    case TypeKind::TensorType: return ir::ValueKind::Tensor;
    case TypeKind::IntType: return ir::ValueKind::Int;
    case TypeKind::FloatType: return ir::ValueKind::Float;
    case TypeKind::BoolType: return ir::ValueKind::Bool;
    case TypeKind::StringType: return ir::ValueKind::String;
    case TypeKind::NoneType: return ir::ValueKind::None;
    case TypeKind::DeviceObjType: return ir::ValueKind::Device;
    case TypeKind::TupleType: return ir::ValueKind::Tuple;
    case TypeKind::ListType: {
      auto elem = type->containedType(0)->kind();
      if (elem == TypeKind::IntType) return ir::ValueKind::IntList;
      if (elem == TypeKind::FloatType) return ir::ValueKind::FloatList;
      if (elem == TypeKind::BoolType) return ir::ValueKind::BoolList;
      if (elem == TypeKind::TensorType) return ir::ValueKind::TensorList;
      return ir::ValueKind::Other;
    }
    default: return ir::ValueKind::Other;
  }
}

// The printed form of a constant; tensors by dtype, shape and a hash of their bytes.
std::string printConstant(const c10::IValue& v) {
  std::ostringstream os;
  if (v.isTensor()) {
    at::Tensor t = v.toTensor().contiguous().cpu();
    os << "tensor(" << t.scalar_type() << ", " << t.sizes() << ", #" << std::hex
       << Fnv1a().bytes(t.data_ptr(), t.numel() * t.element_size()).digest() << ")";
  } else {
    os << v;
  }
  return os.str();
}

bool sameConstant(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) {
    const at::Tensor &x = a.toTensor(), &y = b.toTensor();
    return x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() && at::equal(x, y);
  }
  return printConstant(a) == printConstant(b);
}

// Whether constants a (trace at b1) and b (trace at b2) look like k*b1 and k*b2.
bool looksLikeBatchSize(const c10::IValue& a, const c10::IValue& b, int64_t b1, int64_t b2) {
  auto ints = [](const c10::IValue& v) -> std::vector<int64_t> {
    if (v.isInt()) return {v.toInt()};
    if (v.isIntList()) return v.toIntVector();
    return {};
  };
  std::vector<int64_t> x = ints(a), y = ints(b);
  if (x.empty() || x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] != y[i] && x[i] > 0 && x[i] % b1 == 0 && y[i] == x[i] / b1 * b2) return true;
  }
  return false;
}

// Both traces must be the same program: same ops, same wiring, same constants.
void checkSameProgram(const TraceExample& a, const TraceExample& b,
                      const std::unordered_map<std::string, std::string>& classes) {
  std::unordered_map<const JitValue*, int> ia, ib;
  int next = 0;
  for (auto* v : a.graph->inputs()) ia[v] = next++;
  next = 0;
  for (auto* v : b.graph->inputs()) ib[v] = next++;
  std::vector<Node*> na(a.graph->nodes().begin(), a.graph->nodes().end());
  std::vector<Node*> nb(b.graph->nodes().begin(), b.graph->nodes().end());
  auto differs = [&](Node* x, Node* y, const std::string& how) {
    std::ostringstream os;
    os << "the traced program depends on the input values or on the batch size (Python "
          "control flow on tensor data?): traced at batch size "
       << a.batch_size << " it runs " << describeNodeIn(x, classes) << ", traced at batch size "
       << b.batch_size << " it runs " << (y ? describeNodeIn(y, classes) : "nothing more") << " "
       << how << ". Make the computation independent of tensor values (torch.where instead of "
       << "`if`, no .item()/.tolist() in forward).";
    throw TraceError(os.str());
  };
  const size_t n = std::min(na.size(), nb.size());
  for (size_t i = 0; i < n; ++i) {
    Node *x = na[i], *y = nb[i];
    if (x->kind() != y->kind()) differs(x, y, "instead");
    if (x->inputs().size() != y->inputs().size() || x->outputs().size() != y->outputs().size()) {
      differs(x, y, "with other arguments");
    }
    for (size_t k = 0; k < x->inputs().size(); ++k) {
      if (ia.at(x->inputs()[k]) != ib.at(y->inputs()[k])) differs(x, y, "on other inputs");
    }
    if (x->kind() == c10::prim::Constant) {
      c10::IValue cx = *torch::jit::toIValue(x->output());
      c10::IValue cy = *torch::jit::toIValue(y->output());
      if (!sameConstant(cx, cy)) {
        // Name the op that consumes the constant: that is where the user wrote it.
        const Node* user = x;
        const JitValue* through = x->output();
        while (!through->uses().empty()) {
          user = through->uses()[0].user;
          const auto kind = user->kind();
          if (kind != c10::prim::ListConstruct && kind != c10::prim::TupleConstruct) break;
          through = user->output();
        }
        std::ostringstream os;
        if (looksLikeBatchSize(cx, cy, a.batch_size, b.batch_size)) {
          os << "the batch size is baked into a shape: " << describeNodeIn(user, classes)
             << " uses the constant " << printConstant(cx) << " when traced at batch size "
             << a.batch_size << " and " << printConstant(cy) << " at batch size " << b.batch_size
             << ". Compute it from the input (x.size(0), or -1 in view/reshape) so that "
                "micro-batches of any size work.";
        } else {
          os << "the traced program depends on the input values: " << describeNodeIn(user, classes)
             << " uses a constant that was " << printConstant(cx) << " in one trace and "
             << printConstant(cy) << " in another (a tensor turned into a Python number, or "
             << "control flow on tensor data?).";
        }
        throw TraceError(os.str());
      }
    }
    for (size_t k = 0; k < x->outputs().size(); ++k) {
      ia[x->outputs()[k]] = next;
      ib[y->outputs()[k]] = next++;
    }
  }
  if (na.size() != nb.size()) {
    differs(na.size() > n ? na[n] : nb[n], nullptr, "(the traces differ in length)");
  }
  if (a.graph->outputs().size() != b.graph->outputs().size()) {
    throw TraceError("the traced program returns " + std::to_string(a.graph->outputs().size()) +
                     " tensors at batch size " + std::to_string(a.batch_size) + " but " +
                     std::to_string(b.graph->outputs().size()) + " at batch size " +
                     std::to_string(b.batch_size) + ": the outputs depend on the inputs");
  }
}

// The operator a node runs. The prim ops that build and take apart lists and tuples
// have no registered operator (TorchScript's interpreter runs them as instructions, with
// helpers it does not export), so they are written here.
torch::jit::Operation resolveOperation(Node* node,
                                       const std::unordered_map<std::string, std::string>& classes) {
  using torch::jit::Stack;
  const size_t nin = node->inputs().size(), nout = node->outputs().size();
  auto popN = [](Stack& stack, size_t n) {
    std::vector<c10::IValue> items(std::make_move_iterator(stack.end() - n),
                                   std::make_move_iterator(stack.end()));
    stack.erase(stack.end() - n, stack.end());
    return items;
  };
  switch (node->kind()) {
    case c10::prim::ListConstruct: {
      c10::TypePtr elem = node->output()->type()->containedType(0);
      return torch::jit::Operation([elem, nin, popN](Stack& stack) {
        c10::impl::GenericList list(elem);
        for (auto& v : popN(stack, nin)) list.push_back(std::move(v));
        stack.emplace_back(std::move(list));
      });
    }
    case c10::prim::ListUnpack:
      return torch::jit::Operation([nout](Stack& stack) {
        c10::IValue list = std::move(stack.back());
        stack.pop_back();
        auto items = list.toListRef();
        RANNC_CHECK(items.size() == nout, "list of " << items.size() << " unpacked into " << nout);
        stack.insert(stack.end(), items.begin(), items.end());
      });
    case c10::prim::TupleConstruct:
      return torch::jit::Operation([nin, popN](Stack& stack) {
        stack.emplace_back(c10::ivalue::Tuple::create(popN(stack, nin)));
      });
    case c10::prim::TupleUnpack:
      return torch::jit::Operation([](Stack& stack) {
        c10::IValue tuple = std::move(stack.back());
        stack.pop_back();
        const auto& items = tuple.toTupleRef().elements();
        stack.insert(stack.end(), items.begin(), items.end());
      });
    case c10::prim::DictConstruct: {
      c10::TypePtr type = node->output()->type();
      return torch::jit::Operation([type, nin, popN](Stack& stack) {
        c10::impl::GenericDict dict(type->containedType(0), type->containedType(1));
        auto items = popN(stack, nin);
        for (size_t i = 0; i + 1 < items.size(); i += 2) dict.insert(items[i], items[i + 1]);
        stack.emplace_back(std::move(dict));
      });
    }
  default:
      break;
  }
  if (!node->maybeOperator()) {
    throw TraceError("rannc cannot run " + describeNodeIn(node, classes) +
                     ": no operator is registered for it");
  }
  return node->getOperation();
}

struct Observed {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::ScalarType> dtypes;
  std::vector<std::string> scalars;  // printed ints, floats, bools and lists of them
  std::vector<char> seen;
};

bool isScalarLike(const c10::IValue& v) {
  return v.isInt() || v.isDouble() || v.isBool() || v.isIntList() || v.isDoubleList() ||
         v.isBoolList();
}

Observed observe(const TracedModel& model, const std::vector<at::Tensor>& inputs) {
  Observed o;
  const int n = model.graph.numValues();
  o.shapes.resize(n);
  o.dtypes.resize(n, at::ScalarType::Undefined);
  o.scalars.resize(n);
  o.seen.resize(n, 0);
  std::vector<c10::IValue> ins(inputs.begin(), inputs.end());
  torch::NoGradGuard no_grad;
  runGraph(model, ins, [&](ir::ValueId id, const c10::IValue& v) {
    o.seen[id] = 1;
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      o.shapes[id] = t.sizes().vec();
      o.dtypes[id] = t.scalar_type();
    } else if (isScalarLike(v)) {
      std::ostringstream os;
      os << v;
      o.scalars[id] = os.str();
    }
  });
  return o;
}

// [Note: batch values] A tensor is a batch value when exactly one dimension scales with
// the batch size by a whole factor between the runs at both sizes. A value depends on the
// batch when a batch input reaches it, except through the sizes of non-batch dimensions:
// a non-tensor (a size, a shape list) depends on the batch only if it differs between the
// two runs, so a causal mask built from the sequence length is the same for every
// micro-batch.
void findBatchValues(ir::Graph& ir, const Observed& at1, const Observed& at2, int64_t b1,
                     int64_t b2) {
  std::vector<char> dep(ir.numValues(), 0);
  for (ir::ValueId id : ir.inputs()) dep[id] = ir.value(id).role == ir::ValueRole::Input;
  for (ir::TaskId t : ir.topologicalOrder()) {
    bool any = false;
    for (ir::ValueId in : ir.task(t).inputs) any = any || dep[in];
    for (ir::ValueId out : ir.task(t).outputs) {
      const bool tensor = ir.value(out).isTensor();
      dep[out] = any && (tensor || !at1.seen[out] || at1.scalars[out].empty() ||
                         at1.scalars[out] != at2.scalars[out]);
    }
  }
  for (ir::ValueId id = 0; id < ir.numValues(); ++id) {
    ir::Value& v = ir.mutableValue(id);
    if (!at1.seen[id]) continue;
    v.dtype = toDType(at1.dtypes[id]);
    v.shape = at1.shapes[id];
    v.batch_dependent = dep[id];
    if (!v.isTensor() || !at2.seen[id]) continue;
    const auto &s1 = at1.shapes[id], &s2 = at2.shapes[id];
    if (s1.size() != s2.size()) continue;
    int changed = -1, nchanged = 0;
    for (size_t d = 0; d < s1.size(); ++d) {
      if (s1[d] != s2[d]) changed = static_cast<int>(d), ++nchanged;
    }
    if (nchanged == 1 && s1[changed] % b1 == 0 && s1[changed] / b1 * b2 == s2[changed]) {
      v.batch_dim = changed;
      v.batch_multiple = s1[changed] / b1;
      v.batch_dependent = true;
    } else if (nchanged > 0) {
      v.batch_dependent = true;
      if (logEnabled(LogLevel::Debug)) {
        logDebug("value " + ir::describe(v) +
                 " changes shape with the batch size but no dimension scales with it");
      }
    }
  }
}

}  // namespace

std::string TracedModel::describeTask(ir::TaskId task) const {
  return describeNodeIn(task_nodes.at(task), module_classes);
}

std::shared_ptr<TracedModel> buildTracedModel(
    const TraceExample& first, const TraceExample& second, const std::vector<GraphInput>& inputs,
    std::unordered_map<std::string, std::string> module_classes) {
  if (first.batch_size == second.batch_size) {
    throw TraceError("the two traces need different batch sizes (both are " +
                     std::to_string(first.batch_size) + ")");
  }
  const auto& g = first.graph;
  if (g->inputs().size() != inputs.size()) {
    throw TraceError("the traced graph has " + std::to_string(g->inputs().size()) +
                     " inputs but " + std::to_string(inputs.size()) + " were described");
  }
  checkSameProgram(first, second, module_classes);

  auto model = std::make_shared<TracedModel>();
  model->jit_graph = g;
  model->module_classes = std::move(module_classes);
  ir::Graph& ir = model->graph;
  ir.setBatchSize(first.batch_size);
  std::unordered_map<const JitValue*, ir::ValueId> ids;

  auto addValue = [&](const JitValue* v, ir::ValueRole role, std::string name) {
    ir::Value val;
    val.name = name.empty() ? (v->hasDebugName() ? v->debugName() : "") : std::move(name);
    val.kind = toKind(v->type());
    val.role = role;
    ir::ValueId id = ir.addValue(std::move(val));
    ids[v] = id;
    return id;
  };

  std::vector<ir::ValueId> graph_inputs;
  for (size_t i = 0; i < inputs.size(); ++i) {
    graph_inputs.push_back(addValue(g->inputs()[i], inputs[i].role, inputs[i].name));
  }
  ir.setInputs(graph_inputs);

  for (Node* node : g->nodes()) {
    if (!node->blocks().empty()) {
      throw TraceError(describeNodeIn(node, model->module_classes) +
                       " has nested blocks, which a trace should not produce");
    }
    if (node->kind() == c10::prim::Constant) {
      ir::ValueId id = addValue(node->output(), ir::ValueRole::Constant, "");
      c10::IValue c = *torch::jit::toIValue(node->output());
      ir.mutableValue(id).constant = printConstant(c);
      if (c.isTensor()) {
        const at::Tensor& t = c.toTensor();
        ir.mutableValue(id).dtype = toDType(t.scalar_type());
        ir.mutableValue(id).shape = t.sizes().vec();
      }
      model->constants.resize(ir.numValues());
      model->constants[id] = std::move(c);
      continue;
    }
    std::vector<ir::ValueId> ins, outs;
    for (const JitValue* v : node->inputs()) ins.push_back(ids.at(v));
    for (const JitValue* v : node->outputs()) {
      outs.push_back(addValue(v, ir::ValueRole::Intermediate, ""));
    }
    torch::jit::Operation operation = resolveOperation(node, model->module_classes);
    ir.addTask(node->kind().toQualString(), std::move(ins), std::move(outs), modulePath(node),
               sourceLocation(node));
    model->task_nodes.push_back(node);
    model->operations.push_back(std::move(operation));
  }
  model->constants.resize(ir.numValues());
  std::vector<ir::ValueId> outs;
  for (const JitValue* v : g->outputs()) outs.push_back(ids.at(v));
  ir.setOutputs(outs);
  ir.validate();

  // Shapes and dtypes as the graph really computes them, at both batch sizes.
  Observed at1 = observe(*model, first.inputs);
  Observed at2 = observe(*model, second.inputs);
  findBatchValues(ir, at1, at2, first.batch_size, second.batch_size);
  // Gradients flow from parameters (and inputs that require grad) through float tensors.
  for (size_t i = 0; i < ir.inputs().size(); ++i) {
    ir.mutableValue(ir.inputs()[i]).requires_grad = first.inputs.at(i).requires_grad();
  }
  for (ir::TaskId t : ir.topologicalOrder()) {
    bool grad = false;
    for (ir::ValueId in : ir.task(t).inputs) grad = grad || ir.value(in).requires_grad;
    for (ir::ValueId out : ir.task(t).outputs) {
      ir::Value& v = ir.mutableValue(out);
      // Lists and tuples of tensors carry gradients to what is unpacked from them.
      const bool container = v.kind == ir::ValueKind::TensorList ||
                             v.kind == ir::ValueKind::Tuple || v.kind == ir::ValueKind::Other;
      const bool floating = v.dtype == ir::DType::Float32 || v.dtype == ir::DType::Float64 ||
                            v.dtype == ir::DType::Float16 || v.dtype == ir::DType::BFloat16;
      v.requires_grad = grad && (container || (v.isTensor() && floating));
    }
  }
  for (ir::ValueId id : ir.outputs()) {
    ir::Value& v = ir.mutableValue(id);
    v.is_loss = v.isTensor() && v.shape.empty() && v.batch_dependent && v.requires_grad;
  }
  logInfo("traced: " + std::to_string(ir.numTasks()) + " tasks, " + std::to_string(ir.numValues()) +
          " values, " +
          std::to_string(std::count_if(ir.values().begin(), ir.values().end(),
                                       [](const ir::Value& v) { return v.isBatch(); })) +
          " batch values");
  return model;
}

}  // namespace rannc::frontend
