#pragma once
// Running a traced model on another device than the one it was traced on.
//
// [Note: traced devices] A trace records devices as constants (`torch.arange(n,
// device=x.device)` becomes arange on a constant device) and tensors it captured as
// constant tensors, on the device the model was traced on. To run a piece on another
// device, those constants, and values kept from a run (a Device that crossed a piece
// boundary, tensors), are moved to it: every Device value becomes the target device, and
// every tensor too except 0-dim CPU ones that need no grad (CPU scalars mix with any
// device, and sizes turned into tensors stay on the CPU in a CUDA trace; a 0-dim CUDA
// constant, such as GPT-Neo's `torch.tensor(mask_value, device=...)`, mixes only with its
// own device, so it moves). A model that moves data
// to the CPU on purpose thus runs that work on the target device. The profiler and the
// pipeline's stages both run pieces this way, so what is measured is what runs.
#include <memory>

#include <ATen/core/ivalue.h>

#include "frontend/traced_model.h"

namespace rannc::frontend {

// `model` with its constant devices and tensors on `device`; `model` itself when nothing
// had to move, else a copy (the original is unchanged).
std::shared_ptr<const TracedModel> onDevice(std::shared_ptr<const TracedModel> model,
                                            const c10::Device& device);

// `value` on `device` by the rule above (a leaf that required grad stays one).
c10::IValue toDevice(const c10::IValue& value, const c10::Device& device);

}  // namespace rannc::frontend
