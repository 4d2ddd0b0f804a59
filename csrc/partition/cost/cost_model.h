#pragma once
// How the planner learns what a piece of the graph costs. The planner only ever asks
// this interface; the analytic model (analytic_cost_model.h) answers from shapes, the
// profiler (csrc/profile, torch) answers by running the piece. Queries are cached here,
// so the planner may ask again freely.
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "ir/graph.h"
#include "ir/subgraph.h"

namespace rannc::partition {

// The accelerator and the links between accelerators.
struct DeviceSpec {
  double peak_flops = 100e12;          // FLOP/s one device reaches on large matmuls
  double memory_bandwidth = 1.5e12;    // bytes/s of device memory
  int64_t memory_bytes = 32LL << 30;   // device memory
  double intra_node_bandwidth = 50e9;  // bytes/s between two devices of one node
  double inter_node_bandwidth = 12.5e9;  // bytes/s between devices of two nodes
  double link_latency = 0.0;           // seconds added to every transfer
  double kernel_overhead = 0.0;        // seconds added per task (launch cost)
  int devices_per_node = 8;
};

enum class Link { IntraNode, InterNode };

// Optimizer state kept per parameter byte: Adam keeps two moments, SGD with momentum one.
enum class Optimizer { Sgd, SgdMomentum, Adam };
int optimizerStateFactor(Optimizer optimizer);
// Bytes an optimizer step reads and writes per parameter byte (parameter, gradient and
// state in, parameter and state out): the update time where no measured rate is given.
int optimizerUpdateTraffic(Optimizer optimizer);
const char* optimizerName(Optimizer optimizer);

// What one micro-batch of `rows` rows costs on one device for a piece.
struct PieceCost {
  double forward_time = 0.0;   // seconds
  double backward_time = 0.0;  // seconds, without recomputation
  // The weight part of the backward as ZB-H1 splits it (seconds; < 0: not measured, the
  // stage estimate applies [Note: weight gradient share]).
  double weight_time = -1.0;
  int64_t activation_bytes = 0;  // kept from the forward for the backward (one micro-batch)
  int64_t param_bytes = 0;       // parameters read by the piece (each counted once)
  // [Note: frozen parameters' memory] Of param_bytes, the parameters that do not require
  // grad (a frozen backbone, a LoRA model's base): no gradient, no optimizer state, no
  // all-reduce and no update. Before session 32 they were charged all four, so a LoRA
  // model's plan reserved four times its base weights (fp32 Adam) and spread it over more
  // stages than it needs. A parameter unfrozen after planning is checked when it trains
  // (python/rannc/deployed.py, [Note: frozen parameters]).
  int64_t frozen_bytes = 0;
  int64_t trainedBytes() const { return param_bytes - frozen_bytes; }
  int64_t buffer_bytes = 0;      // buffers read by the piece
  int64_t input_bytes = 0;       // activations entering the piece (one micro-batch)
  int64_t output_bytes = 0;      // activations leaving the piece (one micro-batch)
};

// Bytes a value occupies at a micro-batch of `rows` rows (batch values scale with rows).
int64_t valueBytesAt(const ir::Graph& graph, const ir::Value& value, int64_t rows);

// [Note: constant tasks] A task is purely constant when nothing it reads depends on a
// model input, parameter or buffer; such tasks are cloned into every piece that needs
// them (atomic partitioning), so their outputs never cross a piece boundary.
std::vector<char> pureConstantTasks(const ir::Graph& graph);

// Builds the piece `tasks` (any order, constant clones allowed) without a convexity check:
// tasks in topological order, inputs, and outputs used outside (purely constant outputs
// are left out, every consumer holds its own clone). `topo_pos` is the position of each
// task in a topological order.
ir::Subgraph makePiece(const ir::Graph& graph, const std::vector<ir::TaskId>& tasks,
                       const std::vector<int>& topo_pos, const std::vector<char>& pure_constant);

class CostModel {
 public:
  // The model answers for pieces of `graph`, which must outlive it.
  CostModel(const ir::Graph& graph, DeviceSpec device);
  virtual ~CostModel() = default;
  CostModel(const CostModel&) = delete;
  CostModel& operator=(const CostModel&) = delete;

  const ir::Graph& graph() const { return graph_; }
  const DeviceSpec& device() const { return device_; }
  // Position of each task in the graph's topological order.
  const std::vector<int>& topoPosition() const { return topo_pos_; }
  const std::vector<char>& pureConstant() const { return pure_constant_; }
  // graph().contentHash(), computed on first use (every deployment records it; hashing a
  // 20,000-task graph per candidate plan was a fifth of the planning time).
  uint64_t graphHash() const;

  // Cost of the piece made of `tasks` (a convex set, constant clones allowed, order free)
  // at a micro-batch of `rows` rows. Cached by task set, and by content hash when
  // cacheByContent() (identical layers then cost one query). Not thread-safe.
  PieceCost cost(const std::vector<ir::TaskId>& tasks, int64_t rows);

  // Cost of the union of `parts`: disjoint pieces listed in a topological order whose union
  // is convex (a range of blocks, two groups being merged). By default the union is costed
  // as one piece; a model whose answers are measurements may compose it from the parts'
  // costs instead ([Note: composed costs] in profile/profiling_cost_model.h).
  virtual PieceCost unionCost(const std::vector<const std::vector<ir::TaskId>*>& parts, int64_t rows);
  // Whether unionCost composes: the planner then announces the parts, not the unions.
  virtual bool composesUnions() const { return false; }

  // A hint that the planner will ask for no fewer than `rows` rows (a measuring model may
  // fit costs between row counts it measured).
  virtual void expectRows(int64_t /*min_rows*/) {}

  // A hint that `pieces` will be asked for at `rows` soon: a profiler can measure them in
  // one batch spread over all ranks. The default does nothing; answers still come from
  // cost().
  virtual void prefetch(const std::vector<std::vector<ir::TaskId>>& /*pieces*/, int64_t /*rows*/) {}

  // Seconds to move `bytes` between two devices over `link`.
  virtual double commTime(int64_t bytes, Link link) const;
  // Seconds of a ring all-reduce of `bytes` over `participants` devices (0 for one).
  double allReduceTime(int64_t bytes, int participants, Link link) const;

  // `tasks` with repeats removed (the same constant clone listed by two parts), in order.
  std::vector<ir::TaskId> uniqueTasks(const std::vector<ir::TaskId>& tasks);
  // The piece of `tasks` (repeats allowed), as makePiece builds it.
  ir::Subgraph pieceOf(const std::vector<ir::TaskId>& tasks);

  int64_t queries() const { return queries_; }
  int64_t misses() const { return misses_; }

 protected:
  // Computes the cost of a piece; called once per distinct (piece, rows).
  virtual PieceCost computeCost(const ir::Subgraph& piece, int64_t rows) = 0;
  // Optional fast path from the distinct task ids (any order), skipping makePiece; used
  // when not caching by content. Returns false when not implemented.
  virtual bool computeCostDirect(const std::vector<ir::TaskId>& /*tasks*/, int64_t /*rows*/,
                                 PieceCost* /*out*/) {
    return false;
  }
  // Whether to key the cache by ir::contentHash too (worth it when computeCost is costly).
  virtual bool cacheByContent() const { return true; }

 private:
  struct Key {
    uint64_t a, b;
    int64_t rows;
    bool operator==(const Key& o) const { return a == o.a && b == o.b && rows == o.rows; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return k.a ^ (k.b * 31) ^ (uint64_t(k.rows) * 1000003); }
  };

  const ir::Graph& graph_;
  DeviceSpec device_;
  std::vector<int> topo_pos_;
  std::vector<char> pure_constant_;
  std::vector<int> task_mark_;  // dedupe of query task ids without sorting
  int task_stamp_ = 0;
  std::unordered_map<Key, PieceCost, KeyHash> by_set_;
  std::unordered_map<Key, PieceCost, KeyHash> by_content_;
  mutable uint64_t graph_hash_ = 0;
  mutable bool graph_hashed_ = false;
  int64_t queries_ = 0;
  int64_t misses_ = 0;
};

}  // namespace rannc::partition
