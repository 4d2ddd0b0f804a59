"""Loss scaling for mixed precision across the stages: torch.amp.GradScaler (and
rannc.GradScaler, the same class under rannc's name).

[Note: agreed steps] torch.amp.GradScaler checks the gradients its optimizer holds for
inf/NaN and skips the step where it finds one. Under rannc each rank's optimizer holds
only its stage's parameters, so an overflow on one stage would skip the step there and
apply it everywhere else, and the ranks' scales would drift apart. `import rannc` makes
the scaler sum the found-inf flags of every rank before anyone steps an optimizer that
holds a RaNNCModule's parameters: either every rank skips the step (and halves its
scale) or none does. Every rank decides alike (the parameters are the same objects on
every rank), so every rank joins the all-reduce. Other optimizers keep torch's check.

    scaler = torch.amp.GradScaler("cuda")     # or rannc.GradScaler: the same
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x, y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer); torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer); scaler.update()

[Note: scaled seeds] Under 1F1B the step's backward runs inside the forward call,
seeded by the loss, before the user's `scaler.scale(loss).backward()`. Scaling only the
finished gradients afterwards would leave the fp16 activation gradients unscaled, and
small ones flush to zero, which loss scaling exists to prevent. So the forward reads the
scale of the GradScaler that unscaled its optimizer last (at the first step, the newest
enabled GradScaler made after `import rannc`) and seeds the backward
with it; the backward call then multiplies by (its own seed) / (that scale), 1 when the
scale did not change in between, and the gradients come out scaled as PyTorch's do.
"""
from __future__ import annotations

import weakref

import torch

from . import handshake, registry

# The GradScalers made since `import rannc` and alive, oldest first (a dict keeps insertion
# order; one collected leaves it, and a new one that reuses its id goes to the end).
_SCALERS: "weakref.WeakValueDictionary[int, torch.amp.GradScaler]" = weakref.WeakValueDictionary()


def forward_loss_scale(module=None) -> float | torch.Tensor:
    """The factor a training forward of `module` seeds its backward with ([Note: scaled
    seeds]): the scale of the GradScaler that last unscaled an optimizer of the module's
    parameters, where it is alive and enabled, else of the newest enabled GradScaler
    alive, else 1. (A loop with a second scaler for another model, a GAN's or an auxiliary
    one, seeded the module's backward with the other's scale: steps skipped that PyTorch
    took.) Once the scaler has its scale tensor, a copy of it on its device: get_scale()
    would read it on the host, waiting for the GPU's queue to drain once per step."""
    own = getattr(module, "_loss_scaler", None)
    own = own() if own is not None else None
    candidates = ([own] if own is not None else []) + list(reversed(list(_SCALERS.values())))
    for scaler in candidates:
        if scaler.is_enabled():
            scale = getattr(scaler, "_scale", None)
            return scale.detach().clone() if scale is not None else float(scaler.get_scale())
    return 1.0


def _agreed_unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
    """torch's _unscale_grads_, whose found-inf verdict every rank shares when `optimizer`
    holds a RaNNCModule's parameters ([Note: agreed steps])."""
    per_device = _TORCH_UNSCALE(self, optimizer, inv_scale, found_inf, allow_fp16)
    owners = registry.owners(optimizer)
    for module in owners:  # the module's own scaler from now on ([Note: scaled seeds])
        module._loss_scaler = weakref.ref(self)
    if not (handshake.active() and owners):
        return per_device
    flags = torch.tensor([sum(float(v.item()) for v in per_device.values())],
                         dtype=torch.float64)
    flags = handshake.exchange("GradScaler.unscale_()", flags).sum()  # [Note: named collectives]
    if not per_device:  # no gradient here: the verdict still counts for update()
        per_device = {found_inf.device: found_inf}
    for v in per_device.values():
        v.fill_(1.0 if flags.item() else 0.0)
    return per_device


def _registered_init(self, *args, **kwargs):
    _TORCH_INIT(self, *args, **kwargs)
    _SCALERS[id(self)] = self


_TORCH_INIT = torch.amp.GradScaler.__init__
_TORCH_UNSCALE = torch.amp.GradScaler._unscale_grads_


def install() -> None:
    """Makes torch.amp.GradScaler (and its subclasses: torch.cuda.amp's, rannc's) agree
    across the ranks and seed 1F1B backwards ([Note: agreed steps], [Note: scaled seeds])."""
    torch.amp.GradScaler.__init__ = _registered_init
    torch.amp.GradScaler._unscale_grads_ = _agreed_unscale_grads_


class GradScaler(torch.amp.GradScaler):
    """torch.amp.GradScaler under rannc's name: after `import rannc` torch's own agrees on
    overflow across the ranks and seeds the backward that runs inside a 1F1B forward
    ([Note: agreed steps], [Note: scaled seeds]). Every rank must call unscale_ (or step)
    once per step, as the collective agreement needs."""
