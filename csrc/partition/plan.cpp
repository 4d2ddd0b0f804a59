#include "partition/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

#include "common/error.h"
#include "common/hash.h"
#include "common/log_fmt.h"
#include "ir/serialize.h"
#include "ir/subgraph.h"

namespace rannc::partition {
namespace {

// "1f1b"; "interleaved, 2 chunks per device".
std::string scheduleText(const Deployment& d) {
  std::string text = scheduleName(d.schedule);
  if (d.chunks > 1) text += ", " + std::to_string(d.chunks) + " chunks per device";
  return text;
}

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

std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", fraction * 100.0);
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

std::string Deployment::hash() const {
  ir::BinaryWriter w;
  w.u64(graph_hash);
  w.i32(world_size);
  w.i64(batch_size);
  w.i32(pipelines);
  w.i32(micro_batches);
  w.u8(static_cast<uint8_t>(schedule));
  w.u8(static_cast<uint8_t>(optimizer));
  w.u64(stages.size());
  for (const StagePlan& s : stages) {
    w.i32s(s.tasks);
    w.i32s(s.ranks);
    w.u8(s.recompute);
    w.i64(s.micro_batch_rows);
  }
  if (chunks > 1) w.i32(chunks);  // one chunk hashes as before chunks existed
  const uint64_t h = Fnv1a().bytes(w.bytes().data(), w.bytes().size()).digest();
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", static_cast<unsigned>((h ^ (h >> 32)) & 0xffffffffu));
  return buf;
}

std::string Deployment::summary() const {
  std::ostringstream os;
  os << "plan " << hash() << ": " << stages.size() << " stage" << (stages.size() == 1 ? "" : "s")
     << ", replicas ";
  for (size_t s = 0; s < stages.size(); ++s) {
    os << (s ? "/" : "") << stages[s].ranks.size() / std::max<size_t>(1, static_cast<size_t>(pipelines));
  }
  os << ", " << micro_batches << " micro-batch" << (micro_batches == 1 ? "" : "es") << ", " << pipelines
     << " pipeline cop" << (pipelines == 1 ? "y" : "ies") << ", " << scheduleText(*this) << ", predicted "
     << ms(iteration_time) << " ms per iteration";
  return os.str();
}

double Deployment::bubbleFraction() const {
  if (stages.empty() || iteration_time <= 0.0) return 0.0;
  double busy = 0.0;
  for (const StagePlan& s : stages) busy += micro_batches * (s.forward_time + s.backward_time) + s.update_time;
  return std::max(0.0, 1.0 - busy / (static_cast<double>(deviceGroups()) * iteration_time));
}

std::string Deployment::report() const {
  std::ostringstream os;
  os << "plan " << hash() << " by " << planner << ": " << stages.size() << " stage(s) on " << world_size
     << " rank(s), " << pipelines << " pipeline cop" << (pipelines == 1 ? "y" : "ies") << ", "
     << micro_batches << " micro-batch(es) of global batch " << batch_size << ", "
     << scheduleText(*this) << ", " << optimizerName(optimizer) << "\n";
  os << "predicted iteration " << ms(iteration_time) << " ms, bubble " << percent(bubbleFraction())
     << "; memory limit " << human(memory_limit) << (feasible ? "" : " (EXCEEDED)") << "\n";
  if (!schedule_candidates.empty()) {
    os << "schedule auto:";
    for (const ScheduleCandidate& c : schedule_candidates) {
      os << " " << scheduleName(c.schedule) << " " << ms(c.iteration_time) << " ms (bubble "
         << percent(c.bubble) << (c.feasible ? "" : ", does not fit") << ")"
         << (c.schedule == schedule ? " chosen" : "") << ";";
    }
    os << "\n";
  }
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
  static_cast<StageTimes&>(s) = st;
  static_cast<StageMemory&>(s) = st;
  return s;
}

SimResult simulateDeployment(const Deployment& d, ScheduleKind schedule) {
  std::vector<SimStage> stages;
  for (const StagePlan& st : d.stages) stages.push_back(simStage(st));
  return simulate(stages, schedule, d.micro_batches, d.chunks);
}

void applySimulation(Deployment& d, const SimResult& r) {
  const int groups = d.deviceGroups();
  RANNC_CHECK(static_cast<int>(r.busy.size()) == groups, "a simulation of " << r.busy.size()
                                                          << " devices applied to a plan of " << groups);
  d.iteration_time = r.iteration_time;
  for (int i = 0; i < d.numStages(); ++i) {
    // with chunks, a stage reports its device's (all chunks): that is what must fit
    const int g = i % groups;
    d.stages[i].busy_time = r.busy[g];
    d.stages[i].bubble_time = r.bubble[g];
    d.stages[i].memory_bytes = r.peak_memory[g];
    if (d.stages[i].memory_bytes > d.memory_limit) d.feasible = false;
  }
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
  if (d.chunks < 1 || d.numStages() % d.chunks != 0) {
    fail(std::to_string(d.numStages()) + " stages do not split into " + std::to_string(d.chunks) +
         " chunks per device group");
  }
  if ((d.chunks > 1) != (d.schedule == ScheduleKind::Interleaved)) {
    fail(std::string("schedule ") + scheduleName(d.schedule) + " with " + std::to_string(d.chunks) +
         " chunks per device group (interleaved schedules have 2 or more, the others 1)");
  }
  const int groups = d.deviceGroups();
  for (size_t s = 0; s < d.stages.size(); ++s) {
    const StagePlan& st = d.stages[s];
    if (st.tasks.empty()) fail("stage " + std::to_string(s) + " has no tasks");
    if (st.ranks.empty()) fail("stage " + std::to_string(s) + " has no ranks");
    if (static_cast<int>(s) >= groups) {  // a later chunk: the ranks of its device group
      if (st.ranks != d.stages[s % groups].ranks) {
        fail("stage " + std::to_string(s) + " is chunk " + std::to_string(s / groups) + " of device group " +
             std::to_string(s % groups) + " but does not run on its ranks");
      }
    }
    for (int r : static_cast<int>(s) < groups ? st.ranks : std::vector<int>{}) {
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
  w.i32(d.chunks);
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
    for (double x : {s.forward_time, s.backward_time, s.weight_time, s.send_forward_time,
                     s.send_backward_time, s.allreduce_time, s.update_time, s.busy_time, s.bubble_time}) {
      w.f64(x);
    }
    w.i64(s.param_bytes);
    w.i64(s.memory_bytes);
    w.i64(s.static_bytes);
    w.i64(s.stash_bytes);
    w.i64(s.working_bytes);
  }
  w.u64(d.schedule_candidates.size());
  for (const ScheduleCandidate& c : d.schedule_candidates) {
    w.u8(static_cast<uint8_t>(c.schedule));
    w.f64(c.iteration_time);
    w.f64(c.bubble);
    w.u8(c.feasible);
  }
  return ir::frame(kDeploymentKind, kDeploymentFormatVersion, w.bytes());
}

namespace {

// Sense checks of a deployment read from a file or another rank: every count, size and
// time must be one a planner could have written, so a corrupt or hand-edited plan is
// refused naming the field instead of running (or allocating) nonsense.
constexpr int kMaxWorldSize = 1 << 20;

std::string numberText(double x) {
  std::ostringstream os;
  os << x;
  return os.str();
}

void checkTime(const std::string& field, double x) {
  if (!std::isfinite(x) || x < 0.0) {
    throw SerializationError(field + ": " + numberText(x) + " is not a time (finite, >= 0 seconds)");
  }
}

void checkBytes(const std::string& field, int64_t x) {
  if (x < 0) throw SerializationError(field + ": " + std::to_string(x) + " bytes is negative");
}

}  // namespace

Deployment deserializeDeployment(const std::string& bytes, const ir::Graph& graph,
                                 const std::string& origin, int64_t batch_size, int world_size) {
  const std::string payload = ir::unframe(bytes, kDeploymentKind, kDeploymentFormatVersion, origin);
  ir::BinaryReader r(payload);
  Deployment d;
  auto bad = [](const std::string& field, const std::string& why) {
    throw SerializationError(field + ": " + why);
  };
  try {
    d.graph_hash = r.u64("graph_hash");
    const uint64_t expected = graph.contentHash();
    if (d.graph_hash != expected) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%016llx, but the model's graph hashes to %016llx",
                    static_cast<unsigned long long>(d.graph_hash),
                    static_cast<unsigned long long>(expected));
      throw SerializationError(origin + ": the deployment was planned for a graph hashing to " + buf +
                               "; the model changed since it was saved, plan again");
    }
    d.planner = r.str("planner");
    d.world_size = r.i32("world_size");
    if (d.world_size < 1 || d.world_size > kMaxWorldSize) {
      bad("world_size", std::to_string(d.world_size) + " is not a number of ranks (1.." +
                            std::to_string(kMaxWorldSize) + ")");
    }
    if (world_size > 0 && d.world_size != world_size) {
      bad("world_size", "the plan was made for " + std::to_string(d.world_size) + " rank(s), this job has " +
                            std::to_string(world_size) + "; plan again for this world");
    }
    d.batch_size = r.i64("batch_size");
    if (d.batch_size < 1) bad("batch_size", std::to_string(d.batch_size) + " rows is not a batch (>= 1)");
    if (batch_size > 0 && d.batch_size != batch_size) {
      bad("batch_size", "the plan is for a global batch of " + std::to_string(d.batch_size) +
                            " rows, but the model's batch is " + std::to_string(batch_size) +
                            " (local batch x world size); plan again for this batch");
    }
    d.pipelines = r.i32("pipelines");
    if (d.pipelines < 1 || d.pipelines > d.world_size) {
      bad("pipelines", std::to_string(d.pipelines) + " pipeline copies on " + std::to_string(d.world_size) +
                           " rank(s) (expected 1.." + std::to_string(d.world_size) + ")");
    }
    if (d.pipelines > d.batch_size) {
      bad("pipelines", std::to_string(d.pipelines) + " pipeline copies need at least one row each, "
                       "but batch_size is " + std::to_string(d.batch_size));
    }
    const int64_t rows_per_copy = d.batch_size / d.pipelines;
    d.micro_batches = r.i32("micro_batches");
    if (d.micro_batches < 1 || d.micro_batches > rows_per_copy) {
      bad("micro_batches", std::to_string(d.micro_batches) + " is not between 1 and the " +
                               std::to_string(rows_per_copy) + " rows of a pipeline copy");
    }
    const uint8_t schedule = r.u8("schedule");
    if (schedule > static_cast<uint8_t>(ScheduleKind::Interleaved)) {
      bad("schedule", std::to_string(schedule) + " is not a known schedule");
    }
    d.schedule = static_cast<ScheduleKind>(schedule);
    d.chunks = r.i32("chunks");
    if (d.chunks < 1) bad("chunks", std::to_string(d.chunks) + " is not a chunk count (>= 1)");
    if ((d.chunks > 1) != (d.schedule == ScheduleKind::Interleaved)) {
      bad("chunks", std::to_string(d.chunks) + " chunk(s) per device group under schedule " +
                        scheduleName(d.schedule) + " (interleaved: 2 or more, the others 1)");
    }
    const uint8_t optimizer = r.u8("optimizer");
    if (optimizer > static_cast<uint8_t>(Optimizer::Adam)) {
      bad("optimizer", std::to_string(optimizer) + " is not a known optimizer");
    }
    d.optimizer = static_cast<Optimizer>(optimizer);
    d.memory_limit = r.i64("memory_limit");
    checkBytes("memory_limit", d.memory_limit);
    d.iteration_time = r.f64("iteration_time");
    checkTime("iteration_time", d.iteration_time);
    d.feasible = r.u8("feasible") != 0;
    // Each stage holds at least one rank, and takes at least 137 bytes (empty lists).
    const uint64_t n = r.count("stages", 137);
    if (n < 1 || n > static_cast<uint64_t>(d.world_size) * d.chunks || n % d.chunks != 0) {
      bad("stages", "count " + std::to_string(n) + " is not a multiple of " + std::to_string(d.chunks) +
                        " chunk(s) between 1 and the " + std::to_string(d.world_size) + " rank(s) of the world");
    }
    int ranks_used = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const std::string f = "stages[" + std::to_string(i) + "].";
      StagePlan s;
      s.tasks = r.i32s(f + "tasks");
      if (s.tasks.empty()) bad(f + "tasks", "the stage has no tasks");
      for (ir::TaskId t : s.tasks) {
        if (t < 0 || t >= graph.numTasks()) {
          bad(f + "tasks", "names unknown task " + std::to_string(t) + " (the graph has " +
                               std::to_string(graph.numTasks()) + ")");
        }
      }
      s.ranks = r.i32s(f + "ranks");
      const int nranks = static_cast<int>(s.ranks.size());
      if (nranks < d.pipelines || nranks % d.pipelines != 0) {
        bad(f + "ranks", std::to_string(nranks) + " rank(s) are not a whole number of replicas in each of " +
                             std::to_string(d.pipelines) + " pipeline cop" + (d.pipelines == 1 ? "y" : "ies"));
      }
      for (int rank : s.ranks) {
        if (rank < 0 || rank >= d.world_size) {
          bad(f + "ranks", "names rank " + std::to_string(rank) + " outside the world of " +
                               std::to_string(d.world_size));
        }
      }
      const uint64_t groups = n / d.chunks;
      if (i >= groups && s.ranks != d.stages[i % groups].ranks) {
        bad(f + "ranks", "chunk " + std::to_string(i / groups) + " of device group " + std::to_string(i % groups) +
                             " does not run on the group's ranks");
      }
      if (i < groups) ranks_used += nranks;  // later chunks share their group's ranks
      if (ranks_used > d.world_size) {
        bad(f + "ranks", "the stages hold " + std::to_string(ranks_used) + " replicas, more than the " +
                             std::to_string(d.world_size) + " rank(s) of the world");
      }
      s.first_block = r.i32(f + "first_block");
      s.last_block = r.i32(f + "last_block");
      if (!(s.first_block == -1 && s.last_block == -1) && !(0 <= s.first_block && s.first_block < s.last_block)) {
        bad(f + "first_block", "blocks [" + std::to_string(s.first_block) + ", " + std::to_string(s.last_block) +
                                   ") are not a block range (or -1, -1)");
      }
      s.recompute = r.u8(f + "recompute") != 0;
      s.micro_batch_rows = r.i64(f + "micro_batch_rows");
      // The planner gives each replica ceil(batch / (copies x micro-batches x replicas)) rows.
      const int64_t shares = static_cast<int64_t>(d.pipelines) * d.micro_batches * (nranks / d.pipelines);
      if (shares > d.batch_size) {
        bad(f + "ranks", std::to_string(nranks / d.pipelines) + " replica(s) x " + std::to_string(d.micro_batches) +
                             " micro-batch(es) x " + std::to_string(d.pipelines) +
                             " pipeline cop(ies) leave a replica without rows of batch_size " +
                             std::to_string(d.batch_size));
      }
      const int64_t rows = (d.batch_size + shares - 1) / shares;
      if (s.micro_batch_rows != rows) {
        bad(f + "micro_batch_rows", std::to_string(s.micro_batch_rows) + " disagrees with batch_size " +
                                        std::to_string(d.batch_size) + " split over " + std::to_string(shares) +
                                        " shares (" + std::to_string(rows) + " rows each)");
      }
      const std::pair<const char*, double*> times[] = {
          {"forward_time", &s.forward_time},     {"backward_time", &s.backward_time},
          {"weight_time", &s.weight_time},
          {"send_forward_time", &s.send_forward_time}, {"send_backward_time", &s.send_backward_time},
          {"allreduce_time", &s.allreduce_time}, {"update_time", &s.update_time},
          {"busy_time", &s.busy_time},           {"bubble_time", &s.bubble_time}};
      for (const auto& [name, x] : times) {
        *x = r.f64(f + name);
        checkTime(f + name, *x);
      }
      const std::pair<const char*, int64_t*> sizes[] = {
          {"param_bytes", &s.param_bytes},   {"memory_bytes", &s.memory_bytes},
          {"static_bytes", &s.static_bytes}, {"stash_bytes", &s.stash_bytes},
          {"working_bytes", &s.working_bytes}};
      for (const auto& [name, x] : sizes) {
        *x = r.i64(f + name);
        checkBytes(f + name, *x);
      }
      d.stages.push_back(std::move(s));
    }
    const uint64_t tried = r.count("schedule_candidates", 18);
    for (uint64_t i = 0; i < tried; ++i) {
      const std::string f = "schedule_candidates[" + std::to_string(i) + "].";
      ScheduleCandidate c;
      const uint8_t kind = r.u8(f + "schedule");
      if (kind > static_cast<uint8_t>(ScheduleKind::Interleaved)) {  // a plan names no Auto
        bad(f + "schedule", std::to_string(kind) + " is not a known schedule");
      }
      c.schedule = static_cast<ScheduleKind>(kind);
      c.iteration_time = r.f64(f + "iteration_time");
      checkTime(f + "iteration_time", c.iteration_time);
      c.bubble = r.f64(f + "bubble");
      if (!(c.bubble >= 0.0 && c.bubble <= 1.0)) bad(f + "bubble", numberText(c.bubble) + " is not a fraction");
      c.feasible = r.u8(f + "feasible") != 0;
      d.schedule_candidates.push_back(c);
    }
    if (!r.atEnd()) throw SerializationError("trailing bytes after the schedule candidates");
  } catch (const SerializationError& e) {
    const std::string msg = e.what();
    if (msg.rfind(origin, 0) == 0) throw;
    throw SerializationError(origin + ": corrupt deployment: " + msg);
  }
  return d;
}

void saveDeployment(const Deployment& deployment, const std::string& path) {
  ir::writeFile(path, serializeDeployment(deployment));
}

namespace {

// "aten::linear (module 'encoder.layer.0', at modeling_bert.py:120)"
std::string taskText(const ir::Task& t) {
  std::string text = t.op;
  if (!t.scope.empty() || !t.source.empty()) {
    text += " (";
    if (!t.scope.empty()) text += "module '" + t.scope + "'";
    if (!t.scope.empty() && !t.source.empty()) text += ", ";
    if (!t.source.empty()) text += "at " + t.source;
    text += ")";
  }
  return text;
}

// Why value `v` of `graph` is not the value `v` of `planned` ("" when it is).
std::string valueDifference(const ir::Value& was, const ir::Value& now) {
  if (was.kind != now.kind) {
    return std::string(ir::valueKindName(now.kind)) + " instead of " + std::string(ir::valueKindName(was.kind));
  }
  if (was.role != now.role) {
    return std::string(ir::valueRoleName(now.role)) + " instead of " + std::string(ir::valueRoleName(was.role));
  }
  if (was.dtype != now.dtype) {
    return std::string(ir::dtypeName(now.dtype)) + " instead of " + std::string(ir::dtypeName(was.dtype));
  }
  if (was.batch_dim != now.batch_dim) {
    return "batch dimension " + std::to_string(now.batch_dim) + " instead of " + std::to_string(was.batch_dim);
  }
  return "";
}

// The bytes of the batch values a stage's tasks produce, per row of the graph's batch.
double bytesPerRow(const ir::Graph& graph, const StagePlan& stage) {
  if (graph.batchSize() <= 0) return 0.0;
  double bytes = 0.0;
  for (ir::TaskId t : stage.tasks) {
    for (ir::ValueId v : graph.task(t).outputs) {
      if (graph.value(v).isBatch()) bytes += double(graph.value(v).bytes());
    }
  }
  return bytes / double(graph.batchSize());
}

// Bytes of the parameters `stage` reads that do not require grad in `graph`, each once.
int64_t frozenBytes(const ir::Graph& graph, const StagePlan& stage) {
  std::set<ir::ValueId> seen;
  int64_t bytes = 0;
  for (ir::TaskId t : stage.tasks) {
    for (ir::ValueId v : graph.task(t).inputs) {
      const ir::Value& val = graph.value(v);
      if (val.role == ir::ValueRole::Param && !val.requires_grad && seen.insert(v).second) bytes += val.bytes();
    }
  }
  return bytes;
}

}  // namespace

Deployment rebindDeployment(const Deployment& plan, const ir::Graph& planned, const ir::Graph& graph) {
  RANNC_CHECK(plan.graph_hash == planned.contentHash(), "rebindDeployment: the plan was not made for `planned`");
  const std::string cure =
      "; rannc traces the model again for new input shapes and runs the plan made at the first "
      "ones, which needs the same ops in the same order. Pad the inputs to one length (or a few "
      "lengths the model treats alike)";
  auto differ = [&](const std::string& what) {
    throw TraceError("at the new input shapes the model is another program than the one planned: " + what + cure);
  };
  const auto& was_tasks = planned.tasks();
  const auto& now_tasks = graph.tasks();
  const size_t common = std::min(was_tasks.size(), now_tasks.size());
  for (size_t i = 0; i < common; ++i) {
    const ir::Task& was = was_tasks[i];
    const ir::Task& now = now_tasks[i];
    if (was.op != now.op || was.inputs.size() != now.inputs.size() || was.outputs.size() != now.outputs.size()) {
      differ("task " + std::to_string(i) + " is " + taskText(now) + " but was " + taskText(was));
    }
    for (size_t k = 0; k < was.inputs.size(); ++k) {
      if (was.inputs[k] != now.inputs[k]) {
        differ("task " + std::to_string(i) + ", " + taskText(now) + ", reads other values");
      }
    }
    for (size_t k = 0; k < was.outputs.size(); ++k) {
      if (was.outputs[k] != now.outputs[k]) {
        differ("task " + std::to_string(i) + ", " + taskText(now) + ", writes other values");
      }
    }
  }
  if (was_tasks.size() != now_tasks.size()) {
    const auto& longer = was_tasks.size() > now_tasks.size() ? was_tasks : now_tasks;
    differ(std::to_string(now_tasks.size()) + " ops instead of " + std::to_string(was_tasks.size()) +
           ", from task " + std::to_string(common) + " (" + taskText(longer[common]) + ") on");
  }
  if (planned.numValues() != graph.numValues() || planned.inputs() != graph.inputs() ||
      planned.outputs() != graph.outputs()) {
    differ("its values, arguments or outputs differ");
  }
  for (ir::ValueId v = 0; v < static_cast<ir::ValueId>(graph.numValues()); ++v) {
    const std::string why = valueDifference(planned.value(v), graph.value(v));
    if (!why.empty()) {
      const ir::Value& now = graph.value(v);
      const std::string where =
          now.producer != ir::kNoId ? ", made by " + taskText(graph.task(now.producer)) : "";
      differ("value " + ir::describe(now) + where + " is " + why);
    }
  }
  Deployment d = plan;
  d.graph_hash = graph.contentHash();
  // A stage stashes its values per row: at rows of other sizes (longer sequences), so much
  // more or less ([Note: memory at other batches] in runtime/batch_memory.h). The peaks and
  // feasibility stay as planned.
  for (StagePlan& stage : d.stages) {
    const double was = bytesPerRow(planned, stage), now = bytesPerRow(graph, stage);
    if (was <= 0.0 || now <= 0.0) continue;
    stage.stash_bytes = std::llround(double(stage.stash_bytes) * now / was);
    stage.working_bytes = std::llround(double(stage.working_bytes) * now / was);
  }
  // Parameters unfrozen since the plan get a gradient and optimizer state (frozen ones
  // give theirs back): [Note: frozen parameters' memory] in cost/cost_model.h.
  for (StagePlan& stage : d.stages) {
    const int64_t thawed = frozenBytes(planned, stage) - frozenBytes(graph, stage);
    stage.static_bytes += thawed * (1 + optimizerStateFactor(d.optimizer));
  }
  return d;
}

Deployment loadDeployment(const std::string& path, const ir::Graph& graph, int64_t batch_size,
                          int world_size) {
  Deployment d = deserializeDeployment(ir::readFile(path), graph, path, batch_size, world_size);
  logger().info("{} (loaded from {})", d.summary(), path);
  return d;
}

}  // namespace rannc::partition
