#pragma once
// The memory a stage replica needs (DESIGN §5): parameters, their gradients and the
// optimizer state, buffers, and the activations stashed for the micro-batches in flight.
#include <cstdint>

#include "partition/cost/cost_model.h"

namespace rannc::partition {

// Bytes of a replica's state: parameters, their gradients and optimizer state, buffers,
// and `model_copies` copies of the parameters and buffers kept beside the model (an EMA,
// a reference model: [Note: copies of a wrapped model] in python/rannc/copies.py).
inline int64_t stateMemory(const PieceCost& cost, Optimizer optimizer, int model_copies = 0) {
  // the weights (and each copy's), then a gradient and the optimizer's state of the trained
  return cost.param_bytes * (1 + model_copies) + cost.trainedBytes() * (1 + optimizerStateFactor(optimizer)) +
         cost.buffer_bytes * (1 + model_copies);
}

// Peak bytes of a replica of a piece costing `cost` that keeps `in_flight` micro-batches
// stashed. With `recompute` only the inputs of each in-flight micro-batch are stashed and
// one micro-batch's activations are rebuilt at a time during its backward.
inline int64_t replicaMemory(const PieceCost& cost, Optimizer optimizer, int in_flight,
                             bool recompute, int model_copies = 0) {
  const int64_t state = stateMemory(cost, optimizer, model_copies);
  const int64_t stash = recompute ? in_flight * cost.input_bytes + cost.activation_bytes
                                  : in_flight * cost.activation_bytes;
  return state + stash;
}

}  // namespace rannc::partition
