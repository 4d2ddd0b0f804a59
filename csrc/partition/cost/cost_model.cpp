#include "partition/cost/cost_model.h"

#include <algorithm>
#include <unordered_set>

#include "common/error.h"

namespace rannc::partition {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64 finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

int optimizerStateFactor(Optimizer optimizer) {
  switch (optimizer) {
    case Optimizer::Sgd: return 0;
    case Optimizer::SgdMomentum: return 1;
    case Optimizer::Adam: return 2;
  }
  return 2;
}

int optimizerUpdateTraffic(Optimizer optimizer) {
  return 3 + 2 * optimizerStateFactor(optimizer);
}

const char* optimizerName(Optimizer optimizer) {
  switch (optimizer) {
    case Optimizer::Sgd: return "sgd";
    case Optimizer::SgdMomentum: return "sgd-momentum";
    case Optimizer::Adam: return "adam";
  }
  return "?";
}

int64_t valueBytesAt(const ir::Graph& graph, const ir::Value& value, int64_t rows) {
  const int64_t bytes = value.bytes();
  if (!value.isBatch() || graph.batchSize() <= 0) return bytes;
  // The batch dimension is batch_multiple * batch size; every other dimension stays.
  return bytes * rows / graph.batchSize();
}

std::vector<char> pureConstantTasks(const ir::Graph& graph) {
  std::vector<char> depends(graph.numValues(), 0);
  for (const ir::Value& v : graph.values()) {
    if (v.role == ir::ValueRole::Input || v.isModelState()) depends[v.id] = 1;
  }
  for (ir::ValueId v : graph.inputs()) depends[v] = 1;
  std::vector<char> pure(graph.numTasks(), 1);
  for (ir::TaskId t : graph.topologicalOrder()) {
    const ir::Task& task = graph.task(t);
    bool dep = std::any_of(task.inputs.begin(), task.inputs.end(),
                           [&](ir::ValueId v) { return depends[v] != 0; });
    pure[t] = !dep;
    if (dep) {
      for (ir::ValueId v : task.outputs) depends[v] = 1;
    }
  }
  return pure;
}

ir::Subgraph makePiece(const ir::Graph& graph, const std::vector<ir::TaskId>& tasks,
                       const std::vector<int>& topo_pos, const std::vector<char>& pure_constant) {
  ir::Subgraph piece;
  piece.tasks = tasks;
  std::sort(piece.tasks.begin(), piece.tasks.end(),
            [&](ir::TaskId a, ir::TaskId b) { return topo_pos[a] < topo_pos[b]; });
  piece.tasks.erase(std::unique(piece.tasks.begin(), piece.tasks.end()), piece.tasks.end());
  // Membership by binary search over the sorted ids keeps this O(|piece| log |piece|)
  // instead of O(|graph|): the planner builds many small pieces of a large graph.
  std::vector<ir::TaskId> sorted = piece.tasks;
  std::sort(sorted.begin(), sorted.end());
  auto inside = [&](ir::TaskId t) { return std::binary_search(sorted.begin(), sorted.end(), t); };
  std::unordered_set<ir::ValueId> seen;
  for (ir::TaskId t : piece.tasks) {
    for (ir::ValueId v : graph.task(t).inputs) {
      const ir::Value& val = graph.value(v);
      if (val.producer != ir::kNoId && inside(val.producer)) continue;
      if (seen.insert(v).second) piece.inputs.push_back(v);
    }
  }
  std::vector<ir::ValueId> graph_outputs = graph.outputs();
  std::sort(graph_outputs.begin(), graph_outputs.end());
  for (ir::TaskId t : piece.tasks) {
    for (ir::ValueId v : graph.task(t).outputs) {
      const ir::Value& val = graph.value(v);
      bool used_outside = std::binary_search(graph_outputs.begin(), graph_outputs.end(), v);
      if (!pure_constant[t]) {
        used_outside = used_outside || std::any_of(val.consumers.begin(), val.consumers.end(),
                                                   [&](ir::TaskId c) { return !inside(c); });
      }
      if (used_outside) piece.outputs.push_back(v);
    }
  }
  return piece;
}

CostModel::CostModel(const ir::Graph& graph, DeviceSpec device)
    : graph_(graph), device_(device), topo_pos_(graph.numTasks(), 0) {
  std::vector<ir::TaskId> order = graph.topologicalOrder();
  for (size_t i = 0; i < order.size(); ++i) topo_pos_[order[i]] = static_cast<int>(i);
  pure_constant_ = pureConstantTasks(graph);
  task_mark_.assign(graph.numTasks(), 0);
}

uint64_t CostModel::graphHash() const {
  if (!graph_hashed_) {
    graph_hash_ = graph_.contentHash();
    graph_hashed_ = true;
  }
  return graph_hash_;
}

std::vector<ir::TaskId> CostModel::uniqueTasks(const std::vector<ir::TaskId>& tasks) {
  ++task_stamp_;
  std::vector<ir::TaskId> uniq;
  uniq.reserve(tasks.size());
  for (ir::TaskId t : tasks) {
    RANNC_CHECK(t >= 0 && t < graph_.numTasks(), "cost query names unknown task " << t);
    if (task_mark_[t] == task_stamp_) continue;
    task_mark_[t] = task_stamp_;
    uniq.push_back(t);
  }
  return uniq;
}

ir::Subgraph CostModel::pieceOf(const std::vector<ir::TaskId>& tasks) {
  return makePiece(graph_, uniqueTasks(tasks), topo_pos_, pure_constant_);
}

PieceCost CostModel::cost(const std::vector<ir::TaskId>& tasks, int64_t rows) {
  RANNC_CHECK(!tasks.empty(), "cost of an empty piece");
  RANNC_CHECK(rows >= 1, "cost at " << rows << " rows");
  ++queries_;
  // Order-free key of the task set: two independent sums of mixed ids. Duplicates (the
  // same clone listed by two atomic pieces) are removed first so they do not change it.
  const std::vector<ir::TaskId> uniq = uniqueTasks(tasks);
  uint64_t a = uniq.size(), b = 0;
  for (ir::TaskId t : uniq) {
    a += mix(static_cast<uint64_t>(t));
    b ^= mix(static_cast<uint64_t>(t) * 0x2545f4914f6cdd1dULL + 7);
  }
  const Key set_key{a, b, rows};
  auto it = by_set_.find(set_key);
  if (it != by_set_.end()) return it->second;

  if (!cacheByContent()) {
    PieceCost direct;
    if (computeCostDirect(uniq, rows, &direct)) {
      ++misses_;
      by_set_.emplace(set_key, direct);
      return direct;
    }
  }
  ir::Subgraph piece = makePiece(graph_, uniq, topo_pos_, pure_constant_);
  PieceCost result;
  if (cacheByContent()) {
    const Key content_key{ir::contentHash(graph_, piece), 0, rows};
    auto cit = by_content_.find(content_key);
    if (cit != by_content_.end()) {
      result = cit->second;
    } else {
      ++misses_;
      result = computeCost(piece, rows);
      by_content_.emplace(content_key, result);
    }
  } else {
    ++misses_;
    result = computeCost(piece, rows);
  }
  by_set_.emplace(set_key, result);
  return result;
}

PieceCost CostModel::unionCost(const std::vector<const std::vector<ir::TaskId>*>& parts, int64_t rows) {
  std::vector<ir::TaskId> all;
  for (const auto* p : parts) all.insert(all.end(), p->begin(), p->end());
  return cost(all, rows);
}

double CostModel::commTime(int64_t bytes, Link link) const {
  if (bytes <= 0) return 0.0;
  const double bw =
      link == Link::IntraNode ? device_.intra_node_bandwidth : device_.inter_node_bandwidth;
  return device_.link_latency + static_cast<double>(bytes) / bw;
}

double CostModel::allReduceTime(int64_t bytes, int participants, Link link) const {
  if (participants <= 1 || bytes <= 0) return 0.0;
  // A ring moves 2 (p-1)/p of the buffer through every link.
  const double moved = 2.0 * (participants - 1) / participants * static_cast<double>(bytes);
  return commTime(static_cast<int64_t>(moved), link);
}

}  // namespace rannc::partition
