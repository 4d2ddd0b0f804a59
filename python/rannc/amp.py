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

[Note: scaled seeds] Under 1F1B the step's backward runs inside the forward call,
seeded by the loss, before the user's `scaler.scale(loss).backward()`. Scaling only the
finished gradients afterwards would leave the fp16 activation gradients unscaled, and
small ones flush to zero, which loss scaling exists to prevent. So the forward reads the
scale of the newest enabled rannc.GradScaler and seeds the backward with it; the
backward call then multiplies by (its own seed) / (that scale), 1 when the scale did not
change in between, and the gradients come out scaled as PyTorch's do. torch's own
GradScaler is not seen at forward time: with fp16, use rannc.GradScaler.
"""
from __future__ import annotations

import weakref

import torch

from . import _C

# The rannc.GradScalers alive, oldest first (a dict keeps insertion order; one collected
# leaves it, and a new one that reuses its id goes to the end).
_SCALERS: "weakref.WeakValueDictionary[int, GradScaler]" = weakref.WeakValueDictionary()


def forward_loss_scale() -> float:
    """The factor a training forward seeds its backward with ([Note: scaled seeds]): the
    scale of the newest enabled rannc.GradScaler alive, else 1."""
    for scaler in reversed(list(_SCALERS.values())):
        if scaler.is_enabled():
            return float(scaler.get_scale())
    return 1.0


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler whose inf/NaN check covers every rank's gradients, and whose
    scale reaches the backward that runs inside a 1F1B forward ([Note: scaled seeds]).
    Every rank must call unscale_ (or step) once per step, as the collective agreement
    needs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _SCALERS[id(self)] = self

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
