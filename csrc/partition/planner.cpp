#include "partition/planner.h"

#include <algorithm>
#include <map>

#include "common/error.h"
#include "common/log_fmt.h"

namespace rannc::partition {

namespace {

[[noreturn]] void badOption(const std::string& name, const std::string& value, const std::string& expected) {
  throw InvalidGraphError("option " + name + " is " + value + "; expected " + expected);
}

std::string replicaList(const std::vector<int>& replicas) {
  std::string list;
  for (int r : replicas) list += (list.empty() ? "" : ",") + std::to_string(r);
  return list;
}

}  // namespace

void checkOptions(const PlannerOptions& o) {
  auto str = [](auto v) { return std::to_string(v); };
  if (o.world_size < 1) badOption("world_size", str(o.world_size), "at least 1");
  if (o.num_blocks < 1) badOption("num_blocks", str(o.num_blocks), "at least 1");
  if (o.model_copies < 0) badOption("model_copies", str(o.model_copies), "at least 0");
  if (!(o.memory_margin >= 0.0 && o.memory_margin < 1.0)) {
    badOption("memory_margin", str(o.memory_margin), "a fraction in [0, 1) of device_memory");
  }
  if (o.batch_size < 0) badOption("batch_size", str(o.batch_size), "at least 0 (0: the traced batch x world_size)");
  if (o.memory_limit < 0) badOption("memory_limit", str(o.memory_limit), "at least 0 (0: from the device)");
  if (o.num_stages < 0) badOption("num_stages", str(o.num_stages), "at least 0 (0: searched)");
  if (o.num_microbatches < 0) badOption("num_microbatches", str(o.num_microbatches), "at least 0 (0: searched)");
  if (!o.replicas.empty()) {
    for (int r : o.replicas) {
      if (r < 1) badOption("replicas", replicaList(o.replicas), "counts of at least 1 per stage, such as 2,1,1");
    }
    if (o.num_stages != static_cast<int>(o.replicas.size())) {
      badOption("replicas", replicaList(o.replicas),
                "one count per stage: set num_stages to " + str(o.replicas.size()) + " (it is " +
                    str(o.num_stages) + ")");
    }
  }
  if (o.chunks < 2) badOption("chunks", str(o.chunks), "at least 2 (stages per device under schedule interleaved)");
  if (o.schedule == ScheduleKind::Interleaved && o.num_stages > 0 && o.num_stages % o.chunks != 0) {
    badOption("num_stages", str(o.num_stages),
              "a multiple of chunks=" + str(o.chunks) + " under schedule interleaved");
  }
  if (o.search_patience < 0) badOption("search_patience", str(o.search_patience), "at least 0 (0: exhaustive)");
  if (o.verify_finalists < 0) badOption("verify_finalists", str(o.verify_finalists), "at least 0");
  if (o.refine_candidates < 1) badOption("refine_candidates", str(o.refine_candidates), "at least 1");
  if (o.max_microbatches < 1) badOption("max_microbatches", str(o.max_microbatches), "at least 1");
  if (!(o.plan_tolerance >= 0.0 && o.plan_tolerance < 1.0)) {
    badOption("plan_tolerance", str(o.plan_tolerance),
              "a fraction in [0, 1) of the fastest plan's time (0.02: 2%)");
  }
}

PlanContext planContext(const ir::Graph& graph, const CostModel& costs, const PlannerOptions& o) {
  checkOptions(o);
  if (!o.replicas.empty()) {
    int sum = 0;
    // interleaved: the chunks of a device group share its devices; count them once
    const int counted = o.schedule == ScheduleKind::Interleaved ? o.num_stages / o.chunks : o.num_stages;
    for (int s = 0; s < counted; ++s) sum += o.replicas[s];
    if (o.world_size % sum != 0) {
      badOption("replicas", replicaList(o.replicas),
                std::string(counted < o.num_stages ? "counts whose first " + std::to_string(counted) +
                                                         " (one per device group) sum"
                                                   : "counts whose sum") +
                    " divides the world size " + std::to_string(o.world_size) + " (they use " +
                    std::to_string(sum) + " device(s) per pipeline copy)");
    }
  }
  PlanContext ctx;
  ctx.world_size = o.world_size;
  ctx.batch_size = o.batch_size > 0 ? o.batch_size : std::max<int64_t>(1, graph.batchSize()) * o.world_size;
  ctx.devices_per_node = costs.device().devices_per_node;
  ctx.memory_limit = o.memory_limit > 0
                         ? o.memory_limit
                         : static_cast<int64_t>(static_cast<double>(costs.device().memory_bytes) *
                                                (1.0 - o.memory_margin));
  ctx.optimizer = o.optimizer;
  ctx.model_copies = o.model_copies;
  ctx.schedule = o.schedule;
  ctx.recompute = o.recompute;
  ctx.update_seconds_per_byte = o.update_seconds_per_byte;
  ctx.rows_together = o.rows_together;
  return ctx;
}

namespace {

// Plans up to this much slower than the fastest (by composed costs) may be verified:
// composing a big stage from its blocks came out up to ~10% fast on the CPU (session 8).
constexpr double kFinalistMargin = 0.15;

bool sameShape(const Deployment& a, const Deployment& b) {
  const PlanShape x = planShape(a), y = planShape(b);
  return x.stages == y.stages && x.micro_batches == y.micro_batches && x.pipelines == y.pipelines &&
         x.replicas == y.replicas;
}

// [Note: verified finalists] Composed costs rank plans well but run big stages a little
// fast (a whole stage allocates more fresh memory than its blocks one at a time), so
// plans of different shapes within a few percent by composed costs can rank the other
// way measured whole. The chosen plan and the fastest plans of other shapes within
// kFinalistMargin are measured whole (their stages announced as one batch, so the ranks
// share them) and the preference decides again. The chosen plan is measured whole even
// when it has no rival: its prediction is what the user compares the run with (a
// composed 2-stage GPT came out 10-15% under its run on the CPU, session 14).
Deployment verifyFinalists(const Deployment& chosen, std::vector<Deployment> near, CostModel& costs,
                           const PlanContext& ctx, const PlannerOptions& options) {
  std::sort(near.begin(), near.end(),
            [](const Deployment& a, const Deployment& b) { return a.iteration_time < b.iteration_time; });
  std::vector<Deployment> finalists{chosen};
  for (const Deployment& d : near) {
    if (static_cast<int>(finalists.size()) >= options.verify_finalists) break;
    if (!d.feasible || d.iteration_time > chosen.iteration_time * (1.0 + kFinalistMargin)) continue;
    const bool seen = std::any_of(finalists.begin(), finalists.end(),
                                  [&](const Deployment& f) { return sameShape(f, d); });
    if (!seen) finalists.push_back(d);
  }
  std::map<int64_t, std::vector<std::vector<ir::TaskId>>> pieces;  // by rows
  for (const Deployment& f : finalists) {
    for (const StagePlan& s : f.stages) {
      if (s.micro_batch_rows > 0) pieces[s.micro_batch_rows].push_back(s.tasks);
    }
  }
  for (const auto& [rows, list] : pieces) costs.prefetch(list, rows);
  std::vector<Deployment> whole;
  std::vector<PlanShape> shapes;
  for (const Deployment& f : finalists) {
    Deployment w = assembleWhole(costs, ctx, f);
    logger().info("finalist {} stage(s), {} micro-batch(es), {} pipeline cop(ies): {:.3f} ms composed, "
                  "{:.3f} ms with its stages measured whole", w.numStages(), w.micro_batches, w.pipelines,
                  f.iteration_time * 1e3, w.iteration_time * 1e3);
    if (!w.feasible) continue;
    shapes.push_back(planShape(w));
    whole.push_back(std::move(w));
  }
  if (whole.empty()) return chosen;
  return whole[preferredIndex(shapes, options.plan_tolerance)];
}

// One schedule's search: blocks, the stage DP, refinement and verification.
void planSchedule(PlanTrace& trace, CostModel& costs, const PlanContext& ctx, const PlannerOptions& options) {
  BlockOptions bo;
  bo.num_blocks = options.num_blocks;
  // Blocks are costed at the smallest micro-batch a plan can use with every device a data
  // parallel replica; stage costs are then taken merged at each candidate's own rows.
  bo.rows = std::max<int64_t>(1, (ctx.batch_size + ctx.world_size - 1) / ctx.world_size);
  // A block only has to fit at the smallest micro-batch a plan may use; fitting at the
  // larger rows would cut big models into many small blocks and slow the stage search.
  const int64_t max_mb = options.num_microbatches > 0 ? options.num_microbatches : options.max_microbatches;
  bo.memory_rows = std::max<int64_t>(1, (bo.rows + max_mb - 1) / max_mb);
  bo.memory_limit = ctx.memory_limit;
  bo.optimizer = ctx.optimizer;
  bo.model_copies = ctx.model_copies;
  StageSearchOptions so;
  so.num_stages = options.num_stages;
  so.num_microbatches = options.num_microbatches;
  so.max_microbatches = options.max_microbatches;
  so.search_patience = options.search_patience;
  so.every_node_count = options.every_node_count;
  so.replicas = options.replicas;
  so.plan_tolerance = options.plan_tolerance;
  const int atoms = static_cast<int>(trace.atomic.pieces.size());
  std::vector<Deployment> candidates;
  const int keep = options.refine_boundaries ? options.refine_candidates : 1;
  for (int attempt = 0;; ++attempt) {
    trace.blocks = partitionBlocks(trace.atomic, costs, bo);
    StageProblem problem(trace.blocks, costs, ctx);
    try {
      candidates = ctx.schedule == ScheduleKind::Interleaved
                       ? std::vector<Deployment>{formInterleavedStages(problem, so, options.chunks)}
                       : formStageCandidates(problem, so, keep);
      break;
    } catch (const InfeasiblePlanError& e) {
      // Stages are unions of blocks, so k caps the stage count and the granularity of
      // stage memory; when more devices than blocks could help, retry with finer blocks.
      const int k = static_cast<int>(trace.blocks.blocks.size());
      if (attempt >= 3 || k >= atoms || k >= ctx.world_size) throw;
      bo.num_blocks = std::min(atoms, std::max(2 * k, std::min(ctx.world_size, 2 * bo.num_blocks)));
      logger().info("no plan fits with {} blocks ({}); retrying with {} blocks", k, e.what(),
                    bo.num_blocks);
    }
  }
  // The block DP ranks shapes at block granularity; a shape it ranks second can win once
  // cut piece by piece, so the best plans of several shapes are refined. Every plan met on
  // the way competes (the unrefined winner too): the simplest within the tolerance of the
  // fastest ([Note: plan tolerance]), its boundaries then settled within the same bound.
  trace.deployment = candidates.front();
  const bool verify = costs.composesUnions() && options.verify_finalists > 0;
  // Refinement moves single boundaries and replicas; an interleaved plan's stages are tied
  // to their device groups, so it keeps the block-level cut (measured whole all the same).
  if (!options.refine_boundaries || ctx.schedule == ScheduleKind::Interleaved) {
    if (verify) trace.deployment = verifyFinalists(trace.deployment, {}, costs, ctx, options);
  } else {
    RefineOptions ro;
    ro.move_replicas = options.refine_replicas && options.replicas.empty();
    ro.move_micro_batches = options.refine_replicas && options.num_microbatches == 0;
    ro.max_microbatches = options.max_microbatches;
    PreferredPlan met(verify ? std::max(options.plan_tolerance, kFinalistMargin) : options.plan_tolerance);
    for (const Deployment& c : candidates) {
      refineBoundaries(c, trace.atomic, trace.blocks, costs, ctx, ro, &met);
    }
    if (!met.empty()) {
      trace.deployment = settleBoundaries(met.choice(options.plan_tolerance), trace.atomic, trace.blocks,
                                          costs, ctx, met.fastestTime() * (1.0 + options.plan_tolerance));
      if (verify) trace.deployment = verifyFinalists(trace.deployment, met.near(), costs, ctx, options);
    }
  }
}

// `plan` run under `schedule` instead: the simulator over its stages' predictions (the
// recomputation choices kept); infeasible where a stage then holds more than fits.
Deployment rescheduled(const Deployment& plan, ScheduleKind schedule) {
  Deployment d = plan;
  d.schedule = schedule;
  applySimulation(d, simulateDeployment(plan, schedule));
  return d;
}

// Whether `a` beats `b`: it fits where `b` does not, or is faster by more than `tolerance`.
bool faster(const Deployment& a, const Deployment& b, double tolerance) {
  if (a.feasible != b.feasible) return a.feasible;
  return a.iteration_time < b.iteration_time * (1.0 - tolerance);
}

// [Note: schedule choice] schedule=auto plans each schedule the runtime runs from a loss
// (1F1B, ZB-H1, interleaved 1F1B with `chunks` chunks) with the whole search, since the
// best stages, replicas and micro-batch count differ between them (ZB-H1's smaller bubble
// needs fewer micro-batches; interleaving cuts twice the stages). Another schedule wins
// only when it is faster than 1F1B by more than plan_tolerance: 1F1B is the simplest
// (one backward per micro-batch, one stage per device), ZB-H1 keeps activations until
// the deferred weight parts and its weight share is estimated where it is not measured
// ([Note: weight gradient share] in stage_cost.h), and interleaving sends chunks times as
// often. The costs are measured once: later searches read them from the
// cost model.
PlanTrace chooseSchedule(PlanTrace atomic, CostModel& costs, const PlanContext& ctx,
                         const PlannerOptions& options) {
  std::vector<ScheduleKind> kinds{ScheduleKind::OneFOneB};
  // One stage has no bubble to fill: every schedule runs the same plan.
  if (options.num_stages != 1) kinds.push_back(ScheduleKind::ZeroBubbleH1);
  // Interleaving needs two device groups (all chunks on one group is one slower stage),
  // a fixed stage count it can split, and no fixed replicas.
  const bool interleave = options.replicas.empty() && ctx.world_size >= 2 &&
                          (options.num_stages == 0 ||
                           (options.num_stages % options.chunks == 0 && options.num_stages / options.chunks >= 2));
  if (interleave) kinds.push_back(ScheduleKind::Interleaved);
  std::vector<PlanTrace> found;
  for (ScheduleKind kind : kinds) {
    PlanContext c = ctx;
    c.schedule = kind;
    PlanTrace t = atomic;
    try {
      planSchedule(t, costs, c, options);
    } catch (const InfeasiblePlanError&) {
      if (kind == kinds.back() && found.empty()) throw;  // neither schedule has a plan
      continue;
    }
    found.push_back(std::move(t));
  }
  // Each schedule's search ranks stages by a score that approximates the simulator, so
  // another schedule's plan, simulated under this one, can beat this one's own search.
  for (PlanTrace& t : found) {
    for (const PlanTrace& other : found) {
      // (an interleaved plan's stages are tied to its chunks: it runs under no other schedule)
      if (&other == &t || t.deployment.chunks > 1 || other.deployment.chunks > 1) continue;
      Deployment cross = rescheduled(other.deployment, t.deployment.schedule);
      if (faster(cross, t.deployment, 0.0)) {
        logger().info("schedule {}: the {} plan is faster ({:.3f} ms against {:.3f} ms)",
                      scheduleName(cross.schedule), scheduleName(other.deployment.schedule),
                      cross.iteration_time * 1e3, t.deployment.iteration_time * 1e3);
        t.deployment = std::move(cross);
      }
    }
  }
  std::vector<ScheduleCandidate> tried;
  size_t best = 0;
  for (size_t i = 0; i < found.size(); ++i) {
    const Deployment& d = found[i].deployment;
    tried.push_back({d.schedule, d.iteration_time, d.bubbleFraction(), d.feasible});
    logger().info("schedule {}: {}", scheduleName(d.schedule), d.summary());
  }
  // 1F1B (the first) unless another is faster than it by the tolerance; among those, the
  // fastest.
  for (size_t i = 1; i < found.size(); ++i) {
    if (faster(found[i].deployment, found[0].deployment, options.plan_tolerance) &&
        (best == 0 || faster(found[i].deployment, found[best].deployment, 0.0))) {
      best = i;
    }
  }
  PlanTrace chosen = std::move(found[best]);
  chosen.deployment.schedule_candidates = std::move(tried);
  return chosen;
}

}  // namespace

PlanTrace planTrace(const ir::Graph& graph, CostModel& costs, const PlannerOptions& options) {
  RANNC_CHECK(&costs.graph() == &graph, "the cost model was built over another graph");
  if (graph.numTasks() == 0) throw InvalidGraphError("cannot plan a graph without tasks");
  const PlanContext ctx = planContext(graph, costs, options);
  PlanTrace trace;
  trace.atomic = partitionAtomic(graph, options.constant_policy);
  if (options.schedule != ScheduleKind::Auto) {
    planSchedule(trace, costs, ctx, options);
  } else {
    trace = chooseSchedule(std::move(trace), costs, ctx, options);
  }
  logger().info("{} (planned: {} tasks, {} atomic pieces, {} blocks)", trace.deployment.summary(),
                graph.numTasks(), trace.atomic.pieces.size(), trace.blocks.blocks.size());
  return trace;
}

Deployment plan(const ir::Graph& graph, CostModel& costs, const PlannerOptions& options) {
  return planTrace(graph, costs, options).deployment;
}

}  // namespace rannc::partition
