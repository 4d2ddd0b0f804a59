#pragma once
// Block partitioning (RaNNC §III-B): groups the atomic pieces into k convex blocks of
// balanced compute time with little traffic between them. Three phases, as in the paper:
// multilevel coarsening, uncoarsening (boundary refinement by communication), and
// compaction along a topological order of the groups.
#include <cstdint>
#include <vector>

#include "partition/atomic/atomic.h"
#include "partition/cost/cost_model.h"

namespace rannc::partition {

struct BlockOptions {
  int num_blocks = 32;             // k: compaction stops at this many blocks
  int64_t rows = 1;                // micro-batch rows at which block times are compared
  int64_t memory_rows = 0;         // rows at which a block must fit memory (0: rows)
  int64_t memory_limit = INT64_MAX;  // a block (one micro-batch in flight) must fit this
  Optimizer optimizer = Optimizer::Adam;
  int model_copies = 0;            // copies of the parameters and buffers beside the model
  bool uncoarsen = true;           // off: skip the communication refinement
  bool compact = true;             // off: stop after coarsening/uncoarsening
};

struct Block {
  std::vector<int> atoms;          // atomic pieces, ascending (= topological order)
  std::vector<ir::TaskId> tasks;   // their tasks, each once, in topological order
  double time = 0.0;               // forward + backward at BlockOptions::rows
  int64_t memory = 0;              // replicaMemory, one micro-batch of memory_rows in flight
};

struct BlockPartition {
  std::vector<Block> blocks;  // in a topological order of the block DAG
  // Block DAG: succ[b] lists (c, bytes at the traced batch size), c > b always.
  std::vector<std::vector<std::pair<int, int64_t>>> succ;
  int levels = 0;             // coarsening levels run
  int moves = 0;              // uncoarsening moves applied
};

// Groups the pieces of `atomic` into at most options.num_blocks convex blocks (more when
// memory forbids merging further). The block DAG is acyclic, so every block is convex and
// every interval of `blocks` is convex. Costs come from `costs` at options.rows.
BlockPartition partitionBlocks(const AtomicPartition& atomic, CostModel& costs,
                               const BlockOptions& options);

// Tasks of blocks [first, last), each once, in topological order.
std::vector<ir::TaskId> blockRangeTasks(const BlockPartition& blocks, int first, int last,
                                        const std::vector<int>& topo_pos);

}  // namespace rannc::partition
