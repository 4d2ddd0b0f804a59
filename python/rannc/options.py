"""rannc's options: one table for RaNNCModule and rannc.plan.

RaNNCModule reads each option from its keyword argument, then from the environment variable
RANNC_<NAME>, then the default below; rannc.plan from its keyword arguments. An unknown
option, or one that only the other entry point takes, is an error naming it. The planner's
and profiler's options reach C++ as one object each (`planner_options`, `profiler_options`),
under the names the user writes, and the planner checks them there (partition::checkOptions):
one set of checks, one set of messages (docs/options.md lists them all).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields

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


def format_bytes(n: int) -> str:
    """Bytes for people: 3195086 -> "3.0 MiB" (the inverse of parse_bytes)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"


def _replicas(value) -> str:
    """"2,1,1" or [2, 1, 1] -> "2,1,1"."""
    if isinstance(value, (list, tuple)):
        return ",".join(str(int(r)) for r in value)
    text = str(value).replace(" ", "")
    if text and not re.fullmatch(r"\d+(,\d+)*", text):
        raise ValueError("expected counts per stage such as \"2,1,1\" or [2, 1, 1]")
    return text


def _pad_values(value):
    """"transformers", a dict {argument: pad value} or its JSON text -> that; "" -> None."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if value == "transformers":
            return value
        import json
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError("expected \"transformers\" or a dict of argument names to pad "
                             "values such as {\"input_ids\": 0, \"labels\": -100}") from None
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float, bool)) for k, v in value.items()):
        raise ValueError("expected \"transformers\" or a dict of argument names to pad values "
                         "(numbers)")
    return dict(value)


def _at_least_one(value) -> int:
    if int(value) < 1:
        raise ValueError("expected at least 1")
    return int(value)


def _bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _optional(convert):
    return lambda value: None if value is None or value in ("", "none", "None") else convert(value)


# option precision -> the autocast dtype (None: the caller's autocast state)
PRECISIONS = {"fp32": None, "bf16": "bfloat16", "fp16": "float16"}

MODULE, PLAN, BOTH = "RaNNCModule", "rannc.plan", "both"


def _option(default, meaning: str, *, where: str = BOTH, convert=None, choices=()):
    """A field of Options: its default, what it means, which entry point takes it, how a
    keyword or environment value becomes its value, and, for a string naming one of a
    few choices that C++ does not check, those choices."""
    if convert is None:
        convert = {bool: _bool, int: int, float: float, str: str}[type(default)]
    return field(default=default, metadata={"meaning": meaning, "where": where,
                                            "convert": convert, "choices": choices})


@dataclass
class Options:
    # memory
    device_memory: int = _option(0, "bytes per device the plan must fit in (16GiB, 512MB or a number); "
                                 "0: a GPU's memory shared by the ranks on it, 8GiB on the CPU",
                                 convert=parse_bytes)
    memory_margin: float = _option(0.1, "fraction of device_memory kept free")
    model_copies: int = _option(0, "copies of the parameters and buffers kept beside the model "
                                "(an EMA, a reference model) that each stage's memory counts; "
                                "RaNNCModule counts at least the copies made before its first "
                                "call")
    # the search
    num_blocks: int = _option(32, "k of block partitioning")
    num_stages: int = _option(0, "> 0: fix the number of pipeline stages")
    num_microbatches: int = _option(0, "> 0: fix the number of micro-batches")
    replicas: str = _option("", "with num_stages: replicas per stage of one pipeline copy, \"2,1,1\"",
                            convert=_replicas)
    max_microbatches: int = _option(64, "upper end of the micro-batch search")
    recompute: str = _option("auto", "auto (where memory needs it), always (every stage) or never")
    schedule: str = _option("1f1b", "1f1b (seeded by the scalar loss), zb_h1 (1F1B with each backward "
                            "split, the weight parts deferred), interleaved (interleaved 1F1B: "
                            "`chunks` stages per rank), auto (the planner plans 1f1b, zb_h1 and, "
                            "with two device groups or more, interleaved, and keeps the fastest; the "
                            "report names each) or fill_drain "
                            "(backward with gradients from outside)")
    chunks: int = _option(2, "schedule interleaved: stages per rank (model chunks, as Megatron's "
                          "virtual pipeline stages)")
    plan_tolerance: float = _option(0.02, "plans within this fraction of the fastest are equal: the "
                                    "simplest wins, so noise does not change the plan")
    refine_candidates: int | None = _option(
        None, "plans of this many pipeline shapes refined piece by piece (None: 6 with analytic "
        "costs, 1 when profiling: every new piece is a measurement)", convert=_optional(int))
    verify_finalists: int = _option(2, "profiled plans with compose_costs: the chosen plan and the "
                                    "fastest plans of other shapes, this many in all, costed again "
                                    "with their stages measured whole")
    # costs and profiling
    cost_model: str = _option("profile", "profile (measure pieces on the device) or analytic (shapes)",
                              choices=("profile", "analytic"))
    profile_warmup: int = _option(1, "untimed runs before measuring a piece")
    profile_repetitions: int = _option(3, "timed runs per piece (the median is kept)")
    profile_time_budget: float = _option(0.5, "seconds of timed runs per piece after which timing stops")
    profile_cpu_clock: str = _option("auto", "CPU clock: thread (CPU time), wall, auto (thread with "
                                     "1 intra-op thread)")
    profile_parallel: bool = _option(True, "spread profiling over the MPI world's ranks")
    profile_fit_tolerance: float = _option(0.1, "records between measured row counts are interpolated "
                                           "when a check measurement agrees within this fraction "
                                           "(0: measure every row count)")
    compose_costs: bool = _option(True, "a range of blocks costs the sum of its parts' measurements "
                                  "instead of being measured whole")
    profile_fake_timer: bool = _option(False, "deterministic times from shapes (tests); the optimizer's "
                                       "update is not timed either")
    profile_fake_noise: float = _option(0.0, "with profile_fake_timer: each measurement scaled by a "
                                        "reproducible draw in 1 +- this (tests of noisy clocks)")
    profile_fake_seed: int = _option(0, "the seed of profile_fake_noise's draws")
    probe_bandwidth: bool = _option(True, "measure link bandwidth between ranks (else DeviceSpec defaults)")
    progress: bool | None = _option(None, "show profiling progress (None: when stderr is a terminal)",
                                    convert=_optional(_bool))
    # RaNNCModule only
    profile_cache: str = _option("", "load measured pieces from / save them to this file", where=MODULE)
    optimizer_kind: str = _option("", "memory model: adam, sgd_momentum, sgd (\"\": from the optimizer)",
                                  where=MODULE)
    save_plan: str = _option("", "write the plan to this file", where=MODULE)
    load_plan: str = _option("", "use the plan in this file (checked against the model)", where=MODULE)
    verify_plan: bool = _option(True, "check every stage and task of the plan before deploying", where=MODULE)
    comm_timeout: float = _option(600.0, "seconds a rank waits for a peer before failing", where=MODULE)
    log_level: str = _option("", "trace, debug, info, warn, error, off", where=MODULE,
                             choices=("", "trace", "debug", "info", "warn", "error", "off"))
    device: str = _option("auto", "where stages run: auto (one rank: the model's CUDA device; several: "
                          "this rank's GPU; cpu without CUDA), cpu, cuda, cuda:N", where=MODULE)
    data_plane: str = _option("auto", "CUDA stages: auto (NCCL if built with it and no two ranks share a "
                              "GPU, else MPI through host memory), nccl, mpi", where=MODULE,
                              choices=("auto", "nccl", "mpi"))
    loss_reduction: str = _option("auto", "how scalar outputs combine over micro-batches, replicas and "
                                  "ranks: mean (weighted by rows: a mean over the batch), sum (added "
                                  "up: a sum over the batch, such as reduction=\"sum\" or a sum divided "
                                  "by a count passed in) or auto (sum where the graph shows a sum over "
                                  "the batch, else mean)", where=MODULE, choices=("auto", "mean", "sum"))
    precision: str = _option("fp32", "fp32 (the caller's torch.autocast, if any), bf16, fp16 (as if "
                             "every call ran under torch.autocast(dtype))", where=MODULE,
                             choices=tuple(PRECISIONS))
    pad_values: dict | str | None = _option(
        None, "pad the arguments named here (dimension 1) to the longest of each call over the "
        "ranks with these values, where the ranks' lengths differ (a per-rank collator's dynamic "
        "padding): a dict {name: value} or \"transformers\" (input_ids: the pad token, "
        "attention masks 0, labels -100, ...)", where=MODULE, convert=_pad_values)
    pad_multiple_of: int = _option(8, "with pad_values: padded lengths are rounded up to a "
                                   "multiple of this (fewer lengths to trace)", where=MODULE,
                                   convert=_at_least_one)
    # rannc.plan only (RaNNCModule knows these from the model, the batch and its device)
    batch_size: int = _option(0, "global batch (0: the example's batch x world_size)", where=PLAN)
    training: bool = _option(True, "plan a training step (forward and backward); False: forward "
                             "only (eval, no_grad)", where=PLAN)
    profile_device: str | None = _option(None, "cpu, cuda or cuda:N (None: cuda when "
                                         "torch.cuda.is_available(), else cpu)", where=PLAN,
                                         convert=_optional(str))
    update_seconds_per_byte: float | None = _option(
        None, "optimizer step per parameter byte (None: timed on copies of the parameters for "
        "profiled plans, else from the device's bandwidth)", where=PLAN, convert=_optional(float))

    @staticmethod
    def resolve(kwargs: dict, environ=os.environ, entry: str = MODULE) -> "Options":
        """The options of `entry` (RaNNCModule or rannc.plan) from keyword arguments, then
        RANNC_<NAME> variables of `environ`, then the defaults; checked."""
        known = {f.name: f for f in fields(Options)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise _C.Error(f"unknown option(s) {', '.join(unknown)} of {entry}; known options:\n"
                           + option_docs(entry))
        elsewhere = sorted(n for n in kwargs if known[n].metadata["where"] not in (BOTH, entry))
        if elsewhere:
            raise _C.Error(f"option(s) {', '.join(elsewhere)} belong to "
                           f"{known[elsewhere[0]].metadata['where']}, not {entry}")
        opts = Options()
        for name, f in known.items():
            takes = f.metadata["where"] in (BOTH, entry)
            raw = kwargs.get(name, environ.get("RANNC_" + name.upper()) if takes else None)
            if raw is None:
                continue
            try:
                value = f.metadata["convert"](raw)
            except (TypeError, ValueError) as e:
                raise _C.Error(f"option {name} is {raw!r}: {e}") from None
            choices = f.metadata["choices"]
            if choices and value not in choices:
                raise _C.Error(f"option {name} is {value!r}; expected "
                               + ", ".join(c or '""' for c in choices))
            setattr(opts, name, value)
        opts.planner_options().check()
        opts.profiler_options()  # names the bad clock
        return opts

    def replica_counts(self) -> list:
        return [int(r) for r in self.replicas.split(",") if r]

    def planner_options(self, world_size: int = 1, batch_size: int = 0, optimizer: str = "adam",
                        update_seconds_per_byte: float | None = None) -> "_C.PlannerOptions":
        """The planner's options (partition/planner.h) for `world_size` devices and a global
        `batch_size` (0: the traced batch x world_size)."""
        p = _C.PlannerOptions()
        p.world_size = int(world_size)
        p.batch_size = int(batch_size)
        p.num_blocks = self.num_blocks
        p.memory_margin = self.memory_margin
        p.optimizer = optimizer
        p.model_copies = self.model_copies
        p.schedule = self.schedule
        p.chunks = self.chunks
        p.recompute = self.recompute
        p.num_stages = self.num_stages
        p.num_microbatches = self.num_microbatches
        p.max_microbatches = self.max_microbatches
        p.replicas = self.replica_counts()
        rate = update_seconds_per_byte if update_seconds_per_byte is not None else self.update_seconds_per_byte
        p.update_seconds_per_byte = 0.0 if not self.training else -1.0 if rate is None else float(rate)
        # Refinement re-cuts stages piece by piece: cheap from shapes, but with the profiler
        # each new piece is a measurement (BERT-base: 918 s refining 6 shapes against 109 s for 1).
        refine = self.refine_candidates
        p.refine_candidates = refine if refine is not None else (6 if self.cost_model == "analytic" else 1)
        p.plan_tolerance = self.plan_tolerance
        p.verify_finalists = self.verify_finalists
        return p

    def profiler_options(self, device: str = "cpu", memory_limit: int = 0) -> "_C.ProfilerOptions":
        """The profiler's options (profile/profiler.h) for pieces run on `device` within
        `memory_limit` bytes (0: no limit)."""
        p = _C.ProfilerOptions()
        p.warmup = self.profile_warmup
        p.repetitions = self.profile_repetitions
        p.time_budget = self.profile_time_budget
        p.memory_limit = int(memory_limit)
        p.fake_timer = self.profile_fake_timer
        p.fake_noise = self.profile_fake_noise
        p.fake_seed = self.profile_fake_seed
        p.device = str(device)
        p.cpu_clock = self.profile_cpu_clock
        p.forward_only = not self.training
        # the weight part of a split backward, for plans that may run ZB-H1
        p.measure_weight_part = self.training and self.schedule in ("zb_h1", "auto")
        return p


def option_docs(entry: str = PLAN) -> str:
    """One line per option `entry` takes: name, default, meaning."""
    return "\n".join(f"  {f.name:24s} default {f.default!r:10s} {f.metadata['meaning']}"
                     for f in fields(Options) if f.metadata["where"] in (BOTH, entry))
