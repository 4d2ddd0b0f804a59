#include "partition/stage/stage_dp.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <tuple>

#include "common/error.h"
#include "common/log_fmt.h"
#include "partition/stage/preference.h"

namespace rannc::partition {

StageProblem::StageProblem(const BlockPartition& blocks, CostModel& costs, PlanContext ctx)
    : blocks_(blocks), costs_(costs), ctx_(ctx),
      first_together_(firstPartTogether(ctx_, blockParts(0, static_cast<int>(blocks.blocks.size())))) {
  const int k = numBlocks();
  tasks_.resize(static_cast<size_t>(k + 1) * (k + 1));
}

std::vector<const std::vector<ir::TaskId>*> StageProblem::blockParts(int first, int last) const {
  std::vector<const std::vector<ir::TaskId>*> parts;
  for (int b = first; b < last; ++b) parts.push_back(&blocks_.blocks[b].tasks);
  return parts;
}

const std::vector<ir::TaskId>& StageProblem::tasks(int first, int last) {
  auto& t = tasks_[static_cast<size_t>(first) * (numBlocks() + 1) + last];
  if (t.empty()) t = blockRangeTasks(blocks_, first, last, costs_.topoPosition());
  return t;
}

std::vector<int32_t>& StageProblem::table(int64_t rows) {
  auto& slot = recent_[rows & 15];
  if (slot.second != nullptr && slot.first == rows) return *slot.second;
  auto it = tables_.find(rows);
  if (it == tables_.end()) {
    const size_t k1 = static_cast<size_t>(numBlocks()) + 1;
    it = tables_.emplace(rows, std::vector<int32_t>(k1 * k1, kUnknown)).first;
  }
  slot = {rows, &it->second};
  return it->second;
}

void StageProblem::prefetch(int S, int D, int R, int M) {
  const int K = numBlocks();
  for (int devices = 1; devices <= D - S + 1; ++devices) {
    StageSlot slot;
    slot.devices = devices;
    slot.pipelines = R;
    slot.micro_batches = M;
    const int64_t rows = stageRows(ctx_, slot);
    if (rows == 0) continue;
    std::vector<int32_t>& t = table(rows);
    std::vector<std::vector<ir::TaskId>> pieces;
    if (costs_.composesUnions()) {
      // Ranges are composed from their blocks: only the blocks are measured.
      for (int b = 0; b < K; ++b) {
        int32_t& entry = t[static_cast<size_t>(b) * (K + 1) + b + 1];
        if (entry != kUnknown) continue;
        entry = kAnnounced;
        pieces.push_back(tasks(b, b + 1));
      }
      if (!pieces.empty()) costs_.prefetch(pieces, rows);
      continue;
    }
    for (int first = 0; first < K; ++first) {
      for (int last = first + 1; last <= K && last - first <= K - S + 1; ++last) {
        int32_t& entry = t[static_cast<size_t>(first) * (K + 1) + last];
        if (entry != kUnknown) continue;
        entry = kAnnounced;
        pieces.push_back(tasks(first, last));
      }
    }
    if (!pieces.empty()) costs_.prefetch(pieces, rows);
  }
}

StageEstimate StageProblem::estimate(int first, int last, const StageSlot& slot) {
  const int64_t rows = stageRows(ctx_, slot);
  if (rows == 0) return StageEstimate{};
  int32_t& entry = table(rows)[static_cast<size_t>(first) * (numBlocks() + 1) + last];
  if (entry < 0) {
    if (costs_.composesUnions() && last - first > 1) {
      costs_store_.push_back(costs_.unionCost(blockParts(first, last), rows));
    } else {
      costs_store_.push_back(costs_.cost(tasks(first, last), rows));
    }
    entry = static_cast<int32_t>(costs_store_.size() - 1);
  }
  return estimateStage(costs_, costs_store_[entry], slot, ctx_);
}

StageSolution formStageDp(StageProblem& problem, int S, int D, int R, int M,
                          StageObjective objective, const std::vector<int>& replicas) {
  const int K = problem.numBlocks();
  StageSolution sol;
  sol.pipelines = R;
  sol.micro_batches = M;
  if (S < 1 || S > K || D < S || M < 1 || R < 1) return sol;
  // [Note: rows kept together] in stage_cost.h: one pipeline copy, and one replica for a
  // stage that reaches the first block holding such a task
  const int together = problem.firstBlockTogether();
  if (together < K && R > 1) return sol;
  const bool fixed = !replicas.empty();
  RANNC_CHECK(!fixed || static_cast<int>(replicas.size()) == S, "fixed replicas for " << replicas.size()
                                                                   << " stages, planning " << S);
  problem.prefetch(S, D, R, M);
  const double kInf = std::numeric_limits<double>::infinity();
  auto at = [&](int s, int b, int d) { return (static_cast<size_t>(s) * (K + 1) + b) * (D + 1) + d; };
  const size_t n = static_cast<size_t>(S + 1) * (K + 1) * (D + 1);
  std::vector<double> V(n, kInf);
  std::vector<int> from_b(n, -1), from_d(n, -1);
  V[at(0, 0, 0)] = 0.0;
  for (int s = 1; s <= S; ++s) {
    for (int b = s; b <= K - (S - s); ++b) {
      // Descending device counts; stop once a count has no solution for memory reasons.
      for (int d = D - (S - s); d >= s; --d) {
        bool found = false, rows_limited = false, kept_together = false;
        for (int bp = s - 1; bp < b; ++bp) {
          for (int dp = s - 1; dp < d; ++dp) {
            if (fixed && d - dp != replicas[s - 1]) continue;
            if (b > together && d - dp > 1) {
              kept_together = true;
              continue;
            }
            const double prev = V[at(s - 1, bp, dp)];
            if (prev == kInf) continue;
            StageSlot slot{s - 1, S, dp, d - dp, D, R, M};
            StageEstimate e = problem.estimate(bp, b, slot);
            if (e.rows == 0) {
              rows_limited = true;
              continue;
            }
            double h;
            if (objective == StageObjective::Time) {
              if (!e.feasible) continue;
              h = e.score;
            } else {
              h = static_cast<double>(e.min_memory_bytes);
            }
            found = true;
            const double v = std::max(prev, h);
            double& cur = V[at(s, b, d)];
            if (v < cur) {
              cur = v;
              from_b[at(s, b, d)] = bp;
              from_d[at(s, b, d)] = dp;
            }
          }
        }
        if (!found && !rows_limited && !fixed && !kept_together) break;
      }
    }
  }
  const double best = V[at(S, K, D)];
  if (best == kInf) return sol;
  sol.feasible = true;
  sol.value = best;
  sol.block_ends.resize(S);
  sol.devices.resize(S);
  int b = K, d = D;
  for (int s = S; s >= 1; --s) {
    const int bp = from_b[at(s, b, d)], dp = from_d[at(s, b, d)];
    sol.block_ends[s - 1] = b;
    sol.devices[s - 1] = d - dp;
    b = bp;
    d = dp;
  }
  return sol;
}

std::vector<int> microBatchCandidates(int64_t rows, int limit) {
  std::vector<int> out;
  const int64_t top = std::min<int64_t>(rows, std::max(1, limit));
  for (int64_t m = 1; m <= top; m = m < 16 ? m + 1 : (m * 5 + 3) / 4) out.push_back(static_cast<int>(m));
  if (!out.empty() && out.back() != top) out.push_back(static_cast<int>(top));
  // Divisors of the rows split them evenly, so every micro-batch (and every replica's
  // share of it) has the same rows; the geometric steps miss most of them (63, not 64).
  for (int64_t m = 17; m < top; ++m) {
    if (rows % m == 0) out.push_back(static_cast<int>(m));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

namespace {

Deployment toDeployment(StageProblem& problem, const StageSolution& sol) {
  std::vector<StageChoice> stages;
  int first = 0;
  for (size_t s = 0; s < sol.block_ends.size(); ++s) {
    StageChoice c;
    c.first_block = first;
    c.last_block = sol.block_ends[s];
    c.tasks = problem.tasks(first, c.last_block);
    c.parts = problem.blockParts(first, c.last_block);
    c.devices = sol.devices[s];
    stages.push_back(std::move(c));
    first = sol.block_ends[s];
  }
  return assembleDeployment(problem.costs(), problem.context(), stages, sol.pipelines,
                            sol.micro_batches, "rannc");
}

std::string bytesText(int64_t bytes) {
  std::ostringstream os;
  os << bytes << " bytes (" << std::fixed;
  os.precision(2);
  os << static_cast<double>(bytes) / (1 << 30) << " GiB)";
  return os.str();
}

// Why no shape tried had rows for every replica: each stage replica of each pipeline
// copy needs a row per micro-batch, so a shape of S stages on D devices per copy needs
// R x M x (replicas of its widest stage, at least ceil(D / S)) rows.
std::string tooFewRows(const PlanContext& ctx, const StageSearchOptions& options,
                       const std::vector<std::tuple<int, int, int, int>>& tried) {
  int widest_fixed = 0;
  for (int r : options.replicas) widest_fixed = std::max(widest_fixed, r);
  const int fixed_m = options.num_microbatches;
  int64_t least = std::numeric_limits<int64_t>::max(), least_per_mb = 0;
  int best_s = 0, best_d = 0, best_r = 0, best_w = 0;
  int64_t most_m = 0;  // the most micro-batches some tried shape has rows for
  for (auto [S, D, R, M] : tried) {
    const int widest = widest_fixed > 0 ? widest_fixed : (D + S - 1) / S;
    const int64_t per_mb = static_cast<int64_t>(R) * widest;
    const int64_t rows = per_mb * (fixed_m > 0 ? fixed_m : 1);
    most_m = std::max(most_m, ctx.batch_size / per_mb);
    if (rows < least) {
      least = rows;
      least_per_mb = per_mb;
      best_s = S, best_d = D, best_r = R, best_w = widest;
    }
  }
  std::ostringstream os;
  const std::string shape = std::to_string(best_s) + " stage(s) on " + std::to_string(best_d) +
                            " device(s) per copy";
  if (fixed_m > 1 && least_per_mb <= ctx.batch_size) {
    // One micro-batch would have had rows: the count asked for is the cause.
    os << "num_microbatches=" << fixed_m << " needs at least " << least << " rows (" << fixed_m
       << " per pipeline copy x " << best_w << " replica(s) of the widest stage x " << best_r
       << " cop" << (best_r == 1 ? "y" : "ies") << ", with " << shape << "), but the global batch has "
       << ctx.batch_size << " row(s); use num_microbatches <= " << most_m << " or a larger batch";
  } else if (least == ctx.world_size) {
    os << "the batch has too few rows for the devices (need at least one row per device: "
       << least << " rows)";
  } else {
    os << "the batch has too few rows: every stage replica needs a row per micro-batch, and the "
          "smallest shape tried (" << shape << ", " << best_w << " replica(s) of the widest stage x "
       << best_r << " cop" << (best_r == 1 ? "y" : "ies") << ") needs " << least << " rows";
  }
  return os.str();
}

}  // namespace

Deployment formStage(StageProblem& problem, const StageSearchOptions& options) {
  return formStageCandidates(problem, options, 1).front();
}

namespace {

// The search over pipeline shapes of formStageCandidates, step by step: sweep the node
// counts (each: its stage counts, each: its micro-batch counts) collecting every feasible
// candidate; pick the preferred one and the starting points for refinement; or explain
// why nothing fits.
class ShapeSearch {
 public:
  ShapeSearch(StageProblem& problem, const StageSearchOptions& options)
      : problem_(problem), options_(options), ctx_(problem.context()), K_(problem.numBlocks()),
        per_node_(effectiveDevicesPerNode(ctx_)), nodes_(std::max(1, ctx_.world_size / per_node_)),
        patience_(options.search_patience > 0 ? options.search_patience : std::numeric_limits<int>::max()) {
    for (int r : options.replicas) fixed_devices_ += r;
  }

  // The fewest rows a stage can get: every device a replica, the most micro-batches.
  void announceRows() {
    const int64_t most_mb = options_.num_microbatches > 0 ? options_.num_microbatches
                                                             : options_.max_microbatches;
    const int64_t shares = std::max<int64_t>(
        1, std::min<int64_t>(ctx_.batch_size, ctx_.world_size * std::max<int64_t>(1, most_mb)));
    problem_.costs().expectRows((ctx_.batch_size + shares - 1) / shares);
  }

  void sweepNodeCounts() {
    const bool fixed_layout = !options_.replicas.empty();
    for (int n = 1; n <= nodes_; ++n) {
      if (nodes_ % n != 0 && !fixed_layout) continue;
      sweepStageCounts(n, fixed_layout);
      // The paper stops at the first node count with a plan (the most data parallelism).
      // For models with many parameters per layer fewer, deeper pipelines can win (smaller
      // all-reduces per device), so by default every node count competes.
      if (fixed_layout || (!found_.empty() && !options_.every_node_count)) break;
    }
  }

  bool foundAny() const { return !found_.empty(); }

  // The preferred plan, then (keep > 1) the starting points for refinement.
  std::vector<Deployment> pick(int keep) {
    std::vector<size_t> all(found_.size());
    for (size_t i = 0; i < found_.size(); ++i) all[i] = i;
    const size_t chosen = preferredIndexAmong(all, options_.plan_tolerance);
    std::vector<Deployment> out{rebuild(chosen)};
    const Deployment& best = out.front();
    logger().info("stage partitioning: {} stage(s), {} pipeline(s), {} micro-batch(es), "
                  "predicted iteration {:.3f} ms",
                  best.numStages(), best.pipelines, best.micro_batches, best.iteration_time * 1e3);
    if (keep > 1) addStartingPoints(keep, chosen, out);
    return out;
  }

  // Throws InfeasiblePlanError saying why no shape gave a plan.
  [[noreturn]] void explainInfeasible() {
    if (tried_.empty()) {
      std::ostringstream os;
      os << "no pipeline shape to try: " << K_ << " block(s), " << ctx_.world_size
         << " device(s), global batch " << ctx_.batch_size;
      if (options_.num_stages > 0) os << ", num_stages=" << options_.num_stages;
      os << " (stages must not exceed the blocks or the devices of the pipeline, and every "
            "pipeline copy needs at least one row)";
      throw InfeasiblePlanError(os.str(), 0);
    }
    // Nothing fits: the least, over every candidate shape, of the largest stage memory.
    int64_t needed = std::numeric_limits<int64_t>::max();
    for (auto [S, D, R, M] : tried_) {
      StageSolution sol = formStageDp(problem_, S, D, R, M, StageObjective::Memory, options_.replicas);
      if (sol.feasible) needed = std::min(needed, static_cast<int64_t>(sol.value));
    }
    std::ostringstream os;
    if (needed != std::numeric_limits<int64_t>::max()) {
      os << "no plan fits " << bytesText(ctx_.memory_limit) << " of usable memory per device on "
         << ctx_.world_size << " device(s) with global batch " << ctx_.batch_size
         << "; the smallest plan needs " << bytesText(needed)
         << " per device: use devices with more memory, more devices, a smaller batch"
         << (ctx_.recompute == Recompute::Never ? ", or allow recomputation" : "");
    } else {
      // Not memory: no shape had a row for every replica and micro-batch.
      os << "no plan for " << ctx_.world_size << " device(s) with global batch " << ctx_.batch_size
         << ": " << tooFewRows(ctx_, options_, tried_);
    }
    throw InfeasiblePlanError(os.str(), needed == std::numeric_limits<int64_t>::max() ? 0 : needed);
  }

 private:
  // Every feasible candidate, light: the preference needs them all ([Note: plan
  // tolerance]), and the few kept are rebuilt from their DP (its costs are cached).
  struct Candidate {
    int D, R, S, M;
    PlanShape shape;
  };

  // The stage counts of a pipeline copy spanning `n` nodes.
  void sweepStageCounts(int n, bool fixed_layout) {
    // A fixed layout is one shape: its devices per copy and world / devices copies.
    const int D = fixed_layout ? fixed_devices_ : per_node_ * n;
    const int R = fixed_layout ? ctx_.world_size / fixed_devices_ : nodes_ / n;
    // The paper tries S in (D_node (n - 1), D_node n] only; with every_node_count, all S
    // up to D compete, since a copy spanning n nodes with few stages of many replicas
    // (all-reduced inside a node) can beat both deep pipelines and more copies.
    int s_lo = options_.every_node_count ? 1 : per_node_ * (n - 1) + 1, s_hi = per_node_ * n;
    if (options_.num_stages > 0) s_lo = s_hi = options_.num_stages;
    s_hi = std::min(s_hi, std::min(K_, D));
    // Patience is judged against the best of this node count (stage sweep) and of this
    // stage count (micro-batch sweep), never the overall best: another shape's plan must
    // not cut a sweep short before it reaches its own good micro-batch counts.
    double best_n = std::numeric_limits<double>::infinity();
    int stale_stages = 0;
    int S = s_lo;
    for (; S <= s_hi && stale_stages < patience_; ++S) {
      const double best_s = sweepMicroBatches(n, S, D, R);
      if (best_s == std::numeric_limits<double>::infinity()) continue;  // nothing fits at this S
      if (best_s < best_n) {
        best_n = best_s;
        stale_stages = 0;
      } else {
        ++stale_stages;
      }
    }
    // Time in S has two valleys: few stages of many replicas, and deep pipelines whose
    // stages are not replicated at all (no all-reduce, which wins for parameter-heavy
    // models). Patience stops in the first, so the stage counts dividing D (every stage
    // can have the same replicas, down to one) past it are still tried.
    if (options_.num_stages == 0) {
      for (; S <= s_hi; ++S) {
        if (D % S != 0) continue;
        sweepMicroBatches(n, S, D, R);
        deep_.emplace_back(D, R, S);
      }
    }
  }

  // The micro-batch sweep of one stage count; the fastest simulated time (infinite when
  // nothing fits).
  double sweepMicroBatches(int n, int S, int D, int R) {
    double best_s = std::numeric_limits<double>::infinity();
    const int64_t rows_per_copy = ctx_.batch_size / R;
    std::vector<int> mbs = options_.num_microbatches > 0
                               ? std::vector<int>{options_.num_microbatches}
                               : microBatchCandidates(rows_per_copy, options_.max_microbatches);
    if (mbs.empty()) return best_s;
    // The largest count tried per shape (unless fixed, one that leaves a row for each
    // replica of the widest stage): memory only falls as it grows, so the memory search
    // for an infeasible request needs no other (with more, no stage had rows, and a model
    // too large for one stage read as a batch with too few rows).
    int widest = (D + S - 1) / S;
    for (int r : options_.replicas) widest = std::max(widest, r);
    const int64_t with_rows = options_.num_microbatches > 0 ? mbs.back()
                                                            : std::max<int64_t>(1, rows_per_copy / widest);
    tried_.emplace_back(S, D, R, static_cast<int>(std::min<int64_t>(mbs.back(), with_rows)));
    int best_m = 0, stale = 0;
    for (int M : mbs) {
      // Rounding rows up to whole micro-batches makes the time jagged in M, so a run of
      // non-improving counts ends the sweep only once M is four times the best one: the
      // next even split (a divisor of the rows) can be twice as far as the last one.
      if (stale >= patience_ && M > 4 * best_m) break;
      StageSolution sol = formStageDp(problem_, S, D, R, M, StageObjective::Time, options_.replicas);
      if (!sol.feasible) continue;
      const Deployment d = toDeployment(problem_, sol);
      logger().debug("stage candidate: n={} S={} M={} dp={:.6f} simulated={:.6f}", n, S, M,
                     sol.value, d.iteration_time);
      if (d.iteration_time < best_s) {
        best_s = d.iteration_time;
        best_m = M;
        stale = 0;
      } else {
        ++stale;
      }
      found_.push_back(Candidate{D, R, S, M, planShape(d)});
    }
    return best_s;
  }

  Deployment rebuild(size_t i) {
    const Candidate& c = found_[i];
    return toDeployment(problem_, formStageDp(problem_, c.S, c.D, c.R, c.M, StageObjective::Time,
                                              options_.replicas));
  }

  size_t preferredIndexAmong(const std::vector<size_t>& among, double tolerance) const {
    std::vector<PlanShape> shapes;
    for (size_t i : among) shapes.push_back(found_[i].shape);
    return among[preferredIndex(shapes, tolerance)];
  }

  // The fastest plan of each of the `keep` fastest shapes (the first two with the
  // runner-up micro-batch count too: block-level times rank the counts of one shape
  // poorly; ResNet-152 x8 with links at half speed: the runner-up refines to 1.348 s, the
  // block-level best to 1.380 s), then the deep-pipeline shapes past the patience: their
  // block-level plans are coarse (about one block per stage) and their micro-batch sweep
  // short, so they are worth a refinement even when slow here. Fastest, not preferred:
  // these are starting points of a search whose plans all compete later.
  void addStartingPoints(int keep, size_t chosen, std::vector<Deployment>& out) {
    std::map<std::tuple<int, int, int>, std::vector<size_t>> of_shape;
    for (size_t i = 0; i < found_.size(); ++i) {
      of_shape[std::make_tuple(found_[i].D, found_[i].R, found_[i].S)].push_back(i);
    }
    struct Ranked {
      std::tuple<int, int, int> shape;
      double fastest;
      size_t pick;
    };
    std::vector<Ranked> ranked;
    for (const auto& [shape, members] : of_shape) {
      const size_t fastest = preferredIndexAmong(members, 0.0);
      ranked.push_back(Ranked{shape, found_[fastest].shape.time, fastest});
    }
    std::stable_sort(ranked.begin(), ranked.end(),
                     [](const Ranked& a, const Ranked& b) { return a.fastest < b.fastest; });
    std::vector<size_t> taken{chosen};
    auto take = [&](size_t i) {
      if (std::find(taken.begin(), taken.end(), i) != taken.end()) return;
      taken.push_back(i);
      out.push_back(rebuild(i));
    };
    const int kRunnerUps = 2;  // shapes whose runner-up count is refined too
    for (size_t r = 0; r < ranked.size(); ++r) {
      const bool is_deep = std::find(deep_.begin(), deep_.end(), ranked[r].shape) != deep_.end();
      if (static_cast<int>(r) < keep || is_deep) take(ranked[r].pick);
      if (static_cast<int>(r) >= kRunnerUps) continue;
      // The fastest plan of the shape at another micro-batch count.
      size_t runner_up = found_.size();
      for (size_t i : of_shape[ranked[r].shape]) {
        if (found_[i].M == found_[ranked[r].pick].M) continue;
        if (runner_up == found_.size() || found_[i].shape.time < found_[runner_up].shape.time) runner_up = i;
      }
      if (runner_up != found_.size()) take(runner_up);
    }
  }

  StageProblem& problem_;
  const StageSearchOptions& options_;
  const PlanContext& ctx_;
  const int K_;
  const int per_node_;
  const int nodes_;
  const int patience_;
  int fixed_devices_ = 0;
  std::vector<std::tuple<int, int, int, int>> tried_;  // (S, D, R, M)
  std::vector<Candidate> found_;
  std::vector<std::tuple<int, int, int>> deep_;  // shapes tried past the stage patience
};

}  // namespace

std::vector<Deployment> formStageCandidates(StageProblem& problem, const StageSearchOptions& options,
                                            int keep) {
  ShapeSearch search(problem, options);
  search.announceRows();
  search.sweepNodeCounts();
  if (!search.foundAny()) search.explainInfeasible();
  return search.pick(keep);
}

// [Note: interleaved search] Interleaved 1F1B ([Note: interleaved 1F1B] in sim/schedule.h)
// cuts the blocks into v x G stages; stage c x G + g runs on device group g, so every stage
// of a group has the group's replicas. The search keeps that shape simple: every stage has
// the same replica count r (G x r x copies = the world, as Megatron's virtual pipeline
// stages do; fixed `replicas` may give each group its own, repeated for every chunk) and
// Algorithm 1 cuts the blocks for it with the devices counted once per
// chunk and each chunk given 1/v of a device's memory; the simulator then times each
// candidate with the chunks on their devices (its memory summed over them), and the
// preference picks among all of them. Micro-batch counts are multiples of G (the schedule
// runs micro-batches in rounds of G).
Deployment formInterleavedStages(StageProblem& problem, const StageSearchOptions& options, int chunks) {
  const PlanContext& ctx = problem.context();
  RANNC_CHECK(chunks >= 2, "interleaved plans have 2 or more chunks per device, not " << chunks);
  PlanContext per_chunk = ctx;
  per_chunk.world_size = ctx.world_size * chunks;
  per_chunk.memory_limit = ctx.memory_limit / chunks;
  StageProblem chunked(problem.blocks(), problem.costs(), per_chunk);
  const int N = ctx.world_size, K = problem.numBlocks();
  const int patience = options.search_patience > 0 ? options.search_patience : std::numeric_limits<int>::max();
  std::vector<Deployment> found;
  std::vector<PlanShape> shapes;
  int tried = 0;
  // fixed replicas: one count per stage, the same for every chunk of a group
  int fixed_devices = 0;
  if (!options.replicas.empty()) {
    const int S = static_cast<int>(options.replicas.size()), groups = S / chunks;
    for (int s = 0; s < S; ++s) {
      if (options.replicas[s] != options.replicas[s % groups]) {
        throw InvalidGraphError("option replicas gives stage " + std::to_string(s) + " " +
                                std::to_string(options.replicas[s]) + " replicas and stage " +
                                std::to_string(s % groups) + ", on the same devices, " +
                                std::to_string(options.replicas[s % groups]) +
                                "; under schedule interleaved the chunks of a device group have its replicas");
      }
      if (s < groups) fixed_devices += options.replicas[s];
    }
  }
  for (int copies = 1; copies <= N; ++copies) {
    if (N % copies != 0) continue;
    if (fixed_devices > 0 && copies * fixed_devices != N) continue;
    for (int groups = 1; groups <= N / copies; ++groups) {
      if (fixed_devices == 0 && (N / copies) % groups != 0) continue;
      const int S = chunks * groups, r = N / copies / groups;
      if (options.num_stages > 0 ? S != options.num_stages : groups < 2) continue;
      if (S > K) continue;
      const std::vector<int> replicas = fixed_devices > 0 ? options.replicas : std::vector<int>(S, r);
      int group_devices = 0;
      for (int g = 0; g < groups; ++g) group_devices += replicas[g];
      std::vector<int> counts;
      if (options.num_microbatches > 0) {
        counts.push_back(options.num_microbatches);
      } else {
        for (int M : microBatchCandidates(ctx.batch_size / copies, options.max_microbatches)) counts.push_back(M);
      }
      const int widest = *std::max_element(replicas.begin(), replicas.end());
      double best = std::numeric_limits<double>::infinity();
      int since_best = 0;
      for (int M : counts) {
        if (M % groups != 0) continue;
        if (static_cast<int64_t>(copies) * M * widest > ctx.batch_size) break;
        ++tried;
        chunked.prefetch(S, chunks * group_devices, copies, M);
        StageSolution sol = formStageDp(chunked, S, chunks * group_devices, copies, M, StageObjective::Time, replicas);
        if (!sol.feasible) continue;
        std::vector<StageChoice> stages;
        int first = 0;
        for (int e : sol.block_ends) {
          StageChoice c;
          c.first_block = first;
          c.last_block = e;
          c.tasks = chunked.tasks(first, e);
          c.parts = chunked.blockParts(first, e);
          c.devices = replicas[stages.size()];
          stages.push_back(std::move(c));
          first = e;
        }
        Deployment d = assembleDeployment(problem.costs(), ctx, stages, copies, M, "rannc", chunks);
        if (!d.feasible) continue;
        if (d.iteration_time < best) {
          best = d.iteration_time;
          since_best = 0;
        } else if (++since_best >= patience) {
          break;
        }
        shapes.push_back(planShape(d));
        found.push_back(std::move(d));
      }
    }
  }
  if (found.empty()) {
    std::ostringstream os;
    os << "no interleaved plan with " << chunks << " chunks per device fits: " << tried
       << " shape(s) tried on " << N << " device(s) with " << K << " block(s), global batch " << ctx.batch_size
       << (options.num_stages > 0 ? ", num_stages=" + std::to_string(options.num_stages) : std::string())
       << (options.num_microbatches > 0 ? ", num_microbatches=" + std::to_string(options.num_microbatches)
                                        : std::string())
       << " (the stages are chunks x device groups of at least 2 devices, the micro-batches a multiple of "
          "the groups, and the chunks of a device share its "
       << bytesText(ctx.memory_limit) << ")";
    throw InfeasiblePlanError(os.str(), 0);
  }
  Deployment chosen = std::move(found[preferredIndex(shapes, options.plan_tolerance)]);
  logger().info("interleaved stage partitioning: {} stage(s) in {} chunks, {} pipeline(s), {} micro-batch(es), "
                "predicted iteration {:.3f} ms",
                chosen.numStages(), chunks, chosen.pipelines, chosen.micro_batches, chosen.iteration_time * 1e3);
  return chosen;
}

}  // namespace rannc::partition
