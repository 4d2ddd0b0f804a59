#pragma once
// [Note: plan tolerance] Which of several plans the planner keeps. Profiled costs carry
// noise of a few percent, so ranking plans by simulated time alone makes the same run plan
// differently twice (1 micro-batch one run, 2 the next). Plans whose times are within a
// tolerance of the fastest (PlannerOptions::plan_tolerance, 2% by default) count as equally
// fast, and among them a fixed preference for the simpler plan decides; only beyond the
// tolerance does time. Simpler means, in this order:
//   1. fewer stages: every boundary is a send each micro-batch, activations held for the
//      next stage, and a place where measured and real costs can disagree;
//   2. fewer micro-batches: each one is a round of kernel launches and of the engine's
//      per-micro-batch work, which the simulator does not charge, on smaller kernels;
//   3. fewer pipeline copies: more data parallelism inside a copy, one pipeline to run;
//   4. replicas closer to equal between stages (no redistribution of rows between stages
//      of different widths), then the replica list in lexicographic order, so that even
//      layouts equally simple by the rules above are chosen the same way every time.
// Stage boundaries are settled the same way afterwards (stage/refine.h, settleBoundaries):
// within the tolerance, where the fewest bytes cross.
#include <cstddef>
#include <vector>

#include "partition/plan.h"

namespace rannc::partition {

inline constexpr double kDefaultPlanTolerance = 0.02;

// What the preference reads of a plan.
struct PlanShape {
  double time = 0.0;  // simulated seconds per iteration
  int stages = 1;
  int micro_batches = 1;
  int pipelines = 1;
  std::vector<int> replicas;  // per stage, within one pipeline copy
};

PlanShape planShape(const Deployment& plan);

// True when `a` is simpler than `b` by rules 1-4 above (time plays no part).
bool simpler(const PlanShape& a, const PlanShape& b);

// The index of the preferred plan: among the plans whose time is at most (1 + tolerance)
// times the fastest, the simplest; among equally simple ones the fastest, then the first.
// `plans` must not be empty.
size_t preferredIndex(const std::vector<PlanShape>& plans, double tolerance);

// Collects feasible plans one at a time and keeps the preferred one (preferredIndex over
// all offered), holding only those within the tolerance of the fastest so far.
class PreferredPlan {
 public:
  explicit PreferredPlan(double tolerance) : tolerance_(tolerance) {}
  void offer(const Deployment& plan);
  bool empty() const { return near_.empty(); }
  double fastestTime() const { return fastest_; }
  // The preferred plan of those offered; not empty().
  const Deployment& choice() const { return choice(tolerance_); }
  // The preferred plan by a smaller `tolerance` (the collector may keep a wider margin).
  const Deployment& choice(double tolerance) const;
  // Every plan kept: those within the tolerance of the fastest.
  const std::vector<Deployment>& near() const { return near_; }

 private:
  double tolerance_;
  double fastest_ = 0.0;
  std::vector<Deployment> near_;
};

}  // namespace rannc::partition
