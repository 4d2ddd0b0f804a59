// Bindings of the device profiler: the profile cache, one-piece measurements, the
// bandwidth probe and planning with measured costs (parallel over the world's ranks).
#include <limits>

#include "bind/bindings.h"

#include "comm/communicator.h"
#include "comm/world.h"
#include "common/error.h"
#include "partition/plan.h"
#include "partition/planner.h"
#include "profile/bandwidth.h"
#include "profile/boundary_inputs.h"
#include "profile/device_meter.h"
#include "profile/memory_counter.h"
#include "profile/profile_cache.h"
#include "profile/profiler.h"
#include "profile/profiling_cost_model.h"

namespace py = pybind11;

namespace rannc::bind {
namespace {

py::dict recordToDict(const profile::ProfileRecord& r) {
  py::dict d;
  d["forward_time"] = r.forward_time;
  d["backward_time"] = r.backward_time;
  d["activation_bytes"] = r.activation_bytes;
  d["peak_bytes"] = r.peak_bytes;
  d["out_of_memory"] = r.out_of_memory;
  d["weight_time"] = r.weight_time;
  return d;
}

profile::ProfilerOptions profilerOptions(int warmup, int repetitions, int64_t memory_limit,
                                         bool fake_timer, double time_budget,
                                         const std::string& device, const std::string& cpu_clock,
                                         bool forward_only = false, bool measure_weight_part = false) {
  profile::ProfilerOptions o;
  o.forward_only = forward_only;
  o.measure_weight_part = measure_weight_part;
  o.device = device;
  o.cpu_clock = profile::cpuClockFromName(cpu_clock);
  o.time_budget = time_budget;
  o.warmup = warmup;
  o.repetitions = repetitions;
  o.memory_limit = memory_limit;
  o.fake_timer = fake_timer;
  return o;
}

// A progress callback that may be called without the GIL.
profile::ProgressFn progressFrom(py::object callback) {
  if (callback.is_none()) return nullptr;
  auto shared = std::make_shared<py::object>(std::move(callback));
  return [shared](int64_t done, int64_t total) {
    py::gil_scoped_acquire gil;
    (*shared)(done, total);
  };
}

}  // namespace

void bindProfiler(py::module& m) {
  // InfeasiblePlanError in Python carries bytes_needed (registered after module.cpp's
  // plain translation, so this one is tried first).
  static py::handle infeasible_type = m.attr("InfeasiblePlanError");
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InfeasiblePlanError& e) {
      py::gil_scoped_acquire gil;
      py::object exc = infeasible_type(e.what());
      exc.attr("bytes_needed") = e.bytesNeeded();
      PyErr_SetObject(infeasible_type.ptr(), exc.ptr());
    }
  });

  py::class_<partition::PlannerOptions>(m, "PlannerOptions", "Options of the planner (partition/planner.h).")
      .def(py::init<>())
      .def_readwrite("world_size", &partition::PlannerOptions::world_size)
      .def_readwrite("batch_size", &partition::PlannerOptions::batch_size)
      .def_readwrite("num_blocks", &partition::PlannerOptions::num_blocks)
      .def_readwrite("memory_margin", &partition::PlannerOptions::memory_margin)
      .def_readwrite("memory_limit", &partition::PlannerOptions::memory_limit)
      .def_property(
          "recompute",
          [](const partition::PlannerOptions& o) { return std::string(partition::recomputeName(o.recompute)); },
          [](partition::PlannerOptions& o, const std::string& name) { o.recompute = partition::recomputeFromName(name); })
      .def_readwrite("update_seconds_per_byte", &partition::PlannerOptions::update_seconds_per_byte)
      .def_readwrite("num_stages", &partition::PlannerOptions::num_stages)
      .def_readwrite("num_microbatches", &partition::PlannerOptions::num_microbatches)
      .def_readwrite("max_microbatches", &partition::PlannerOptions::max_microbatches)
      .def_readwrite("replicas", &partition::PlannerOptions::replicas)
      .def_readwrite("search_patience", &partition::PlannerOptions::search_patience)
      .def_readwrite("refine_boundaries", &partition::PlannerOptions::refine_boundaries)
      .def_readwrite("refine_candidates", &partition::PlannerOptions::refine_candidates)
      .def_readwrite("verify_finalists", &partition::PlannerOptions::verify_finalists)
      .def_readwrite("rows_together", &partition::PlannerOptions::rows_together,
                     "tasks that see every row of the batch at once: the stage holding the "
                     "first and every later one run one replica ([Note: rows kept together])")
      .def_readwrite("plan_tolerance", &partition::PlannerOptions::plan_tolerance)
      .def_readwrite("chunks", &partition::PlannerOptions::chunks)
      .def_readwrite("model_copies", &partition::PlannerOptions::model_copies)
      .def_property(
          "optimizer",
          [](const partition::PlannerOptions& o) { return std::string(partition::optimizerName(o.optimizer)); },
          [](partition::PlannerOptions& o, const std::string& name) { o.optimizer = optimizerFromName(name); })
      .def_property(
          "schedule",
          [](const partition::PlannerOptions& o) { return std::string(partition::scheduleName(o.schedule)); },
          [](partition::PlannerOptions& o, const std::string& name) { o.schedule = scheduleFromName(name); })
      .def("check", &partition::checkOptions,
           "Raises rannc.Error naming the first option out of range (the world-independent checks).");

  py::class_<profile::ProfilerOptions>(m, "ProfilerOptions", "Options of the profiler (profile/profiler.h).")
      .def(py::init<>())
      .def_readwrite("warmup", &profile::ProfilerOptions::warmup)
      .def_readwrite("repetitions", &profile::ProfilerOptions::repetitions)
      .def_readwrite("time_budget", &profile::ProfilerOptions::time_budget)
      .def_readwrite("memory_limit", &profile::ProfilerOptions::memory_limit)
      .def_readwrite("fake_timer", &profile::ProfilerOptions::fake_timer)
      .def_readwrite("fake_noise", &profile::ProfilerOptions::fake_noise)
      .def_readwrite("fake_seed", &profile::ProfilerOptions::fake_seed)
      .def_readwrite("device", &profile::ProfilerOptions::device)
      .def_readwrite("forward_only", &profile::ProfilerOptions::forward_only)
      .def_readwrite("measure_weight_part", &profile::ProfilerOptions::measure_weight_part)
      .def_property(
          "cpu_clock",
          [](const profile::ProfilerOptions& o) { return std::string(profile::cpuClockName(o.cpu_clock)); },
          [](profile::ProfilerOptions& o, const std::string& name) { o.cpu_clock = profile::cpuClockFromName(name); });

  py::class_<profile::ProfileCache, std::shared_ptr<profile::ProfileCache>>(
      m, "ProfileCache", "Measured pieces by content hash, rows, dtype, device and recompute flag.")
      .def(py::init<>())
      .def("__len__", &profile::ProfileCache::size)
      .def("clear", &profile::ProfileCache::clear)
      .def_property_readonly("hits", &profile::ProfileCache::hits)
      .def_property_readonly("misses", &profile::ProfileCache::misses)
      .def("save", &profile::ProfileCache::save, py::arg("path"))
      .def("load", &profile::ProfileCache::load, py::arg("path"),
           "Merges the entries of a saved cache; False when the file does not exist.")
      .def("to_bytes", [](const profile::ProfileCache& c) { return py::bytes(c.serialize()); })
      .def("merge_bytes", [](profile::ProfileCache& c, const py::bytes& b) {
        c.merge(std::string(b), "<bytes>");
      })
      .def("entries",
           [](const profile::ProfileCache& c) {
             py::list out;
             for (const auto& [k, r] : c.entries()) {
               py::dict d = recordToDict(r);
               d["content_hash"] = k.content_hash;
               d["rows"] = k.rows;
               d["dtype"] = k.dtype;
               d["device"] = k.device;
               d["recompute"] = k.recompute;
               out.append(d);
             }
             return out;
           },
           "Every entry as a dict (key: content_hash, rows, dtype, device, recompute; record: "
           "forward_time, backward_time, activation_bytes, peak_bytes, out_of_memory, weight_time: "
           "-1 where not measured), by key.")
      .def(
          "put",
          [](profile::ProfileCache& c, uint64_t content_hash, int64_t rows, const std::string& dtype,
             const std::string& device, bool recompute, double forward_time, double backward_time,
             int64_t activation_bytes, int64_t peak_bytes, bool out_of_memory, double weight_time) {
            profile::ProfileKey k{content_hash, rows, dtype, device, recompute};
            profile::ProfileRecord r{forward_time, backward_time, activation_bytes, peak_bytes, out_of_memory,
                                     weight_time};
            const std::string problem = profile::profileEntryProblem(k, r);
            if (!problem.empty()) throw Error("ProfileCache.put: " + problem);
            c.insert(k, r);
          },
          py::arg("content_hash"), py::arg("rows"), py::arg("dtype"), py::arg("device"), py::arg("recompute"),
          py::arg("forward_time"), py::arg("backward_time"), py::arg("activation_bytes"),
          py::arg("peak_bytes"), py::arg("out_of_memory") = false, py::arg("weight_time") = -1.0,
          "Adds or replaces an entry (the fields of entries()); refuses what a file would be refused for.");

  m.def(
      "profile_piece",
      [](std::shared_ptr<frontend::TracedModel> model, const std::vector<at::Tensor>& example,
         const ir::Subgraph& piece, int64_t rows, bool recompute, int warmup, int repetitions,
         int64_t memory_limit, bool fake_timer, double time_budget, const std::string& device,
         const std::string& cpu_clock, bool weight_part) {
        py::gil_scoped_release release;
        auto inputs = std::make_shared<profile::BoundaryInputs>(model, example);
        profile::Profiler profiler(model, inputs,
                                   profilerOptions(warmup, repetitions, memory_limit, fake_timer,
                                                   time_budget, device, cpu_clock, false, weight_part));
        auto r = profiler.measure(piece, rows, recompute);
        py::gil_scoped_acquire gil;
        return recordToDict(r);
      },
      py::arg("model"), py::arg("example"), py::arg("piece"), py::arg("rows"),
      py::arg("recompute") = false, py::arg("warmup") = 1, py::arg("repetitions") = 3,
      py::arg("memory_limit") = 0, py::arg("fake_timer") = false, py::arg("time_budget") = 0.5,
      py::arg("device") = "cpu", py::arg("cpu_clock") = "auto", py::arg("weight_part") = false,
      "Measures one piece (forward, backward, memory) at `rows` rows on `device` (cpu, cuda, "
      "cuda:N); on the CPU with `cpu_clock` (auto, wall, thread); with `weight_part`, the "
      "weight part of a split backward too (weight_time).");

  m.def(
      "profile_cpu_clock", [](const std::string& clock) {
        return std::string(profile::cpuClockName(profile::resolveCpuClock(profile::cpuClockFromName(clock))));
      },
      py::arg("clock") = "auto",
      "The clock a CPU measurement with `clock` uses now: wall or thread (auto: thread when "
      "torch runs one intra-op thread).");

  m.def(
      "profile_device_kind", [](const std::string& device) {
        return profile::deviceKind(profile::parseProfileDevice(device));
      },
      py::arg("device"),
      "The profile cache's device kind for a profiling device (\"cpu\", \"cuda:<name>\"); raises "
      "rannc.Error for a device this build or machine cannot profile on.");
#ifdef RANNC_HAVE_CUDA
  m.attr("has_cuda_profiler") = true;
#else
  m.attr("has_cuda_profiler") = false;
#endif

  m.def(
      "probe_bandwidth",
      [](double fallback_inter, int64_t max_bytes) {
        auto comm = comm::worldCpuCommunicator();
        const auto& nodes = comm::World::get().nodeOfRank();
        profile::Bandwidth bw;
        {
          py::gil_scoped_release release;
          bw = profile::probeBandwidth(comm, nodes, fallback_inter, max_bytes);
        }
        py::dict d;
        d["intra_node"] = bw.intra_node;
        d["inter_node"] = bw.inter_node;
        d["latency"] = bw.latency;
        d["intra_measured"] = bw.intra_measured;
        d["inter_measured"] = bw.inter_measured;
        return d;
      },
      py::arg("fallback_inter"), py::arg("max_bytes") = 8 << 20,
      "Collective: intra-/inter-node bandwidth (bytes/s) from a ping-pong probe (rank 0's).");

  m.def(
      "plan_profiled",
      [](std::shared_ptr<frontend::TracedModel> model, const std::vector<at::Tensor>& example,
         const partition::DeviceSpec& device, const partition::PlannerOptions& options,
         const profile::ProfilerOptions& profiler_options, std::shared_ptr<profile::ProfileCache> cache,
         bool parallel, py::object progress, bool compose, double fit_tolerance, py::object stats) -> py::object {
        auto inputs = std::make_shared<profile::BoundaryInputs>(model, example);
        auto profiler = std::make_shared<profile::Profiler>(model, inputs, profiler_options);
        std::shared_ptr<comm::Communicator> comm;
        if (parallel && comm::World::get().size() > 1) comm = comm::worldCpuCommunicator();
        profile::ProfilingCostModel costs(model, profiler, cache, device, comm);
        costs.setProgress(progressFrom(progress));
        costs.setComposeUnions(compose);
        costs.setFitTolerance(fit_tolerance);
        auto report = [&] {
          if (stats.is_none()) return;
          py::dict d = stats;
          d["pieces_measured"] = costs.measured();
          d["measuring_seconds"] = costs.measuringSeconds();
          d["unions_composed"] = costs.composed();
          d["records_fitted"] = costs.fitted();
          d["cost_queries"] = costs.queries();
        };
        if (comm && comm->rank() != 0) {
          py::gil_scoped_release release;
          costs.serve();
          return py::none();
        }
        partition::Deployment d;
        {
          py::gil_scoped_release release;
          try {
            d = partition::plan(model->graph, costs, options);
          } catch (...) {
            costs.finish();
            throw;
          }
          costs.finish();
        }
        report();
        return py::cast(d);
      },
      py::arg("model"), py::arg("example"), py::arg("device"), py::arg("options"),
      py::arg("profiler"), py::arg("cache"), py::arg("parallel") = true,
      py::arg("progress") = py::none(), py::arg("compose") = true,
      py::arg("fit_tolerance") = 0.1, py::arg("stats") = py::none(),
      "Plans with measured costs (a union of blocks or groups composed from its parts' "
      "measurements when `compose`; records between row counts fitted within `fit_tolerance`, 0: "
      "off; `stats`, a dict, gets pieces_measured, measuring_seconds, unions_composed, records_fitted, "
      "cost_queries). Collective when `parallel` and the world has several ranks: "
      "rank 0 plans and returns the Deployment, the others profile their shares and return None.");

  m.def("memory_counter_current", [] { return profile::MemoryCounter::get().current(); });
}

}  // namespace rannc::bind
