"""Gradient clipping by the norm over every stage, for RaNNCModule.clip_grad_norm and for
torch's own torch.nn.utils.clip_grad_norm_.

[Note: torch's clip_grad_norm_] Training loops clip with
`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`, and so do the loops users
do not write themselves (transformers' Trainer through accelerate, Lightning, timm). Under
rannc each rank holds the gradients of its own stages only, so torch's function would
measure each stage's norm and clip each stage by its own: a different model from plain
PyTorch's, without a word. `import rannc` therefore replaces torch's function with one that
does what it does for any parameter outside a RaNNCModule, and for those of a RaNNCModule
that has trained measures the norm over every stage (each parameter counted once, on the
first rank of its gradient group, one all-reduce) and scales this rank's gradients by it.
Every rank passes the same parameters (freed ones included: they are the same objects on
every rank), so every rank sees the same modules and joins the same collective. The
parameters outside any RaNNCModule add this rank's own norm, as torch's does.

A module that imported the function before rannc was (`from torch.nn.utils import
clip_grad_norm_` above `import rannc`) keeps torch's: RaNNCModule warns when the training
script holds it (`warn_early_imports`).
"""
from __future__ import annotations

import math
import sys
import zlib

import torch

from . import _C, handshake, registry
from .optimizer_share import GroupShare

_TORCH_CLIP = torch.nn.utils.clip_grad.clip_grad_norm_
_TORCH_TOTAL_NORM = getattr(torch.nn.utils, "get_total_norm", None)  # torch >= 2.6


def install() -> None:
    """Puts clip_grad_norm_ and get_total_norm where torch's callers look them up."""
    torch.nn.utils.clip_grad_norm_ = clip_grad_norm_
    torch.nn.utils.clip_grad.clip_grad_norm_ = clip_grad_norm_  # torch's deprecated alias calls it
    if _TORCH_TOTAL_NORM is not None:
        torch.nn.utils.get_total_norm = get_total_norm


def warn_early_imports() -> None:
    """Rank 0 warns when the training script bound torch's clip_grad_norm_ before
    `import rannc` replaced it: that name would clip each stage by its own norm."""
    if _C.get_rank() != 0:
        return
    main = sys.modules.get("__main__")
    names = [n for n, v in vars(main).items() if v is _TORCH_CLIP] if main is not None else []
    if names:
        _C.log_warn(f"{main.__file__ if hasattr(main, '__file__') else '__main__'} imported torch's "
                    f"clip_grad_norm_ as {names[0]!r} before `import rannc`: it would clip each "
                    "stage by its own gradients' norm, not the model's; import rannc first (or "
                    "call torch.nn.utils.clip_grad_norm_, or model.clip_grad_norm)")


def counted_grads(module, selected: set[int] | None = None) -> list[torch.Tensor]:
    """The gradients this rank counts in the norm over every stage: each trained parameter
    on the first rank that trains it (replicas and stages sharing it hold the same sum),
    restricted to the parameter objects in `selected` when given."""
    rank = _C.get_rank()
    return [t.grad.detach() for t, trainers in module.placement.trained_parameters()
            if min(trainers) == rank and t.grad is not None
            and (selected is None or id(t) in selected)]


def held_grads(module, selected: set[int] | None = None) -> list[torch.Tensor]:
    """The gradients of the trained parameters this rank holds (each once)."""
    rank = _C.get_rank()
    return [t.grad for t, trainers in module.placement.trained_parameters()
            if rank in trainers and t.grad is not None
            and (selected is None or id(t) in selected)]


def _local_term(grads, norm_type: float) -> torch.Tensor:
    """sum |g|^p over `grads` (their max for the infinity norm) as a float64 on the host:
    one pass on their device and one copy (a GPU would stall on a .cpu() per gradient)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(grads, norm_type)).double().cpu()
    return norms.max() if math.isinf(norm_type) else (norms ** norm_type).sum()


def global_norm(counted: list[torch.Tensor], local: list[torch.Tensor],
                norm_type: float, over: str = "") -> torch.Tensor:
    """The norm over `counted` on every rank (a collective) and `local` on this rank.
    `over` names the parameters meant, the same on every rank that means the same ones."""
    infinite = math.isinf(norm_type)
    # one all-gather that also checks every rank is here and means the same parameters
    # ([Note: named collectives], [Note: clipping a param group])
    what = f"clip_grad_norm over {over}" if over else "clip_grad_norm"
    terms = handshake.exchange(what, _local_term(counted, norm_type).view(1))[:, 0]
    term = terms.max() if infinite else terms.sum()
    mine = _local_term(local, norm_type)
    if infinite:
        return torch.maximum(term, mine)
    return (term + mine) ** (1.0 / norm_type)


def _which(own: list[torch.Tensor], mine: set[int], name: str) -> str:
    """Names the parameters `mine` among a module's `own` alike on every rank (the objects
    are the same everywhere): how many, and a checksum of their positions."""
    if len(mine) == len(own):
        return f"every parameter of {name}"
    positions = ",".join(str(i) for i, p in enumerate(own) if id(p) in mine)
    return f"{len(mine)} of {name}'s parameters (#{zlib.crc32(positions.encode()):08x})"


def scale_(grads, max_norm: float, total: torch.Tensor) -> None:
    """Scales `grads` by max_norm / total where that is below 1, as torch does."""
    coef = max_norm / (float(total) + 1e-6)
    if not coef >= 1 and grads:  # a NaN norm makes NaN gradients, as torch's does
        torch._foreach_mul_(grads, coef)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_, with the norm of a RaNNCModule's parameters taken
    over every stage ([Note: torch's clip_grad_norm_]). A collective when any of
    `parameters` belongs to a RaNNCModule that has trained."""
    if isinstance(parameters, GroupShare):
        parameters = parameters.whole  # [Note: clipping a param group]
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    norm_type = float(norm_type)
    ids = {id(p) for p in params}
    counted, held, claimed, over = [], [], set(), []
    for module in registry.modules():
        if module._deployed.get(True) is None:
            continue  # not trained yet: its gradients, if any, are the user's own
        own = list(module.module.parameters())
        mine = {id(p) for p in own} & ids
        if mine:
            counted += counted_grads(module, mine)
            held += held_grads(module, mine)
            claimed |= mine
            over.append(_which(own, mine, type(module.module).__name__))
    if not claimed or _C.get_world_size() == 1:
        # one rank holds every gradient whole: torch's own, which waits for no GPU
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    others = [p.grad for p in params if id(p) not in claimed and p.grad is not None]
    total = global_norm(counted, others, norm_type, ", ".join(over))
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    scale_(held + others, max_norm, total)
    device = (held + others)[0].device if held or others else total.device
    return total.float().to(device)


# [Note: torch's get_total_norm] torch >= 2.6 splits clip_grad_norm_ into
# `total = get_total_norm([p.grad for p in params])` and
# `clip_grads_with_norm_(params, max_norm, total)` (for a norm to log, or a clip of one's
# own). Each rank holds its stages' gradients, so torch's get_total_norm gave the norm of
# this rank's stages (0.107 for 0.161 on 2 stages), and the clip scaled each stage by its
# own, without a word. Here the gradients of a trained RaNNCModule's parameters among
# `tensors` count over every stage (each parameter once, one collective, as in
# clip_grad_norm_), and the others this rank's. clip_grads_with_norm_ scales by the total it
# is given, so torch's is right as it is. A norm written by hand over `p.grad` still
# measures this rank's stages only (docs/api.md).
@torch.no_grad()
def get_total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                   foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.get_total_norm, with the gradients of a RaNNCModule's parameters
    counted over every stage ([Note: torch's get_total_norm]). A collective when any of
    `tensors` is the gradient of a parameter of a RaNNCModule that has trained."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    given = {id(t) for t in tensors}
    counted, claimed = [], set()
    if _C.get_world_size() > 1:
        for module in registry.modules():
            if module._deployed.get(True) is None:
                continue
            mine = {id(p) for p in module.module.parameters()
                    if p.grad is not None and id(p.grad) in given}
            if mine:
                counted += counted_grads(module, mine)
                claimed |= {id(p.grad) for p in module.module.parameters() if id(p) in mine}
    if not claimed:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    total = global_norm(counted, [t for t in tensors if id(t) not in claimed], norm_type)
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    return total.float().to(tensors[0].device)
