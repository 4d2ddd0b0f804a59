#include "ir/value.h"

#include <sstream>

namespace rannc::ir {

std::string_view dtypeName(DType dtype) {
  switch (dtype) {
    case DType::Undefined: return "Undefined";
    case DType::Float32: return "Float32";
    case DType::Float64: return "Float64";
    case DType::Float16: return "Float16";
    case DType::BFloat16: return "BFloat16";
    case DType::Int64: return "Int64";
    case DType::Int32: return "Int32";
    case DType::Int16: return "Int16";
    case DType::Int8: return "Int8";
    case DType::UInt8: return "UInt8";
    case DType::Bool: return "Bool";
    case DType::Complex64: return "Complex64";
    case DType::Complex128: return "Complex128";
  }
  return "?";
}

bool isFloatingPoint(DType dtype) {
  return dtype == DType::Float32 || dtype == DType::Float64 || dtype == DType::Float16 ||
         dtype == DType::BFloat16;
}

bool isDifferentiable(DType dtype) {
  return isFloatingPoint(dtype) || dtype == DType::Complex64 || dtype == DType::Complex128;
}

int64_t dtypeSize(DType dtype) {
  switch (dtype) {
    case DType::Undefined: return 0;
    case DType::Float32: case DType::Int32: return 4;
    case DType::Float64: case DType::Int64: case DType::Complex64: return 8;
    case DType::Float16: case DType::BFloat16: case DType::Int16: return 2;
    case DType::Int8: case DType::UInt8: case DType::Bool: return 1;
    case DType::Complex128: return 16;
  }
  return 0;
}

std::string_view valueKindName(ValueKind kind) {
  switch (kind) {
    case ValueKind::Tensor: return "Tensor";
    case ValueKind::Int: return "int";
    case ValueKind::Float: return "float";
    case ValueKind::Bool: return "bool";
    case ValueKind::String: return "str";
    case ValueKind::None: return "None";
    case ValueKind::Device: return "Device";
    case ValueKind::IntList: return "int[]";
    case ValueKind::FloatList: return "float[]";
    case ValueKind::BoolList: return "bool[]";
    case ValueKind::TensorList: return "Tensor[]";
    case ValueKind::Tuple: return "tuple";
    case ValueKind::Other: return "other";
  }
  return "?";
}

std::string_view valueRoleName(ValueRole role) {
  switch (role) {
    case ValueRole::Input: return "input";
    case ValueRole::Param: return "param";
    case ValueRole::Buffer: return "buffer";
    case ValueRole::Constant: return "constant";
    case ValueRole::Intermediate: return "intermediate";
  }
  return "?";
}

int64_t Value::numel() const {
  if (kind != ValueKind::Tensor) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t Value::bytes() const { return numel() * dtypeSize(dtype); }

std::string describe(const Value& value) {
  std::ostringstream os;
  os << (value.name.empty() ? "%" + std::to_string(value.id) : value.name) << ": ";
  if (value.kind != ValueKind::Tensor) {
    os << valueKindName(value.kind);
    if (value.isConstant()) os << " = " << value.constant;
    return os.str();
  }
  os << dtypeName(value.dtype) << "[";
  for (size_t i = 0; i < value.shape.size(); ++i) {
    if (i) os << ",";
    if (static_cast<int32_t>(i) == value.batch_dim) os << "?";
    os << value.shape[i];
  }
  os << "]";
  if (value.is_loss) os << " loss";
  return os.str();
}

}  // namespace rannc::ir
