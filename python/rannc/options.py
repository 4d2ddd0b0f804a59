"""RaNNCModule's options: keyword arguments first, then RANNC_<NAME> environment variables,
then the defaults below. An unknown option is an error (docs/options.md lists them all)."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from . import _C

_SIZE = re.compile(r"^\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {None: 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> int:
    """16 * 2**30, "16GiB", "512MB" -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE.match(str(value))
    if not m:
        raise _C.Error(f"cannot read {value!r} as a size in bytes (say 16GiB, 512MB or 1000000)")
    unit = m.group(2).lower() if m.group(2) else None
    return int(float(m.group(1)) * _UNITS[unit])


# option precision -> the autocast dtype (None: the caller's autocast state)
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}


@dataclass
class Options:
    device_memory: int = 8 * 2**30     # bytes per device the plan must fit in
    memory_margin: float = 0.1         # fraction of device_memory kept free
    num_blocks: int = 32               # k of block partitioning
    num_stages: int = 0                # > 0: fix the number of pipeline stages
    num_microbatches: int = 0          # > 0: fix the number of micro-batches
    replicas: str = ""                 # with num_stages: replicas per stage, "2,1,1"
    recompute: str = "auto"            # "auto" (where memory needs it), "always", "never"
    schedule: str = "1f1b"             # training schedule: "1f1b" (seeded by the scalar loss)
                                       # or "fill_drain" (backward with gradients from outside)
    optimizer_kind: str = ""           # memory model: adam, sgd_momentum, sgd ("" = from the optimizer)
    save_plan: str = ""                # write the plan to this file
    load_plan: str = ""                # use the plan in this file (checked against the model)
    comm_timeout: float = 600.0        # seconds a rank waits for a peer before failing
    log_level: str = ""                # trace, debug, info, warn, error, off
    verify_plan: bool = True           # check every stage and task of the plan before deploying
    plan_tolerance: float = 0.02       # plans this close to the fastest are equal: the simplest wins
    cost_model: str = "profile"        # "profile" (measure pieces on the device) or "analytic" (shapes)
    profile_cache: str = ""            # load measured pieces from / save them to this file
    profile_warmup: int = 1            # untimed runs before measuring a piece
    profile_repetitions: int = 3       # timed runs per piece (the median is kept)
    device: str = "auto"               # where stages run: auto (the model's CUDA device, else
                                       # this rank's GPU if any, else cpu), cpu, cuda, cuda:N
    data_plane: str = "auto"           # CUDA stages: auto (NCCL if built with it, else MPI
                                       # through host memory), nccl, mpi
    precision: str = "fp32"            # fp32 (the caller's torch.autocast, if any), bf16, fp16
                                       # (as if every call ran under torch.autocast(dtype))

    @staticmethod
    def resolve(kwargs: dict, environ=os.environ) -> "Options":
        known = {f.name: f for f in fields(Options)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise _C.Error(f"unknown option(s) {', '.join(unknown)}; known options: "
                           f"{', '.join(sorted(known))}")
        opts = Options()
        for name, f in known.items():
            env = environ.get("RANNC_" + name.upper())
            raw = kwargs.get(name, env)
            if raw is None:
                continue
            setattr(opts, name, _convert(name, f.type, raw))
        if opts.replicas and not re.fullmatch(r"\d+(,\d+)*", opts.replicas.replace(" ", "")):
            raise _C.Error(f"option replicas is {opts.replicas!r}; expected counts per stage "
                           "such as \"2,1,1\" or [2, 1, 1]")
        if opts.cost_model not in ("profile", "analytic"):
            raise _C.Error(f"option cost_model is {opts.cost_model!r}; expected profile or analytic")
        if opts.schedule not in ("1f1b", "fill_drain"):
            raise _C.Error(f"option schedule is {opts.schedule!r}; expected 1f1b or fill_drain")
        if opts.data_plane not in ("auto", "nccl", "mpi"):
            raise _C.Error(f"option data_plane is {opts.data_plane!r}; expected auto, nccl or mpi")
        if opts.precision not in PRECISIONS:
            raise _C.Error(f"option precision is {opts.precision!r}; expected fp32, bf16 or fp16")
        if not 0.0 <= opts.plan_tolerance < 1.0:
            raise _C.Error(f"option plan_tolerance is {opts.plan_tolerance!r}; expected a fraction "
                           "in [0, 1) of the fastest plan's time (0.02: 2%)")
        if opts.recompute not in ("auto", "always", "never"):
            raise _C.Error(f"option recompute is {opts.recompute!r}; expected auto, always or never")
        return opts


def _convert(name, type_name, raw):
    try:
        if name == "device_memory":
            return parse_bytes(raw)
        if name == "replicas" and isinstance(raw, (list, tuple)):
            return ",".join(str(int(r)) for r in raw)
        if type_name in ("int", int):
            return int(raw)
        if type_name in ("float", float):
            return float(raw)
        if type_name in ("bool", bool):
            if isinstance(raw, str):
                return raw.strip().lower() in ("1", "true", "yes", "on")
            return bool(raw)
        return str(raw)
    except (TypeError, ValueError) as e:
        raise _C.Error(f"option {name}: cannot use {raw!r} ({e})") from None
