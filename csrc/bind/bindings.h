#pragma once
// The binding layer's pieces, each registering its part of rannc._C.
#include <torch/extension.h>

namespace rannc::bind {

void bindPlanner(pybind11::module& m);
void bindProfiler(pybind11::module& m);

}  // namespace rannc::bind
