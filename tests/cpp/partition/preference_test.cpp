// [Note: plan tolerance]: plans within the tolerance of the fastest are equally fast and
// the simpler one wins (fewer stages, then micro-batches, then pipeline copies, then more
// equal replicas); beyond it, the faster one.
#include <gtest/gtest.h>

#include <algorithm>

#include "common/error.h"
#include "common/hash.h"
#include "partition/cost/analytic_cost_model.h"
#include "partition/partition_graphs.h"
#include "partition/planner.h"
#include "partition/stage/preference.h"

namespace rannc::partition {
namespace {

PlanShape shape(double time, int stages, int micro_batches, int pipelines, std::vector<int> replicas = {}) {
  PlanShape s;
  s.time = time;
  s.stages = stages;
  s.micro_batches = micro_batches;
  s.pipelines = pipelines;
  s.replicas = replicas.empty() ? std::vector<int>(stages, 1) : std::move(replicas);
  return s;
}

TEST(APlanPreference, TakesTheSimplerOfTwoPlansWithin2PercentAndTheFasterOf3PercentApart) {
  const PlanShape deep = shape(1.00, 2, 4, 1);
  EXPECT_EQ(preferredIndex({deep, shape(1.019, 1, 4, 1)}, 0.02), 1u);  // fewer stages
  EXPECT_EQ(preferredIndex({deep, shape(1.03, 1, 4, 1)}, 0.02), 0u);   // beyond: faster
  EXPECT_EQ(preferredIndex({deep, shape(1.019, 2, 2, 1)}, 0.02), 1u);  // fewer micro-batches
  EXPECT_EQ(preferredIndex({deep, shape(1.03, 2, 2, 1)}, 0.02), 0u);
  EXPECT_EQ(preferredIndex({shape(1.00, 2, 4, 2), shape(1.019, 2, 4, 1)}, 0.02), 1u);  // fewer copies
  EXPECT_EQ(preferredIndex({shape(1.00, 2, 4, 2), shape(1.03, 2, 4, 1)}, 0.02), 0u);
  // The order does not matter, and the slower plan within the tolerance is no worse
  // than 2% of the fastest whichever comes first.
  EXPECT_EQ(preferredIndex({shape(1.019, 1, 4, 1), deep}, 0.02), 0u);
  EXPECT_EQ(preferredIndex({shape(1.03, 1, 4, 1), deep}, 0.02), 1u);
}

TEST(APlanPreference, RanksStagesBeforeMicroBatchesBeforeCopies) {
  // Within the tolerance: fewer stages beat fewer micro-batches, which beat fewer copies.
  EXPECT_EQ(preferredIndex({shape(1.00, 1, 8, 2), shape(1.01, 2, 1, 1)}, 0.02), 0u);
  EXPECT_EQ(preferredIndex({shape(1.00, 2, 2, 2), shape(1.01, 2, 4, 1)}, 0.02), 0u);
  // Equally simple: the faster.
  EXPECT_EQ(preferredIndex({shape(1.01, 2, 4, 1), shape(1.00, 2, 4, 1)}, 0.02), 1u);
  // Then replicas closer to equal, then the replica list, so layouts equally fast within
  // the tolerance are picked the same way every time.
  EXPECT_EQ(preferredIndex({shape(1.00, 3, 4, 1, {2, 1, 1}), shape(1.01, 3, 4, 1, {2, 2, 2})}, 0.02), 1u);
  EXPECT_EQ(preferredIndex({shape(1.00, 3, 4, 1, {2, 1, 1}), shape(1.01, 3, 4, 1, {1, 2, 1})}, 0.02), 1u);
  EXPECT_EQ(preferredIndex({shape(1.00, 3, 4, 1, {1, 2, 1}), shape(1.01, 3, 4, 1, {1, 1, 2})}, 0.02), 1u);
}

TEST(APlanPreference, WithoutToleranceIsTheFastest) {
  EXPECT_EQ(preferredIndex({shape(1.00, 4, 16, 1), shape(1.0001, 1, 1, 1)}, 0.0), 0u);
  // A tie in time goes to the simpler plan.
  EXPECT_EQ(preferredIndex({shape(1.00, 4, 16, 1), shape(1.00, 1, 1, 1)}, 0.0), 1u);
}

TEST(APlanPreference, IsMeasuredFromTheFastestSoPlansCannotChainAway) {
  // 1.00, 1.015, 1.03: each within 2% of the next, but only the first two of the fastest.
  const std::vector<PlanShape> plans{shape(1.00, 3, 8, 1), shape(1.015, 2, 8, 1), shape(1.03, 1, 8, 1)};
  EXPECT_EQ(preferredIndex(plans, 0.02), 1u);
}

Deployment planWithTime(double time, int stages, int micro_batches) {
  Deployment d;
  d.iteration_time = time;
  d.micro_batches = micro_batches;
  d.stages.resize(stages);
  for (int s = 0; s < stages; ++s) d.stages[s].ranks = {s};
  return d;
}

TEST(APreferredPlan, KeepsThePreferredOfAllOfferedInAnyOrder) {
  std::vector<Deployment> plans{planWithTime(1.03, 1, 1), planWithTime(1.00, 3, 8), planWithTime(1.015, 2, 8),
                                planWithTime(1.01, 2, 16), planWithTime(1.5, 1, 1)};
  std::vector<int> order{0, 1, 2, 3, 4};
  do {
    PreferredPlan pool(0.02);
    for (int i : order) pool.offer(plans[i]);
    EXPECT_DOUBLE_EQ(pool.fastestTime(), 1.00);
    EXPECT_EQ(pool.choice().numStages(), 2);
    EXPECT_EQ(pool.choice().micro_batches, 8);
  } while (std::next_permutation(order.begin(), order.end()));
}

// The planner end to end: its plan is within the tolerance of the fastest it would pick
// without one (it refines every candidate it would refine without one, so it finds that
// plan too).
TEST(APlanPreference, CostsThePlannerAtMostTheTolerance) {
  ir::Graph g = testing::smallTransformer();
  PlannerOptions o;
  o.world_size = 8;
  o.num_blocks = 10;
  o.memory_limit = 8 << 20;
  o.plan_tolerance = 0.0;
  AnalyticCostModel a(g, DeviceSpec{}), b(g, DeviceSpec{});
  const Deployment fastest = plan(g, a, o);
  o.plan_tolerance = 0.02;
  const Deployment preferred = plan(g, b, o);
  EXPECT_LE(preferred.iteration_time, fastest.iteration_time * 1.02)
      << fastest.summary() << " vs " << preferred.summary();
}

TEST(APlanPreference, IsAPlannerOptionCheckedForRange) {
  ir::Graph g = testing::uniformChain(4);
  AnalyticCostModel m(g, DeviceSpec{});
  PlannerOptions o;
  o.plan_tolerance = -0.01;
  EXPECT_THROW(plan(g, m, o), InvalidGraphError);
  o.plan_tolerance = 1.0;
  EXPECT_THROW(plan(g, m, o), InvalidGraphError);
}

}  // namespace
}  // namespace rannc::partition

namespace rannc::partition {
namespace {

// Analytic costs with every piece's times off by up to +-`amplitude`, the same for the
// same piece and rows whenever asked (a profile cache of noisy measurements).
class NoisyCostModel : public CostModel {
 public:
  NoisyCostModel(const ir::Graph& g, double amplitude, uint64_t seed)
      : CostModel(g, DeviceSpec{}), exact_(g, DeviceSpec{}), amplitude_(amplitude), seed_(seed) {}

 protected:
  PieceCost computeCost(const ir::Subgraph& piece, int64_t rows) override {
    PieceCost c = exact_.cost(piece.tasks, rows);
    std::vector<ir::TaskId> tasks = piece.tasks;
    std::sort(tasks.begin(), tasks.end());
    Fnv1a h;
    h.u64(seed_).i64(rows);
    for (ir::TaskId t : tasks) h.i64(t);
    const double u = static_cast<double>(h.digest() >> 11) / static_cast<double>(1ULL << 53);  // [0, 1)
    const double f = 1.0 + amplitude_ * (2.0 * u - 1.0);
    c.forward_time *= f;
    c.backward_time *= f;
    return c;
  }
  bool cacheByContent() const override { return false; }

 private:
  AnalyticCostModel exact_;
  double amplitude_;
  uint64_t seed_;
};

// The noise of measured costs, at half the tolerance, leaves the plan as it is: shape,
// replicas, micro-batches and every boundary (the hash). Without the tolerance, 4 of these
// 8 noisy plans move a boundary (measured when the test was written).
TEST(APlanUnderNoise, StaysTheSameWhenEveryCostMovesByHalfTheTolerance) {
  ir::Graph g = testing::smallTransformer();
  PlannerOptions o;
  o.world_size = 2;
  o.num_blocks = 16;
  o.memory_limit = 64 << 20;
  NoisyCostModel exact(g, 0.0, 0);
  const Deployment base = plan(g, exact, o);
  ASSERT_EQ(base.numStages(), 2) << base.summary();  // boundaries to keep
  for (uint64_t seed = 1; seed <= 8; ++seed) {
    NoisyCostModel noisy(g, 0.01, seed);
    const Deployment p = plan(g, noisy, o);
    EXPECT_EQ(p.hash(), base.hash()) << "seed " << seed << ": " << p.summary() << "\n  base: " << base.summary();
  }
}

}  // namespace
}  // namespace rannc::partition
