#pragma once
// Between the IR's dtypes and torch's scalar types, both ways.
#include <c10/core/ScalarType.h>

#include "ir/value.h"

namespace rannc::frontend {

inline ir::DType toDType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ir::DType::Float32;
    case at::kDouble: return ir::DType::Float64;
    case at::kHalf: return ir::DType::Float16;
    case at::kBFloat16: return ir::DType::BFloat16;
    case at::kLong: return ir::DType::Int64;
    case at::kInt: return ir::DType::Int32;
    case at::kShort: return ir::DType::Int16;
    case at::kChar: return ir::DType::Int8;
    case at::kByte: return ir::DType::UInt8;
    case at::kBool: return ir::DType::Bool;
    case at::kComplexFloat: return ir::DType::Complex64;
    case at::kComplexDouble: return ir::DType::Complex128;
    default: return ir::DType::Undefined;
  }
}

// Undefined maps to float (a value the trace never typed).
inline at::ScalarType toScalarType(ir::DType d) {
  switch (d) {
    case ir::DType::Float32: return at::kFloat;
    case ir::DType::Float64: return at::kDouble;
    case ir::DType::Float16: return at::kHalf;
    case ir::DType::BFloat16: return at::kBFloat16;
    case ir::DType::Int64: return at::kLong;
    case ir::DType::Int32: return at::kInt;
    case ir::DType::Int16: return at::kShort;
    case ir::DType::Int8: return at::kChar;
    case ir::DType::UInt8: return at::kByte;
    case ir::DType::Bool: return at::kBool;
    case ir::DType::Complex64: return at::kComplexFloat;
    case ir::DType::Complex128: return at::kComplexDouble;
    case ir::DType::Undefined: break;
  }
  return at::kFloat;
}

}  // namespace rannc::frontend
