"""What the optimizer step costs per parameter byte, for the planner's
`update_seconds_per_byte`: every replica of a stage runs the step over the stage's
parameters after the gradient all-reduce, so it adds to the iteration in full (on CPU it
was ~2% of a small GPT's step; for Adam on big models it is a memory-bound pass over four
to seven times the parameter bytes).

Timed with the user's optimizer type and hyperparameters on scratch copies of (a sample
of) the model's parameters, on the device the pieces are profiled on. The model, the
optimizer and torch's random streams are left untouched.
"""
from __future__ import annotations

import statistics
import time

import torch

# Enough bytes that the per-tensor overhead and the memory traffic are both seen in the
# model's own mix of tensor sizes; small enough to take well under a second.
SAMPLE_BYTES = 32 << 20

_BY_KIND = {
    "adam": lambda ps: torch.optim.Adam(ps),
    "adamw": lambda ps: torch.optim.AdamW(ps),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.01),
}

_MEASURED = {}


def _sample(params, device) -> list:
    """Scratch tensors shaped like the model's parameters, in order, up to SAMPLE_BYTES."""
    out, total = [], 0
    for p in params:
        if total >= SAMPLE_BYTES:
            break
        t = torch.full(p.shape, 0.5, dtype=p.dtype, device=device, requires_grad=True)
        t.grad = torch.full_like(t, 1e-3)
        out.append(t)
        total += t.numel() * t.element_size()
    return out


def _make_optimizer(optimizer, kind: str, scratch):
    """The user's optimizer type and settings over `scratch`; the kind's torch optimizer
    when there is no optimizer or its type cannot be built from its defaults alone."""
    if optimizer is not None:
        try:
            return type(optimizer)(scratch, **dict(optimizer.defaults))
        except Exception:  # a custom optimizer with required arguments: time its kind
            pass
    return _BY_KIND.get(kind, _BY_KIND["adam"])(scratch)


def measure_update_rate(params, optimizer=None, kind: str = "adam", device="cpu",
                        repeats: int = 5) -> float:
    """Seconds per parameter byte of one optimizer step (the median of `repeats` steps
    after two that create the state). `params`: the model's trainable parameters;
    `optimizer`: the user's optimizer (its type and defaults are used) or None for `kind`
    (adam, adamw, sgd_momentum, sgd). 0.0 when there are no parameters."""
    params = [p for p in params if p.requires_grad and p.numel()]  # shapes and dtypes only
    # Once per process and setting, like the profiles: a second plan of the same model
    # gets the same rate, hence the same plan.
    key = (type(optimizer).__name__ if optimizer is not None else kind,
           repr(sorted((optimizer.defaults if optimizer is not None else {}).items())),
           str(device), tuple((tuple(p.shape), p.dtype) for p in params[:256]))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(params, optimizer, kind, device, repeats)
    return _MEASURED[key]


def _measure(params, optimizer, kind, device, repeats) -> float:
    with torch.no_grad():
        scratch = _sample(params, device)
    if not scratch:
        return 0.0
    sample_bytes = sum(t.numel() * t.element_size() for t in scratch)
    opt = _make_optimizer(optimizer, kind, scratch)
    try:
        seconds = _timed_step(opt, device, repeats)
    except Exception:
        # a step that needs what only the loop has (SAM's or LBFGS's closure that recomputes
        # the loss, a custom step's arguments): time the kind's torch optimizer instead
        with torch.no_grad():
            scratch = _sample(params, device)
        seconds = _timed_step(_BY_KIND.get(kind, _BY_KIND["adam"])(scratch), device, repeats)
    return seconds / sample_bytes


def _timed_step(opt, device, repeats: int) -> float:
    """The median seconds of `repeats` steps of `opt` after two that create its state."""
    cuda = torch.device(device).type == "cuda"
    times = []
    for i in range(2 + repeats):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.step()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
