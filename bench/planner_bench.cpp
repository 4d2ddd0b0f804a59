// Planner benchmark on synthetic BERT-like graphs (no torch, no devices): planning time
// and simulated iteration time of RaNNC's plan against the baselines given the same
// pipeline shape. Prints a table; speed goals are judged here, never in unit tests.
//   rannc_planner_bench [layers=256] [world=32] [device GiB=32] [global batch=256]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "partition/baseline/baselines.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/planner.h"
#include "partition/synthetic.h"

using namespace rannc::partition;

int main(int argc, char** argv) {
  const int layers = argc > 1 ? std::atoi(argv[1]) : 256;
  const int world = argc > 2 ? std::atoi(argv[2]) : 32;
  const int64_t gib = argc > 3 ? std::atoll(argv[3]) : 32;
  const int64_t batch = argc > 4 ? std::atoll(argv[4]) : 256;
  rannc::setLogLevel("warn");

  SyntheticTransformerOptions t;
  t.layers = layers;
  t.hidden = 1024;
  t.heads = 16;
  t.seq_len = 512;
  t.batch_size = 4;
  rannc::ir::Graph g = syntheticTransformer(t);
  DeviceSpec d;  // V100-like: 100 TFLOP/s, 1.5 TB/s, 8 per node
  d.memory_bytes = gib << 30;
  d.kernel_overhead = 5e-6;
  AnalyticCostModel costs(g, d);
  PlannerOptions o;
  o.world_size = world;
  o.batch_size = batch;

  std::printf("BERT-like: %d layers, hidden 1024, seq 512; %d tasks; %d devices of %lld GiB; batch %lld\n",
              layers, g.numTasks(), world, static_cast<long long>(gib), static_cast<long long>(batch));
  const auto t0 = std::chrono::steady_clock::now();
  PlanTrace trace;
  try {
    trace = planTrace(g, costs, o);
  } catch (const rannc::InfeasiblePlanError& e) {
    std::printf("infeasible: %s\n", e.what());
    return 0;
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const Deployment& plan = trace.deployment;
  std::printf("planned in %.2f s: %zu atomic pieces, %zu blocks\n\n%s\n", secs,
              trace.atomic.pieces.size(), trace.blocks.blocks.size(), plan.report().c_str());

  // Baselines with the same stages, pipelines and micro-batches, replicas spread evenly.
  PlanContext ctx = planContext(g, costs, o);
  BaselineShape shape{plan.numStages(), std::max(1, world / (plan.numStages() * plan.pipelines)),
                      plan.pipelines, plan.micro_batches};
  std::printf("%-16s %14s %9s\n", "planner", "iteration ms", "fits");
  std::printf("%-16s %14.3f %9s\n", "rannc", plan.iteration_time * 1e3, plan.feasible ? "yes" : "no");
  auto row = [&](const char* name, auto&& make) {
    try {
      Deployment b = make();
      std::printf("%-16s %14.3f %9s\n", name, b.iteration_time * 1e3, b.feasible ? "yes" : "no");
    } catch (const rannc::Error& e) {
      std::printf("%-16s %14s %9s  (%s)\n", name, "-", "-", e.what());
    }
  };
  row("equal-tasks", [&] { return equalTaskSplit(trace.atomic, costs, ctx, shape); });
  row("param-balanced", [&] { return paramBalancedSplit(trace.atomic, costs, ctx, shape); });
  row("time-balanced", [&] { return timeBalancedSplit(trace.atomic, costs, ctx, shape); });
  row("piper", [&] { return piperSplit(trace.blocks, costs, ctx, shape); });
  return 0;
}
