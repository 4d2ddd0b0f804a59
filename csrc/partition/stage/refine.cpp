#include "partition/stage/refine.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>
#include <unordered_map>

#include "partition/sim/simulator.h"

#include "common/error.h"
#include "common/log_fmt.h"

namespace rannc::partition {
namespace {

// Re-cuts the piece sequence `seq` for fixed replicas.
class Recutter {
 public:
  Recutter(const AtomicPartition& atomic, const BlockPartition& blocks, std::vector<int> seq,
           std::vector<int> block_start, CostModel& costs, const PlanContext& ctx, const Deployment& plan)
      : atomic_(atomic), blocks_(blocks), seq_(std::move(seq)), block_start_(std::move(block_start)),
        costs_(costs), ctx_(ctx), plan_(plan), micro_batches_(plan.micro_batches) {
    std::vector<const std::vector<ir::TaskId>*> order;
    for (int p : seq_) order.push_back(&atomic_.pieces[p].tasks);
    first_together_ = firstPartTogether(ctx_, order);
  }

  // [Note: rows kept together] in stage_cost.h: whether a stage of pieces [lo, hi) may
  // have `replicas` replicas
  bool replicable(int hi, int replicas) const {
    return replicas <= 1 || hi <= first_together_;
  }

  int microBatches() const { return micro_batches_; }
  void setMicroBatches(int m) {
    if (m != micro_batches_) sim_cache_.clear();
    micro_batches_ = m;
  }

  int pieces() const { return static_cast<int>(seq_.size()); }

  std::vector<ir::TaskId> tasksOf(int lo, int hi) const {
    std::vector<ir::TaskId> t;
    for (int i = lo; i < hi; ++i) {
      const auto& p = atomic_.pieces[seq_[i]].tasks;
      t.insert(t.end(), p.begin(), p.end());
    }
    return t;
  }

  // Pieces [lo, hi) as parts: the blocks they cover whole, single pieces at either end.
  std::vector<const std::vector<ir::TaskId>*> partsOf(int lo, int hi) const {
    std::vector<const std::vector<ir::TaskId>*> parts;
    for (int i = lo; i < hi;) {
      auto it = std::lower_bound(block_start_.begin(), block_start_.end(), i);
      if (it != block_start_.end() && *it == i && it + 1 != block_start_.end() && *(it + 1) <= hi) {
        parts.push_back(&blocks_.blocks[it - block_start_.begin()].tasks);
        i = *(it + 1);
      } else {
        parts.push_back(&atomic_.pieces[seq_[i]].tasks);
        ++i;
      }
    }
    return parts;
  }

  // Pieces [lo, hi) as one stage: composed from their parts where the cost model does.
  PieceCost stageCost(int lo, int hi, int64_t rows) {
    if (costs_.composesUnions()) {
      const auto parts = partsOf(lo, hi);
      if (parts.size() > 1) return costs_.unionCost(parts, rows);
    }
    return costs_.cost(tasksOf(lo, hi), rows);
  }

  // The min-max cut for `devices` (replicas per stage), starting from `cut` (whose
  // largest score bounds the search); false when no cut fits.
  bool recut(const std::vector<int>& devices, std::vector<int>* cut) {
    const int S = static_cast<int>(devices.size());
    const int n = pieces();
    std::vector<int> offsets(S, 0);
    int D = 0;
    for (int s = 0; s < S; ++s) {
      offsets[s] = D;
      D += devices[s];
    }
    const double kInf = std::numeric_limits<double>::infinity();
    // Scores asked again (every bisection step starts stage 0 at piece 0) skip building
    // and hashing the piece.
    std::unordered_map<int64_t, double> memo;
    auto score = [&](int s, int lo, int hi) {
      if (hi <= lo) return kInf;
      const int64_t key = (static_cast<int64_t>(s) * (n + 1) + lo) * (n + 1) + hi;
      auto [it, fresh] = memo.try_emplace(key, kInf);
      if (!fresh) return it->second;
      if (!replicable(hi, devices[s])) return it->second = kInf;
      StageSlot slot{s, S, offsets[s], devices[s], D, plan_.pipelines, micro_batches_};
      const int64_t rows = stageRows(ctx_, slot);
      if (rows == 0) return kInf;
      StageEstimate e = estimateStage(costs_, stageCost(lo, hi, rows), slot, ctx_);
      return it->second = e.feasible ? e.score : kInf;
    };
    // Min-max over all cuts at once: for a bound T, each stage greedily takes the longest
    // run whose score stays within T (scores about grow with the run, and a later start
    // only helps the following stages); bisect on T.
    auto greedy = [&](double bound, std::vector<int>* cuts) {
      std::vector<int> c(S + 1, 0);
      for (int st = 0; st < S; ++st) {
        const int lo = c[st];
        if (st + 1 == S) {
          if (lo >= n || score(st, lo, n) > bound) return false;
          c[S] = n;
          break;
        }
        // Leave at least one piece for each later stage.
        int a = lo + 1, b = n - (S - 1 - st);
        if (a > b || score(st, lo, a) > bound) return false;
        while (a < b) {
          const int mid = a + (b - a + 1) / 2;
          if (score(st, lo, mid) <= bound) a = mid; else b = mid - 1;
        }
        c[st + 1] = a;
      }
      if (cuts) *cuts = c;
      return true;
    };
    double hi_bound = 0.0;
    for (int st = 0; st < S; ++st) hi_bound = std::max(hi_bound, score(st, (*cut)[st], (*cut)[st + 1]));
    if (hi_bound == kInf) {
      // The starting cut does not fit these replicas: bound by the slowest whole model.
      hi_bound = 0.0;
      for (int st = 0; st < S; ++st) hi_bound = std::max(hi_bound, score(st, 0, n));
      if (hi_bound == kInf) return false;
    }
    if (!greedy(hi_bound, nullptr)) return false;
    double lo_bound = 0.0;
    for (int it = 0; it < 40 && hi_bound - lo_bound > 1e-6 * hi_bound; ++it) {
      const double mid = 0.5 * (lo_bound + hi_bound);
      (greedy(mid, nullptr) ? hi_bound : lo_bound) = mid;
    }
    return greedy(hi_bound, cut);
  }

  // The estimates of `cut`'s stages for `devices`, or empty when a stage does not fit;
  // cached per replica layout, so moving one boundary costs two.
  std::vector<const StageEstimate*> estimates(const std::vector<int>& devices, const std::vector<int>& cut) {
    const int S = static_cast<int>(devices.size());
    if (devices != sim_devices_) {
      sim_devices_ = devices;
      sim_cache_.clear();
    }
    std::vector<const StageEstimate*> out(S);
    int offset = 0, D = 0;
    for (int d : devices) D += d;
    for (int s = 0; s < S; ++s) {
      auto [it, fresh] = sim_cache_.try_emplace({cut[s], cut[s + 1]});
      if (fresh) {
        StageSlot slot{s, S, offset, devices[s], D, plan_.pipelines, micro_batches_};
        const int64_t rows = stageRows(ctx_, slot);
        if (rows > 0 && cut[s + 1] > cut[s] && replicable(cut[s + 1], devices[s])) {
          it->second = estimateStage(costs_, stageCost(cut[s], cut[s + 1], rows), slot, ctx_);
        }
      }
      if (!it->second.feasible) return {};
      out[s] = &it->second;
      offset += devices[s];
    }
    return out;
  }

  // The simulated iteration of `cut` for `devices` (infinite when a stage does not fit).
  double simulated(const std::vector<int>& devices, const std::vector<int>& cut) {
    const std::vector<const StageEstimate*> stages = estimates(devices, cut);
    if (stages.empty()) return std::numeric_limits<double>::infinity();
    std::vector<SimStage> sim(stages.size());
    for (size_t s = 0; s < stages.size(); ++s) static_cast<StageTimes&>(sim[s]) = *stages[s];
    return simulate(sim, ctx_.schedule, micro_batches_).iteration_time;
  }

  // [Note: one micro-batch's boundaries] With one micro-batch nothing overlaps: the stages
  // run one after another, every cut takes about the same time, and a send a few bytes
  // smaller would pull a boundary to the model's edge (a stage of four ops beside one
  // holding the whole model, seen on GPT-2 forced to 2 stages). Such stages are there for
  // memory, so with M = 1 the moves on the simulator (polish, leanPolish, settle) keep the
  // largest stage score within `slack` of the cut they start from, the min-max cut's
  // balance; with more micro-batches the simulated time itself weighs the balance.
  double balanceLimit(const std::vector<int>& devices, const std::vector<int>& cut, double slack) {
    if (micro_batches_ != 1) return std::numeric_limits<double>::infinity();
    return largestScore(devices, cut) * (1 + slack);
  }

  double largestScore(const std::vector<int>& devices, const std::vector<int>& cut) {
    double largest = 0.0;
    const std::vector<const StageEstimate*> stages = estimates(devices, cut);
    if (stages.empty()) return std::numeric_limits<double>::infinity();
    for (const StageEstimate* e : stages) largest = std::max(largest, e->score);
    return largest;
  }

  // Pattern search on the simulated iteration: each boundary moves by +-step pieces while
  // that helps, step halving down to one piece. The min-max cut balances the score, a
  // proxy; this settles what the proxy cannot see (a first stage's all-reduce tail, sends
  // of unequal boundaries).
  void polish(const std::vector<int>& devices, std::vector<int>* cut) {
    const int S = static_cast<int>(devices.size());
    std::vector<int>& c = *cut;
    double best = simulated(devices, c);
    if (best == std::numeric_limits<double>::infinity()) return;
    const double balance = balanceLimit(devices, c, 0.0);
    int step = 1;
    while (step * 2 <= pieces() / (4 * S)) step *= 2;
    for (; step >= 1; step /= 2) {
      bool moved = true;
      for (int pass = 0; moved && pass < 8; ++pass) {
        moved = false;
        for (int b = 1; b < S; ++b) {
          for (int dir : {-1, 1}) {
            const int to = c[b] + dir * step;
            if (to <= c[b - 1] || to >= c[b + 1]) continue;
            const int was = c[b];
            c[b] = to;
            const double t = simulated(devices, c);
            if (t < best * (1 - 1e-12) && largestScore(devices, c) <= balance) {
              best = t;
              moved = true;
            } else {
              c[b] = was;
            }
          }
        }
      }
    }
  }

  // [Note: settled boundaries] Bytes crossing each cut of the piece sequence (cut k
  // separates pieces [0, k) from [k, n)): every value produced before k and read at or
  // after it, at the traced batch size. From shapes only, so the same in every run; cuts at
  // the fewest bytes are few (a transformer's residual stream between its sublayers), far
  // apart, and the same whatever the measured times.
  const std::vector<int64_t>& crossingBytes() {
    if (!crossing_.empty()) return crossing_;
    const int n = pieces();
    const ir::Graph& g = costs_.graph();
    std::vector<int> pos(atomic_.pieces.size(), -1);
    for (int i = 0; i < n; ++i) pos[seq_[i]] = i;
    std::vector<int64_t> diff(n + 2, 0);
    for (const ir::Value& v : g.values()) {
      if (v.producer == ir::kNoId) continue;
      const int p = atomic_.piece_of[v.producer];  // -1: a constant, cloned into its readers
      if (p < 0 || pos[p] < 0) continue;
      int last = -1;
      for (ir::TaskId c : v.consumers) {
        const int q = atomic_.piece_of[c];
        if (q >= 0 && pos[q] >= 0) last = std::max(last, pos[q]);
      }
      if (last <= pos[p]) continue;
      const int64_t bytes = valueBytesAt(g, v, std::max<int64_t>(1, g.batchSize()));
      diff[pos[p] + 1] += bytes;
      diff[last + 1] -= bytes;
    }
    crossing_.assign(n + 1, 0);
    int64_t run = 0;
    for (int k = 0; k <= n; ++k) crossing_[k] = run += diff[k];
    return crossing_;
  }

  // Polish's blind spot: where sends weigh, a boundary can sit beside a position where far
  // fewer bytes cross that no +-step move reaches, the positions between sending more. So
  // each boundary also tries the positions with fewer crossing bytes than its own (up to
  // kMaxTrials a side) and moves to the fastest of them that beats the iteration, in rounds
  // while that helps.
  void leanPolish(const std::vector<int>& devices, std::vector<int>* cut) {
    constexpr int kMaxTrials = 24, kMaxRounds = 4;
    const std::vector<int64_t>& bytes = crossingBytes();
    std::vector<int>& c = *cut;
    const int S = static_cast<int>(devices.size());
    double best = simulated(devices, c);
    if (best == std::numeric_limits<double>::infinity()) return;
    const double balance = balanceLimit(devices, c, 0.0);
    for (int round = 0; round < kMaxRounds; ++round) {
      bool moved = false;
      for (int b = 1; b < S; ++b) {
        const int home = c[b];
        int to = home;
        double to_time = best;
        for (int dir : {-1, 1}) {
          int trials = 0;
          for (int p = home + dir; p > c[b - 1] && p < c[b + 1] && trials < kMaxTrials; p += dir) {
            if (bytes[p] >= bytes[home]) continue;
            ++trials;
            c[b] = p;
            const double t = simulated(devices, c);
            const bool balanced = largestScore(devices, c) <= balance;
            c[b] = home;
            if (t < to_time * (1 - 1e-12) && balanced) {
              to = p;
              to_time = t;
            }
          }
        }
        if (to != home) {
          c[b] = to;
          best = to_time;
          moved = true;
        }
      }
      if (!moved) break;
    }
  }

  // Moves each boundary of `cut` (left to right, the others fixed) to a position with the
  // fewest crossing bytes whose simulated iteration stays within `bound`. Positions next to
  // each other with the same bytes (a run of cheap ops between them) are one choice: of
  // such runs the one with the fastest position, deepest inside the bound, where noise
  // moves it least; in it, the earliest position within the bound, not the fastest, whose
  // lead over its neighbours is noise. Only positions with no more bytes than the best so
  // far are simulated; a side is given up after kMaxTrials of them, or kMaxMisses in a row
  // outside the bound (the time grows with the distance from the balanced cut, but
  // measured stage times are noisy, so one or two misses say little).
  void settle(const std::vector<int>& devices, std::vector<int>* cut, double bound) {
    constexpr int kMaxTrials = 24, kMaxMisses = 4;
    const std::vector<int64_t>& bytes = crossingBytes();
    std::vector<int>& c = *cut;
    const int S = static_cast<int>(devices.size());
    const double start = simulated(devices, c);
    const double balance = balanceLimit(devices, c, std::max(0.0, bound / start - 1));
    for (int b = 1; b < S; ++b) {
      const int home = c[b];
      std::map<int, double> within{{home, simulated(devices, c)}};  // position -> time
      int64_t least = bytes[home];
      for (int dir : {-1, 1}) {
        int misses = 0, trials = 0;
        for (int p = home + dir; p > c[b - 1] && p < c[b + 1] && misses < kMaxMisses && trials < kMaxTrials;
             p += dir) {
          if (bytes[p] > least) continue;
          ++trials;
          c[b] = p;
          const double t = simulated(devices, c);
          const bool balanced = largestScore(devices, c) <= balance;
          c[b] = home;
          logger().debug("settle boundary {}: piece {} ({} bytes) {:.6f} s", b, p, bytes[p], t);
          if (!(t <= bound) || !balanced) {
            ++misses;
            continue;
          }
          misses = 0;
          within[p] = t;
          least = std::min(least, bytes[p]);
        }
      }
      // Runs of adjacent positions with the least bytes: the fastest run, its first position.
      int best = home;
      double best_run_time = std::numeric_limits<double>::infinity();
      for (auto it = within.begin(); it != within.end();) {
        if (bytes[it->first] != least) {
          ++it;
          continue;
        }
        const int first = it->first;
        double run_time = it->second;
        int last = first;
        for (++it; it != within.end() && it->first == last + 1 && bytes[it->first] == least; ++it) {
          last = it->first;
          run_time = std::min(run_time, it->second);
        }
        if (run_time < best_run_time) {
          best_run_time = run_time;
          best = first;
        }
      }
      logger().debug("settle boundary {}: piece {} ({} bytes) -> {} ({} bytes)", b, home, bytes[home], best,
                     bytes[best]);
      c[b] = best;
    }
  }

  Deployment assemble(const std::vector<int>& devices, const std::vector<int>& cut) {
    const int S = static_cast<int>(devices.size());
    std::vector<StageChoice> stages(S);
    for (int s = 0; s < S; ++s) {
      stages[s].tasks = tasksOf(cut[s], cut[s + 1]);
      if (costs_.composesUnions()) stages[s].parts = partsOf(cut[s], cut[s + 1]);
      stages[s].devices = devices[s];
    }
    return assembleDeployment(costs_, ctx_, stages, plan_.pipelines, micro_batches_, plan_.planner);
  }

 private:
  const AtomicPartition& atomic_;
  const BlockPartition& blocks_;
  std::vector<int> seq_;
  std::vector<int> block_start_;  // where each block starts in seq_ (and the end)
  CostModel& costs_;
  const PlanContext& ctx_;
  const Deployment& plan_;
  int micro_batches_;
  int first_together_ = 0;  // the first piece of the sequence holding a task of ctx_.rows_together
  std::vector<int> sim_devices_;
  std::map<std::pair<int, int>, StageEstimate> sim_cache_;
  std::vector<int64_t> crossing_;
};

// The atomic pieces in the blocks' order (every interval of it is convex), and where each
// block starts in it (one more entry: the end).
std::vector<int> blockOrder(const BlockPartition& blocks, std::vector<int>* block_start) {
  std::vector<int> seq;
  block_start->clear();
  for (const Block& b : blocks.blocks) {
    block_start->push_back(static_cast<int>(seq.size()));
    seq.insert(seq.end(), b.atoms.begin(), b.atoms.end());
  }
  block_start->push_back(static_cast<int>(seq.size()));
  return seq;
}

// refineBoundaries step by step: the best plan so far (its cut and replicas), improved by
// a piece-level re-cut, polishing on the simulator, replica moves and micro-batch moves.
class Refinement {
 public:
  Refinement(Recutter& recutter, const Deployment& plan, std::vector<int> cut, std::vector<int> devices,
             const PlanContext& ctx, const RefineOptions& options, PreferredPlan* visited)
      : recutter_(recutter), options_(options), visited_(visited), best_(plan), best_cut_(std::move(cut)),
        devices_(std::move(devices)), S_(plan.numStages()),
        rows_per_copy_(ctx.batch_size / std::max(1, plan.pipelines)) {
    all_pairs_ = S_ <= options.all_pairs_up_to ||
                 static_cast<double>(S_) * (S_ - 1) * recutter.pieces() <= options.all_pairs_budget;
  }

  const Deployment& best() const { return best_; }

  // The block plan's stages re-cut at piece level.
  void recut() {
    std::vector<int> cut = best_cut_;
    if (recutter_.recut(devices_, &cut)) offer(recutter_.assemble(devices_, cut), cut, devices_);
  }

  // Settles the boundaries of the best plan on the simulator itself.
  void polish() {
    std::vector<int> polished = best_cut_;
    recutter_.polish(devices_, &polished);
    const std::vector<int> stepped = polished;
    recutter_.leanPolish(devices_, &polished);
    if (polished != stepped) recutter_.polish(devices_, &polished);
    if (polished == best_cut_) return;
    offer(recutter_.assemble(devices_, polished), polished, devices_);
  }

  // The best move of one or two (up to max_move_size) replicas between two stages, re-cut,
  // while the simulator improves. True when any move was taken.
  bool moveReplicas() {
    bool any = false;
    for (int moves = 0; options_.move_replicas && moves < options_.max_moves; ++moves) {
      std::vector<int> move_devices, move_cut;
      Deployment move_best;
      bool improved = false;
      for (int from = 0; from < S_; ++from) {
        for (int to = 0; to < S_; ++to) {
          if (to == from || (!all_pairs_ && std::abs(to - from) != 1)) continue;
          for (int k = 1; k <= options_.max_move_size && k < devices_[from]; k *= 2) {
            std::vector<int> d = devices_;
            d[from] -= k;
            d[to] += k;
            std::vector<int> c = best_cut_;
            if (!recutter_.recut(d, &c)) continue;
            Deployment t = recutter_.assemble(d, c);
            if (!t.feasible) continue;
            const double bar = improved ? move_best.iteration_time : best_.iteration_time;
            if (t.iteration_time < bar * (1 - 1e-9)) {
              move_best = std::move(t);
              move_devices = d;
              move_cut = c;
              improved = true;
            }
          }
        }
      }
      if (!improved) break;
      take(std::move(move_best), move_cut, move_devices);
      any = true;
    }
    return any;
  }

  // The block DP chose M for its own cut; a piece-level cut (and other replicas) can prefer
  // another. Hill-climbs M by factors of 2, then about 1.25, taking the first count that
  // improves. True when M moved.
  bool moveMicroBatches() {
    bool any = false;
    for (double factor : {2.0, 1.25}) {
      for (bool improved = true; improved;) {
        improved = false;
        const int m = recutter_.microBatches();
        for (int next : {static_cast<int>(m * factor + 0.5), static_cast<int>(m / factor + 0.5)}) {
          if (next < 1 || next == m || next > options_.max_microbatches || next > rows_per_copy_) continue;
          recutter_.setMicroBatches(next);
          std::vector<int> c = best_cut_;
          if (recutter_.recut(devices_, &c)) {
            Deployment t = recutter_.assemble(devices_, c);
            if (t.feasible && t.iteration_time < best_.iteration_time * (1 - 1e-9)) {
              take(std::move(t), c, devices_);
              improved = any = true;
              break;
            }
          }
          recutter_.setMicroBatches(m);
        }
      }
    }
    return any;
  }

 private:
  // Takes `candidate` when it is feasible and faster than the best.
  void offer(Deployment candidate, const std::vector<int>& cut, const std::vector<int>& devices) {
    if (candidate.feasible && candidate.iteration_time < best_.iteration_time) {
      take(std::move(candidate), cut, devices);
    }
  }

  void take(Deployment candidate, const std::vector<int>& cut, const std::vector<int>& devices) {
    best_ = std::move(candidate);
    best_cut_ = cut;
    devices_ = devices;
    if (visited_) visited_->offer(best_);
  }

  Recutter& recutter_;
  const RefineOptions& options_;
  PreferredPlan* visited_;
  Deployment best_;
  std::vector<int> best_cut_;
  std::vector<int> devices_;
  const int S_;
  const int64_t rows_per_copy_;
  bool all_pairs_ = false;
};

}  // namespace

Deployment refineBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                            const RefineOptions& options, PreferredPlan* visited) {
  if (visited && plan.feasible) visited->offer(plan);
  const int S = plan.numStages();
  if (S < 2) return plan;
  // Pieces in block order, and each stage's cut in that sequence.
  std::vector<int> block_start;
  std::vector<int> seq = blockOrder(blocks, &block_start);
  std::vector<int> cut(S + 1, 0), devices(S);
  for (int s = 0; s < S; ++s) {
    const StagePlan& st = plan.stages[s];
    if (st.first_block < 0 || st.last_block <= st.first_block) return plan;
    cut[s] = block_start[st.first_block];
    cut[s + 1] = block_start[st.last_block];
    devices[s] = static_cast<int>(st.ranks.size()) / std::max(1, plan.pipelines);
  }
  Recutter recutter(atomic, blocks, std::move(seq), block_start, costs, ctx, plan);
  Refinement refinement(recutter, plan, cut, devices, ctx, options, visited);
  refinement.recut();
  // Moves below must beat the polished plan, so they never end slower than a plain re-cut.
  refinement.polish();
  // A new M can want other replicas (more micro-batches favour more stages of fewer
  // replicas over a bubble) and those another M, so the two alternate until neither helps.
  refinement.moveReplicas();
  for (int round = 0; options.move_micro_batches && round < options.max_rounds; ++round) {
    if (!refinement.moveMicroBatches() || !refinement.moveReplicas()) break;
  }
  refinement.polish();
  const Deployment& best = refinement.best();
  if (best.iteration_time < plan.iteration_time) {
    logger().info("boundary refinement: {:.3f} ms -> {:.3f} ms per iteration", plan.iteration_time * 1e3,
                  best.iteration_time * 1e3);
  }
  return best;
}

Deployment settleBoundaries(const Deployment& plan, const AtomicPartition& atomic,
                            const BlockPartition& blocks, CostModel& costs, const PlanContext& ctx,
                            double time_bound) {
  const int S = plan.numStages();
  if (S < 2 || !plan.feasible) return plan;
  std::vector<int> block_start;
  std::vector<int> seq = blockOrder(blocks, &block_start);
  std::vector<int> pos(atomic.pieces.size(), -1);
  for (size_t i = 0; i < seq.size(); ++i) pos[seq[i]] = static_cast<int>(i);
  // Each stage's pieces must be the run [cut[s], cut[s + 1]) of the sequence.
  std::vector<int> cut(S + 1, 0), devices(S);
  for (int s = 0; s < S; ++s) {
    const StagePlan& st = plan.stages[s];
    int lo = std::numeric_limits<int>::max(), hi = -1;
    std::set<int> held;  // a piece of joined tasks ([Note: share scalars]) counts once
    for (ir::TaskId t : st.tasks) {
      const int p = atomic.piece_of[t];
      if (p < 0) continue;
      if (pos[p] < 0) return plan;
      lo = std::min(lo, pos[p]);
      hi = std::max(hi, pos[p]);
      held.insert(p);
    }
    const int count = static_cast<int>(held.size());
    if (count == 0 || hi - lo + 1 != count || lo != cut[s]) return plan;
    cut[s + 1] = hi + 1;
    devices[s] = static_cast<int>(st.ranks.size()) / std::max(1, plan.pipelines);
  }
  if (cut[S] != static_cast<int>(seq.size())) return plan;
  Recutter recutter(atomic, blocks, std::move(seq), block_start, costs, ctx, plan);
  std::vector<int> settled = cut;
  recutter.settle(devices, &settled, std::max(time_bound, plan.iteration_time));
  if (settled == cut) return plan;
  Deployment out = recutter.assemble(devices, settled);
  if (!out.feasible) return plan;
  logger().info("settled stage boundaries where the fewest bytes cross: {:.3f} ms -> {:.3f} ms per iteration",
                plan.iteration_time * 1e3, out.iteration_time * 1e3);
  return out;
}

}  // namespace rannc::partition
