#include "frontend/placement.h"

namespace rannc::frontend {
namespace {

// [Note: traced devices] (placement.h)
bool moves(const at::Tensor& t, const c10::Device& device) {
  return t.defined() && t.device() != device && (t.dim() > 0 || t.requires_grad() || !t.is_cpu());
}

bool moves(const c10::IValue& v, const c10::Device& device) {
  if (v.isDevice()) return v.toDevice() != device;
  if (v.isTensor()) return moves(v.toTensor(), device);
  if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorVector()) {
      if (moves(t, device)) return true;
    }
  }
  return false;
}

at::Tensor moved(const at::Tensor& t, const c10::Device& device) {
  return moves(t, device) ? t.detach().to(device).requires_grad_(t.requires_grad()) : t;
}

}  // namespace

c10::IValue toDevice(const c10::IValue& value, const c10::Device& device) {
  if (!moves(value, device)) return value;
  if (value.isDevice()) return c10::IValue(device);
  if (value.isTensor()) return moved(value.toTensor(), device);
  if (value.isTensorList()) {
    std::vector<at::Tensor> ts;
    for (const at::Tensor& t : value.toTensorVector()) ts.push_back(moved(t, device));
    return c10::IValue(ts);
  }
  return value;
}

std::shared_ptr<const TracedModel> onDevice(std::shared_ptr<const TracedModel> model,
                                            const c10::Device& device) {
  std::vector<c10::IValue> constants = model->constants;
  bool changed = false;
  for (c10::IValue& c : constants) {
    if (!moves(c, device)) continue;
    c = toDevice(c, device);
    changed = true;
  }
  if (!changed) return model;
  auto copy = std::make_shared<TracedModel>(*model);
  copy->constants = std::move(constants);
  return copy;
}

}  // namespace rannc::frontend
