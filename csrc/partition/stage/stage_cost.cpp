#include "partition/stage/stage_cost.h"

#include <algorithm>
#include <unordered_set>

#include "common/error.h"
#include "partition/cost/memory.h"
#include "partition/sim/simulator.h"

namespace rannc::partition {

const char* recomputeName(Recompute r) {
  switch (r) {
    case Recompute::Auto: return "auto";
    case Recompute::Never: return "never";
    case Recompute::Always: return "always";
  }
  return "?";
}

Recompute recomputeFromName(const std::string& name) {
  if (name == "auto") return Recompute::Auto;
  if (name == "never") return Recompute::Never;
  if (name == "always") return Recompute::Always;
  throw Error("option recompute is '" + name + "'; expected auto, always or never");
}

int64_t stageRows(const PlanContext& ctx, const StageSlot& slot) {
  const int64_t shares = static_cast<int64_t>(slot.pipelines) * slot.micro_batches * slot.devices;
  if (shares <= 0 || shares > ctx.batch_size) return 0;
  return (ctx.batch_size + shares - 1) / shares;
}

int effectiveDevicesPerNode(const PlanContext& ctx) {
  const int per = std::max(1, ctx.devices_per_node);
  return ctx.world_size % per == 0 ? per : std::max(1, ctx.world_size);
}

double updateTime(const CostModel& costs, const PlanContext& ctx, int64_t param_bytes) {
  const double per_byte = ctx.update_seconds_per_byte >= 0.0
                              ? ctx.update_seconds_per_byte
                              : optimizerUpdateTraffic(ctx.optimizer) / costs.device().memory_bandwidth;
  return per_byte * static_cast<double>(param_bytes);
}

StageEstimate estimateStage(const CostModel& costs, const PieceCost& cost, const StageSlot& slot,
                            const PlanContext& ctx) {
  StageEstimate e;
  e.rows = stageRows(ctx, slot);
  e.cost = cost;
  if (e.rows == 0) return e;
  const int per_node = effectiveDevicesPerNode(ctx);
  auto node = [&](int64_t rank) { return rank / per_node; };
  // A boundary between devices x-1 and x of every copy stays inside a node or not.
  auto boundaryLink = [&](int x) {
    for (int c = 0; c < slot.pipelines; ++c) {
      const int64_t base = static_cast<int64_t>(c) * slot.pipeline_devices;
      if (node(base + x - 1) != node(base + x)) return Link::InterNode;
    }
    return Link::IntraNode;
  };
  const bool first = slot.index == 0, last = slot.index + 1 == slot.num_stages;
  e.forward_time = cost.forward_time;
  e.backward_time = cost.backward_time;
  e.weight_time = cost.weight_time >= 0.0 ? std::min(cost.weight_time, cost.backward_time)
                  : cost.trainedBytes() > 0 ? kWeightGradientShare * cost.backward_time
                                         : 0.0;
  e.send_forward_time = last ? 0.0 : costs.commTime(cost.output_bytes, boundaryLink(slot.first_device + slot.devices));
  e.send_backward_time = first ? 0.0 : costs.commTime(cost.input_bytes, boundaryLink(slot.first_device));
  const int64_t lo = slot.first_device;
  const int64_t hi = static_cast<int64_t>(slot.pipelines - 1) * slot.pipeline_devices + slot.first_device + slot.devices - 1;
  const Link ring = node(lo) == node(hi) ? Link::IntraNode : Link::InterNode;
  // frozen parameters are neither summed nor updated ([Note: frozen parameters' memory])
  e.allreduce_time = costs.allReduceTime(cost.trainedBytes(), slot.devices * slot.pipelines, ring);
  e.update_time = updateTime(costs, ctx, cost.trainedBytes());

  const int in_flight = maxInFlight(ctx.schedule, slot.index, slot.num_stages, slot.micro_batches);
  const int64_t plain = replicaMemory(cost, ctx.optimizer, in_flight, false, ctx.model_copies);
  const int64_t again = replicaMemory(cost, ctx.optimizer, in_flight, true, ctx.model_copies);
  e.min_memory_bytes = ctx.recompute == Recompute::Never    ? plain
                       : ctx.recompute == Recompute::Always ? again
                                                            : std::min(plain, again);
  e.static_bytes = stateMemory(cost, ctx.optimizer, ctx.model_copies);
  // Recompute only where memory needs it (or asked to): one more forward per micro-batch.
  if (ctx.recompute != Recompute::Always && plain <= ctx.memory_limit) {
    e.feasible = true;
    e.memory_bytes = plain;
    e.stash_bytes = cost.activation_bytes;
  } else if (ctx.recompute != Recompute::Never && again <= ctx.memory_limit) {
    e.feasible = true;
    e.recompute = true;
    e.memory_bytes = again;
    e.backward_time += cost.forward_time;
    e.stash_bytes = cost.input_bytes;
    e.working_bytes = cost.activation_bytes;
  } else {
    e.memory_bytes = e.min_memory_bytes;
  }
  // [Note: stage score] Mirrors the simulator (sim/simulator.cpp) for a balanced pipeline
  // whose bottleneck is this stage; checked against it in stage_test.cpp.
  // - Compute: M + S - 1 micro-batch slots of f + b.
  // - Sends are latency between stages, not work of the stage. Under 1F1B a stage holds
  //   only S - i micro-batches, so the round trip to the last stage and back throttles
  //   every slot: about (S - 1) / S of a boundary's two transfers per slot. Under
  //   fill-drain they lie on the critical path once per boundary: S - 1 round trips.
  //   A stage's boundary is its larger side (the first and last stage have one).
  // - The gradient all-reduce starts at the stage's last backward and overlaps it. In the
  //   simulator a later stage's all-reduce also hides behind the drain of the stages
  //   before it (its last backward ends `index` steps before the first stage's), but the
  //   score does not count that: a DP that does equalises every stage's score, leaving
  //   late parameter-heavy stages no slack, and the simulated plans came out slower (ResNet-152
  //   x8 1.179 s against 1.156 s, BERT 24 layers h2048 0.719 against 0.704; docs/partition.md).
  // - The optimizer step over the stage's parameters follows, on every replica.
  const int S = slot.num_stages, M = slot.micro_batches;
  const double round_trip = 2.0 * std::max(e.send_forward_time, e.send_backward_time);
  const double compute = e.forward_time + e.backward_time;
  // - ZB-H1 ([Note: ZB-H1] in sim/schedule.h): a deferred W absorbs up to W of the round
  //   trip's throttling per slot, and each boundary's fill and drain costs F + B - W
  //   instead of F + B + W, plus the round trip both ways.
  const double slot_time = compute + round_trip * (S - 1) / S;
  switch (ctx.schedule) {
    // Interleaved: the search that cuts its chunks (formInterleavedStages) compares stages of
    // one shape with this score and times each plan with the simulator.
    case ScheduleKind::OneFOneB:
    case ScheduleKind::Interleaved: e.score = (M + S - 1) * slot_time; break;
    case ScheduleKind::ZeroBubbleH1:
      e.score = M * std::max(compute, slot_time - e.weight_time) +
                (S - 1) * (compute - 2.0 * e.weight_time + 2.0 * round_trip);
      break;
    case ScheduleKind::FillDrain: e.score = (M + S - 1) * compute + (S - 1) * round_trip; break;
    case ScheduleKind::Auto:
      throw InternalError(std::string("the stage search does not plan schedule ") + scheduleName(ctx.schedule));
  }
  e.score += std::max(0.0, e.allreduce_time - e.backward_time) + e.update_time;
  return e;
}

Deployment assembleDeployment(CostModel& costs, const PlanContext& ctx,
                              const std::vector<StageChoice>& stages, int pipelines,
                              int micro_batches, const std::string& planner, int chunks) {
  RANNC_CHECK(!stages.empty(), "a deployment needs a stage");
  const int S = static_cast<int>(stages.size());
  RANNC_CHECK(chunks >= 1 && S % chunks == 0, S << " stages in " << chunks << " chunks per device group");
  const int groups = S / chunks;
  // A device group's first stage places it; its later chunks share its devices.
  std::vector<int> group_offset(groups);
  int D = 0;
  for (int g = 0; g < groups; ++g) {
    group_offset[g] = D;
    D += stages[g].devices;
  }
  for (int i = groups; i < S; ++i) {
    RANNC_CHECK(stages[i].devices == stages[i % groups].devices,
                "stage " << i << " has " << stages[i].devices << " replicas, its device group "
                         << stages[i % groups].devices);
  }
  // Each chunk's estimate (recomputing where it needs to) sees its share of the memory;
  // the simulator then checks what the device holds over all its chunks.
  PlanContext chunk_ctx = ctx;
  chunk_ctx.memory_limit = ctx.memory_limit / chunks;
  RANNC_CHECK(static_cast<int64_t>(D) * pipelines <= ctx.world_size,
              D << " devices x " << pipelines << " pipelines exceed the world of " << ctx.world_size);
  Deployment d;
  d.graph_hash = costs.graphHash();
  d.planner = planner;
  d.world_size = ctx.world_size;
  d.batch_size = ctx.batch_size;
  d.pipelines = pipelines;
  d.micro_batches = micro_batches;
  d.schedule = ctx.schedule;
  d.chunks = chunks;
  d.optimizer = ctx.optimizer;
  d.memory_limit = ctx.memory_limit;
  std::vector<SimStage> sim;
  for (int i = 0; i < S; ++i) {
    const StageChoice& c = stages[i];
    const int offset = group_offset[i % groups];
    StageSlot slot{i, S, offset, c.devices, D, pipelines, micro_batches};
    const int64_t rows = stageRows(ctx, slot);
    StageEstimate e;
    if (rows > 0) {
      const PieceCost cost = c.parts.size() > 1 && costs.composesUnions() ? costs.unionCost(c.parts, rows)
                                                                          : costs.cost(c.tasks, rows);
      e = estimateStage(costs, cost, slot, chunk_ctx);
    }
    d.feasible = d.feasible && e.feasible;
    StagePlan p;
    p.tasks = c.tasks;
    const auto& pos = costs.topoPosition();
    std::sort(p.tasks.begin(), p.tasks.end(), [&](ir::TaskId a, ir::TaskId b) { return pos[a] < pos[b]; });
    p.tasks.erase(std::unique(p.tasks.begin(), p.tasks.end()), p.tasks.end());
    for (int cp = 0; cp < pipelines; ++cp) {
      for (int j = 0; j < c.devices; ++j) p.ranks.push_back(cp * D + offset + j);
    }
    p.first_block = c.first_block;
    p.last_block = c.last_block;
    p.recompute = e.recompute;
    p.micro_batch_rows = rows;
    static_cast<StageTimes&>(p) = e;
    static_cast<StageMemory&>(p) = e;
    p.param_bytes = e.cost.param_bytes;
    if (!e.feasible) {
      // Not runnable as planned; still report what it would need.
      p.static_bytes = e.min_memory_bytes;
      p.stash_bytes = p.working_bytes = 0;
    }
    sim.push_back(simStage(p));
    d.stages.push_back(std::move(p));
  }
  applySimulation(d, simulate(sim, ctx.schedule, micro_batches, chunks));
  return d;
}

Deployment assembleWhole(CostModel& costs, const PlanContext& ctx, const Deployment& plan) {
  std::vector<StageChoice> stages;
  for (const StagePlan& s : plan.stages) {
    StageChoice c;
    c.tasks = s.tasks;
    c.devices = static_cast<int>(s.ranks.size()) / std::max(1, plan.pipelines);
    c.first_block = s.first_block;
    c.last_block = s.last_block;
    stages.push_back(std::move(c));
  }
  return assembleDeployment(costs, ctx, stages, plan.pipelines, plan.micro_batches, plan.planner,
                            plan.chunks);
}

int firstPartTogether(const PlanContext& ctx, const std::vector<const std::vector<ir::TaskId>*>& order) {
  if (ctx.rows_together.empty()) return static_cast<int>(order.size());
  const std::unordered_set<ir::TaskId> together(ctx.rows_together.begin(), ctx.rows_together.end());
  for (size_t i = 0; i < order.size(); ++i) {
    for (ir::TaskId t : *order[i]) {
      if (together.count(t)) return static_cast<int>(i);
    }
  }
  return static_cast<int>(order.size());
}

}  // namespace rannc::partition
