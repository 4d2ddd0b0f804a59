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
The parameters outside any RaNNCModule add this rank's own norm, as torch's does.

[Note: the parameters meant] Once a RaNNCModule has trained on several ranks, every call
is a collective of every rank, whatever it is given: the ranks' lists differ where a loop
filters on `p.grad is not None` (fairseq's `[p for p in model.parameters() if p.grad is not
None]`, `get_total_norm([p.grad for p in layer.parameters() if p.grad is not None])`), since
a freed parameter has no gradient on the ranks that do not train it. So a rank whose list
named none of the module's parameters ran torch's function alone (a norm of 0) and the
others' collective paired with its next one (another layer's norm, 0.406 for 0.215 and
0.345, or "the ranks are in different RaNNCModule collectives"). Each rank sends a mask of
the module's trained parameters its list names and its terms of the gradients it counts
(each parameter on the first rank that trains it), in one all-reduce: the norm is over the
union of the masks, what every DDP rank measures from the same list.

A module that imported the function before rannc was (`from torch.nn.utils import
clip_grad_norm_` above `import rannc`) keeps torch's: RaNNCModule warns when the training
script holds it (`warn_early_imports`).
"""
from __future__ import annotations

import math
import sys

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


def _local_term(grads, norm_type: float) -> torch.Tensor:
    """sum |g|^p over `grads` (their max for the infinity norm) as a float64 on the host:
    one pass on their device and one copy (a GPU would stall on a .cpu() per gradient)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch.stack(torch._foreach_norm(grads, norm_type)).double().cpu()
    return norms.max() if math.isinf(norm_type) else (norms ** norm_type).sum()


def _combined(term: torch.Tensor, local: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of `term` (sum |g|^p over every stage, or their max) with this rank's
    `local` gradients."""
    mine = _local_term(local, norm_type)
    if math.isinf(norm_type):
        return torch.maximum(term, mine)
    return (term + mine) ** (1.0 / norm_type)


def _trained_modules() -> list:
    """The RaNNCModules that have trained, the same on every rank, oldest first."""
    return [m for m in registry.modules() if m._deployed.get(True) is not None]


def _norm_of_the_meant(modules: list, meant, local: list[torch.Tensor], norm_type: float,
                       what: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """[Note: the parameters meant] The norm over the trained parameters of `modules` that
    any rank's `meant(parameter)` names, and `local` on this rank (a collective of every
    rank, named `what`); with the gradients of those parameters this rank holds."""
    rank = _C.get_rank()
    entries = [entry for m in modules for entry in m.placement.trained_parameters()]
    n = len(entries)
    row = torch.zeros(2 * n, dtype=torch.float64)  # the mask, then each parameter's term
    counted, at = [], []
    for i, (t, trainers) in enumerate(entries):
        if meant(t):
            row[i] = 1.0
        if min(trainers) == rank and t.grad is not None:
            counted.append(t.grad.detach())
            at.append(n + i)
    if counted:  # one pass on the gradients' device and one copy
        norms = torch.stack(torch._foreach_norm(counted, norm_type)).double().cpu()
        row[at] = norms if math.isinf(norm_type) else norms ** norm_type
    handshake.exchange(what, torch.zeros(1))  # every rank is here ([Note: named collectives])
    if _C.get_world_size() > 1:
        _C.Communicator.world_cpu().all_reduce(row).wait()  # one rank's term per parameter
    union = row[:n] > 0
    terms = row[n:][union]
    if math.isinf(norm_type):
        term = terms.max() if terms.numel() else torch.zeros((), dtype=torch.float64)
    else:
        term = terms.sum()
    held = [t.grad for (t, trainers), u in zip(entries, union.tolist())
            if u and rank in trainers and t.grad is not None]
    return _combined(term, local, norm_type), held


def _outside(modules: list, meant, what: str) -> list[torch.Tensor]:
    """The gradients of `modules`' parameters that no stage uses and `meant` names, averaged
    over the ranks first, so the same on every rank ([Note: gradients made outside] in
    optimizer_share.py; before, clipping neither counted nor scaled them)."""
    from .optimizer_share import average_outside_gradients
    grads = []
    for m in modules:
        average_outside_gradients(m, what)
        grads += [p.grad for _, p in m.placement.unused_parameters()
                  if p.grad is not None and meant(p)]
    return grads


def clip_module_(module, max_norm: float, norm_type: float) -> torch.Tensor:
    """Clips every trained gradient of `module` by their norm over every stage (a
    collective): RaNNCModule.clip_grad_norm."""
    outside = _outside([module], lambda t: True, "clip_grad_norm")
    total, held = _norm_of_the_meant([module], lambda t: True, outside, norm_type,
                                     "clip_grad_norm")
    scale_(held + outside, max_norm, total)
    return total.float()


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
    # a module not trained yet: its gradients, if any, are the user's own
    modules = _trained_modules() if _C.get_world_size() > 1 else []
    if not modules:
        # one rank holds every gradient whole: torch's own, which waits for no GPU
        return _TORCH_CLIP(params, max_norm, norm_type, error_if_nonfinite, foreach)
    ids = {id(p) for p in params}
    theirs = {id(p) for m in modules for p in m.module.parameters()}
    others = [p.grad for p in params if id(p) not in theirs and p.grad is not None]
    others += _outside(modules, lambda t: id(t) in ids, "torch.nn.utils.clip_grad_norm_()")
    total, held = _norm_of_the_meant(modules, lambda t: id(t) in ids, others, norm_type,
                                     "torch.nn.utils.clip_grad_norm_()")
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
    modules = _trained_modules() if _C.get_world_size() > 1 else []
    if not modules:
        return _TORCH_TOTAL_NORM(tensors, norm_type, error_if_nonfinite, foreach)
    given = {id(t) for t in tensors}
    theirs = {id(p.grad) for m in modules for p in m.module.parameters() if p.grad is not None}
    norm_type = float(norm_type)
    total, _ = _norm_of_the_meant(
        modules, lambda t: t.grad is not None and id(t.grad) in given,
        [t for t in tensors if id(t) not in theirs], norm_type, "torch.nn.utils.get_total_norm()")
    if error_if_nonfinite and not math.isfinite(float(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is "
            "non-finite, so it cannot be clipped. To disable this error and scale the "
            "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`")
    device = next((t.device for t in tensors), total.device)
    return total.float().to(device)
