#include "frontend/convert.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <functional>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "common/error.h"
#include "common/hash.h"
#include "common/log.h"
#include "frontend/dtypes.h"
#include "frontend/interpreter.h"
#include "frontend/masked_losses.h"
#include "frontend/scalar_updates.h"
#include "frontend/state_shapes.h"
#include "ir/reduction.h"

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

// The printed form of a constant; tensors by dtype, shape and a hash of their bytes, a
// device by its type: every device constant runs on the stage's device ([Note: traced
// devices]), and ranks that traced on cuda:0 and cuda:1 must hash the same graph.
std::string printConstant(const c10::IValue& v) {
  std::ostringstream os;
  if (v.isDevice()) {
    os << c10::DeviceTypeName(v.toDevice().type(), /*lower_case=*/true);
  } else if (v.isTensor()) {
    at::Tensor t = v.toTensor().contiguous().cpu();
    os << "tensor(" << t.scalar_type() << ", " << t.sizes() << ", #" << std::hex
       << Fnv1a().bytes(t.data_ptr(), t.numel() * t.element_size()).digest() << ")";
  } else {
    os << v;
  }
  return os.str();
}

// A constant as an error names it: a small tensor by its values (`tensor(4)`, the tracer's
// 0-dim tensor of a Python int), else as printConstant does.
std::string readableConstant(const c10::IValue& v) {
  if (!v.isTensor() || v.toTensor().numel() > 8) return printConstant(v);
  const at::Tensor t = v.toTensor().detach().cpu().flatten();
  std::ostringstream os;
  os << "tensor(" << (v.toTensor().dim() == 0 ? "" : "[");
  for (int64_t i = 0; i < t.numel(); ++i) os << (i ? ", " : "") << t[i].item();
  os << (v.toTensor().dim() == 0 ? "" : "]") << ")";
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
    // `loss / len(x)`: the tracer makes a 0-dim integer tensor constant of the Python int
    if (v.isTensor() && v.toTensor().dim() == 0 && !v.toTensor().is_floating_point() &&
        !v.toTensor().is_complex() && v.toTensor().scalar_type() != at::kBool) {
      return {v.toTensor().item<int64_t>()};
    }
    return {};
  };
  std::vector<int64_t> x = ints(a), y = ints(b);
  if (x.empty() || x.size() != y.size()) return false;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i] != y[i] && x[i] > 0 && x[i] % b1 == 0 && y[i] == x[i] / b1 * b2) return true;
    // a Python int made from it: a mixture of experts' capacity, int(f * tokens / experts)
    // (not a tensor constant: `x * 2` and `x - 1` on two branches are 2 and 1 by chance)
    if (a.isInt() && x[i] != y[i] && x[i] > 0 && y[i] > 0 && x[i] * b2 == y[i] * b1) return true;
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
    if (a.batch_size == 1 || b.batch_size == 1) {
      // transformers' masks expand position ids only for several rows where no
      // attention_mask is given (masking_utils), as other models take a path of their own
      // for one row
      os << " Traced at one row, a model may take a path of its own for a single row "
            "(transformers without an attention_mask): pass an attention_mask, or give each "
            "rank 2 rows or more.";
    }
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
          os << "the batch size is baked into a shape, or a number made from it: "
             << describeNodeIn(user, classes) << " uses the constant " << readableConstant(cx)
             << " when traced at batch size " << a.batch_size << " and " << readableConstant(cy)
             << " at batch size " << b.batch_size
             << ". Compute it from the input with tensor ops (x.size(0), or -1 in view/reshape; "
                "not len(x) or int(...) of it, which a trace fixes: a capacity of experts as "
                "int(f * tokens / experts) is one) so that micro-batches of any size work.";
        } else {
          os << "the traced program depends on the input values: " << describeNodeIn(user, classes)
             << " uses a constant that was " << readableConstant(cx) << " in one trace and "
             << readableConstant(cy) << " in another (a tensor turned into a Python number, "
             << "control flow on tensor data, or a tensor made outside torch's ops, such as a "
             << "mask drawn with numpy's random numbers?).";
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

PythonOpFactory& pythonOpFactory() {
  static PythonOpFactory factory;
  return factory;
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
        // The trace unrolled a Python loop or unpacking over the list: its length is fixed.
        TORCH_CHECK(items.size() == nout, "it unpacks ", items.size(), " values where the trace unpacked ",
                    nout, ": the model unpacks or loops over a tensor whose length depends on the data ",
                    "(for i in x.nonzero(): ...) or on the batch size, which a trace fixes at its length ",
                    "when traced; compute it with tensor ops of fixed shape (transformers' mixture-of-experts ",
                    "models: experts_implementation=\"batched_mm\" or \"grouped_mm\")");
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
    case c10::prim::PythonOp:  // [Note: Functions of several outputs] in convert.h
      if (pythonOpFactory()) return pythonOpFactory()(node);
      break;
  default:
      break;
  }
  if (!node->maybeOperator()) {
    throw TraceError("rannc cannot run " + describeNodeIn(node, classes) +
                     ": no operator is registered for it");
  }
  return node->getOperation();
}

// A run of TorchScript nodes executed as one IR task (see [Note: fused list ops]).
struct TaskGroup {
  std::vector<Node*> nodes;                  // in graph order
  std::vector<const JitValue*> inputs;       // read from outside, in first-use order
  std::vector<const JitValue*> outputs;      // used outside, returned, or unused

  // The node that names the task in messages: the first that is not a list prim.
  Node* mainNode() const {
    for (Node* n : nodes) {
      const auto k = n->kind();
      if (k != c10::prim::ListConstruct && k != c10::prim::ListUnpack &&
          k != c10::prim::TupleConstruct && k != c10::prim::TupleUnpack) {
        return n;
      }
    }
    return nodes.front();
  }
};

bool isTensorContainer(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TupleType) return true;
  if (type->kind() != c10::TypeKind::ListType) return false;
  const auto elem = type->containedType(0);
  return elem->kind() == c10::TypeKind::TensorType ||
         (elem->kind() == c10::TypeKind::OptionalType &&
          elem->containedType(0)->kind() == c10::TypeKind::TensorType);
}

std::vector<TaskGroup> groupListOps(const std::vector<Node*>& nodes,
                                    const std::unordered_set<const JitValue*>& glue) {
  std::unordered_map<const Node*, int> index;
  for (size_t i = 0; i < nodes.size(); ++i) index[nodes[i]] = static_cast<int>(i);
  std::vector<int> parent(nodes.size());
  for (size_t i = 0; i < parent.size(); ++i) parent[i] = static_cast<int>(i);
  std::function<int(int)> find = [&](int x) { return parent[x] == x ? x : parent[x] = find(parent[x]); };
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (const JitValue* out : nodes[i]->outputs()) {
      if (!isTensorContainer(out->type()) && !glue.count(out)) continue;
      for (const auto& use : out->uses()) {
        auto it = index.find(use.user);
        if (it != index.end()) parent[find(it->second)] = find(static_cast<int>(i));
      }
    }
  }
  // Convex closure: a node on a path from one member of a group to another joins it, so
  // every fused task can still be ordered (nodes are in a topological order).
  for (bool changed = true; changed;) {
    changed = false;
    std::unordered_map<int, std::pair<int, int>> range;  // root -> first and last member
    for (size_t i = 0; i < nodes.size(); ++i) {
      auto [it, fresh] = range.emplace(find(static_cast<int>(i)), std::make_pair(int(i), int(i)));
      if (!fresh) it->second.second = static_cast<int>(i);
    }
    for (const auto& [root, span] : range) {
      if (span.first == span.second) continue;
      std::vector<char> reached(span.second - span.first + 1, 0), reaching(reached.size(), 0);
      for (int i = span.first; i <= span.second; ++i) {
        bool r = find(i) == root;
        for (const JitValue* in : nodes[i]->inputs()) {
          auto it = index.find(in->node());
          if (it != index.end() && it->second >= span.first && reached[it->second - span.first]) r = true;
        }
        reached[i - span.first] = r;
      }
      for (int i = span.second; i >= span.first; --i) {
        bool r = find(i) == root;
        for (const JitValue* out : nodes[i]->outputs()) {
          for (const auto& use : out->uses()) {
            auto it = index.find(use.user);
            if (it != index.end() && it->second <= span.second && reaching[it->second - span.first]) r = true;
          }
        }
        reaching[i - span.first] = r;
        if (r && reached[i - span.first] && find(i) != root) {
          parent[find(i)] = root;
          changed = true;
        }
      }
      if (changed) break;  // ranges moved: recompute them
    }
  }
  std::unordered_map<int, int> group_of_root;
  std::vector<TaskGroup> groups;
  std::vector<int> group_of(nodes.size());
  for (size_t i = 0; i < nodes.size(); ++i) {
    auto [it, fresh] = group_of_root.emplace(find(static_cast<int>(i)), static_cast<int>(groups.size()));
    if (fresh) groups.emplace_back();
    group_of[i] = it->second;
    groups[it->second].nodes.push_back(nodes[i]);
  }
  for (TaskGroup& group : groups) {
    const int gid = group_of[index.at(group.nodes.front())];
    auto inside = [&](const Node* n) {
      auto it = index.find(n);
      return it != index.end() && group_of[it->second] == gid;
    };
    std::unordered_set<const JitValue*> seen;
    for (Node* n : group.nodes) {
      for (const JitValue* v : n->inputs()) {
        if (!inside(v->node()) && seen.insert(v).second) group.inputs.push_back(v);
      }
      for (const JitValue* v : n->outputs()) {
        bool outside = v->uses().empty();  // unused results stay visible (buffers' add_)
        for (const auto& use : v->uses()) outside = outside || !inside(use.user);
        if (outside) group.outputs.push_back(v);
      }
    }
  }
  return groups;
}

// One operation running a group's nodes in order over slots: the group's inputs first, then
// every node's outputs.
torch::jit::Operation fuseOperations(const TaskGroup& group,
                                     const std::unordered_map<std::string, std::string>& classes) {
  struct Step {
    torch::jit::Operation op;
    std::vector<int> ins, outs;
  };
  std::unordered_map<const JitValue*, int> slot;
  for (const JitValue* v : group.inputs) slot.emplace(v, static_cast<int>(slot.size()));
  auto steps = std::make_shared<std::vector<Step>>();
  for (Node* n : group.nodes) {
    Step step{resolveOperation(n, classes), {}, {}};
    for (const JitValue* v : n->inputs()) step.ins.push_back(slot.at(v));
    for (const JitValue* v : n->outputs()) {
      step.outs.push_back(static_cast<int>(slot.size()));
      slot.emplace(v, static_cast<int>(slot.size()));
    }
    steps->push_back(std::move(step));
  }
  std::vector<int> results;
  for (const JitValue* v : group.outputs) results.push_back(slot.at(v));
  const size_t nin = group.inputs.size(), nslots = slot.size();
  return torch::jit::Operation([steps, results, nin, nslots](torch::jit::Stack& stack) {
    std::vector<c10::IValue> slots(nslots);
    for (size_t i = 0; i < nin; ++i) slots[i] = std::move(stack[stack.size() - nin + i]);
    stack.erase(stack.end() - nin, stack.end());
    torch::jit::Stack local;
    for (Step& step : *steps) {
      local.clear();
      for (int i : step.ins) local.push_back(slots[i]);
      step.op(local);
      for (size_t i = 0; i < step.outs.size(); ++i) slots[step.outs[i]] = std::move(local[i]);
    }
    for (int i : results) stack.push_back(std::move(slots[i]));
  });
}

struct Observed {
  std::vector<std::vector<int64_t>> shapes;
  std::vector<at::ScalarType> dtypes;
  std::vector<std::string> scalars;  // printed ints, floats, bools and lists of them
  std::vector<std::vector<int64_t>> ints;  // ints, int lists, 0-dim integer tensors
  std::vector<char> has_ints;
  std::vector<at::Tensor> tensors;  // kept values (the first run only)
  // Per value, against the kept run: -1 not compared, 0 rows differ, 1 the common rows agree.
  std::vector<int8_t> rows_agree;
  std::vector<char> seen;
};

bool isScalarLike(const c10::IValue& v) {
  return v.isInt() || v.isDouble() || v.isBool() || v.isIntList() || v.isDoubleList() ||
         v.isBoolList();
}

// at::allclose(x, y, rtol, atol, equal_nan=true) for host tensors of one real dtype and the
// same sizes (any strides), in one pass without temporaries or copies, stopping at the
// first row that disagrees: the rows check runs on every batch value of the model, and
// at::allclose's temporaries made it 1.2 s of BERT-base's 7 s of tracing (session 14).
template <typename T>
bool allCloseOnHost(const at::Tensor& x, const at::Tensor& y, double rtol, double atol) {
  auto close = [rtol, atol](T a, T b) {
    const double u = static_cast<double>(a), v = static_cast<double>(b);
    return u == v || std::abs(u - v) <= atol + rtol * std::abs(v) || (std::isnan(u) && std::isnan(v));
  };
  const T* p = x.const_data_ptr<T>();
  const T* q = y.const_data_ptr<T>();
  if (x.numel() == 0) return true;
  if (x.dim() == 0) return close(*p, *q);
  // Rows along the last dimension, the other dimensions walked as an odometer.
  const int last = static_cast<int>(x.dim()) - 1;
  const at::IntArrayRef sizes = x.sizes(), xs = x.strides(), ys = y.strides();
  const int64_t inner = sizes[last], sx = xs[last], sy = ys[last];
  std::vector<int64_t> index(last, 0);
  int64_t ox = 0, oy = 0;
  for (int64_t row = 0, rows = x.numel() / inner; row < rows; ++row) {
    bool agree = true;
    if (sx == 1 && sy == 1) {
      for (int64_t i = 0; i < inner; ++i) agree &= close(p[ox + i], q[oy + i]);
    } else {
      for (int64_t i = 0; i < inner; ++i) agree &= close(p[ox + i * sx], q[oy + i * sy]);
    }
    if (!agree) return false;
    for (int d = last - 1; d >= 0; --d) {
      if (++index[d] < sizes[d]) {
        ox += xs[d], oy += ys[d];
        break;
      }
      ox -= xs[d] * (sizes[d] - 1), oy -= ys[d] * (sizes[d] - 1);
      index[d] = 0;
    }
  }
  return true;
}

// Whether the `entries` along `dim` that two observations of one value share agree: the
// smaller's and the larger's last ones (the smaller run's inputs are the larger's trailing
// rows). True for a value whose rows are computed row by row; false where rows are
// interleaved ((seq*batch, hidden) reshapes, say) and where a row's value is its position
// ([Note: row positions]).
//
// [Note: rows in low precision] The tolerance follows the dtype. A bf16 matmul may round a
// row differently at another batch size (oneDNN on CPUs with AMX blocks the rows by the
// batch), so a row computed row by row can differ by an ulp or two of bf16 (0.4% each)
// between the two observations; against float32's 1e-4 every such value read as
// interleaved and was glued to its neighbours (most likely why BERT-large's program
// under bf16 autocast had 446 tasks on an H200's host, against 1079 in fp32, and failed
// there). A value in half precision, or computed from one (autocast's fp32 softmax of a
// bf16 matmul keeps its rounding), is compared within 8 bf16 ulps, plus an absolute part
// of one ulp of the values' largest magnitude (a sum that cancels to near zero keeps the
// error of its terms); interleaved rows differ by whole values.
bool sharedRowsAgree(const at::Tensor& smaller, const at::Tensor& larger, int dim, int64_t entries,
                     bool low_precision) {
  constexpr double kRtol = 1e-4, kAtol = 1e-5;
  constexpr double kUlp = 1.0 / 128;  // bf16's at 1.0 (fp16's is finer)
  at::Tensor x = smaller.narrow(dim, 0, entries);
  at::Tensor y = larger.narrow(dim, larger.size(dim) - entries, entries);
  const double rtol = low_precision ? 8 * kUlp : kRtol;
  // (a mask or an index computed from a bf16 value is compared exactly, below)
  const bool inexact = y.is_floating_point() || y.is_complex();
  const double atol = low_precision && inexact && y.numel() > 0
                          ? kAtol + kUlp * y.abs().max().item<double>()
                          : kAtol;
  if (x.is_cpu() && y.is_cpu() && x.scalar_type() == y.scalar_type()) {
    switch (x.scalar_type()) {
      case at::kFloat: return allCloseOnHost<float>(x, y, rtol, atol);
      case at::kDouble: return allCloseOnHost<double>(x, y, rtol, atol);
      case at::kHalf: return allCloseOnHost<c10::Half>(x, y, rtol, atol);
      case at::kBFloat16: return allCloseOnHost<c10::BFloat16>(x, y, rtol, atol);
      default: break;
    }
  }
  if (x.is_floating_point() || x.is_complex()) {
    // In the values' own dtype where both have it (no double copies: GPT-2's logits
    // are 25M entries); reduced precisions are compared widened.
    const auto t = x.scalar_type();
    const bool native = t == y.scalar_type() && (t == at::kFloat || t == at::kDouble ||
                                                 t == at::kComplexFloat || t == at::kComplexDouble);
    if (!native) {
      const auto wide = x.is_complex() ? at::kComplexDouble : at::kDouble;
      x = x.to(wide), y = y.to(wide);
    }
    return at::allclose(x, y, rtol, atol, /*equal_nan=*/true);
  }
  return at::equal(x, y);
}

// The observations of `from` (over the IR values whose JIT values `from_jit` lists) for
// the IR values whose JIT values `to_jit` lists; false when one was not observed there.
bool remapObserved(const Observed& from, const std::vector<const torch::jit::Value*>& from_jit,
                   const std::vector<const torch::jit::Value*>& to_jit, Observed* to) {
  std::unordered_map<const torch::jit::Value*, size_t> old_id;
  for (size_t i = 0; i < from_jit.size(); ++i) old_id.emplace(from_jit[i], i);
  const size_t n = to_jit.size();
  *to = Observed{};
  to->shapes.resize(n);
  to->dtypes.resize(n, at::ScalarType::Undefined);
  to->scalars.resize(n);
  to->ints.resize(n);
  to->has_ints.resize(n, 0);
  to->rows_agree.resize(n, -1);
  to->seen.resize(n, 0);
  if (!from.tensors.empty()) to->tensors.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto it = old_id.find(to_jit[i]);
    if (it == old_id.end()) return false;
    const size_t j = it->second;
    to->shapes[i] = from.shapes[j];
    to->dtypes[i] = from.dtypes[j];
    to->scalars[i] = from.scalars[j];
    to->ints[i] = from.ints[j];
    to->has_ints[i] = from.has_ints[j];
    to->rows_agree[i] = from.rows_agree[j];
    to->seen[i] = from.seen[j];
    if (!from.tensors.empty()) to->tensors[i] = from.tensors[j];
  }
  return true;
}

// [Note: random values] A float value computed from random draws (noise added to the
// embeddings: transformers' NEFTune; a Gaussian input noise) differs between any two runs,
// so the rows both observations share cannot tell whether the ops mix rows: such values
// would all read as interleaved, and gluing them made the whole model one task (no stage
// could be cut). Their rows are not compared; their shapes still decide. Dropout and
// batch statistics are switched off instead ([Note: row-coupling flags]); a draw of
// indices (randperm, randint, multinomial) and what integers are computed from random
// values are compared as before, but for integers drawn below a constant (a diffusion
// model's timesteps, `torch.randint(0, T, (x.shape[0],))`, and their casts and
// arithmetic): they index no rows, and returned beside the loss they came back as micro-
// batch 0's of the first replica on every rank (kDrawnNotRows). Likewise draws in a fixed
// range (rand, randn, their _like forms; multinomial over weights that are no batch value)
// and what comparisons, rounding and arithmetic with constants make of them: classifier-
// free guidance's label dropout (`torch.where(torch.rand(B) < p, null, y)`), a timestep
// `(torch.rand(B) * T).long()`. Their bools and integers were compared, some rows agreed by
// chance, and the trace depended on the draw: the ranks traced different graphs (an error
// blaming control flow on the data), or a value returned read as holding no rows.
constexpr char kDrawnNotRows = 2;

// `fixed`: whether each value is made from constants, parameters and buffers alone.
bool drawsInAFixedRange(const ir::Task& task, const std::vector<char>& fixed) {
  if (task.op == "aten::rand" || task.op == "aten::randn" || task.op == "aten::rand_like" ||
      task.op == "aten::randn_like") {
    return true;  // [0, 1) or N(0, 1), of the size asked for (a _like reads only the shape)
  }
  // classes drawn: as many as the weights have, which the batch does not size
  return task.op == "aten::multinomial" && !task.inputs.empty() && fixed[task.inputs[0]];
}

bool actsElementwise(const std::string& op) {
  for (const char* o : {"aten::to", "aten::long", "aten::int", "aten::clone", "aten::contiguous",
                        "aten::detach", "aten::add", "aten::sub", "aten::mul", "aten::remainder",
                        "aten::clamp", "aten::masked_fill", "aten::abs", "aten::sign"}) {
    if (op == o) return true;
  }
  return false;
}

// Elementwise ops that keep a draw's values a draw when every other input is a constant.
bool mapsDrawnValues(const std::string& op) {
  for (const char* o : {"aten::lt", "aten::gt", "aten::le", "aten::ge", "aten::eq", "aten::ne",
                        "aten::floor", "aten::ceil", "aten::round", "aten::trunc", "aten::div",
                        "aten::floor_divide", "aten::neg", "aten::pow", "aten::where",
                        "aten::logical_not", "aten::bitwise_not", "aten::logical_and",
                        "aten::logical_or", "aten::__and__", "aten::__or__", "aten::float"}) {
    if (op == o) return true;
  }
  return false;
}

bool drawsBelowAConstant(const ir::Graph& ir, const ir::Task& task) {
  // randint(high, size, ...), randint(low, high, size, ...), randint_like(self, high, ...),
  // randint_like(self, low, high, ...): the bounds are the leading ints
  if (task.op != "aten::randint" && task.op != "aten::randint_like") return false;
  const size_t first = task.op == "aten::randint_like" ? 1 : 0;
  bool any = false;
  for (size_t i = first; i < task.inputs.size() && i < first + 2; ++i) {
    const ir::Value& v = ir.value(task.inputs[i]);
    if (v.kind != ir::ValueKind::Int) break;  // the size list
    if (v.role != ir::ValueRole::Constant) return false;
    any = true;
  }
  return any;
}

bool keepsDrawnValues(const std::string& op) {
  for (const char* o : {"aten::to", "aten::long", "aten::int", "aten::clone", "aten::contiguous",
                        "aten::detach", "aten::add", "aten::sub", "aten::mul", "aten::remainder",
                        "aten::clamp", "aten::view", "aten::reshape", "aten::unsqueeze", "aten::squeeze"}) {
    if (op == o) return true;
  }
  return false;
}

std::vector<char> randomValues(const ir::Graph& ir) {
  std::vector<char> random(ir.numValues(), 0);
  std::vector<char> fixed(ir.numValues(), 0);
  for (const ir::Value& v : ir.values()) {
    fixed[v.id] = v.role == ir::ValueRole::Constant || v.role == ir::ValueRole::Param ||
                  v.role == ir::ValueRole::Buffer;
  }
  for (ir::TaskId t : ir.topologicalOrder()) {
    const ir::Task& task = ir.task(t);
    const bool made_of_fixed =
        !ir::drawsAtRandom(task.op) &&
        std::all_of(task.inputs.begin(), task.inputs.end(), [&](ir::ValueId in) { return fixed[in]; });
    for (ir::ValueId out : task.outputs) fixed[out] = made_of_fixed;
    // what an op makes of such draws and constants alone is one too; a size beside them
    // (`(torch.rand(B) * B).long()`: rows of the batch drawn) only reshapes, and a cast's
    // dtype or device (`t.to(x.dtype)`) carries no values
    const bool reshapes = task.op == "aten::view" || task.op == "aten::reshape" ||
                          task.op == "aten::unsqueeze" || task.op == "aten::squeeze" ||
                          task.op == "aten::to" || task.op == "aten::long" || task.op == "aten::int" ||
                          task.op == "aten::float" || task.op == "aten::clone" ||
                          task.op == "aten::contiguous" || task.op == "aten::detach";
    const bool mapped =
        (keepsDrawnValues(task.op) || mapsDrawnValues(task.op)) &&
        std::any_of(task.inputs.begin(), task.inputs.end(),
                    [&](ir::ValueId in) { return random[in] == kDrawnNotRows; }) &&
        std::all_of(task.inputs.begin(), task.inputs.end(), [&](ir::ValueId in) {
          const ir::Value& v = ir.value(in);
          const bool number = v.kind == ir::ValueKind::Int || v.kind == ir::ValueKind::Float ||
                              v.kind == ir::ValueKind::IntList || v.isTensor();
          return random[in] == kDrawnNotRows || v.role == ir::ValueRole::Constant ||
                 (!number || (reshapes && !v.isTensor()));  // a device, a dtype: no values
        });
    const bool below = drawsBelowAConstant(ir, task) || drawsInAFixedRange(task, fixed) || mapped;
    if (below) {
      for (ir::ValueId out : task.outputs) random[out] = kDrawnNotRows;
      continue;
    }
    bool drawn = false;
    for (size_t b = 0; b <= task.op.size() && !drawn;) {  // each op of a glued task
      const size_t e = std::min(task.op.find('+', b), task.op.size());
      const std::string op = task.op.substr(b, e - b);
      drawn = ir::drawsAtRandom(op) && op.find("dropout") == std::string::npos;  // switched off
      b = e + 1;
    }
    for (ir::ValueId in : task.inputs) drawn = drawn || random[in];
    if (!drawn) continue;
    for (ir::ValueId out : task.outputs) random[out] = 1;
  }
  return random;
}

// [Note: uninitialised values] torch.empty's memory holds whatever was there (diffusers'
// classic attention passes one to baddbmm with beta=0, which never reads it). Observed as
// it came, its rows differed between the runs at two batch sizes by chance, so whether it
// was glued to its readers depended on the heap: the ranks traced different graphs ("the
// model's control flow depends on its input data"), and one rank's graphs differed from
// run to run. The observations fill such values with zeros; the steps run them as traced.
bool leavesUninitialised(const std::string& op) {
  return op == "aten::empty" || op == "aten::empty_like" || op == "aten::new_empty" ||
         op == "aten::empty_strided" || op == "aten::new_empty_strided";
}

// Runs the graph without gradients and records every value. With `keep`, keeps the tensors;
// with `kept` (a run at another batch size, the smaller run's inputs the larger's trailing
// rows: [Note: row positions]), compares the rows both runs share of each value whose
// shape scales with the batch (but random ones: [Note: random values]).
// [Note: extremes over the rows] A max or min over the rows (a quantization observer's
// aminmax of the batch, `logits - logits.max()` for a stable softmax, a max-abs scale) moves
// only where an extreme row does: whether the rows two observations share agree after it
// depended on the data, so the ranks glued ops otherwise (non-fused QAT on 2 ranks: "the
// ranks traced different graphs", blaming control flow). What is computed from it is not
// compared; its shapes decide, as for a draw ([Note: random values]): such a statistic is
// each share's own, as batch norm's is and as under DistributedDataParallel.
bool takesExtremes(const std::string& op) {
  for (size_t b = 0; b <= op.size();) {  // each op of a glued task
    const size_t e = std::min(op.find('+', b), op.size());
    const std::string one = op.substr(b, e - b);
    for (const char* o : {"aten::aminmax", "aten::amax", "aten::amin", "aten::max", "aten::min"}) {
      if (one == o) return true;
    }
    b = e + 1;
  }
  return false;
}

Observed observe(const TracedModel& model, const std::vector<at::Tensor>& inputs, bool keep,
                 const Observed* kept = nullptr, int64_t batch = 0, int64_t kept_batch = 0) {
  Observed o;
  const std::vector<char> random = kept ? randomValues(model.graph) : std::vector<char>();
  const int n = model.graph.numValues();
  o.shapes.resize(n);
  o.dtypes.resize(n, at::ScalarType::Undefined);
  o.scalars.resize(n);
  o.seen.resize(n, 0);
  o.ints.resize(n);
  o.has_ints.resize(n, 0);
  o.rows_agree.resize(n, -1);
  if (keep) o.tensors.resize(n);
  std::vector<c10::IValue> ins(inputs.begin(), inputs.end());
  std::vector<char> low(n, 0);  // [Note: rows in low precision]: half, or computed from one
  std::vector<char> extremes(n, 0);  // [Note: extremes over the rows]: computed from one
  auto reducesTheRows = [&](ir::ValueId id, const ir::Task& task, const at::Tensor& t) {
    // its shape is the kept observation's while an input's is not
    if (kept->tensors.size() <= static_cast<size_t>(id) || !kept->tensors[id].defined() ||
        kept->tensors[id].sizes() != t.sizes()) {
      return false;
    }
    return std::any_of(task.inputs.begin(), task.inputs.end(), [&](ir::ValueId in) {
      return o.seen[in] && kept->tensors.size() > static_cast<size_t>(in) &&
             kept->tensors[in].defined() && kept->tensors[in].sizes().vec() != o.shapes[in];
    });
  };
  // A drawn integer or bool made elementwise from values whose rows agreed or were not
  // compared (`torch.where(torch.rand(B) < p, null, labels)`): its rows are its inputs'
  // rows, and comparing them would read the draw ([Note: random values]).
  auto rowsInherited = [&](ir::ValueId id) {
    const ir::TaskId producer = model.graph.value(id).producer;
    if (producer == ir::kNoId) return false;
    const ir::Task& task = model.graph.task(producer);
    if (!mapsDrawnValues(task.op) && !actsElementwise(task.op)) return false;
    // each input's rows agreed, or it is such a draw, or it is no batch value (a float
    // drawn from the data, whose rows were not compared, may hold rows drawn: not these)
    return std::all_of(task.inputs.begin(), task.inputs.end(), [&](ir::ValueId in) {
      return o.rows_agree[in] == 1 || random[in] == kDrawnNotRows ||
             (!random[in] && o.rows_agree[in] == -1);
    });
  };
  torch::NoGradGuard no_grad;
  runGraph(model, ins, [&](ir::ValueId id, const c10::IValue& v) {
    o.seen[id] = 1;
    if (v.isTensor() && model.graph.value(id).producer != ir::kNoId &&
        leavesUninitialised(model.graph.task(model.graph.value(id).producer).op)) {
      v.toTensor().zero_();  // [Note: uninitialised values]
    }
    low[id] = v.isTensor() && (v.toTensor().scalar_type() == at::kHalf ||
                               v.toTensor().scalar_type() == at::kBFloat16);
    const ir::TaskId producer = model.graph.value(id).producer;
    if (!low[id] && producer != ir::kNoId) {
      for (ir::ValueId in : model.graph.task(producer).inputs) low[id] = low[id] || low[in];
    }
    if (kept && producer != ir::kNoId) {
      const ir::Task& task = model.graph.task(producer);
      for (ir::ValueId in : task.inputs) extremes[id] = extremes[id] || extremes[in];
      if (!extremes[id] && v.isTensor() && takesExtremes(task.op)) {
        extremes[id] = reducesTheRows(id, task, v.toTensor());
      }
    }
    if (v.isTensor()) {
      const at::Tensor& t = v.toTensor();
      o.shapes[id] = t.sizes().vec();
      o.dtypes[id] = t.scalar_type();
      if (keep) o.tensors[id] = t;
      const bool drawn = kept && (random[id] == kDrawnNotRows ||
                                  (random[id] && (t.is_floating_point() || t.is_complex() || rowsInherited(id))));
      // any other integer or bool drawn (a permutation, rows drawn by the batch's size)
      // agrees only by chance (3 draws in 30 read `(torch.rand(n) * n).long()` as rows):
      // it holds no rows, at every draw
      const bool drawn_apart = kept && random[id] && !drawn;
      if (kept && !drawn && !extremes[id] && kept->tensors.size() > static_cast<size_t>(id) &&
          kept->tensors[id].defined()) {
        const at::Tensor& other = kept->tensors[id];
        if (other.dim() == t.dim()) {
          int changed = -1, nchanged = 0;
          for (int64_t d = 0; d < t.dim(); ++d) {
            if (t.size(d) != other.size(d)) changed = static_cast<int>(d), ++nchanged;
          }
          if (nchanged == 1 && t.size(changed) % batch == 0) {
            const int64_t rows = std::min(batch, kept_batch), k = t.size(changed) / batch;
            const bool smaller = batch < kept_batch;
            o.rows_agree[id] = !drawn_apart && rows * k <= other.size(changed) &&
                               sharedRowsAgree(smaller ? t : other, smaller ? other : t, changed, rows * k,
                                               low[id] != 0);
          }
        }
      }
      if (t.dim() == 0 && !t.is_floating_point() && !t.is_complex() && t.scalar_type() != at::kBool) {
        o.ints[id] = {t.item<int64_t>()};
        o.has_ints[id] = 1;
      }
    } else if (isScalarLike(v)) {
      if (v.isInt()) o.ints[id] = {v.toInt()}, o.has_ints[id] = 1;
      if (v.isIntList()) o.ints[id] = v.toIntVector(), o.has_ints[id] = 1;
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
// [Note: integers of sizes] A 0-dim integer tensor's value is read as a size (a batch
// multiple where it scales with the batch) only where the trace made it from sizes
// (aten::size, prim::NumToTensor, arithmetic over such values and constants). A count of
// the data (`(logits.argmax(-1) == y).sum()`, an accuracy's numerator) could scale with
// the batch on one rank's shard and not on another's: the ranks' graphs then differed, and
// every rank failed with "the model's control flow depends on its input data".
std::vector<char> madeFromSizes(const ir::Graph& ir) {
  std::vector<char> sized(ir.numValues(), 0);
  for (const ir::Value& v : ir.values()) sized[v.id] = v.role == ir::ValueRole::Constant;
  for (ir::TaskId t : ir.topologicalOrder()) {
    const ir::Task& task = ir.task(t);
    const bool reads_sizes = task.op == "aten::size" || task.op == "aten::numel" || task.op == "aten::dim" ||
                             task.op == "aten::sym_size" || task.op == "aten::sym_numel";
    bool all = !task.inputs.empty();
    for (ir::ValueId in : task.inputs) all = all && sized[in];
    for (ir::ValueId out : task.outputs) sized[out] = reads_sizes || all;
  }
  return sized;
}

// [Note: the type of self] `x.new_ones(n, n)` (Funnel Transformer's mask of its [CLS]
// token) reads the dtype and device of `x`, not its data: made from a batch value, it
// depends on the batch no more than a constant does, and is no statistic of its rows
// ([Note: rows coupled] in planning.py).
bool readsOnlyTheTypeOfSelf(const std::string& op) {
  return op == "aten::new_ones" || op == "aten::new_zeros" || op == "aten::new_empty" ||
         op == "aten::new_full" || op == "aten::new_empty_strided";
}

// [Note: rows that agree by chance] A value is a batch value where the rows two observations
// share agree. A value whose rows are not the batch's can agree there by chance where its
// data repeat: masks and lengths of padded sequences (a reward model's
// `cat([mask_chosen, mask_rejected]).sum(-1)` agreed where two rows had the same lengths),
// so whether it was glued into its readers depended on each rank's data, and the ranks
// traced different graphs, blamed on control flow (a DPO loop on 2 ranks). Two rules make
// such values interleaved whatever the data: a cat, repeat or tile along the batch
// dimension (more rows per batch row than any of its batch inputs: the rows of one input
// follow those of another, never a row's own), and a value of coarse data (integers and
// bools, and what is computed from them alone, as their embeddings) whose inputs that
// change with the batch are all interleaved. What floats compute from real-valued data is
// left to the observations: their rows agree only where the rows are the batch's.
void demoteChanceAgreements(ir::Graph& ir, std::vector<ir::ValueId>* interleaved) {
  const int n = ir.numValues();
  std::vector<char> inter(n, 0), coarse(n, 0);
  for (ir::ValueId id : *interleaved) inter[id] = 1;
  for (ir::ValueId id : ir.inputs()) {
    const ir::Value& v = ir.value(id);
    coarse[id] = v.isTensor() && !ir::isDifferentiable(v.dtype);
  }
  auto stacks = [](const std::string& op) {
    return op.find("aten::cat") != std::string::npos || op.find("aten::repeat") != std::string::npos ||
           op.find("aten::tile") != std::string::npos;
  };
  for (ir::TaskId t : ir.topologicalOrder()) {
    const ir::Task& task = ir.task(t);
    bool all_coarse = true, all_inter = true, any = false;
    for (ir::ValueId in : task.inputs) {
      const ir::Value& v = ir.value(in);
      if (!v.isTensor() || !v.batch_dependent || !(v.isBatch() || inter[in])) continue;
      any = true;
      all_coarse = all_coarse && coarse[in];
      all_inter = all_inter && inter[in];
    }
    for (ir::ValueId out : task.outputs) {
      ir::Value& v = ir.mutableValue(out);
      if (!v.isTensor()) continue;
      coarse[out] = !ir::isDifferentiable(v.dtype) || (any && all_coarse);
      if (inter[out] || !v.isBatch()) continue;
      int64_t most = 0;  // rows per batch row of the inputs cut along the same dimension
      for (ir::ValueId in : task.inputs) {
        const ir::Value& u = ir.value(in);
        if (u.isBatch() && !inter[in] && u.batch_dim == v.batch_dim) most = std::max(most, u.batch_multiple);
      }
      const bool stacked = stacks(task.op) && most > 0 && v.batch_multiple > most;
      if (!stacked && !(any && all_inter && coarse[out])) continue;
      v.batch_dim = -1;
      v.batch_multiple = 0;
      inter[out] = 1;
      if (v.role == ir::ValueRole::Intermediate) interleaved->push_back(out);
      if (logEnabled(LogLevel::Debug)) {
        logDebug("value " + ir::describe(v) + (stacked ? " stacks rows of the batch" : " agrees by chance") +
                 " ([Note: rows that agree by chance])");
      }
    }
  }
}

std::vector<ir::ValueId> findBatchValues(ir::Graph& ir, const Observed& at1, const Observed& at2,
                                         int64_t b1, int64_t b2,
                                         std::vector<ir::ValueId>* paired = nullptr) {
  std::vector<ir::ValueId> interleaved;
  const std::vector<char> sized = madeFromSizes(ir);  // [Note: integers of sizes]
  std::vector<char> dep(ir.numValues(), 0);
  for (ir::ValueId id : ir.inputs()) dep[id] = ir.value(id).role == ir::ValueRole::Input;
  for (ir::TaskId t : ir.topologicalOrder()) {
    const ir::Task& task = ir.task(t);
    bool any = false;
    for (size_t i = readsOnlyTheTypeOfSelf(task.op) ? 1 : 0; i < task.inputs.size(); ++i) {
      any = any || dep[task.inputs[i]];
    }
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
    if (at1.has_ints[id] && at2.has_ints[id] && at1.ints[id].size() == at2.ints[id].size() &&
        (!v.isTensor() || sized[id])) {
      v.int_values = at1.ints[id];
      v.int_batch_multiples.assign(v.int_values.size(), 0);
      bool linear = true;
      for (size_t i = 0; i < v.int_values.size(); ++i) {
        const int64_t x = at1.ints[id][i], y = at2.ints[id][i];
        if (x == y) continue;
        if (x % b1 == 0 && x / b1 * b2 == y) {
          v.int_batch_multiples[i] = x / b1;
        } else {
          linear = false;
        }
      }
      if (!linear) v.int_values.clear(), v.int_batch_multiples.clear();
    }
    if (!v.isTensor() || !at2.seen[id]) continue;
    const auto &s1 = at1.shapes[id], &s2 = at2.shapes[id];
    if (s1.size() != s2.size()) continue;
    int changed = -1, nchanged = 0, scaled = 0;
    for (size_t d = 0; d < s1.size(); ++d) {
      if (s1[d] != s2[d]) changed = static_cast<int>(d), ++nchanged;
      scaled += s1[d] != s2[d] && s1[d] % b1 == 0 && s1[d] / b1 * b2 == s2[d];
    }
    if (paired && scaled >= 2) paired->push_back(id);  // [Note: rows paired]
    if (nchanged == 1 && s1[changed] % b1 == 0 && s1[changed] / b1 * b2 == s2[changed] &&
        at1.rows_agree[id] != 0) {
      v.batch_dim = changed;
      v.batch_multiple = s1[changed] / b1;
      v.batch_dependent = true;
    } else if (nchanged > 0) {
      if (v.role == ir::ValueRole::Intermediate) interleaved.push_back(id);
      v.batch_dependent = true;
      if (logEnabled(LogLevel::Debug)) {
        logDebug("value " + ir::describe(v) +
                 " changes with the batch size but cannot be cut into rows");
      }
    }
  }
  demoteChanceAgreements(ir, &interleaved);
  return interleaved;
}

// [Note: data-sized values] An op whose output size the data decides (x[mask], nonzero,
// masked_select, unique) makes a value with as many rows as the data selects. When the
// traced example selects as many elements from every row (no padding in the first batch),
// that count is a multiple of the rows at both batch sizes and the value reads as a batch
// value; a later batch that selects unevenly would then be cut at the wrong rows (a stage
// failed in index_put with "shape mismatch"). So such values, and what is computed from
// them along the same data-sized dimension (its sizes at both batch sizes), are glued into
// their tasks whatever the example's counts. The count a selecting op makes may be the same
// at both batch sizes (an expert of a mixture that no token of the rows the second
// observation drops was routed to): its outputs are data-sized all the same, along their
// first dimension that changes, else their first, or the ranks, whose counts differ, glued
// differently and traced different graphs ("the model's control flow depends on its input
// data", for a third of the seeds of a hand-written top-2 mixture of experts).
std::vector<ir::ValueId> dataSizedValues(const ir::Graph& ir, const Observed& at1, const Observed& at2) {
  // per value: its dimension's sizes at both batch sizes, for data-sized values
  std::vector<std::optional<std::pair<int64_t, int64_t>>> sized(ir.numValues());
  std::vector<ir::ValueId> out;
  // each dimension's sizes at both batch sizes, those that change first
  auto dimensions = [&](ir::ValueId v) -> std::vector<std::pair<int64_t, int64_t>> {
    std::vector<std::pair<int64_t, int64_t>> dims, same;
    if (!at1.seen[v] || !at2.seen[v] || !ir.value(v).isTensor()) return dims;
    const auto &s1 = at1.shapes[v], &s2 = at2.shapes[v];
    if (s1.size() != s2.size()) return dims;
    for (size_t d = 0; d < s1.size(); ++d) {
      (s1[d] != s2[d] ? dims : same).emplace_back(s1[d], s2[d]);
    }
    dims.insert(dims.end(), same.begin(), same.end());
    return dims;
  };
  for (ir::TaskId t : ir.topologicalOrder()) {
    const ir::Task& task = ir.task(t);
    const bool selects = ir::selectsByData(ir, task);
    std::vector<std::pair<int64_t, int64_t>> from;
    for (ir::ValueId in : task.inputs) {
      if (sized[in]) from.push_back(*sized[in]);
    }
    if (!selects && from.empty()) continue;
    for (ir::ValueId v : task.outputs) {
      for (const auto& dim : dimensions(v)) {
        if (selects || std::find(from.begin(), from.end(), dim) != from.end()) {
          sized[v] = dim;
          if (ir.value(v).role == ir::ValueRole::Intermediate) out.push_back(v);
          if (logEnabled(LogLevel::Debug)) {
            logDebug("value " + ir::describe(ir.value(v)) + " of " + task.op + " is sized by the data");
          }
          break;
        }
      }
    }
  }
  return out;
}

// [Note: row-coupling flags] The argument of each op that makes rows depend on each other
// (batch statistics) or on the RNG (dropout): switched off while observing, so that the rows
// two observations share can be compared.
struct RowCouplingFlag {
  c10::Symbol op;
  size_t argument;
  c10::IValue off;
};

const std::vector<RowCouplingFlag>& rowCouplingFlags() {
  static const std::vector<RowCouplingFlag> flags = {
      {c10::aten::batch_norm, 5, false},        // training
      {c10::aten::instance_norm, 5, false},     // use_input_stats
      {c10::aten::dropout, 2, false},           // train
      {c10::aten::feature_dropout, 2, false},
      {c10::aten::alpha_dropout, 2, false},
      {c10::aten::feature_alpha_dropout, 2, false},
      {c10::aten::scaled_dot_product_attention, 4, 0.0},  // dropout_p
      // quantization-aware training's fused observer: its range and scale come from the
      // batch's min and max, which only the extreme rows move, so whether the rows read as
      // coupled depended on each rank's data (the ranks traced different graphs). Observed
      // with the observer and the fake quantization off (the module's buffers: zeros while
      // observing), it passes its rows through ([Note: row-coupling flags])
      {c10::Symbol::fromQualString("aten::fused_moving_avg_obs_fake_quant"), 1, false},
      {c10::Symbol::fromQualString("aten::fused_moving_avg_obs_fake_quant"), 2, false},
  };
  return flags;
}

// Builds the IR of a traced graph with the values in `glue` kept inside tasks.
class IrBuilder {
 public:
  IrBuilder(const std::shared_ptr<torch::jit::Graph>& graph, const std::vector<GraphInput>& inputs,
            const std::unordered_map<std::string, std::string>& module_classes, int64_t batch_size)
      : graph_(graph), inputs_(inputs), module_classes_(module_classes), batch_size_(batch_size) {}

  // The model, with (in `jit_of`) each IR value's TorchScript value and (in `flags`) the
  // constants to switch off while observing ([Note: row-coupling flags]).
  std::shared_ptr<TracedModel> build(const std::unordered_set<const JitValue*>& glue,
                                     std::vector<const JitValue*>& jit_of,
                                     std::vector<std::pair<ir::ValueId, c10::IValue>>& flags) {
    model_ = std::make_shared<TracedModel>();
    model_->jit_graph = graph_;
    model_->module_classes = module_classes_;
    model_->graph.setBatchSize(batch_size_);
    ids_.clear();
    jit_of_ = &jit_of;
    addInputs();
    std::vector<Node*> nodes = addConstants();
    addTasks(nodes, glue);
    flags = offFlags(nodes);
    ir::Graph& ir = model_->graph;
    model_->order = ir.topologicalOrder();
    model_->constants.resize(ir.numValues());
    std::vector<ir::ValueId> outs;
    for (const JitValue* v : graph_->outputs()) outs.push_back(ids_.at(v));
    ir.setOutputs(outs);
    ir.validate();
    return model_;
  }

 private:
  ir::ValueId addValue(const JitValue* v, ir::ValueRole role, std::string name) {
    ir::Value val;
    val.name = name.empty() ? (v->hasDebugName() ? v->debugName() : "") : std::move(name);
    val.kind = toKind(v->type());
    val.role = role;
    ir::ValueId id = model_->graph.addValue(std::move(val));
    ids_[v] = id;
    jit_of_->push_back(v);
    return id;
  }

  void addInputs() {
    std::vector<ir::ValueId> graph_inputs;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      graph_inputs.push_back(addValue(graph_->inputs()[i], inputs_[i].role, inputs_[i].name));
    }
    model_->graph.setInputs(graph_inputs);
  }

  // Constants become values, not tasks; returns the other nodes.
  std::vector<Node*> addConstants() {
    ir::Graph& ir = model_->graph;
    std::vector<Node*> nodes;
    for (Node* node : graph_->nodes()) {
      if (!node->blocks().empty()) {
        // a trace records no control flow but that of code compiled by torch.jit.script
        throw TraceError(describeNodeIn(node, module_classes_) +
                         " is control flow (an if or a loop) of code compiled by torch.jit.script, "
                         "which a trace keeps whole: rannc cuts the ops of an eager forward. Call "
                         "the function or module without torch.jit.script, or write the branch "
                         "with tensor ops (torch.where)");
      }
      if (node->kind() != c10::prim::Constant) {
        nodes.push_back(node);
        continue;
      }
      ir::ValueId id = addValue(node->output(), ir::ValueRole::Constant, "");
      c10::IValue c = *torch::jit::toIValue(node->output());
      ir.mutableValue(id).constant = printConstant(c);
      if (c.isTensor()) {
        const at::Tensor& t = c.toTensor();
        ir.mutableValue(id).dtype = toDType(t.scalar_type());
        ir.mutableValue(id).shape = t.sizes().vec();
      }
      model_->constants.resize(ir.numValues());
      model_->constants[id] = std::move(c);
    }
    return nodes;
  }

  // [Note: fused list ops] A list or tuple of tensors (aten::split -> prim::ListUnpack,
  // prim::ListConstruct -> aten::cat) lives inside one task: its producer and consumers are
  // fused, so what flows between tasks, and so between stages, is tensors and shapes.
  // Values first, tasks second: a fused group may read what a later-starting group makes.
  void addTasks(const std::vector<Node*>& nodes, const std::unordered_set<const JitValue*>& glue) {
    const std::vector<TaskGroup> groups = groupListOps(nodes, glue);
    for (const TaskGroup& group : groups) {
      for (const JitValue* v : group.outputs) addValue(v, ir::ValueRole::Intermediate, "");
    }
    for (const TaskGroup& group : groups) {
      std::vector<ir::ValueId> ins, outs;
      for (const JitValue* v : group.inputs) ins.push_back(ids_.at(v));
      for (const JitValue* v : group.outputs) outs.push_back(ids_.at(v));
      std::string op;
      for (Node* n : group.nodes) op += (op.empty() ? "" : "+") + std::string(n->kind().toQualString());
      Node* main = group.mainNode();
      const ir::TaskId task = model_->graph.addTask(op, std::move(ins), std::move(outs),
                                                    modulePath(main), sourceLocation(main));
      model_->task_nodes.push_back(main);
      for (Node* n : group.nodes) model_->task_of_node[n] = task;
      // A task reads each value once (x * x has one input), so a node that reads a value
      // twice runs through slots like a fused group, which hand it every argument.
      const bool alone = group.nodes.size() == 1 && group.inputs.size() == group.nodes[0]->inputs().size();
      model_->operations.push_back(alone ? resolveOperation(group.nodes[0], module_classes_)
                                         : fuseOperations(group, module_classes_));
    }
  }

  std::vector<std::pair<ir::ValueId, c10::IValue>> offFlags(const std::vector<Node*>& nodes) const {
    std::vector<std::pair<ir::ValueId, c10::IValue>> out;
    for (Node* node : nodes) {
      for (const RowCouplingFlag& f : rowCouplingFlags()) {
        if (node->kind() != f.op || f.argument >= node->inputs().size()) continue;
        std::vector<std::pair<ir::ValueId, c10::IValue>> statistics;
        if (isNorm(node) && !runningStatistics(node, statistics)) continue;
        const JitValue* v = node->inputs()[f.argument];
        // a constant, or a module's buffer (a graph input: zeros while observing)
        const auto kind = v->node()->kind();
        if ((kind == c10::prim::Constant || kind == c10::prim::Param) && ids_.count(v)) {
          out.emplace_back(ids_.at(v), f.off);
          out.insert(out.end(), statistics.begin(), statistics.end());
        }
      }
    }
    return out;
  }

  static bool isNorm(const Node* node) {
    return node->kind() == c10::aten::batch_norm || node->kind() == c10::aten::instance_norm;
  }

  // [Note: norms without running statistics] Switched to its running statistics, a batch
  // norm built with track_running_stats=False (MAML's, some GANs') or an instance norm (its
  // default) has none, and the observation failed ("running_mean must be defined in
  // evaluation mode"), so such models could not be traced at all. An instance norm's
  // statistics are each row's own: its flag stays. A batch norm's None statistics
  // (constants the trace makes for this op alone, affine=False's weight and bias included)
  // read as ones of its channels while observing, the rows then apart as with
  // running statistics. False where the flag must stay; `statistics`: what to observe the
  // None constants as.
  bool runningStatistics(const Node* node,
                         std::vector<std::pair<ir::ValueId, c10::IValue>>& statistics) const {
    if (!node->inputs()[3]->type()->cast<c10::NoneType>()) return true;
    if (node->kind() == c10::aten::instance_norm) return false;
    const auto input = node->inputs()[0]->type()->cast<c10::TensorType>();
    const auto sizes = input ? input->sizes().concrete_sizes() : std::nullopt;
    if (!sizes || sizes->size() < 2) return false;
    const at::Tensor ones = at::ones({(*sizes)[1]}, at::TensorOptions()
                                                        .dtype(input->scalarType().value_or(at::kFloat))
                                                        .device(input->device().value_or(at::kCPU)));
    std::vector<const JitValue*> nones;  // the statistics' (and weight's, bias's) None constants
    for (size_t k = 1; k <= 4; ++k) {
      const JitValue* v = node->inputs()[k];
      if (!v->type()->cast<c10::NoneType>() || std::find(nones.begin(), nones.end(), v) != nones.end()) continue;
      if (v->node()->kind() != c10::prim::Constant || !ids_.count(v)) return false;
      for (const torch::jit::Use& use : v->uses()) {
        if (use.user != node || use.offset < 1 || use.offset > 4) return false;
      }
      nones.push_back(v);
    }
    for (const JitValue* v : nones) statistics.emplace_back(ids_.at(v), ones);
    return true;
  }

  const std::shared_ptr<torch::jit::Graph>& graph_;
  const std::vector<GraphInput>& inputs_;
  const std::unordered_map<std::string, std::string>& module_classes_;
  const int64_t batch_size_;
  std::shared_ptr<TracedModel> model_;
  std::unordered_map<const JitValue*, ir::ValueId> ids_;
  std::vector<const JitValue*>* jit_of_ = nullptr;
};

// [Note: smaller observations] The batch analysis needs every value at two batch sizes,
// not at the traced one: where the second trace has 4 rows or more, the graph is observed
// at its rows and at half of them (the trailing rows of its inputs, so the rows both runs
// share hold the same data: [Note: row positions]), and each value's shape and integers at the traced batch are
// extrapolated from those two. That replaces a run of the whole model at the user's
// batch with a quarter of one (BERT-base at batch 8: ~1 s of its first step). Where a
// value does not scale linearly (a dimension of batch + 1), or an extrapolated shape is
// not the one the trace at the traced batch recorded (`x[:4]` is 4 rows at 12 but 3 at
// 3), the graph is observed at the traced batch after all, as before.

// [Note: row positions] A value whose rows hold their own positions in the batch, as
// torch.arange(batch_size) that indexes rows (transformers' masks:
// padding_mask[batch_arange, kv_idx]; a classifier's logits[arange(B), last_token]), is
// right only in the share that computed it: a share of rows 3-5 has arange(3) = 0, 1, 2,
// and cut from a whole batch's arange(6) it reads 3, 4, 5. Between stages whose replicas
// split the rows differently such a value was cut as a batch value: an index out of
// bounds, or, the other way round, the wrong rows of a padding mask without a word. Its
// leading rows agree between two batch sizes (0, 1, 2 of both), its trailing rows do not;
// so the smaller observation runs on the larger one's trailing rows, and a value whose
// shared rows differ is glued into the tasks that read it, computed in every share where
// it is used.

// The trailing-rows inputs of `inputs` (observed at `rows_from` rows) at `rows` rows:
// batch inputs cut to their last rows ([Note: row positions]), buffers copied from the
// traced batch's inputs, which no run has updated yet (a batch norm counts its calls in place).
std::vector<at::Tensor> trailingRowsOf(const std::vector<at::Tensor>& inputs,
                                      const std::vector<at::Tensor>& at_traced, int64_t traced_rows,
                                      int64_t rows_from, int64_t rows,
                                      const std::vector<GraphInput>& roles) {
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    const at::Tensor& traced = at_traced.at(i);
    // an input's batch dimension: the one dimension where it and the traced input differ
    // (dimension 1 of sequence-first arguments, [Note: batch dimensions] in _trace.py)
    int64_t dim = -1;
    if (roles.at(i).role == ir::ValueRole::Input && t.defined() && traced.defined() && t.dim() == traced.dim()) {
      for (int64_t d = 0; d < t.dim(); ++d) {
        if (t.size(d) == traced.size(d)) continue;
        dim = (dim == -1 && t.size(d) == rows_from && traced.size(d) == traced_rows) ? d : -2;
      }
    }
    if (dim >= 0) {
      out.push_back(t.narrow(dim, rows_from - rows, rows));
    } else if (roles.at(i).role == ir::ValueRole::Buffer && traced.defined()) {
      out.push_back(traced.clone());  // as before any run: the run at b2 may have updated `t`
    } else {
      out.push_back(t);
    }
  }
  return out;
}

// The observation at `batch` rows extrapolated from `at2` (rows b2, kept) and `at3` (rows
// b3, compared with it); -1, or the first value that does not scale linearly.
int64_t extrapolate(const Observed& at2, const Observed& at3, int64_t b2, int64_t b3, int64_t batch,
                    Observed* out) {
  *out = at3;
  out->tensors.clear();
  const size_t n = at2.shapes.size();
  for (size_t id = 0; id < n; ++id) {
    if (!at3.seen[id] || !at2.seen[id]) continue;
    out->dtypes[id] = at2.dtypes[id];
    const auto &s2 = at2.shapes[id], &s3 = at3.shapes[id];
    if (s2.size() != s3.size()) return static_cast<int64_t>(id);
    std::vector<int64_t> s1 = s2;
    for (size_t d = 0; d < s2.size(); ++d) {
      if (s2[d] == s3[d]) continue;
      if (s2[d] % b2 != 0 || s2[d] / b2 * b3 != s3[d]) return static_cast<int64_t>(id);
      s1[d] = s2[d] / b2 * batch;
    }
    out->shapes[id] = std::move(s1);
    if (at2.has_ints[id] != at3.has_ints[id]) return static_cast<int64_t>(id);
    if (at2.has_ints[id]) {
      if (at2.ints[id].size() != at3.ints[id].size()) return static_cast<int64_t>(id);
      for (size_t i = 0; i < at2.ints[id].size(); ++i) {
        const int64_t x2 = at2.ints[id][i], x3 = at3.ints[id][i];
        if (x2 == x3) {
          out->ints[id][i] = x2;
        } else if (x2 % b2 == 0 && x2 / b2 * b3 == x3) {
          out->ints[id][i] = x2 / b2 * batch;
        } else {
          return static_cast<int64_t>(id);
        }
      }
    }
    // Printed scalars only tell whether a value changes with the batch.
    out->scalars[id] = at2.scalars[id] == at3.scalars[id] ? at2.scalars[id] : at3.scalars[id];
  }
  return -1;
}

// The first IR value whose extrapolated shape differs from the sizes the trace recorded
// for its TorchScript value (where it recorded them), or -1.
int64_t disagreesWithTrace(const Observed& at1, const std::vector<const torch::jit::Value*>& jit_of) {
  for (size_t id = 0; id < jit_of.size() && id < at1.shapes.size(); ++id) {
    if (!at1.seen[id] || !jit_of[id]) continue;
    const auto tensor = jit_of[id]->type()->cast<c10::TensorType>();
    if (!tensor) continue;
    const std::optional<std::vector<int64_t>> traced = tensor->sizes().concrete_sizes();
    if (traced && *traced != at1.shapes[id]) return static_cast<int64_t>(id);
  }
  return -1;
}

// [Note: in-place writes] An op that writes into a value (x += b, relu_, copy_ into a
// slice) must run after every op that reads the value before it and must not find it cut
// from its producer: a stage's received value is a leaf that requires grad, which no op
// may write into, and a value sent to a later stage would carry the write to readers that
// ran before it. The IR has no edge for that order, so the written value, and the base of
// a view written through, are glued: their producer and all their readers become one task,
// which runs its nodes in the traced order. Values made outside the graph's nodes (inputs,
// parameters, buffers such as batch norm's counter) stay as they are.
std::unordered_set<const JitValue*> writtenValues(const torch::jit::Graph& graph) {
  std::unordered_set<const JitValue*> written;
  auto madeByNode = [](const JitValue* v) {
    return v->node()->kind() != c10::prim::Param && v->type()->kind() == c10::TypeKind::TensorType;
  };
  for (const Node* node : graph.nodes()) {
    const c10::FunctionSchema* schema = node->maybeSchema();
    if (schema == nullptr || !schema->is_mutable()) continue;
    const auto& args = schema->arguments();
    for (size_t i = 0; i < args.size() && i < node->inputs().size(); ++i) {
      if (args[i].alias_info() == nullptr || !args[i].alias_info()->isWrite()) continue;
      // The written value and, through views (slice, select, view), the values they alias.
      for (const JitValue* v = node->inputs()[i]; v != nullptr && madeByNode(v) && written.insert(v).second;) {
        const Node* producer = v->node();
        const c10::FunctionSchema* ps = producer->maybeSchema();
        v = nullptr;
        if (ps == nullptr || ps->returns().empty() || ps->returns()[0].alias_info() == nullptr) break;
        const c10::AliasInfo& out = *ps->returns()[0].alias_info();
        for (size_t k = 0; k < ps->arguments().size() && k < producer->inputs().size(); ++k) {
          const c10::AliasInfo* in = ps->arguments()[k].alias_info();
          if (in != nullptr && !out.isWrite() && in->beforeSets() == out.beforeSets()) {
            v = producer->inputs()[k];
            break;
          }
        }
      }
    }
  }
  return written;
}

// Shapes and dtypes as the graph really computes them, at both batch sizes; values whose
// rows cannot be cut apart are glued inside tasks and the IR is built again (at most five
// times).
std::shared_ptr<TracedModel> buildGluedModel(IrBuilder& builder, const TraceExample& first,
                                             const TraceExample& second,
                                             const std::vector<GraphInput>& roles) {
  std::unordered_set<const JitValue*> glue = writtenValues(*first.graph);
  std::shared_ptr<TracedModel> model;
  // The first attempt's observations: gluing only hides values inside tasks, so a later
  // attempt reads its values from these instead of running the graph twice again (BERT:
  // 4 of the 10 s tracing took).
  Observed first_at1, first_at2;
  std::vector<const JitValue*> first_jit;
  std::vector<std::string> pairing_ops;  // [Note: rows paired]
  std::vector<const Node*> pairing_nodes;
  for (int attempt = 0;; ++attempt) {
    std::vector<const JitValue*> jit_of;
    std::vector<std::pair<ir::ValueId, c10::IValue>> flags;
    model = builder.build(glue, jit_of, flags);
    Observed at1, at2;
    if (attempt == 0 || !remapObserved(first_at2, first_jit, jit_of, &at2) ||
        !remapObserved(first_at1, first_jit, jit_of, &at1)) {
      TracedModel rows_apart = *model;  // the same program with row-coupling flags off
      std::vector<size_t> off_inputs;     // flags that are graph inputs (a module's buffer)
      const auto& graph_inputs = model->graph.inputs();
      for (const auto& [id, off] : flags) {
        const auto at = std::find(graph_inputs.begin(), graph_inputs.end(), id);
        if (at != graph_inputs.end()) {
          off_inputs.push_back(static_cast<size_t>(at - graph_inputs.begin()));
        } else {
          rows_apart.constants[id] = off;
        }
      }
      auto apart = [&](std::vector<at::Tensor> inputs) {
        for (size_t i : off_inputs) {
          if (i < inputs.size() && inputs[i].defined()) inputs[i] = at::zeros_like(inputs[i]);
        }
        return inputs;
      };
      const std::vector<at::Tensor> second_in = apart(second.observe_inputs);
      const std::vector<at::Tensor> first_in = apart(first.observe_inputs);
      // Both observations start from the same model state (fresh copies of the buffers).
      at2 = observe(rows_apart, second_in, /*keep=*/true);
      const int64_t b2 = second.batch_size, b3 = b2 / 2;
      bool extrapolated = false;
      if (b3 >= 2 && b2 < first.batch_size) {  // [Note: smaller observations]
        const Observed at3 = observe(
            rows_apart, trailingRowsOf(second_in, first_in, first.batch_size, b2, b3, roles),
            false, &at2, b3, b2);
        int64_t odd = extrapolate(at2, at3, b2, b3, first.batch_size, &at1);
        if (odd < 0) odd = disagreesWithTrace(at1, jit_of);
        extrapolated = odd < 0;
        if (!extrapolated && logEnabled(LogLevel::Debug)) {
          logDebug("value " + ir::describe(model->graph.value(static_cast<ir::ValueId>(odd))) +
                   " does not scale linearly with the batch, or not as traced: observing at the traced batch");
        }
      }
      if (!extrapolated) {
        at1 = observe(rows_apart, first_in, false, &at2, first.batch_size, second.batch_size);
      }
      if (attempt == 0) first_at1 = at1, first_at2 = at2, first_jit = jit_of;
    }
    std::vector<ir::ValueId> paired;
    std::vector<ir::ValueId> interleaved = findBatchValues(
        model->graph, at1, at2, first.batch_size, second.batch_size, attempt == 0 ? &paired : nullptr);
    if (attempt == 0) {  // [Note: data-sized values]: once, while tasks are single ops
      for (ir::ValueId id : dataSizedValues(model->graph, at1, at2)) interleaved.push_back(id);
      // named where the pairing starts: ops none of whose inputs pair rows already
      std::unordered_set<const JitValue*> pairs;
      for (ir::ValueId id : paired) pairs.insert(jit_of[id]);
      for (ir::ValueId id : paired) {
        const Node* node = jit_of[id] ? jit_of[id]->node() : nullptr;
        if (!node || std::any_of(node->inputs().begin(), node->inputs().end(),
                                 [&](const JitValue* in) { return pairs.count(in) > 0; })) {
          continue;
        }
        const std::string op = describeNodeIn(node, model->module_classes);
        if (std::find(pairing_ops.begin(), pairing_ops.end(), op) == pairing_ops.end()) {
          pairing_ops.push_back(op);
        }
        pairing_nodes.push_back(node);
      }
    }
    size_t before = glue.size();
    for (ir::ValueId id : interleaved) glue.insert(jit_of[id]);
    if (glue.size() == before || attempt == 4) break;
    logDebug("gluing " + std::to_string(glue.size() - before) +
             " values whose rows cannot be cut apart into their tasks");
  }
  model->pairing_ops = std::move(pairing_ops);
  for (const Node* node : pairing_nodes) {
    auto it = model->task_of_node.find(node);
    if (it != model->task_of_node.end() &&
        std::find(model->pairing_tasks.begin(), model->pairing_tasks.end(), it->second) ==
            model->pairing_tasks.end()) {
      model->pairing_tasks.push_back(it->second);
    }
  }
  return model;
}

// Gradients flow from parameters (and inputs that require grad) through float tensors; a
// scalar output that reduces over the batch and requires grad is the loss.
void markGradientsAndLoss(ir::Graph& ir, const std::vector<at::Tensor>& inputs) {
  for (size_t i = 0; i < ir.inputs().size(); ++i) {
    ir.mutableValue(ir.inputs()[i]).requires_grad = inputs.at(i).requires_grad();
  }
  for (ir::TaskId t : ir.topologicalOrder()) {
    bool grad = false;
    if (ir.task(t).op != "aten::detach") {
      for (ir::ValueId in : ir.task(t).inputs) grad = grad || ir.value(in).requires_grad;
    }
    for (ir::ValueId out : ir.task(t).outputs) {
      ir::Value& v = ir.mutableValue(out);
      // Lists and tuples of tensors carry gradients to what is unpacked from them.
      const bool container = v.kind == ir::ValueKind::TensorList ||
                             v.kind == ir::ValueKind::Tuple || v.kind == ir::ValueKind::Other;
      // complex values too (an FFT layer's spectrum crossing a stage: its first stage never
      // got a gradient, and trained nothing)
      v.requires_grad = grad && (container || (v.isTensor() && ir::isDifferentiable(v.dtype)));
    }
  }
  for (ir::ValueId id : ir.outputs()) {
    ir::Value& v = ir.mutableValue(id);
    v.is_loss = v.isOneElementTensor() && !v.isBatch() && v.batch_dependent && v.requires_grad;
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
  if (first.graph->inputs().size() != inputs.size()) {
    throw TraceError("the traced graph has " + std::to_string(first.graph->inputs().size()) +
                     " inputs but " + std::to_string(inputs.size()) + " were described");
  }
  checkSameProgram(first, second, module_classes);
  // after the check, which compares the traces as the user's code made them
  if (int n = rewriteMaskedLosses(*first.graph)) {
    logDebug(std::to_string(n) + " loss(es) over the elements a boolean mask selects rewritten ([Note: masked losses])");
  }
  if (int n = foldStateShapes(*first.graph, inputs, first.inputs)) {
    logDebug(std::to_string(n) + " size(s) of parameters and buffers read as constants ([Note: shapes of the model's state])");
  }
  if (int n = functionalScalarUpdates(first.graph)) {
    logDebug(std::to_string(n) + " in-place update(s) of a scalar made functional");
  }
  IrBuilder builder(first.graph, inputs, module_classes, first.batch_size);
  std::shared_ptr<TracedModel> model = buildGluedModel(builder, first, second, inputs);
  ir::Graph& ir = model->graph;
  markGradientsAndLoss(ir, first.inputs);
  logInfo("traced: " + std::to_string(ir.numTasks()) + " tasks, " + std::to_string(ir.numValues()) +
          " values, " +
          std::to_string(std::count_if(ir.values().begin(), ir.values().end(),
                                       [](const ir::Value& v) { return v.isBatch(); })) +
          " batch values");
  return model;
}

void setPythonOpFactory(PythonOpFactory factory) { pythonOpFactory() = std::move(factory); }

}  // namespace rannc::frontend
