#pragma once
// A traced model: our IR graph side by side with the TorchScript graph it came from.
// The IR is what the partitioner reasons about; the TorchScript nodes are what the
// interpreter executes (each IR task keeps its node and its resolved operator).
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/runtime/operator.h>

#include "ir/graph.h"

namespace rannc::frontend {

struct TokenMeanLosses;  // token_means.h

struct TracedModel {
  ir::Graph graph;
  std::shared_ptr<torch::jit::Graph> jit_graph;
  std::vector<torch::jit::Node*> task_nodes;      // task id -> TorchScript node
  // task id -> resolved operator (mutable: calling an Operation is not const)
  mutable std::vector<torch::jit::Operation> operations;
  std::vector<c10::IValue> constants;             // value id -> value (constants only)
  std::vector<ir::TaskId> order;                  // a topological order of the tasks
  // Module path -> class name, to name modules in messages ("encoder.layers.3 (Block)").
  std::unordered_map<std::string, std::string> module_classes;
  // [Note: rows paired] The ops that make a value with the batch in two of its dimensions
  // (`z1 @ z2.T` of an in-batch contrastive loss, `cdist(x, x)`): each of its entries pairs
  // two rows of the batch, so a share of the rows (a micro-batch, a replica's rows) computes
  // something else than the whole: a contrastive loss over a micro-batch has fewer
  // negatives. The planner then runs one micro-batch per step, so that each replica of a
  // stage pairs all the rows it holds, as DistributedDataParallel's ranks do
  // ([Note: rows coupled] in planning.py); "op aten::mm in module '<root>' (Clip) at model.py:12".
  std::vector<std::string> pairing_ops;
  // The tasks holding those ops (after gluing): where the rows are paired, which the
  // planner keeps on one replica of one pipeline copy ([Note: rows kept together] in
  // partition/stage/stage_cost.h).
  std::vector<ir::TaskId> pairing_tasks;
  // TorchScript node -> the task that runs it
  std::unordered_map<const torch::jit::Node*, ir::TaskId> task_of_node;
  // Set by tokenMeanLosses() on its first call, which wraps those losses' operations.
  mutable std::shared_ptr<const TokenMeanLosses> token_means;

  // "op aten::view in module 'encoder.layers.3' (Block) at model.py:42"
  std::string describeTask(ir::TaskId task) const;
};

}  // namespace rannc::frontend
