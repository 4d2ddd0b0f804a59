#pragma once
// The binding layer's pieces, each registering its part of rannc._C.
#include <string>

#include <torch/extension.h>

#include "partition/cost/cost_model.h"
#include "partition/sim/schedule.h"

namespace rannc::bind {

void bindPlanner(pybind11::module& m);
void bindProfiler(pybind11::module& m);
void bindRuntime(pybind11::module& m);

// Names Python uses: "adam"/"adamw", "sgd_momentum", "sgd"; "1f1b", "fill_drain".
// Throw rannc::Error naming the accepted names.
partition::Optimizer optimizerFromName(const std::string& name);
partition::ScheduleKind scheduleFromName(const std::string& name);

}  // namespace rannc::bind
