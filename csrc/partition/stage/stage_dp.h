#pragma once
// Stage partitioning (RaNNC §III-C): Algorithm 1 (form_stage_dp) cuts the ordered blocks
// into S contiguous stages and gives each a replica count, for fixed S, devices and
// micro-batches; Algorithm 2 (form_stage) searches node counts, stage counts and
// micro-batch counts and keeps the plan the simulator runs fastest.
#include <cstdint>
#include <map>
#include <vector>

#include "partition/block/block.h"
#include "partition/plan.h"
#include "partition/stage/stage_cost.h"

namespace rannc::partition {

// The blocks, the cost model and the context of one planning problem; caches the merged
// task set of every block interval and its cost per rows, so each candidate stage is
// costed merged (never as a sum of blocks) and only once.
class StageProblem {
 public:
  StageProblem(const BlockPartition& blocks, CostModel& costs, PlanContext ctx);

  int numBlocks() const { return static_cast<int>(blocks_.blocks.size()); }
  const PlanContext& context() const { return ctx_; }
  CostModel& costs() { return costs_; }
  const BlockPartition& blocks() const { return blocks_; }

  // Tasks of blocks [first, last).
  const std::vector<ir::TaskId>& tasks(int first, int last);
  // Blocks [first, last), each as a part (CostModel::unionCost).
  std::vector<const std::vector<ir::TaskId>*> blockParts(int first, int last) const;
  // Announces to the cost model every interval Algorithm 1 may cost for this shape.
  void prefetch(int stages, int devices, int pipelines, int micro_batches);
  // The stage of blocks [first, last) at `slot` (infeasible when its rows would be 0).
  StageEstimate estimate(int first, int last, const StageSlot& slot);
  // The first block holding a task of context().rows_together (numBlocks() when none):
  // a stage reaching it runs one replica, in one pipeline copy ([Note: rows kept
  // together] in stage_cost.h).
  int firstBlockTogether() const { return first_together_; }

 private:
  const BlockPartition& blocks_;
  CostModel& costs_;
  PlanContext ctx_;
  int first_together_;
  // Costs per rows, flat by first * (k + 1) + last: an index into costs_store_, or
  // kUnknown / kAnnounced. The DP asks millions of times, so no tree or hash per ask.
  static constexpr int32_t kUnknown = -1, kAnnounced = -2;
  std::vector<int32_t>& table(int64_t rows);
  std::vector<std::vector<ir::TaskId>> tasks_;  // by first * (k + 1) + last
  std::map<int64_t, std::vector<int32_t>> tables_;
  std::pair<int64_t, std::vector<int32_t>*> recent_[16] = {};
  std::vector<PieceCost> costs_store_;
};

// What the DP minimises. Time: the largest StageEstimate::score among stages, under the
// memory limit. Memory: the largest stage memory (recomputing where allowed), ignoring the
// limit; used to tell an infeasible request how much memory some plan needs.
enum class StageObjective { Time, Memory };

struct StageSolution {
  bool feasible = false;
  double value = 0.0;             // the minimised objective
  std::vector<int> block_ends;    // b_1 < ... < b_S = number of blocks
  std::vector<int> devices;       // replicas of each stage per pipeline copy, summing to D
  int pipelines = 1;
  int micro_batches = 1;
};

// Algorithm 1: the best split of all blocks into `stages` contiguous stages using exactly
// `devices` devices per pipeline copy (each stage >= 1), with `pipelines` copies and
// `micro_batches` micro-batches. Optimal for the objective (min-max over stages); the
// paper's d_min pruning is kept where it is exact: fewer devices are only skipped when a
// stage failed on memory, which fewer replicas (more rows each) cannot fix.
// `replicas`, when not empty, fixes the replicas of each stage (stages entries summing to
// `devices`); only the block split is searched then.
StageSolution formStageDp(StageProblem& problem, int stages, int devices, int pipelines,
                          int micro_batches, StageObjective objective = StageObjective::Time,
                          const std::vector<int>& replicas = {});

struct StageSearchOptions {
  int num_stages = 0;         // > 0: only this many stages
  int num_microbatches = 0;  // > 0: only this many micro-batches
  int max_microbatches = 256;
  // Stop raising the micro-batch count (stage count) after this many feasible candidates
  // in a row did not beat the best; 0 searches every candidate.
  int search_patience = 3;
  // Let every node count compete, each with every stage count up to its devices (the
  // paper keeps the first node count with a plan and S in (D_node (n - 1), D_node n]).
  bool every_node_count = false;
  // Not empty: the replicas of each stage within a pipeline copy (num_stages entries);
  // the copy has their sum of devices and world / sum copies, whatever the nodes.
  std::vector<int> replicas;
  // Plans within this fraction of the fastest count as equally fast; the simplest of
  // them wins ([Note: plan tolerance] in stage/preference.h).
  double plan_tolerance = 0.02;
};

// Micro-batch counts tried for a pipeline copy with `rows` rows per iteration: every count
// up to 16, then steps of about 1.25x and the divisors of `rows`, up to min(rows, limit).
// Not only powers of two. Ascending.
std::vector<int> microBatchCandidates(int64_t rows, int limit);

// Algorithm 2: for node counts n dividing the nodes (ascending), D = n * devices per node,
// R = nodes / n, stage counts in (D_node (n - 1), D_node n] and the micro-batch candidates,
// runs Algorithm 1 and simulates each solution; returns the preferred plan (the simplest
// within options.plan_tolerance of the fastest) of the first n that has one. Throws
// InfeasiblePlanError (with the least memory some plan needs) when none fits.
Deployment formStage(StageProblem& problem, const StageSearchOptions& options = {});

// Algorithm 2 as formStage, returning formStage's plan first, then (when keep > 1) the
// preferred plan of each of the `keep` fastest pipeline shapes (devices per copy, copies,
// stages), fastest first, and the deep-pipeline shapes tried past the stage patience
// (stage counts dividing the devices of a copy). Candidates for refinement, which can
// reorder them.
std::vector<Deployment> formStageCandidates(StageProblem& problem, const StageSearchOptions& options,
                                            int keep);

// [Note: interleaved search] in stage_dp.cpp: v = `chunks` stages per device group, every
// stage with the same replicas, the micro-batches a multiple of the groups; the simplest
// plan within options.plan_tolerance of the fastest the simulator times. Throws
// InfeasiblePlanError when no shape fits.
Deployment formInterleavedStages(StageProblem& problem, const StageSearchOptions& options, int chunks);

}  // namespace rannc::partition
