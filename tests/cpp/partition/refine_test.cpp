#include <gtest/gtest.h>

#include <random>

#include "common/error.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"
#include "partition/planner.h"
#include "synthetic/synthetic.h"

namespace rannc::partition {
namespace {

using testing::device;

int replicasPerCopy(const Deployment& d, int stage) {
  return static_cast<int>(d.stages[stage].ranks.size()) / d.pipelines;
}

// One micro-batch leaves a two-stage pipeline idle half the time; refinement that may
// change the micro-batch count raises it (keeping stages and replicas), one that may not
// keeps it.
TEST(ARefinement, RaisesTheMicroBatchCountOfAPipelineThatHasOne) {
  ir::Graph g = testing::uniformChain(8, 256, /*batch=*/8);
  AnalyticCostModel m(g, device());
  PlannerOptions o;
  o.world_size = 2;
  o.batch_size = 64;
  o.num_blocks = 4;
  o.num_stages = 2;
  o.num_microbatches = 1;
  o.memory_limit = 1LL << 40;
  o.refine_boundaries = false;
  PlanTrace coarse = planTrace(g, m, o);
  ASSERT_EQ(coarse.deployment.micro_batches, 1);
  const PlanContext ctx = planContext(g, m, o);
  RefineOptions fixed;
  fixed.move_micro_batches = false;
  Deployment same_m = refineBoundaries(coarse.deployment, coarse.atomic, coarse.blocks, m, ctx, fixed);
  EXPECT_EQ(same_m.micro_batches, 1);
  Deployment fine = refineBoundaries(coarse.deployment, coarse.atomic, coarse.blocks, m, ctx, RefineOptions{});
  EXPECT_GT(fine.micro_batches, 1);
  EXPECT_EQ(fine.numStages(), 2);
  EXPECT_LT(fine.iteration_time, 0.8 * coarse.deployment.iteration_time);
  EXPECT_NO_THROW(validateDeployment(g, fine));
}

// [Note: one micro-batch's boundaries] Two stages forced on one micro-batch run one after
// the other, every cut about as fast; the fewest bytes cross at the narrow input, but the
// boundaries stay where the stages are balanced, not beside an empty first stage.
TEST(ARefinement, KeepsTheStagesOfOneMicroBatchBalanced) {
  ir::Graph g = testing::linearChain(std::vector<int64_t>(8, 256), /*batch=*/8, /*in_width=*/4);
  AnalyticCostModel m(g, device());
  PlannerOptions o;
  o.world_size = 2;
  o.batch_size = 8;
  o.num_stages = 2;
  o.num_microbatches = 1;
  o.memory_limit = 1LL << 40;
  o.update_seconds_per_byte = 0.0;  // as profiled without timing the update: no time to balance
  const Deployment d = planTrace(g, m, o).deployment;
  ASSERT_EQ(d.numStages(), 2);
  ASSERT_EQ(d.micro_batches, 1);
  const double f0 = d.stages[0].forward_time, f1 = d.stages[1].forward_time;
  EXPECT_LT(std::max(f0, f1), 1.5 * std::min(f0, f1)) << "stage forwards " << f0 << " and " << f1 << " s";
}

// A fixed layout 3/1 on a chain whose layers are all alike puts three quarters of the
// work behind one replica's worth of rows; moving replicas reaches a faster layout that
// still uses the four devices, and never returns anything slower than it was given.
TEST(ARefinement, MovesReplicasTowardsTheSlowerStageAndKeepsTheDevices) {
  std::mt19937 rng(11);
  int faster = 0;
  for (int trial = 0; trial < 12; ++trial) {
    std::vector<int64_t> widths;
    for (int i = 0; i < 12; ++i) widths.push_back(64 + static_cast<int64_t>(rng() % 512));
    ir::Graph g = testing::linearChain(widths, /*batch=*/8, /*in_width=*/64);
    AnalyticCostModel m(g, device());
    PlannerOptions o;
    o.world_size = 4;
    o.batch_size = 64;
    o.num_blocks = 6;
    o.num_stages = 2;
    o.num_microbatches = 4;
    o.replicas = trial % 2 ? std::vector<int>{3, 1} : std::vector<int>{1, 3};
    o.memory_limit = 1LL << 40;
    o.refine_boundaries = false;
    PlanTrace coarse = planTrace(g, m, o);
    const PlanContext ctx = planContext(g, m, o);
    RefineOptions keep;
    keep.move_replicas = false;
    keep.move_micro_batches = false;
    Deployment cut_only = refineBoundaries(coarse.deployment, coarse.atomic, coarse.blocks, m, ctx, keep);
    RefineOptions move;
    move.move_micro_batches = false;
    Deployment moved = refineBoundaries(coarse.deployment, coarse.atomic, coarse.blocks, m, ctx, move);
    EXPECT_EQ(replicasPerCopy(cut_only, 0), o.replicas[0]);
    EXPECT_LE(cut_only.iteration_time, coarse.deployment.iteration_time);
    EXPECT_LE(moved.iteration_time, cut_only.iteration_time);
    EXPECT_EQ(replicasPerCopy(moved, 0) + replicasPerCopy(moved, 1), 4);
    EXPECT_EQ(moved.micro_batches, 4);
    EXPECT_TRUE(moved.feasible);
    EXPECT_NO_THROW(validateDeployment(g, moved));
    if (moved.iteration_time < cut_only.iteration_time && replicasPerCopy(moved, 0) != o.replicas[0]) ++faster;
  }
  EXPECT_GT(faster, 0);
}

// Ten stages, a spare replica on the first and the heavy last layer alone on the last:
// the move that pays is between the two ends. Passing the replica along neighbours gains
// nothing at the middle stages, so refinement limited to neighbours leaves it where it is;
// the default (every pair for a graph this small) moves it.
TEST(ARefinement, TradesReplicasBetweenStagesThatAreNotNeighbours) {
  std::vector<int64_t> widths(18, 256);
  widths.push_back(2048);
  ir::Graph g = testing::linearChain(widths, /*batch=*/8, /*in_width=*/256);
  AnalyticCostModel m(g, device());
  PlannerOptions o;
  o.world_size = 11;
  o.batch_size = 1024;
  o.num_blocks = 19;
  o.num_stages = 10;
  o.num_microbatches = 4;
  o.replicas = {2, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  o.memory_limit = 1LL << 40;
  o.refine_boundaries = false;
  PlanTrace coarse = planTrace(g, m, o);
  ASSERT_TRUE(coarse.deployment.feasible);
  const PlanContext ctx = planContext(g, m, o);
  RefineOptions neighbours;
  neighbours.move_micro_batches = false;
  neighbours.all_pairs_up_to = 0;
  neighbours.all_pairs_budget = 0;
  RefineOptions pairs;
  pairs.move_micro_batches = false;
  Deployment near = refineBoundaries(coarse.deployment, coarse.atomic, coarse.blocks, m, ctx, neighbours);
  Deployment far = refineBoundaries(coarse.deployment, coarse.atomic, coarse.blocks, m, ctx, pairs);
  EXPECT_EQ(replicasPerCopy(near, 9), 1);
  EXPECT_EQ(replicasPerCopy(far, 9), 2);
  EXPECT_EQ(replicasPerCopy(far, 0), 1);
  EXPECT_LT(far.iteration_time, 0.9 * near.iteration_time);
  EXPECT_NO_THROW(validateDeployment(g, far));
}

// Patience stops the stage sweep in the valley of few, replicated stages; the stage
// counts dividing the devices past it (down to one device per stage) still become
// candidates for refinement.
TEST(AStageSearch, OffersTheDeepPipelinesPastThePatienceAsCandidates) {
  ir::Graph g = testing::uniformChain(16, 256, /*batch=*/8);
  AnalyticCostModel m(g, device());
  AtomicPartition atomic = partitionAtomic(g);
  BlockOptions bo;
  bo.num_blocks = 16;
  BlockPartition blocks = partitionBlocks(atomic, m, bo);
  PlanContext ctx;
  ctx.world_size = 8;
  ctx.batch_size = 64;
  StageProblem problem(blocks, m, ctx);
  StageSearchOptions so;
  so.search_patience = 1;
  so.every_node_count = true;
  std::vector<Deployment> candidates = formStageCandidates(problem, so, 2);
  ASSERT_GE(candidates.size(), 2u);
  EXPECT_LE(candidates[0].iteration_time, candidates[1].iteration_time);
  bool deepest = false;
  for (const Deployment& d : candidates) deepest = deepest || d.numStages() == 8;
  EXPECT_TRUE(deepest);
  // formStage keeps returning the fastest.
  StageProblem again(blocks, m, ctx);
  EXPECT_DOUBLE_EQ(formStage(again, so).iteration_time, candidates[0].iteration_time);
}

// Refining several candidates can only help: the plan is never slower than refining the
// block-level winner alone.
TEST(APlanner, IsNoSlowerWhenItRefinesSeveralCandidates) {
  ir::Graph g = testing::smallWideResNet();
  DeviceSpec d;
  d.memory_bytes = 2LL << 30;
  d.devices_per_node = 4;
  PlannerOptions o;
  o.world_size = 8;
  o.batch_size = 64;
  o.refine_candidates = 1;
  o.refine_replicas = false;
  AnalyticCostModel a(g, d), b(g, d);
  Deployment one = plan(g, a, o);
  o.refine_candidates = 6;
  o.refine_replicas = true;
  Deployment many = plan(g, b, o);
  EXPECT_LE(many.iteration_time, one.iteration_time);
  EXPECT_TRUE(many.feasible);
  EXPECT_NO_THROW(validateDeployment(g, many));
}

}  // namespace
}  // namespace rannc::partition
