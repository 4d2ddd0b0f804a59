#include "partition/plan.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "common/error.h"
#include "ir/serialize.h"
#include "ir/subgraph.h"

namespace rannc::partition {
namespace {

const char* kDeploymentKind = "deployment";

std::string human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) v /= 1024.0, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string ms(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3f", seconds * 1e3);
  return buf;
}

std::string rankList(const std::vector<int>& ranks) {
  // Runs of consecutive ranks print as a-b.
  std::ostringstream os;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) os << ',';
    os << ranks[i];
    if (j > i) os << '-' << ranks[j];
    i = j + 1;
  }
  return os.str();
}

}  // namespace

int Deployment::stageOfRank(int rank) const {
  for (size_t s = 0; s < stages.size(); ++s) {
    const auto& r = stages[s].ranks;
    if (std::find(r.begin(), r.end(), rank) != r.end()) return static_cast<int>(s);
  }
  return -1;
}

std::string Deployment::report() const {
  std::ostringstream os;
  os << "deployment by " << planner << ": " << stages.size() << " stage(s) on " << world_size
     << " rank(s), " << pipelines << " pipeline cop" << (pipelines == 1 ? "y" : "ies") << ", "
     << micro_batches << " micro-batch(es) of global batch " << batch_size << ", "
     << scheduleName(schedule) << ", " << optimizerName(optimizer) << "\n";
  os << "predicted iteration " << ms(iteration_time) << " ms; memory limit "
     << human(memory_limit) << (feasible ? "" : " (EXCEEDED)") << "\n";
  os << "stage  blocks    tasks   rows   recomp  fwd ms     bwd ms     allred ms  update ms  "
        "bubble ms  memory      ranks\n";
  for (size_t s = 0; s < stages.size(); ++s) {
    const StagePlan& st = stages[s];
    char line[256];
    std::string blocks = st.first_block >= 0
                             ? std::to_string(st.first_block) + "-" + std::to_string(st.last_block - 1)
                             : "-";
    std::snprintf(line, sizeof line, "%-6zu %-9s %-7zu %-6lld %-7s %-10s %-10s %-10s %-10s %-10s %-11s ", s,
                  blocks.c_str(), st.tasks.size(), static_cast<long long>(st.micro_batch_rows),
                  st.recompute ? "yes" : "no", ms(st.forward_time).c_str(),
                  ms(st.backward_time).c_str(), ms(st.allreduce_time).c_str(),
                  ms(st.update_time).c_str(),
                  ms(st.bubble_time).c_str(), human(st.memory_bytes).c_str());
    // Ranks last: the list can be long, and the columns stay aligned.
    os << line << rankList(st.ranks) << "\n";
  }
  return os.str();
}

SimStage simStage(const StagePlan& st) {
  SimStage s;
  s.forward_time = st.forward_time;
  s.backward_time = st.backward_time;
  s.send_forward_time = st.send_forward_time;
  s.send_backward_time = st.send_backward_time;
  s.allreduce_time = st.allreduce_time;
  s.update_time = st.update_time;
  s.static_bytes = st.static_bytes;
  s.stash_bytes = st.stash_bytes;
  s.working_bytes = st.working_bytes;
  return s;
}

SimResult simulateDeployment(const Deployment& d, ScheduleKind schedule) {
  std::vector<SimStage> stages;
  for (const StagePlan& st : d.stages) stages.push_back(simStage(st));
  return simulate(stages, schedule, d.micro_batches);
}

ir::Subgraph stageSubgraph(const ir::Graph& graph, const StagePlan& stage) {
  std::vector<int> pos(graph.numTasks());
  const std::vector<ir::TaskId> order = graph.topologicalOrder();
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<int>(i);
  return makePiece(graph, stage.tasks, pos, pureConstantTasks(graph));
}

void validateDeployment(const ir::Graph& graph, const Deployment& d) {
  auto fail = [](const std::string& what) { throw InvalidGraphError("invalid deployment: " + what); };
  if (d.graph_hash != graph.contentHash()) fail("it was planned for another graph (content hash differs)");
  if (d.stages.empty()) fail("it has no stages");
  const std::vector<char> constant = pureConstantTasks(graph);
  std::vector<int> stage_of(graph.numTasks(), -1);
  std::vector<char> covered(graph.numTasks(), 0);
  std::vector<char> rank_used(std::max(0, d.world_size), 0);
  for (size_t s = 0; s < d.stages.size(); ++s) {
    const StagePlan& st = d.stages[s];
    if (st.tasks.empty()) fail("stage " + std::to_string(s) + " has no tasks");
    if (st.ranks.empty()) fail("stage " + std::to_string(s) + " has no ranks");
    for (int r : st.ranks) {
      if (r < 0 || r >= d.world_size) fail("stage " + std::to_string(s) + " names rank " + std::to_string(r) +
                                           " outside the world of " + std::to_string(d.world_size));
      if (rank_used[r]++) fail("rank " + std::to_string(r) + " holds two stage replicas");
    }
    std::vector<ir::TaskId> own;
    for (ir::TaskId t : st.tasks) {
      if (t < 0 || t >= graph.numTasks()) fail("stage " + std::to_string(s) + " names unknown task " + std::to_string(t));
      covered[t] = 1;
      if (constant[t]) continue;
      if (stage_of[t] >= 0) {
        fail("task " + std::to_string(t) + " (" + graph.task(t).op + ") is in stages " +
             std::to_string(stage_of[t]) + " and " + std::to_string(s));
      }
      stage_of[t] = static_cast<int>(s);
      own.push_back(t);
    }
    if (!own.empty() && !ir::isConvex(graph, own)) fail("stage " + std::to_string(s) + " is not convex");
  }
  for (ir::TaskId t = 0; t < graph.numTasks(); ++t) {
    if (!covered[t]) fail("task " + std::to_string(t) + " (" + graph.task(t).op + ") is in no stage");
  }
  for (const ir::Task& t : graph.tasks()) {
    if (stage_of[t.id] < 0) continue;
    for (ir::ValueId v : t.inputs) {
      const ir::TaskId p = graph.value(v).producer;
      if (p != ir::kNoId && stage_of[p] > stage_of[t.id]) {
        fail("task " + std::to_string(t.id) + " in stage " + std::to_string(stage_of[t.id]) +
             " reads a value of stage " + std::to_string(stage_of[p]) + ", a later stage");
      }
    }
  }
}

std::string serializeDeployment(const Deployment& d) {
  ir::BinaryWriter w;
  w.u64(d.graph_hash);
  w.str(d.planner);
  w.i32(d.world_size);
  w.i64(d.batch_size);
  w.i32(d.pipelines);
  w.i32(d.micro_batches);
  w.u8(static_cast<uint8_t>(d.schedule));
  w.u8(static_cast<uint8_t>(d.optimizer));
  w.i64(d.memory_limit);
  w.f64(d.iteration_time);
  w.u8(d.feasible);
  w.u64(d.stages.size());
  for (const StagePlan& s : d.stages) {
    w.i32s(s.tasks);
    w.i32s(s.ranks);
    w.i32(s.first_block);
    w.i32(s.last_block);
    w.u8(s.recompute);
    w.i64(s.micro_batch_rows);
    for (double x : {s.forward_time, s.backward_time, s.send_forward_time, s.send_backward_time,
                     s.allreduce_time, s.update_time, s.busy_time, s.bubble_time}) {
      w.f64(x);
    }
    w.i64(s.param_bytes);
    w.i64(s.memory_bytes);
    w.i64(s.static_bytes);
    w.i64(s.stash_bytes);
    w.i64(s.working_bytes);
  }
  return ir::frame(kDeploymentKind, kDeploymentFormatVersion, w.bytes());
}

Deployment deserializeDeployment(const std::string& bytes, const ir::Graph& graph,
                                 const std::string& origin) {
  const std::string payload = ir::unframe(bytes, kDeploymentKind, kDeploymentFormatVersion, origin);
  ir::BinaryReader r(payload);
  Deployment d;
  try {
    d.graph_hash = r.u64();
    const uint64_t expected = graph.contentHash();
    if (d.graph_hash != expected) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%016llx, but the model's graph hashes to %016llx",
                    static_cast<unsigned long long>(d.graph_hash),
                    static_cast<unsigned long long>(expected));
      throw SerializationError(origin + ": the deployment was planned for a graph hashing to " + buf +
                               "; the model changed since it was saved, plan again");
    }
    d.planner = r.str();
    d.world_size = r.i32();
    d.batch_size = r.i64();
    d.pipelines = r.i32();
    d.micro_batches = r.i32();
    d.schedule = static_cast<ScheduleKind>(r.u8());
    d.optimizer = static_cast<Optimizer>(r.u8());
    d.memory_limit = r.i64();
    d.iteration_time = r.f64();
    d.feasible = r.u8() != 0;
    const uint64_t n = r.u64();
    if (n > payload.size()) throw SerializationError("stage count past the end");
    for (uint64_t i = 0; i < n; ++i) {
      StagePlan s;
      s.tasks = r.i32s();
      for (ir::TaskId t : s.tasks) {
        if (t < 0 || t >= graph.numTasks()) {
          throw SerializationError("stage " + std::to_string(i) + " names unknown task " + std::to_string(t));
        }
      }
      s.ranks = r.i32s();
      s.first_block = r.i32();
      s.last_block = r.i32();
      s.recompute = r.u8() != 0;
      s.micro_batch_rows = r.i64();
      for (double* x : {&s.forward_time, &s.backward_time, &s.send_forward_time,
                        &s.send_backward_time, &s.allreduce_time, &s.update_time, &s.busy_time,
                        &s.bubble_time}) {
        *x = r.f64();
      }
      s.param_bytes = r.i64();
      s.memory_bytes = r.i64();
      s.static_bytes = r.i64();
      s.stash_bytes = r.i64();
      s.working_bytes = r.i64();
      d.stages.push_back(std::move(s));
    }
    if (!r.atEnd()) throw SerializationError("trailing bytes");
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    if (msg.rfind(origin, 0) == 0) throw;
    throw SerializationError(origin + ": corrupt deployment (" + msg + ")");
  }
  return d;
}

void saveDeployment(const Deployment& deployment, const std::string& path) {
  ir::writeFile(path, serializeDeployment(deployment));
}

Deployment loadDeployment(const std::string& path, const ir::Graph& graph) {
  return deserializeDeployment(ir::readFile(path), graph, path);
}

}  // namespace rannc::partition
