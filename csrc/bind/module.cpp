// rannc._C's entry: the IR, the traced model, the MPI world and the library's exceptions;
// plan_bindings.cpp, profile_bindings.cpp and runtime_bindings.cpp add the
// rest. Torch's own pybind11 is used so torch._C.Graph and tensors pass through.
#include <map>

#include <torch/extension.h>
#include <pybind11/stl.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/jit/python/python_ir.h>

#include "bind/bindings.h"
#include "comm/communicator.h"
#include "comm/nccl_communicator.h"
#include "comm/world.h"
#include "common/error.h"
#include "common/log.h"
#include "frontend/convert.h"
#include "frontend/interpreter.h"
#include "ir/reduction.h"
#include "ir/serialize.h"
#include "ir/subgraph.h"
#include "runtime/stage.h"

namespace py = pybind11;
using namespace rannc;

namespace {

// [Note: autocast in Python ops] The stages run with autocast off: the casts autocast made
// while tracing are ops of the graph. An autograd.Function is one prim::PythonOp, the ops
// of its forward untraced, so in plain PyTorch they run under the caller's autocast (a
// matmul of a bf16 activation and an fp32 weight casts both; custom_fwd records the state
// for custom_bwd), and here they ran without it: "expected m1 and m2 to have the same
// dtype". So a Function's apply runs under the autocast state of the program that runs it
// (set by the Python side for each call, backward and recompute), with autocast's cache off
// (nothing clears it outside a context) and the thread's own state restored after.
struct PythonOpAutocast {
  bool set = false;
  c10::DeviceType device = c10::DeviceType::CPU;
  at::ScalarType dtype = at::kBFloat16;
};
PythonOpAutocast& pythonOpAutocast() {
  static PythonOpAutocast state;
  return state;
}

class AutocastForPythonOp {
 public:
  AutocastForPythonOp() : state_(pythonOpAutocast()) {
    if (!state_.set) return;
    enabled_ = at::autocast::is_autocast_enabled(state_.device);
    dtype_ = at::autocast::get_autocast_dtype(state_.device);
    cache_ = at::autocast::is_autocast_cache_enabled();
    at::autocast::set_autocast_enabled(state_.device, true);
    at::autocast::set_autocast_dtype(state_.device, state_.dtype);
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~AutocastForPythonOp() {
    if (!state_.set) return;
    at::autocast::set_autocast_enabled(state_.device, enabled_);
    at::autocast::set_autocast_dtype(state_.device, dtype_);
    at::autocast::set_autocast_cache_enabled(cache_);
  }

 private:
  PythonOpAutocast state_;
  bool enabled_ = false, cache_ = true;
  at::ScalarType dtype_ = at::kBFloat16;
};

// [Note: Functions of several outputs] in frontend/convert.h: a prim::PythonOp runs its
// Function's apply as TorchScript's operator does for one output (constant arguments from
// the node, the others from the stack) and pushes each output it returns; under the
// program's autocast ([Note: autocast in Python ops]).
torch::jit::Operation pythonOp(const torch::jit::Node* node) {
  py::gil_scoped_acquire gil;
  auto* op = const_cast<torch::jit::ConcretePythonOp*>(static_cast<const torch::jit::ConcretePythonOp*>(node));
  auto release = [](auto* p) {  // Python objects go with the GIL held
    py::gil_scoped_acquire held;
    delete p;
  };
  std::shared_ptr<py::object> f(new py::object(py::reinterpret_borrow<py::object>(py::handle(op->pyobj.get()))),
                                release);
  std::shared_ptr<std::vector<py::object>> sc(new std::vector<py::object>(), release);
  for (auto& a : op->scalar_args) sc->push_back(py::reinterpret_borrow<py::object>(py::handle(a.get())));
  const std::string cconv = op->cconv;
  const size_t num_inputs = std::count(cconv.begin(), cconv.end(), 'd');
  std::vector<c10::TypePtr> types;
  for (const torch::jit::Value* out : node->outputs()) types.push_back(out->type());
  return torch::jit::Operation([f, sc, cconv, num_inputs, types](torch::jit::Stack& stack) {
    py::gil_scoped_acquire held;
    py::tuple args(cconv.size());
    size_t next_scalar = 0, next_tensor = 0;
    for (size_t i = 0; i < cconv.size(); ++i) {
      args[i] = cconv[i] == 'c' ? (*sc)[next_scalar++]
                                : torch::jit::toPyObject(torch::jit::peek(stack, next_tensor++, num_inputs));
    }
    torch::jit::drop(stack, num_inputs);
    py::object out;
    try {
      AutocastForPythonOp autocast;
      out = (*f)(*args);
    } catch (py::error_already_set& e) {
      throw std::runtime_error(e.what());
    }
    if (types.size() == 1 && !py::isinstance<py::tuple>(out)) {
      stack.push_back(torch::jit::returnToIValue(types[0], out));
      return;
    }
    py::tuple items = py::cast<py::tuple>(out);
    if (items.size() != types.size()) {
      throw std::runtime_error("an autograd.Function traced with " + std::to_string(types.size()) +
                               " outputs returned " + std::to_string(items.size()));
    }
    for (size_t k = 0; k < types.size(); ++k) stack.push_back(torch::jit::returnToIValue(types[k], items[k]));
  });
}

std::vector<c10::IValue> toIValues(const std::vector<at::Tensor>& tensors) {
  return {tensors.begin(), tensors.end()};
}

// The values that cross a stage boundary: tensors, and the ints, floats, bools and lists
// of ints that shapes are made of.
c10::IValue fromPython(py::handle v) {
  if (THPVariable_Check(v.ptr())) return py::cast<at::Tensor>(v);
  if (v.is_none()) return c10::IValue();
  if (py::isinstance<py::bool_>(v)) return py::cast<bool>(v);
  if (py::isinstance<py::int_>(v)) return py::cast<int64_t>(v);
  if (py::isinstance<py::float_>(v)) return py::cast<double>(v);
  if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
    auto seq = py::reinterpret_borrow<py::sequence>(v);
    bool ints = std::all_of(seq.begin(), seq.end(), [](py::handle x) {
      return py::isinstance<py::int_>(x) && !py::isinstance<py::bool_>(x);
    });
    if (ints) return py::cast<std::vector<int64_t>>(v);
    bool floats = std::all_of(seq.begin(), seq.end(), [](py::handle x) { return py::isinstance<py::float_>(x); });
    if (floats) return py::cast<std::vector<double>>(v);
  }
  throw Error(std::string("cannot pass a value of type ") + py::str(v.get_type()).cast<std::string>() +
              " across a stage boundary");
}

std::vector<c10::IValue> fromPython(const py::list& values) {
  std::vector<c10::IValue> out;
  for (const auto& v : values) out.push_back(fromPython(v));
  return out;
}

py::list toPython(const std::vector<c10::IValue>& values) {
  py::list out;
  for (const auto& v : values) out.append(torch::jit::toPyObject(v));
  return out;
}

ir::ValueRole roleFromName(const std::string& name) {
  if (name == "input") return ir::ValueRole::Input;
  if (name == "param") return ir::ValueRole::Param;
  if (name == "buffer") return ir::ValueRole::Buffer;
  throw Error("unknown graph input role '" + name + "' (expected input, param or buffer)");
}

// Runs a stage backward without the GIL on the Python gradients (None: no gradient).
py::list stageBackward(const std::vector<std::optional<at::Tensor>>& grads,
                       const std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>& run) {
  std::vector<at::Tensor> g;
  for (const auto& t : grads) g.push_back(t ? *t : at::Tensor());
  std::vector<at::Tensor> out;
  {
    py::gil_scoped_release release;
    out = run(g);
  }
  py::list res;
  for (const auto& t : out) res.append(t.defined() ? py::cast(t) : py::none());
  return res;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "rannc core: IR, TorchScript frontend, subgraph execution";
  frontend::setPythonOpFactory(pythonOp);

  auto error = py::register_exception<Error>(m, "Error", PyExc_RuntimeError);
  py::register_exception<InvalidGraphError>(m, "InvalidGraphError", error);
  py::register_exception<TraceError>(m, "TraceError", error);
  py::register_exception<SerializationError>(m, "SerializationError", error);
  py::register_exception<InfeasiblePlanError>(m, "InfeasiblePlanError", error);
  py::register_exception<InternalError>(m, "InternalError", error);
  auto comm_error = py::register_exception<CommError>(m, "CommError", error);
  py::register_exception<TimeoutError>(m, "CommTimeoutError", comm_error);

  // ---- the MPI world and the data plane ----------------------------------------------
  // In a process a rank started, that rank's; in a rank, its own, with its identity put in
  // os.environ too, for a subprocess given a copy of it ([Note: processes a rank starts] in
  // world.cpp).
  auto rank_environment = [] {
    std::map<std::string, std::string> out;
    for (const char* name : {"RANNC_RANK_PID", "RANNC_RANK_JOB", "RANNC_RANK", "RANNC_WORLD_SIZE",
                             "RANNC_LOCAL_RANK", "RANNC_LOCAL_SIZE"}) {
      if (const char* v = std::getenv(name)) out[name] = v;
    }
    return out;
  };
  static auto world = [rank_environment]() -> comm::World& {
    comm::World& w = comm::World::get();
    static bool mirrored = false;
    if (!mirrored) {
      mirrored = true;
      py::module_::import("os").attr("environ").attr("update")(rank_environment());
    }
    return w;
  };
  // [Note: signals while waiting] in comm/world.cpp: Python runs signal handlers on its
  // main thread, which imports this module (no MPI is started here)
  comm::World::setInterruptCheck([] {
    if (!Py_IsInitialized()) return;  // a wait after the interpreter's end (static destructors)
    py::gil_scoped_acquire gil;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  });
  auto number = [](int comm::ParentRank::*inherited, int (comm::World::*own)() const) {
    return [inherited, own] {
      auto p = comm::World::parent();
      return p ? (*p).*inherited : (world().*own)();
    };
  };
  m.def("get_rank", number(&comm::ParentRank::rank, &comm::World::rank));
  m.def("get_world_size", number(&comm::ParentRank::size, &comm::World::size));
  m.def("get_local_rank", number(&comm::ParentRank::local_rank, &comm::World::localRank));
  m.def("get_local_size", number(&comm::ParentRank::local_size, &comm::World::localSize));
  m.def("rank_environment", rank_environment,
        "The variables a rank leaves for the processes it starts ([Note: processes a rank starts]).");
  m.def("get_node", [] { return comm::World::get().node(); });
  m.def("get_num_nodes", [] { return comm::World::get().numNodes(); });
  m.def("get_hostname", [] { return comm::World::get().hostname(); });
  m.def(
      "barrier",
      [](std::optional<double> timeout_s) {
        auto& w = comm::World::get();
        py::gil_scoped_release release;
        w.barrier(timeout_s ? std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000))
                            : w.defaultTimeout());
      },
      py::arg("timeout_s") = py::none());
  m.def("log_info", [](const std::string& message) { logInfo(message); }, py::arg("message"),
        "Logs through rannc's logger (spdlog, with the rank) at info level.");
  m.def("log_warn", [](const std::string& message) { logWarn(message); }, py::arg("message"));
  m.def("mpi_initialized", [] {
    int initialized = 0;
    MPI_Initialized(&initialized);
    return initialized != 0;
  }, "Whether MPI is initialised in this process (without initialising it).");
  m.def("report_failure", [](const std::string& msg) { comm::World::get().reportFailure(msg); });
  m.def("check_peers", [] { comm::World::get().checkPeers(); });
  m.def("failure_reported", [] { return comm::World::get().failing(); });
  m.def("set_python_op_autocast", [](const std::string& device, const std::string& dtype) {
    PythonOpAutocast state;  // [Note: autocast in Python ops]
    if (!dtype.empty()) {
      state.set = true;
      state.device = c10::Device(device).type();
      if (dtype == "bfloat16") {
        state.dtype = at::kBFloat16;
      } else if (dtype == "float16") {
        state.dtype = at::kHalf;
      } else {
        throw Error("autocast computes in bfloat16 or float16, not " + dtype);
      }
    }
    pythonOpAutocast() = state;
  }, py::arg("device"), py::arg("dtype"),
        "autograd.Functions run under autocast on `device` in `dtype` ('': as the caller's state).");
  m.def("set_comm_timeout", [](double s) {
    comm::World::get().setDefaultTimeout(std::chrono::milliseconds(static_cast<int64_t>(s * 1000)));
  });

  py::enum_<comm::ReduceOp>(m, "ReduceOp")
      .value("SUM", comm::ReduceOp::Sum)
      .value("MAX", comm::ReduceOp::Max)
      .value("MIN", comm::ReduceOp::Min);

  py::class_<comm::Work, comm::WorkPtr>(m, "Work", "An operation in flight.")
      .def(
          "wait",
          [](comm::Work& w, std::optional<double> timeout_s) {
            py::gil_scoped_release release;
            if (timeout_s) {
              w.wait(std::chrono::milliseconds(static_cast<int64_t>(*timeout_s * 1000)));
            } else {
              w.wait();
            }
          },
          py::arg("timeout_s") = py::none())
      .def("is_completed", &comm::Work::isCompleted);

  py::class_<comm::Communicator, std::shared_ptr<comm::Communicator>>(
      m, "Communicator",
      "Moves tensors between ranks: world_cpu() over MPI (CPU tensors), world_cuda() over NCCL.")
      .def_static("world_cpu", &comm::worldCpuCommunicator)
      .def_static("world_cuda",
                  []() -> std::shared_ptr<comm::Communicator> {
#ifdef RANNC_HAVE_NCCL
                    return comm::worldCudaCommunicator();
#else
                    throw CommError("this build of rannc has no NCCL data plane (it was built "
                                    "against a torch without CUDA, or NCCL was not found)");
#endif
                  })
      .def_property_readonly("rank", &comm::Communicator::rank)
      .def_property_readonly("size", &comm::Communicator::size)
      .def("world_rank", &comm::Communicator::worldRank)
      .def("send", &comm::Communicator::send, py::arg("tensor"), py::arg("peer"), py::arg("tag") = 0)
      .def("recv", &comm::Communicator::recv, py::arg("tensor"), py::arg("peer"), py::arg("tag") = 0)
      .def("all_reduce", &comm::Communicator::allReduce, py::arg("tensor"),
           py::arg("op") = comm::ReduceOp::Sum)
      .def("broadcast", &comm::Communicator::broadcast, py::arg("tensor"), py::arg("root"))
      .def("all_gather", &comm::Communicator::allGather, py::arg("input"), py::arg("output"))
      .def("subgroup", &comm::Communicator::subgroup, py::arg("ranks"));

  m.def("set_log_level", &setLogLevel, py::arg("level"));
#ifdef RANNC_HAVE_NCCL
  m.attr("has_nccl") = true;
#else
  m.attr("has_nccl") = false;
#endif
  bind::bindPlanner(m);
  bind::bindProfiler(m);
  bind::bindRuntime(m);

  py::class_<ir::Subgraph>(m, "Piece", "A convex piece of a graph: tasks and boundary values.")
      .def_readonly("tasks", &ir::Subgraph::tasks)
      .def_readonly("inputs", &ir::Subgraph::inputs)
      .def_readonly("outputs", &ir::Subgraph::outputs)
      .def("__repr__", [](const ir::Subgraph& p) {
        return "<Piece " + std::to_string(p.tasks.size()) + " tasks, " +
               std::to_string(p.inputs.size()) + " inputs, " + std::to_string(p.outputs.size()) +
               " outputs>";
      });

  py::class_<ir::Value>(m, "IrValue", "A value of the IR (ir/value.h), read-only.")
      .def_readonly("id", &ir::Value::id)
      .def_readonly("name", &ir::Value::name)
      .def_property_readonly("kind", [](const ir::Value& v) { return std::string(ir::valueKindName(v.kind)); })
      .def_property_readonly("role", [](const ir::Value& v) { return std::string(ir::valueRoleName(v.role)); })
      .def_property_readonly("dtype", [](const ir::Value& v) { return std::string(ir::dtypeName(v.dtype)); })
      .def_readonly("shape", &ir::Value::shape)
      .def_readonly("batch_dim", &ir::Value::batch_dim)
      .def_readonly("batch_multiple", &ir::Value::batch_multiple)
      .def_readonly("batch_dependent", &ir::Value::batch_dependent)
      .def_readonly("is_loss", &ir::Value::is_loss)
      .def_readonly("requires_grad", &ir::Value::requires_grad)
      .def_readonly("constant", &ir::Value::constant)
      .def_readonly("int_values", &ir::Value::int_values)
      .def_readonly("int_batch_multiples", &ir::Value::int_batch_multiples)
      .def_readonly("producer", &ir::Value::producer)
      .def_readonly("consumers", &ir::Value::consumers)
      .def("__repr__", [](const ir::Value& v) -> std::string {
        std::string shape;
        for (int64_t d : v.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
        return "<IrValue %" + std::to_string(v.id) + (v.name.empty() ? "" : " " + v.name) + " " +
               std::string(ir::valueKindName(v.kind)) + " " + std::string(ir::dtypeName(v.dtype)) + "[" +
               shape + "] " + std::string(ir::valueRoleName(v.role)) + ">";
      });

  py::class_<ir::Task>(m, "IrTask", "A task (one op) of the IR (ir/task.h), read-only.")
      .def_readonly("id", &ir::Task::id)
      .def_readonly("op", &ir::Task::op)
      .def_readonly("inputs", &ir::Task::inputs)
      .def_readonly("outputs", &ir::Task::outputs)
      .def_readonly("scope", &ir::Task::scope)
      .def_readonly("source", &ir::Task::source)
      .def("__repr__", [](const ir::Task& t) -> std::string {
        return "<IrTask #" + std::to_string(t.id) + " " + t.op + (t.scope.empty() ? "" : " in " + t.scope) + ">";
      });

  py::class_<ir::Graph>(m, "IrGraph", "The IR of a traced model (plain data, no torch).")
      .def("summary", &ir::Graph::summary)
      .def("content_hash", &ir::Graph::contentHash, py::arg("include_names") = true)
      .def_property_readonly("num_tasks", &ir::Graph::numTasks)
      .def_property_readonly("num_values", &ir::Graph::numValues)
      .def_property_readonly("batch_size", &ir::Graph::batchSize)
      .def_property_readonly("inputs", &ir::Graph::inputs)
      .def_property_readonly("outputs", &ir::Graph::outputs)
      .def("value", &ir::Graph::value, py::arg("id"), py::return_value_policy::reference_internal)
      .def("task", &ir::Graph::task, py::arg("id"), py::return_value_policy::reference_internal)
      .def("values", [](const ir::Graph& g) { return g.values(); }, py::return_value_policy::reference_internal)
      .def("tasks", [](const ir::Graph& g) { return g.tasks(); }, py::return_value_policy::reference_internal)
      .def("topological_order", &ir::Graph::topologicalOrder)
      .def("batch_reduction", [](const ir::Graph& g, ir::ValueId v) {
        return std::string(ir::batchReductionName(ir::batchReduction(g, v)));
      }, py::arg("value"), "how a scalar reduces over the batch: mean, sum or unknown (ir/reduction.h)")
      .def("output_reduction", [](const ir::Graph& g, ir::ValueId v) {
        return std::string(ir::batchReductionName(ir::outputReduction(ir::outputTerms(g, v))));
      }, py::arg("value"), "how a scalar output combines over shares by default: sum where a term "
         "is a sum over the batch, mean, or unknown (ir/reduction.h)")
      .def("is_convex", [](const ir::Graph& g, const std::vector<ir::TaskId>& tasks) {
        return ir::isConvex(g, tasks);
      })
      .def("extract", [](const ir::Graph& g, const std::vector<ir::TaskId>& tasks) {
        return ir::extractSubgraph(g, tasks);
      })
      .def("split", &ir::splitTopological, py::arg("k"))
      .def("save", [](const ir::Graph& g, const std::string& path) { ir::saveGraph(g, path); });

  m.def("load_ir", &ir::loadGraph, py::arg("path"));

  py::class_<frontend::TracedModel, std::shared_ptr<frontend::TracedModel>>(
      m, "TracedModel", "The IR together with the TorchScript graph that executes it.")
      .def_property_readonly(
          "ir", [](const frontend::TracedModel& t) -> const ir::Graph& { return t.graph; },
          py::return_value_policy::reference_internal)
      .def_property_readonly("jit_graph",
                             [](const frontend::TracedModel& t) { return t.jit_graph; })
      .def("describe_task", &frontend::TracedModel::describeTask)
      .def_property_readonly(
          "pairing_ops", [](const frontend::TracedModel& t) { return t.pairing_ops; },
          "The ops that make a value pairing the batch's rows ([Note: rows paired] in "
          "frontend/traced_model.h).")
      .def_property_readonly(
          "pairing_tasks", [](const frontend::TracedModel& t) { return t.pairing_tasks; },
          "The tasks holding the pairing ops.")
      .def("run",
           [](const frontend::TracedModel& t, const std::vector<at::Tensor>& inputs) {
             std::vector<c10::IValue> outs;
             {
               py::gil_scoped_release release;
               outs = frontend::runGraph(t, toIValues(inputs));
             }
             return toPython(outs);
           })
      .def("run_chained",
           [](const frontend::TracedModel& t, const std::vector<ir::Subgraph>& pieces,
              const std::vector<at::Tensor>& inputs) {
             std::vector<c10::IValue> outs;
             {
               py::gil_scoped_release release;
               outs = frontend::runChained(t, pieces, toIValues(inputs));
             }
             return toPython(outs);
           });

  py::class_<runtime::StageExecutor>(m, "StageExecutor",
                                     "Forward/backward of one piece, one micro-batch at a time.")
      .def(py::init([](std::shared_ptr<frontend::TracedModel> model, ir::Subgraph piece,
                       std::unordered_map<ir::ValueId, at::Tensor> state, const std::string& device) {
             return std::make_unique<runtime::StageExecutor>(model, std::move(piece), std::move(state),
                                                             c10::Device(device));
           }),
           py::arg("model"), py::arg("piece"), py::arg("state"), py::arg("device") = "cpu")
      .def_property_readonly("device",
                             [](const runtime::StageExecutor& s) { return s.device().str(); })
      .def_property_readonly("input_ids", &runtime::StageExecutor::inputIds)
      .def_property_readonly("output_ids", &runtime::StageExecutor::outputIds)
      .def_property_readonly("stashed", &runtime::StageExecutor::stashed)
      .def("set_no_grad_inputs", &runtime::StageExecutor::setNoGradInputs, py::arg("ids"))
      .def("forward",
           [](runtime::StageExecutor& s, int64_t mb, const py::list& inputs, bool keep, bool recompute) {
             auto ins = fromPython(inputs);
             std::vector<c10::IValue> outs;
             {
               py::gil_scoped_release release;
               outs = s.forward(mb, ins, keep, recompute);
             }
             return toPython(outs);
           },
           py::arg("mb"), py::arg("inputs"), py::arg("keep_for_backward") = true,
           py::arg("recompute") = false)
      .def("backward",
           [](runtime::StageExecutor& s, int64_t mb, const std::vector<std::optional<at::Tensor>>& grads) {
             return stageBackward(grads, [&](const std::vector<at::Tensor>& g) { return s.backward(mb, g); });
           },
           py::arg("mb"), py::arg("output_grads"))
      .def("backward_input",
           [](runtime::StageExecutor& s, int64_t mb, const std::vector<std::optional<at::Tensor>>& grads) {
             return stageBackward(grads, [&](const std::vector<at::Tensor>& g) { return s.backwardInput(mb, g); });
           },
           py::arg("mb"), py::arg("output_grads"),
           "The input part of a split backward ([Note: split backward] in frontend/split_backward.h).")
      .def("backward_weight",
           [](runtime::StageExecutor& s, int64_t mb) {
             py::gil_scoped_release release;
             s.backwardWeight(mb);
           },
           py::arg("mb"), "The weight part of a split backward: accumulates the parameters' .grad.");

  m.def(
      "build_traced_model",
      [](std::shared_ptr<torch::jit::Graph> graph1, std::vector<at::Tensor> inputs1, int64_t batch1,
         std::shared_ptr<torch::jit::Graph> graph2, std::vector<at::Tensor> inputs2, int64_t batch2,
         std::vector<at::Tensor> observe1, std::vector<at::Tensor> observe2,
         const std::vector<std::string>& names, const std::vector<std::string>& roles,
         std::unordered_map<std::string, std::string> module_classes) {
        if (names.size() != roles.size()) throw Error("names and roles differ in length");
        std::vector<frontend::GraphInput> described;
        for (size_t i = 0; i < names.size(); ++i) {
          described.push_back({names[i], roleFromName(roles[i])});
        }
        frontend::TraceExample first{std::move(graph1), std::move(inputs1), batch1, std::move(observe1)};
        frontend::TraceExample second{std::move(graph2), std::move(inputs2), batch2, std::move(observe2)};
        return frontend::buildTracedModel(first, second, described, std::move(module_classes));
      },
      py::arg("graph1"), py::arg("inputs1"), py::arg("batch1"), py::arg("graph2"),
      py::arg("inputs2"), py::arg("batch2"), py::arg("observe1"), py::arg("observe2"), py::arg("names"), py::arg("roles"),
      py::arg("module_classes"));
}
