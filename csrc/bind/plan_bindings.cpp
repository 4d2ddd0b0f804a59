// Bindings of the planner: options, the analytic device description, plans (Deployment)
// and schedules as data.
#include "bind/bindings.h"

#include <map>

#include "common/error.h"
#include "ir/serialize.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/plan.h"
#include "partition/planner.h"
#include "partition/sim/schedule.h"
#include "partition/sim/simulator.h"

namespace py = pybind11;

namespace rannc::bind {

partition::Optimizer optimizerFromName(const std::string& name) {
  if (name == "adam" || name == "adamw") return partition::Optimizer::Adam;
  if (name == "sgd_momentum" || name == "sgd-momentum") return partition::Optimizer::SgdMomentum;
  if (name == "sgd") return partition::Optimizer::Sgd;
  throw Error("option optimizer_kind is '" + name + "'; expected adam, adamw, sgd_momentum or sgd");
}

partition::ScheduleKind scheduleFromName(const std::string& name) {
  if (name == "1f1b") return partition::ScheduleKind::OneFOneB;
  if (name == "fill_drain" || name == "fill-drain") return partition::ScheduleKind::FillDrain;
  if (name == "zb_h1" || name == "zb-h1") return partition::ScheduleKind::ZeroBubbleH1;
  if (name == "auto") return partition::ScheduleKind::Auto;
  if (name == "interleaved") return partition::ScheduleKind::Interleaved;
  throw Error("option schedule is '" + name + "'; expected auto, 1f1b, zb_h1, interleaved or fill_drain");
}

void bindPlanner(py::module& m) {
  py::class_<partition::DeviceSpec>(m, "DeviceSpec", "The device the analytic cost model assumes.")
      .def(py::init<>())
      .def_readwrite("peak_flops", &partition::DeviceSpec::peak_flops)
      .def_readwrite("memory_bandwidth", &partition::DeviceSpec::memory_bandwidth)
      .def_readwrite("memory_bytes", &partition::DeviceSpec::memory_bytes)
      .def_readwrite("intra_node_bandwidth", &partition::DeviceSpec::intra_node_bandwidth)
      .def_readwrite("inter_node_bandwidth", &partition::DeviceSpec::inter_node_bandwidth)
      .def_readwrite("link_latency", &partition::DeviceSpec::link_latency)
      .def_readwrite("kernel_overhead", &partition::DeviceSpec::kernel_overhead)
      .def_readwrite("devices_per_node", &partition::DeviceSpec::devices_per_node);

  py::class_<partition::StagePlan>(m, "StagePlan")
      .def_readonly("tasks", &partition::StagePlan::tasks)
      .def_readonly("ranks", &partition::StagePlan::ranks)
      .def_readonly("recompute", &partition::StagePlan::recompute)
      .def_readonly("micro_batch_rows", &partition::StagePlan::micro_batch_rows)
      .def_readonly("forward_time", &partition::StagePlan::forward_time)
      .def_readonly("backward_time", &partition::StagePlan::backward_time)
      .def_readonly("allreduce_time", &partition::StagePlan::allreduce_time)
      .def_readonly("update_time", &partition::StagePlan::update_time)
      .def_readonly("busy_time", &partition::StagePlan::busy_time)
      .def_readonly("bubble_time", &partition::StagePlan::bubble_time)
      .def_readonly("param_bytes", &partition::StagePlan::param_bytes)
      .def_readonly("static_bytes", &partition::StagePlan::static_bytes)
      .def_readonly("stash_bytes", &partition::StagePlan::stash_bytes)
      .def_readonly("memory_bytes", &partition::StagePlan::memory_bytes);

  py::class_<partition::Deployment>(m, "Deployment", "A plan: stages, ranks, micro-batches.")
      .def_readonly("graph_hash", &partition::Deployment::graph_hash)
      .def_readonly("planner", &partition::Deployment::planner)
      .def_readonly("world_size", &partition::Deployment::world_size)
      .def_readonly("batch_size", &partition::Deployment::batch_size)
      .def_readonly("pipelines", &partition::Deployment::pipelines)
      .def_readonly("micro_batches", &partition::Deployment::micro_batches)
      .def_readonly("stages", &partition::Deployment::stages)
      .def_readonly("memory_limit", &partition::Deployment::memory_limit)
      .def_readonly("iteration_time", &partition::Deployment::iteration_time)
      .def_readonly("feasible", &partition::Deployment::feasible)
      .def_property_readonly("schedule", [](const partition::Deployment& d) {
        return std::string(partition::scheduleName(d.schedule));
      })
      .def_property_readonly("num_stages", &partition::Deployment::numStages)
      .def_property_readonly("bubble_fraction", &partition::Deployment::bubbleFraction,
                             "idle fraction of the stages' time in an iteration")
      .def_property_readonly(
          "schedule_candidates",
          [](const partition::Deployment& d) {
            py::list out;
            for (const auto& c : d.schedule_candidates) {
              py::dict row;
              row["schedule"] = partition::scheduleName(c.schedule);
              row["iteration_time"] = c.iteration_time;
              row["bubble"] = c.bubble;
              row["feasible"] = c.feasible;
              out.append(row);
            }
            return out;
          },
          "schedule=auto: the best plan of each schedule tried ([Note: schedule choice])")
      .def("stage_of_rank", &partition::Deployment::stageOfRank)
      .def("report", &partition::Deployment::report)
      .def_property_readonly("hash", &partition::Deployment::hash,
                             "8 hex digits naming what the runtime executes ([Note: plan hash])")
      .def("summary", &partition::Deployment::summary)
      .def("stage_piece", [](const partition::Deployment& d, const ir::Graph& g, int stage) {
        return partition::stageSubgraph(g, d.stages.at(stage));
      })
      .def("validate", [](const partition::Deployment& d, const ir::Graph& g) {
        partition::validateDeployment(g, d);
      })
      .def("to_bytes", [](const partition::Deployment& d) {
        return py::bytes(partition::serializeDeployment(d));
      })
      .def("save", [](const partition::Deployment& d, const std::string& path) {
        partition::saveDeployment(d, path);
      });

  m.def("deployment_from_bytes",
        [](const py::bytes& data, const ir::Graph& g, const std::string& origin, int64_t batch_size,
           int world_size) {
          return partition::deserializeDeployment(std::string(data), g, origin, batch_size, world_size);
        },
        py::arg("data"), py::arg("graph"), py::arg("origin") = "<bytes>", py::arg("batch_size") = 0,
        py::arg("world_size") = 0,
        "A deployment from bytes; batch_size / world_size > 0: the batch and world it must be for.");
  m.def("rebind_deployment", &partition::rebindDeployment, py::arg("plan"), py::arg("planned"),
        py::arg("graph"),
        "`plan` (made for graph `planned`) for `graph`, the same model traced at other input "
        "shapes ([Note: new input shapes] in csrc/partition/plan.h).");
  m.def("load_deployment", &partition::loadDeployment, py::arg("path"), py::arg("graph"),
        py::arg("batch_size") = 0, py::arg("world_size") = 0,
        "A saved deployment; batch_size / world_size > 0: the batch and world it must be for.");

  // The options come as one PlannerOptions (bound in profile_bindings.cpp), so a new
  // planner option needs no argument here.
  m.def(
      "plan_analytic",
      [](const ir::Graph& graph, const partition::DeviceSpec& device, const partition::PlannerOptions& options) {
        py::gil_scoped_release release;
        partition::AnalyticCostModel costs(graph, device);
        return partition::plan(graph, costs, options);
      },
      py::arg("graph"), py::arg("device"), py::arg("options"),
      "Plans `graph` with costs from shapes (FLOPs and bytes against `device`).");

  m.def(
      "build_schedule",
      [](const std::string& kind, int stages, int micro_batches, int chunks) {
        auto schedule = partition::buildSchedule(scheduleFromName(kind), stages, micro_batches, chunks);
        std::vector<std::vector<std::pair<std::string, int>>> out;
        for (const auto& stage : schedule) {
          std::vector<std::pair<std::string, int>> actions;
          for (const auto& a : stage) {
            actions.emplace_back(partition::actionName(a.kind) + (a.chunk ? "." + std::to_string(a.chunk) : ""),
                                 a.micro_batch);
          }
          out.push_back(std::move(actions));
        }
        return out;
      },
      py::arg("kind"), py::arg("stages"), py::arg("micro_batches"), py::arg("chunks") = 1,
      "Per device, the ordered actions ('F', 'B', 'Bi', 'W'; '.c' on chunk c > 0, micro-batch) of the "
      "schedule.");

  m.def(
      "simulate_timeline",
      [](const std::string& kind, const std::vector<std::map<std::string, double>>& stages, int micro_batches,
         int chunks) {
        std::vector<partition::SimStage> sim;
        for (const auto& t : stages) {
          partition::SimStage s;
          auto get = [&](const char* key) {
            auto it = t.find(key);
            return it == t.end() ? 0.0 : it->second;
          };
          s.forward_time = get("forward");
          s.backward_time = get("backward");
          s.weight_time = get("weight");
          s.send_forward_time = get("send_forward");
          s.send_backward_time = get("send_backward");
          sim.push_back(s);
        }
        auto schedule = partition::buildSchedule(scheduleFromName(kind), static_cast<int>(sim.size()) / chunks,
                                                 micro_batches, chunks);
        const int devices = static_cast<int>(schedule.size());
        auto r = partition::simulate(sim, schedule, micro_batches);
        py::list out;
        for (size_t i = 0; i < schedule.size(); ++i) {
          py::list actions;
          for (size_t k = 0; k < schedule[i].size(); ++k) {
            const auto& a = schedule[i][k];
            const double start = r.start[i][k];
            const auto& stage = sim[a.chunk * devices + i];
            actions.append(py::make_tuple(partition::actionName(a.kind), a.micro_batch, a.chunk, start,
                                          start + partition::actionTime(stage, a.kind)));
          }
          out.append(actions);
        }
        return py::make_tuple(out, r.iteration_time);
      },
      py::arg("kind"), py::arg("stages"), py::arg("micro_batches"), py::arg("chunks") = 1,
      "Simulates `kind` over stages given as dicts of seconds (forward, backward, weight, "
      "send_forward, send_backward), chunks x devices of them: (per device [(action, micro-batch, chunk, "
      "start, end)], iteration time).");
}

}  // namespace rannc::bind
