#pragma once
// Pieces of a graph: a set of tasks with the values that cross its boundary.
// A piece can be run on its own only if it is convex: no path leaves it and re-enters.
#include <cstdint>
#include <vector>

#include "ir/graph.h"

namespace rannc::ir {

struct Subgraph {
  std::vector<TaskId> tasks;     // in the graph's topological order
  std::vector<ValueId> inputs;   // consumed but not produced inside (incl. params, constants)
  std::vector<ValueId> outputs;  // produced inside and used outside or by the graph outputs
};

// True when no path from a task of the set through a task outside it returns to the set.
bool isConvex(const Graph& graph, const std::vector<TaskId>& tasks);

// The piece made of `tasks`; throws InvalidGraphError (naming an offending task) if the
// set is not convex, empty of known ids, or holds an id twice.
Subgraph extractSubgraph(const Graph& graph, const std::vector<TaskId>& tasks);

// Content hash of a piece, independent of ids and of where it sits in the graph: two
// identical layers hash alike (the profile cache relies on this).
uint64_t contentHash(const Graph& graph, const Subgraph& piece);

// Cuts the graph into k convex pieces, contiguous in the topological order, with task
// counts as even as possible; a cut moves later where a list or tuple that carries
// gradients would cross it (a stage boundary passes tensors one by one). Throws
// InvalidGraphError if k < 1 or k > number of tasks.
std::vector<Subgraph> splitTopological(const Graph& graph, int k);

}  // namespace rannc::ir
