// rannc._C's pipeline engine: the layout of a deployment and the C++ engine that runs one
// rank's step in one call (csrc/runtime/engine.h).
#include <torch/extension.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "bind/bindings.h"
#include "common/error.h"
#include "runtime/engine.h"

namespace py = pybind11;

namespace rannc::bind {
namespace {

std::map<ir::ValueId, c10::IValue> localValues(const py::dict& local) {
  std::map<ir::ValueId, c10::IValue> out;
  for (const auto& [k, v] : local) {
    out[py::cast<ir::ValueId>(k)] = THPVariable_Check(v.ptr()) ? c10::IValue(py::cast<at::Tensor>(v))
                                                                : torch::jit::toIValue(v, c10::AnyType::get());
  }
  return out;
}

py::tuple toPython(const runtime::StepOutputs& outs) {
  py::dict produced;
  for (const auto& [m, values] : outs.produced) {
    py::dict d;
    for (const auto& [vid, v] : values) d[py::int_(vid)] = torch::jit::toPyObject(v);
    produced[py::int_(m)] = d;
  }
  py::dict batch;
  for (const auto& [vid, t] : outs.batch_outputs) batch[py::int_(vid)] = t;
  return py::make_tuple(produced, batch);
}

runtime::StepMode modeFromName(const std::string& name) {
  if (name == "train") return runtime::StepMode::Train;
  if (name == "eval") return runtime::StepMode::Eval;
  if (name == "fill_drain_forward") return runtime::StepMode::FillDrainForward;
  if (name == "fill_drain_backward") return runtime::StepMode::FillDrainBackward;
  throw rannc::Error("unknown step mode '" + name + "' (expected train, eval, fill_drain_forward or fill_drain_backward)");
}

}  // namespace

void bindRuntime(py::module& m) {
  py::class_<runtime::Rows>(m, "Rows", "A half-open interval of global batch rows.")
      .def_readonly("start", &runtime::Rows::start)
      .def_readonly("stop", &runtime::Rows::stop)
      .def("__len__", &runtime::Rows::size)
      .def("__repr__", &runtime::Rows::str);

  py::class_<runtime::MicroBatchFit>(m, "MicroBatchFit",
                                     "A micro-batch count's predicted peak against the plan's memory limit.")
      .def_readonly("micro_batches", &runtime::MicroBatchFit::micro_batches)
      .def_readonly("fits", &runtime::MicroBatchFit::fits)
      .def_readonly("peak_bytes", &runtime::MicroBatchFit::peak_bytes)
      .def_readonly("stage", &runtime::MicroBatchFit::stage);

  py::class_<runtime::Layout>(m, "Layout", "Stages, pipeline copies, replicas and their rows.")
      .def_property_readonly("world_size", &runtime::Layout::worldSize)
      .def_property_readonly("local_batch", &runtime::Layout::localBatch)
      .def_property_readonly("global_batch", &runtime::Layout::globalBatch)
      .def_property_readonly("pipelines", &runtime::Layout::pipelines)
      .def_property_readonly("micro_batches", &runtime::Layout::microBatches)
      .def_property_readonly("stage_ranks", [](const runtime::Layout& L) {
        std::vector<std::vector<int>> out;
        for (int s = 0; s < L.numStages(); ++s) out.push_back(L.stageRanks(s));
        return out;
      })
      .def("replicas", &runtime::Layout::replicas, py::arg("stage"))
      .def("rank_of", &runtime::Layout::rankOf, py::arg("stage"), py::arg("copy"), py::arg("replica"))
      .def("share", &runtime::Layout::share, py::arg("stage"), py::arg("copy"), py::arg("micro_batch"),
           py::arg("replica"))
      .def("owned", &runtime::Layout::owned, py::arg("rank"));

  py::class_<runtime::StepGrads, std::shared_ptr<runtime::StepGrads>>(
      m, "StepGrads", "One training call's gradients of a rank's parameters (engine.take_step_grads())")
      .def("__len__", [](const runtime::StepGrads& g) { return g.tensors.size(); })
      .def("__getitem__", [](const runtime::StepGrads& g, size_t i) { return g.tensors.at(i); },
           py::arg("i"), "the i-th gradient (engine.own's order)")
      .def("without",
           [](const runtime::StepGrads& g, const std::vector<size_t>& left_out) {
             auto rest = std::make_shared<runtime::StepGrads>(g);
             for (size_t i : left_out) rest->tensors.at(i) = at::Tensor();
             return rest;
           },
           py::arg("left_out"), "these gradients without the ones at `left_out`, which apply_step_grads leaves out")
      .def("cloned",
           [](const runtime::StepGrads& g) {
             auto copy = std::make_shared<runtime::StepGrads>();
             for (const at::Tensor& t : g.tensors) copy->tensors.push_back(t.defined() ? t.clone() : t);
             return copy;
           },
           "a copy of each gradient ([Note: retained graphs] in engine.h: applied again later, "
           "they must not be what .grad holds)");

  using runtime::PipelineEngine;
  py::class_<PipelineEngine>(m, "PipelineEngine", "Runs this rank's stage of a deployment, one step per call.")
      .def(py::init([](std::shared_ptr<frontend::TracedModel> model, const partition::Deployment& deployment,
                       int rank, int world_size, int64_t local_batch,
                       std::unordered_map<ir::ValueId, at::Tensor> state,
                       const std::string& device, bool nccl) {
             return std::make_unique<PipelineEngine>(model, deployment, rank, world_size, local_batch, state,
                                                     c10::Device(device), nccl);
           }),
           py::arg("model"), py::arg("deployment"), py::arg("rank"), py::arg("world_size"),
           py::arg("local_batch"), py::arg("state"), py::arg("device"), py::arg("nccl"))
      .def_property_readonly("layout", &PipelineEngine::layout, py::return_value_policy::reference_internal)
      .def_property_readonly("stage", [](const PipelineEngine& e) { return e.place().stage; })
      .def_property_readonly("stages", &PipelineEngine::stages, "the stages this rank runs, one per chunk")
      .def_property_readonly("copy", [](const PipelineEngine& e) { return e.place().copy; })
      .def_property_readonly("replica", [](const PipelineEngine& e) { return e.place().replica; })
      .def_property_readonly("pieces", &PipelineEngine::pieces)
      .def("executor", &PipelineEngine::executor, py::arg("chunk") = 0, py::return_value_policy::reference_internal)
      .def_property_readonly("loss_vid", [](const PipelineEngine& e) -> py::object {
        return e.lossId() == ir::kNoId ? py::none() : py::cast(e.lossId());
      })
      .def_property_readonly("my_state", &PipelineEngine::stageState)
      .def_property_readonly("own", &PipelineEngine::ownParameters)
      .def_property_readonly("batch_output_ids", &PipelineEngine::batchOutputIds)
      .def("producer_of", &PipelineEngine::producerOf, py::arg("value"))
      .def("share_weight", &PipelineEngine::shareWeight, py::arg("value"), py::arg("micro_batch"))
      .def_property_readonly("token_means", [](const PipelineEngine& e) {
        // [Note: token-mean losses]: the ops made exact, and those weighted by rows with why
        py::dict d;
        py::list exact;
        for (const auto& loss : e.tokenMeans().exact) exact.append(e.describeTask(loss.task));
        d["exact"] = exact;
        d["row_weighted"] = e.tokenMeans().row_weighted;
        d["unknown_terms"] = e.tokenMeans().unknown_terms;
        // [Note: mixed terms]: those scaled by the share's rows (power 1) or divided by them (-1)
        py::list scaled;
        for (const auto& t : e.tokenMeans().terms) {
          if (*t.power != 0) scaled.append(py::make_tuple(e.describeTerm(t.term), *t.power));
        }
        d["scaled_terms"] = scaled;
        return d;
      })
      .def("grad_groups", &PipelineEngine::gradientGroups)
      .def("use_batch", &PipelineEngine::useBatch, py::arg("local_batch"))
      .def_property_readonly("memory_fit", &PipelineEngine::memoryFit, py::return_value_policy::copy)
      .def("set_input_grads", &PipelineEngine::setInputGrads, py::arg("ids"))
      .def("set_summed_outputs", &PipelineEngine::setSummedOutputs, py::arg("ids"))
      .def("step",
           [](PipelineEngine& e, const py::dict& local, bool train, const py::object& loss_scale) {
             auto values = localValues(local);
             // a float, or a GradScaler's scale tensor (read on its device: no host wait)
             const bool tensor = THPVariable_Check(loss_scale.ptr());
             const at::Tensor scale_tensor = tensor ? py::cast<at::Tensor>(loss_scale) : at::Tensor();
             const double scale = tensor ? 1.0 : py::cast<double>(loss_scale);
             runtime::StepOutputs outs;
             {
               py::gil_scoped_release release;
               outs = e.step(values, train, scale, scale_tensor);
             }
             return toPython(outs);
           },
           py::arg("local"), py::arg("train"), py::arg("loss_scale") = 1.0)
      .def("forward_for_backward",
           [](PipelineEngine& e, const py::dict& local) {
             auto values = localValues(local);
             runtime::StepOutputs outs;
             {
               py::gil_scoped_release release;
               outs = e.forwardForBackward(values);
             }
             return toPython(outs);
           },
           py::arg("local"))
      .def_property_readonly("last_forward", &PipelineEngine::lastForward)
      .def("awaits_backward", &PipelineEngine::awaitsBackward, py::arg("id"))
      .def("resume_forward", &PipelineEngine::resumeForward, py::arg("id"))
      .def("drop_forward", &PipelineEngine::dropForward, py::arg("id"))
      .def("backward_from",
           [](PipelineEngine& e, const py::dict& seeds, bool retain) {
             runtime::Seeds s;
             for (const auto& [m, table] : seeds) {
               for (const auto& [vid, v] : py::cast<py::dict>(table)) {
                 runtime::Seed seed;
                 if (THPVariable_Check(v.ptr())) {
                   seed.tensor = py::cast<at::Tensor>(v);
                 } else {
                   seed.value = py::cast<double>(v);
                 }
                 s[py::cast<int>(m)][py::cast<ir::ValueId>(vid)] = seed;
               }
             }
             py::gil_scoped_release release;
             e.backwardFrom(std::move(s), retain);
           },
           py::arg("seeds"), py::arg("retain") = false)
      .def("scatter_output_grads",
           [](PipelineEngine& e, const std::map<ir::ValueId, std::optional<at::Tensor>>& grads) {
             std::map<ir::ValueId, at::Tensor> g;
             for (const auto& [vid, t] : grads) g[vid] = t ? *t : at::Tensor();
             runtime::Seeds seeds;
             {
               py::gil_scoped_release release;
               seeds = e.scatterOutputGrads(g);
             }
             py::dict out;
             for (const auto& [m, table] : seeds) {
               py::dict d;
               for (const auto& [vid, seed] : table) d[py::int_(vid)] = seed.tensor;
               out[py::int_(m)] = d;
             }
             return out;
           },
           py::arg("grads"))
      .def("set_grad_sync", &PipelineEngine::setGradSync, py::arg("sync"))
      .def("sync_held_grads", &PipelineEngine::syncHeldGrads, py::call_guard<py::gil_scoped_release>())
      .def("take_step_grads", &PipelineEngine::takeStepGrads,
           "the last backward's gradients of this rank's parameters, handed over")
      .def("apply_step_grads",
           [](PipelineEngine& e, const runtime::StepGrads& grads, const py::object& scale) {
             if (scale.is_none()) {
               e.applyStepGrads(grads, at::Tensor());
             } else if (THPVariable_Check(scale.ptr())) {
               e.applyStepGrads(grads, py::cast<at::Tensor>(scale));
             } else {
               e.applyStepGrads(grads, py::cast<double>(scale));
             }
           },
           py::arg("grads"), py::arg("scale"),
           ".grad += scale * `grads` (take_step_grads; scale None: 1) of this rank's parameters")
      .def_property_readonly("input_grads", &PipelineEngine::inputGrads)
      .def("output_dtype", [](const PipelineEngine& e, int m, ir::ValueId vid) {
        return py::reinterpret_borrow<py::object>(
            reinterpret_cast<PyObject*>(torch::getTHPDtype(e.outputDtype(m, vid))));
      })
      .def_property_readonly("last_step_times", [](const PipelineEngine& e) {
        const auto& t = e.lastStepTimes();
        py::dict d;
        d["forward"] = t.forward;
        d["backward"] = t.backward;
        d["wait"] = t.wait;
        d["total"] = t.total;
        return d;
      })
      .def("program", [](PipelineEngine& e, const std::string& mode) { return e.program(modeFromName(mode)); },
           py::arg("mode") = "train", "This rank's step as typed actions, one per line.");
}

}  // namespace rannc::bind
