#pragma once
// Code that ran under torch.no_grad() inside the model's forward, made explicit.
//
// [Note: no_grad in forward] A teacher evaluated inside the model (distillation, BYOL,
// mean teacher: `with torch.no_grad(): t = self.teacher(x)`) or a buffer updated in
// forward (DINO's center, a VQ-VAE's EMA codebook: `with torch.no_grad():
// self.center.mul_(0.9).add_(h.mean(0), alpha=0.1)`) relies on grad mode, which
// torch.jit.trace does not record: the stages, which run in grad mode, trained the teacher
// and built autograd history into the buffer ("backward through the graph a second time"
// at the next step). The trace's tensor types do record what each value's requires_grad
// was: an op that read a value requiring grad yet made floating outputs that do not ran
// with grad disabled (or is an op without a gradient, such as zeros_like, for which the
// same holds). Its inputs that require grad are read through aten::detach, which gives the
// op exactly the autograd behaviour it had when traced, in place (the buffer's add_) as
// well as out of place.
#include <memory>

#include <torch/csrc/jit/ir/ir.h>

namespace rannc::frontend {

// Detaches the inputs that require grad of every op of `graph` that ran with grad disabled
// when traced. Returns the number of such ops.
int detachNoGradInputs(const std::shared_ptr<torch::jit::Graph>& graph);

}  // namespace rannc::frontend
