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

// [Note: share scalars] A value computed from the batch that has no batch dimension (a
// mean over the rows, `e.pow(2).mean()` in an auxiliary loss, `mask.sum()`) is its share's
// value: each replica of a stage computes it over its own rows. Across a stage boundary it
// goes whole ([Note: row ownership] in runtime/layout.h), so a reader in a stage with other
// replica counts would read one replica's share as if it were its own (an auxiliary loss
// over half the rows, 0.2% to 12% off). So its producer and readers are one piece, with
// whatever lies on paths between them (a piece must stay convex): they share every stage,
// and the value never crosses a boundary. Sizes (shape values) are computed from each
// stage's own rows instead and join nothing.
struct AtomicPiece {
  ir::TaskId anchor = ir::kNoId;  // the first non-constant task of the piece
  // The non-constant tasks (one, or those joined by share scalars) plus their cloned
  // constant predecessors, in topological order.
  std::vector<ir::TaskId> tasks;
};

struct AtomicPartition {
  std::vector<AtomicPiece> pieces;  // in a topological order of the piece DAG
  std::vector<char> constant;       // per task: classified constant
  std::vector<int> piece_of;        // per task: the piece that holds it, -1 for constant tasks
  int joined = 0;                   // non-constant tasks joined into others' pieces
  // Piece DAG: succ[p] lists (q, bytes at the traced batch size) for values flowing p -> q.
  std::vector<std::vector<std::pair<int, int64_t>>> succ;
  std::vector<std::vector<std::pair<int, int64_t>>> pred;
};

// Classifies tasks with `policy` and forms one piece per non-constant task, joining those
// that share scalars ([Note: share scalars]). A constant task
// that no non-constant task consumes (it feeds only graph outputs) anchors its own piece,
// so every task lies in some piece. Throws InvalidGraphError on a cyclic graph.
AtomicPartition partitionAtomic(const ir::Graph& graph,
                                ConstantPolicy policy = ConstantPolicy::IndependentOfState);

}  // namespace rannc::partition
