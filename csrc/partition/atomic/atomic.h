#pragma once
// Atomic partitioning (RaNNC §III-A): one piece per non-constant task, with the constant
// tasks feeding it cloned into it, so no piece only produces constants and replicating a
// piece never replicates dead work.
#include <vector>

#include "ir/graph.h"

namespace rannc::partition {

// What counts as depending on the model. The paper seeds the forward pass with the model
// inputs only, so tasks on parameters alone (a transpose of a weight) are constant and get
// cloned; seeding with parameters and buffers too clones only tasks on baked-in constants,
// which keeps every parameter (and its gradient) in exactly one piece.
enum class ConstantPolicy {
  IndependentOfState,   // constant: reads no model input, parameter or buffer (default)
  IndependentOfInputs,  // constant: reads no model input (the paper)
};

struct AtomicPiece {
  ir::TaskId anchor = ir::kNoId;  // the non-constant task of the piece
  std::vector<ir::TaskId> tasks;  // anchor plus its cloned constant predecessors, topo order
};

struct AtomicPartition {
  std::vector<AtomicPiece> pieces;  // in topological order of the anchors
  std::vector<char> constant;       // per task: classified constant
  std::vector<int> piece_of;        // per task: the piece it anchors, -1 for constant tasks
  // Piece DAG: succ[p] lists (q, bytes at the traced batch size) for values flowing p -> q.
  std::vector<std::vector<std::pair<int, int64_t>>> succ;
  std::vector<std::vector<std::pair<int, int64_t>>> pred;
};

// Classifies tasks with `policy` and forms one piece per non-constant task. A constant task
// that no non-constant task consumes (it feeds only graph outputs) anchors its own piece,
// so every task lies in some piece. Throws InvalidGraphError on a cyclic graph.
AtomicPartition partitionAtomic(const ir::Graph& graph,
                                ConstantPolicy policy = ConstantPolicy::IndependentOfState);

}  // namespace rannc::partition
