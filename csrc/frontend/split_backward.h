#pragma once
// [Note: split backward] The backward of a run in two parts (ZB-H1, partition/sim/schedule.h).
// The input part computes only the gradients of the run's inputs (what the previous stage
// waits for) and keeps the graph; on the way it records the gradient arriving at each node
// where a path to a parameter leaves the paths to the inputs. The weight part later
// restarts the backward from those nodes, with their edges towards the inputs cut, so it
// computes only the parameters' gradients (accumulated into .grad as backward does) and
// repeats none of the input part. Where no input takes a gradient, the input part does
// nothing and the weight part is the whole backward.
//
// The runtime's stages run it (runtime/stage.h) and the profiler times it
// (profile/profiler.h), so the weight part the planner charges is the one that runs.
#include <memory>
#include <vector>

#include <ATen/ATen.h>

namespace rannc::frontend {

// What the weight part needs; holds the graph alive until it runs.
struct WeightPart;

// Runs the input part of the backward of `roots` seeded with `grads`: returns the gradient
// of each of `inputs` (undefined where an input is undefined, does not require grad or
// gets none) and sets `*weight` to what the weight part needs.
std::vector<at::Tensor> backwardInputPart(const std::vector<at::Tensor>& roots,
                                          const std::vector<at::Tensor>& grads,
                                          const std::vector<at::Tensor>& inputs,
                                          std::shared_ptr<WeightPart>* weight);

// Runs the weight part: the parameters' gradients, accumulated into .grad; frees the graph.
void backwardWeightPart(WeightPart& weight);

}  // namespace rannc::frontend
