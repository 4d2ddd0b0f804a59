#pragma once
// Precompiled header for the torch-facing modules: parsing torch's headers dominates
// build time on small machines, so they are parsed once.
#include <torch/extension.h>
#include <torch/csrc/jit/ir/ir.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/jit/runtime/operator.h>
