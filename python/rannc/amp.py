"""Loss scaling for mixed precision across the stages: rannc.GradScaler.

[Note: agreed steps] torch.amp.GradScaler checks the gradients its optimizer holds for
inf/NaN and skips the step where it finds one. Under rannc each rank's optimizer holds
only its stage's parameters, so an overflow on one stage would skip the step there and
apply it everywhere else, and the ranks' scales would drift apart. rannc.GradScaler sums
the found-inf flags of every rank before anyone steps: either every rank skips the step
(and halves its scale) or none does.

    scaler = rannc.GradScaler("cuda")        # the interface of torch.amp.GradScaler
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer); model.clip_grad_norm(1.0)   # optional, as in PyTorch
    scaler.step(optimizer); scaler.update()
"""
from __future__ import annotations

import torch

from . import _C


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/NaN check covers every rank's gradients. Every rank
    must call unscale_ (or step) once per step, as the collective agreement needs."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        flags = torch.tensor([sum(float(v.item()) for v in per_device.values())],
                             dtype=torch.float64)
        if _C.mpi_initialized() and _C.get_world_size() > 1:
            _C.Communicator.world_cpu().all_reduce(flags).wait()
        if not per_device:  # no gradient here: the verdict still counts for update()
            per_device = {found_inf.device: found_inf}
        for v in per_device.values():
            v.fill_(1.0 if flags.item() else 0.0)
        return per_device
