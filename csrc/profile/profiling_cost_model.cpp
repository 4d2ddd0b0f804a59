#include "profile/profiling_cost_model.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "common/error.h"
#include "common/log.h"

namespace rannc::profile {
namespace {

enum Command : int64_t { kFinish = 0, kBatch = 1 };
enum Status : int64_t { kOk = 0, kOutOfMemory = 1, kFailed = 2 };
constexpr int kRecordWidth = 6;  // forward, backward, activation bytes, peak bytes, status, weight

std::string modelDtype(const ir::Graph& g) {
  for (const ir::Value& v : g.values()) {
    if (v.isModelState() && ir::isFloatingPoint(v.dtype)) {
      return std::string(ir::dtypeName(v.dtype));
    }
  }
  return "Float32";
}

double secondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

ProfileRecord composeRecords(const std::vector<ProfileRecord>& parts) {
  ProfileRecord u;
  u.weight_time = 0.0;  // the parts' weight parts add; unknown if one of them is
  int64_t held = 0;
  for (const ProfileRecord& r : parts) {
    u.forward_time += r.forward_time;
    u.backward_time += r.backward_time;
    u.weight_time = u.weight_time < 0 || r.weight_time < 0 ? -1.0 : u.weight_time + r.weight_time;
    u.peak_bytes = std::max(u.peak_bytes, held + r.peak_bytes);
    held += r.activation_bytes;
    u.out_of_memory = u.out_of_memory || r.out_of_memory;
  }
  u.activation_bytes = held;
  if (u.out_of_memory) {
    u.forward_time = u.backward_time = std::numeric_limits<double>::infinity();
  }
  return u;
}

partition::PieceCost pieceCostFrom(const ir::Graph& g, const ir::Subgraph& piece, int64_t rows,
                                   const ProfileRecord& record) {
  partition::PieceCost c;
  c.forward_time = record.forward_time;
  c.backward_time = record.backward_time;
  c.weight_time = record.weight_time;
  for (ir::ValueId id : piece.inputs) {
    const ir::Value& v = g.value(id);
    if (!v.isTensor() || v.isConstant()) continue;
    const int64_t bytes = partition::valueBytesAt(g, v, rows);
    if (v.role == ir::ValueRole::Param) {
      c.param_bytes += bytes;
      if (!v.requires_grad) c.frozen_bytes += bytes;  // [Note: frozen parameters' memory]
    } else if (v.role == ir::ValueRole::Buffer) {
      c.buffer_bytes += bytes;
    } else {
      c.input_bytes += bytes;
    }
  }
  for (ir::ValueId id : piece.outputs) {
    const ir::Value& v = g.value(id);
    if (v.isTensor()) c.output_bytes += partition::valueBytesAt(g, v, rows);
  }
  c.activation_bytes = std::max(record.activation_bytes + c.input_bytes, record.peak_bytes);
  return c;
}

ProfilingCostModel::ProfilingCostModel(std::shared_ptr<const frontend::TracedModel> model,
                                       std::shared_ptr<Profiler> profiler,
                                       std::shared_ptr<ProfileCache> cache,
                                       partition::DeviceSpec device,
                                       std::shared_ptr<comm::Communicator> comm)
    : partition::CostModel(model->graph, device),
      model_(std::move(model)),
      profiler_(std::move(profiler)),
      cache_(cache ? std::move(cache) : std::make_shared<ProfileCache>()),
      comm_(std::move(comm)),
      dtype_(modelDtype(model_->graph)) {
  if (comm_ && comm_->size() <= 1) comm_.reset();
}

ProfilingCostModel::~ProfilingCostModel() {
  // Releases the serving ranks if rank 0 is unwinding from an error before finish().
  if (comm_ && comm_->rank() == 0 && !finished_) {
    try {
      finish();
    } catch (...) {
    }
  }
}

ProfileKey ProfilingCostModel::key(const ir::Subgraph& piece, int64_t rows, bool recompute) const {
  return ProfileKey{ir::contentHash(graph(), piece), rows, dtype_, profiler_->deviceKind(), recompute};
}

namespace {
// A trace line per cost answer: which piece, where the answer came from, what it said
// (a second plan from the cache must read the same lines as the first).
void traceRecord(const char* how, const ProfileKey& k, size_t tasks, const ProfileRecord& r) {
  if (!logEnabled(LogLevel::Trace)) return;
  std::ostringstream os;
  os << "cost " << how << ": piece " << std::hex << k.content_hash << std::dec << " (" << tasks << " tasks) at "
     << k.rows << " rows: fwd " << r.forward_time << " s, bwd " << r.backward_time << " s";
  log(LogLevel::Trace, os.str());
}
}  // namespace

ProfileRecord ProfilingCostModel::record(const ir::Subgraph& piece, int64_t rows, bool recompute) {
  const ProfileKey k = key(piece, rows, recompute);
  if (auto hit = known(k)) {
    traceRecord("known", k, piece.tasks.size(), *hit);
    return *hit;
  }
  const auto start = std::chrono::steady_clock::now();
  ProfileRecord r = profiler_->measure(piece, rows, recompute);
  measuring_seconds_ += secondsSince(start);
  ++measured_;
  cache_->insert(k, r);
  traceRecord("measured", k, piece.tasks.size(), r);
  return r;
}

partition::PieceCost ProfilingCostModel::computeCost(const ir::Subgraph& piece, int64_t rows) {
  return pieceCostFrom(graph(), piece, rows, record(piece, rows, /*recompute=*/false));
}

ProfileRecord ProfilingCostModel::partRecord(const std::vector<ir::TaskId>& tasks, int64_t rows) {
  const ir::Subgraph piece = pieceOf(tasks);
  const ProfileKey k = key(piece, rows, false);
  // A composition made before wins over a measurement: the measurement may have come
  // later (a coarsening group that became a block), and a second plan, which finds it in
  // the cache from the start, must answer as the first did. A piece announced to be
  // measured as itself (prefetch) drops its composition, in both plans at the same point.
  auto it = composed_.find(k);
  if (it != composed_.end()) {
    traceRecord("part composed", k, piece.tasks.size(), it->second);
    return it->second;
  }
  if (auto hit = known(k)) {
    traceRecord("part known", k, piece.tasks.size(), *hit);
    return *hit;
  }
  return record(piece, rows, false);
}

partition::PieceCost ProfilingCostModel::unionCost(const std::vector<const std::vector<ir::TaskId>*>& parts,
                                                   int64_t rows) {
  if (!compose_ || parts.size() < 2) return CostModel::unionCost(parts, rows);
  std::vector<ir::TaskId> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  const ir::Subgraph whole = pieceOf(all);
  // Always composed, even where the cache holds the union measured whole (a verified
  // finalist's stage): a second plan from the cache must cost it as the first did.
  const ProfileKey k = key(whole, rows, false);
  auto it = composed_.find(k);
  if (it == composed_.end()) {
    std::vector<ProfileRecord> records;
    records.reserve(parts.size());
    for (const auto* p : parts) records.push_back(partRecord(*p, rows));
    it = composed_.emplace(k, composeRecords(records)).first;
    traceRecord("composed", k, whole.tasks.size(), it->second);
  }
  return pieceCostFrom(graph(), whole, rows, it->second);
}

void ProfilingCostModel::prefetch(const std::vector<std::vector<ir::TaskId>>& pieces, int64_t rows) {
  std::vector<ir::Subgraph> distinct, todo;
  std::unordered_map<ProfileKey, bool, ProfileKeyHash> seen;
  for (const auto& tasks : pieces) {
    if (tasks.empty()) continue;
    ir::Subgraph piece = partition::makePiece(graph(), tasks, topoPosition(), pureConstant());
    ProfileKey k = key(piece, rows, false);
    if (seen.count(k)) continue;
    seen.emplace(k, true);
    composed_.erase(k);  // measured as itself from now on (see partRecord)
    if (!known(k)) todo.push_back(piece);
    distinct.push_back(std::move(piece));
  }
  const size_t fitted_before = fitted_.size();
  if (fit_tolerance_ > 0.0 && min_rows_ > 0 && rows > min_rows_) {
    // With nothing to fit, the check still runs on what the cache holds: a second plan
    // from the cache then knows the same checked lines as the first ([Note: fitted rows]).
    todo = fitRows(distinct, rows, /*may_measure=*/!todo.empty());
  }
  measureBatch(todo, rows);
  // Fits reach only to row counts measured whole, so a second plan from the cache fits
  // exactly as the first did (a check measurement must not become a fit's end).
  if (fitted_.size() == fitted_before) whole_rows_.insert(rows);
}

std::optional<ProfileRecord> ProfilingCostModel::known(const ProfileKey& k) const {
  std::optional<ProfileRecord> hit = cache_->find(k);
  if (!hit) {
    auto it = fitted_.find(k);
    if (it != fitted_.end()) hit = it->second;
  }
  // A record made without the weight part (a 1F1B plan's) does not serve a plan that may
  // run ZB-H1: the piece is measured again.
  if (hit && profiler_->options().measure_weight_part && hit->weight_time < 0 && !hit->out_of_memory) {
    return std::nullopt;
  }
  return hit;
}

ProfileRecord interpolateRecords(const ProfileRecord& lo, int64_t lo_rows, const ProfileRecord& hi,
                                 int64_t hi_rows, int64_t rows) {
  const double w = static_cast<double>(rows - lo_rows) / static_cast<double>(hi_rows - lo_rows);
  auto mix = [w](double a, double b) { return a + w * (b - a); };
  ProfileRecord r;
  r.forward_time = mix(lo.forward_time, hi.forward_time);
  r.backward_time = mix(lo.backward_time, hi.backward_time);
  r.weight_time = lo.weight_time < 0 || hi.weight_time < 0 ? -1.0 : mix(lo.weight_time, hi.weight_time);
  r.activation_bytes = static_cast<int64_t>(std::llround(mix(static_cast<double>(lo.activation_bytes),
                                                             static_cast<double>(hi.activation_bytes))));
  r.peak_bytes = static_cast<int64_t>(std::llround(mix(static_cast<double>(lo.peak_bytes),
                                                       static_cast<double>(hi.peak_bytes))));
  return r;
}

std::vector<ir::Subgraph> ProfilingCostModel::fitRows(const std::vector<ir::Subgraph>& pieces, int64_t rows,
                                                      bool may_measure) {
  // Every fit starts from the fewest rows the planner will ask for.
  std::vector<ir::Subgraph> floor, todo;
  for (const auto& piece : pieces) {
    if (!cache_->find(key(piece, min_rows_, false))) floor.push_back(piece);
    if (!known(key(piece, rows, false))) todo.push_back(piece);
  }
  if (!may_measure && (!floor.empty() || !todo.empty())) return todo;
  measureBatch(floor, min_rows_);
  whole_rows_.insert(min_rows_);
  // Each piece's line: from the fewest rows to its nearest measured row count above.
  struct Fit {
    const ir::Subgraph* piece;
    int64_t hi_rows;
    ProfileRecord lo, hi;
  };
  auto fitOf = [&](const ir::Subgraph& piece) -> std::optional<Fit> {
    const auto lo = cache_->find(key(piece, min_rows_, false));
    if (!lo || lo->out_of_memory) return std::nullopt;
    for (int64_t r : whole_rows_) {
      if (r <= rows) continue;
      const auto hi = cache_->find(key(piece, r, false));
      if (!hi) continue;
      if (hi->out_of_memory) return std::nullopt;
      return Fit{&piece, r, *lo, *hi};
    }
    return std::nullopt;
  };
  // The check: of the batch's pieces, the one that takes longest at its upper row count
  // (it matters most to the stage times) is measured at `rows` (or was, by an earlier
  // plan: the same batch then checks on the same piece and measures nothing new).
  auto total = [](const ProfileRecord& r) { return r.forward_time + r.backward_time; };
  std::optional<Fit> check;
  for (const auto& piece : pieces) {
    auto f = fitOf(piece);
    if (f && (!check || total(f->hi) > total(check->hi))) check = f;
  }
  if (!check) return todo;
  // A line that held at one row count inside it holds at the others: only the first row
  // count asked for between the same ends pays a check measurement.
  const std::pair<int64_t, int64_t> line{min_rows_, check->hi_rows};
  const bool held = checked_lines_.count(line) > 0;
  const ProfileKey check_key = key(*check->piece, rows, false);
  double error = 0.0;
  if (!held) {
    if (!cache_->find(check_key)) {
      if (!may_measure) return todo;
      measureBatch({*check->piece}, rows);
    }
    const auto got = cache_->find(check_key);
    const ProfileRecord predicted = interpolateRecords(check->lo, min_rows_, check->hi, check->hi_rows, rows);
    error = got && total(*got) > 0.0 ? std::abs(total(predicted) - total(*got)) / total(*got)
                                     : std::numeric_limits<double>::infinity();
    if (error <= fit_tolerance_) checked_lines_.insert(line);
  }
  std::vector<ir::Subgraph> rest;
  int64_t fitted = 0;
  for (const auto& piece : todo) {
    const ProfileKey k = key(piece, rows, false);
    if (k == check_key && !held) continue;
    auto f = error <= fit_tolerance_ ? fitOf(piece) : std::nullopt;
    if (f) {
      fitted_.emplace(k, interpolateRecords(f->lo, min_rows_, f->hi, f->hi_rows, rows));
      ++fitted;
    } else {
      rest.push_back(piece);
    }
  }
  if (todo.empty()) return rest;
  std::ostringstream os;
  os << "rows " << rows << ": " << fitted << " pieces fitted between " << min_rows_
     << " rows and measured rows above, " << rest.size() << " measured ";
  if (held) {
    os << "(the line from " << line.first << " to " << line.second << " rows was checked before)";
  } else {
    os << "(the check on the longest piece was " << error * 100.0 << "% off; tolerance "
       << fit_tolerance_ * 100.0 << "%)";
  }
  logDebug(os.str());
  return rest;
}

void ProfilingCostModel::measureBatch(const std::vector<ir::Subgraph>& todo, int64_t rows) {
  if (todo.empty()) return;
  std::ostringstream os;
  os << "profiling " << todo.size() << " pieces at " << rows << " rows"
     << (comm_ ? " over " + std::to_string(comm_->size()) + " ranks" : std::string());
  logDebug(os.str());
  const auto start = std::chrono::steady_clock::now();
  auto done_log = [&] {
    logDebug("profiled " + std::to_string(todo.size()) + " pieces at " + std::to_string(rows) +
             " rows in " + std::to_string(secondsSince(start)) + " s");
  };
  if (!comm_) {
    int64_t done = 0;
    for (const auto& piece : todo) {
      record(piece, rows, false);  // adds to measuring_seconds_
      if (progress_) progress_(++done, static_cast<int64_t>(todo.size()));
    }
    done_log();
    return;
  }
  RANNC_CHECK(comm_->rank() == 0, "prefetch with a communicator runs on rank 0 only");
  RANNC_CHECK(!finished_, "prefetch after finish()");
  std::vector<int64_t> flat;
  for (const auto& piece : todo) {
    flat.push_back(static_cast<int64_t>(piece.tasks.size()));
    flat.insert(flat.end(), piece.tasks.begin(), piece.tasks.end());
  }
  at::Tensor header = at::tensor(std::vector<int64_t>{kBatch, rows, static_cast<int64_t>(todo.size()),
                                                      static_cast<int64_t>(flat.size())});
  comm_->broadcast(header, 0)->wait();
  comm_->broadcast(at::tensor(flat), 0)->wait();
  runBatch(todo, rows);
  measuring_seconds_ += secondsSince(start);
  done_log();
}

void ProfilingCostModel::runBatch(const std::vector<ir::Subgraph>& pieces, int64_t rows) {
  const int size = comm_->size(), me = comm_->rank();
  const int64_t n = static_cast<int64_t>(pieces.size());
  const int64_t per = (n + size - 1) / size;
  at::Tensor mine = at::zeros({per, kRecordWidth}, at::kDouble);
  auto acc = mine.accessor<double, 2>();
  std::string failure;
  int64_t done = 0, share = 0;
  // Piece i goes to rank (i + 1) mod size: rank 0, which also runs the search between
  // batches, gets the smallest share when the pieces do not divide evenly.
  auto owner = [size](int64_t i) { return static_cast<int>((i + 1) % size); };
  const int64_t first = (me + size - 1) % size;
  for (int64_t i = first; i < n; i += size) ++share;
  for (int64_t i = first, slot = 0; i < n; i += size, ++slot) {
    ProfileRecord r;
    int64_t status = kOk;
    try {
      r = profiler_->measure(pieces[i], rows, false);
      ++measured_;
      if (r.out_of_memory) status = kOutOfMemory;
    } catch (const std::exception& e) {
      status = kFailed;
      if (failure.empty()) failure = e.what();
    }
    acc[slot][0] = r.forward_time;
    acc[slot][1] = r.backward_time;
    acc[slot][2] = static_cast<double>(r.activation_bytes);
    acc[slot][3] = static_cast<double>(r.peak_bytes);
    acc[slot][4] = static_cast<double>(status);
    acc[slot][5] = r.weight_time;
    if (progress_) progress_(++done, share);
  }
  at::Tensor all = at::zeros({per * size, kRecordWidth}, at::kDouble);
  comm_->allGather(mine, all)->wait();
  auto got = all.accessor<double, 2>();
  int64_t failed_at = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = owner(i) * per + i / size;
    const auto status = static_cast<int64_t>(got[row][4]);
    if (status == kFailed) {
      if (failed_at < 0) failed_at = i;
      continue;
    }
    ProfileRecord r;
    r.forward_time = got[row][0];
    r.backward_time = got[row][1];
    r.activation_bytes = static_cast<int64_t>(got[row][2]);
    r.peak_bytes = static_cast<int64_t>(got[row][3]);
    r.out_of_memory = status == kOutOfMemory;
    r.weight_time = got[row][5];
    cache_->insert(key(pieces[i], rows, false), r);
  }
  if (failed_at >= 0) {
    std::ostringstream os;
    os << "rank " << comm_->worldRank(owner(failed_at))
       << " could not profile a piece of " << pieces[failed_at].tasks.size() << " tasks at " << rows
       << " rows" << (failure.empty() ? std::string() : ": " + failure);
    throw Error(os.str());
  }
}

void ProfilingCostModel::finish() {
  if (!comm_ || finished_) return;
  finished_ = true;
  at::Tensor header = at::tensor(std::vector<int64_t>{kFinish, 0, 0, 0});
  comm_->broadcast(header, 0)->wait();
}

void ProfilingCostModel::serve() {
  if (!comm_) return;
  RANNC_CHECK(comm_->rank() != 0, "rank 0 plans; it does not serve");
  for (;;) {
    at::Tensor header = at::zeros({4}, at::kLong);
    comm_->broadcast(header, 0)->wait();
    auto h = header.accessor<int64_t, 1>();
    if (h[0] == kFinish) return;
    if (h[0] != kBatch) throw Error("unknown profiling command " + std::to_string(h[0]) + " from rank 0");
    const int64_t rows = h[1], n = h[2];
    at::Tensor flat = at::zeros({h[3]}, at::kLong);
    comm_->broadcast(flat, 0)->wait();
    auto f = flat.accessor<int64_t, 1>();
    std::vector<ir::Subgraph> pieces;
    int64_t pos = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t len = f[pos++];
      std::vector<ir::TaskId> tasks;
      for (int64_t j = 0; j < len; ++j) {
        const int64_t t = f[pos++];
        if (t < 0 || t >= graph().numTasks()) {
          throw Error("rank 0 asked to profile task " + std::to_string(t) +
                      ", which this rank's graph does not have (the ranks traced different models)");
        }
        tasks.push_back(static_cast<ir::TaskId>(t));
      }
      pieces.push_back(partition::makePiece(graph(), tasks, topoPosition(), pureConstant()));
    }
    runBatch(pieces, rows);
  }
}

}  // namespace rannc::profile
