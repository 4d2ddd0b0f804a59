#pragma once
// Values of the IR: tensors and the other IValues (ints, lists, constants) that flow
// between tasks. Plain data; no torch here.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace rannc::ir {

using ValueId = int32_t;
using TaskId = int32_t;
inline constexpr int32_t kNoId = -1;

enum class DType : uint8_t {
  Undefined, Float32, Float64, Float16, BFloat16, Int64, Int32, Int16, Int8, UInt8, Bool,
  Complex64, Complex128,
};

std::string_view dtypeName(DType dtype);
// Bytes per element (0 for Undefined).
int64_t dtypeSize(DType dtype);
// Float32, Float64, Float16, BFloat16: the dtypes that carry gradients (not complex).
bool isFloatingPoint(DType dtype);
// Floating point or complex: the dtypes autograd carries gradients in.
bool isDifferentiable(DType dtype);

enum class ValueKind : uint8_t {
  Tensor, Int, Float, Bool, String, None, Device, IntList, FloatList, BoolList, TensorList,
  Tuple, Other,
};

std::string_view valueKindName(ValueKind kind);

// Where a value comes from.
enum class ValueRole : uint8_t {
  Input,         // a tensor argument of the model (after flattening args and kwargs)
  Param,         // a parameter of the module
  Buffer,        // a buffer of the module (batch-norm statistics, say)
  Constant,      // a constant baked into the trace
  Intermediate,  // produced by a task
};

std::string_view valueRoleName(ValueRole role);

struct Value {
  ValueId id = kNoId;
  std::string name;
  ValueKind kind = ValueKind::Tensor;
  ValueRole role = ValueRole::Intermediate;
  DType dtype = DType::Undefined;
  std::vector<int64_t> shape;  // at the traced batch size; empty for scalars and non-tensors

  // [Note: batch values] A tensor carries the batch dimension when one of its dimensions
  // is batch_multiple * (batch size): found by propagation from the batch inputs and
  // confirmed by running the graph at a second batch size. Such a tensor can be cut into
  // row intervals of the batch; every other value is the same for every micro-batch.
  int32_t batch_dim = -1;
  int64_t batch_multiple = 0;
  // Depends on a batch input at all (sizes, batch-reduced scalars such as the loss too).
  bool batch_dependent = false;
  // A scalar output that reduces over the batch: the loss the backward starts from.
  bool is_loss = false;
  bool requires_grad = false;

  // [Note: shape values] Ints, int lists and 0-dim integer tensors (sizes and shapes) as
  // observed at the traced batch size, with per element the factor k when the element is
  // k * (batch size) at both observed sizes (0 when it is fixed). A stage that needs such a
  // value computes it from its own rows instead of receiving it. Empty for other values.
  std::vector<int64_t> int_values;
  std::vector<int64_t> int_batch_multiples;

  // The printed form of a constant (part of the content hash).
  std::string constant;

  TaskId producer = kNoId;
  std::vector<TaskId> consumers;

  bool isBatch() const { return batch_dim >= 0; }
  bool isTensor() const { return kind == ValueKind::Tensor; }
  // A tensor of one element: 0-dim, or [1] (a loss returned as loss.view(1), DataParallel's
  // habit), which a loss and the reading of reductions treat alike.
  bool isOneElementTensor() const {
    if (!isTensor()) return false;
    for (int64_t n : shape) {
      if (n != 1) return false;
    }
    return true;
  }
  bool isConstant() const { return role == ValueRole::Constant; }
  bool isModelState() const { return role == ValueRole::Param || role == ValueRole::Buffer; }
  int64_t numel() const;
  // Bytes of the tensor at the traced shape (0 for non-tensors).
  int64_t bytes() const;
};

// A short printed form: `name: Float32[8,?16,4]` where ? marks the batch dimension.
std::string describe(const Value& value);

}  // namespace rannc::ir
