"""Sharded checkpoints: every rank writes the state of the stages it owns, all at once, and
reads back only the state of its stages in whatever layout it runs now.

    model.save_checkpoint("ckpt/step-1000", extra={"scheduler": sched.state_dict()})
    extra = model.load_checkpoint("ckpt/step-1000")    # any world size, any plan
    python -m rannc.checkpoint consolidate ckpt/step-1000 model.pt   # no MPI

[Note: checkpoint layout] A checkpoint is a directory, on a filesystem every rank sees:
- model-KKKKK-of-NNNNN.safetensors: the parameters and persistent buffers one rank wrote,
  under their names in the user's module.state_dict() (tied weights once, under their first
  name), with model.safetensors.index.json ({"metadata": {"total_size"}, "weight_map"}) as
  Hugging Face writes it. So `safetensors`, and `transformers`' from_pretrained (config.json
  is written for its models), read the weights directly.
- optimizer-KKKKK-of-NNNNN.safetensors: the optimizer's per-parameter tensors, the key
  "<parameter name>#<state key>" ("encoder.w#exp_avg"); optimizer.pt holds the param
  groups (hyperparameters, parameters by name) and non-tensor per-parameter values.
- rng/rank-RRRRR.pt: each rank's random generators (torch CPU and CUDA, Python, NumPy).
- plan-train.rannc / plan-eval.rannc: the deployed plans (option load_plan reads them).
- extra.pt: the caller's `extra` object (rank 0's); rannc_checkpoint.json: the metadata
  (format version, world size, optimizer step, every tensor's file, shape, dtype and CRC-32,
  every file's size), written last.
Each tensor is written by one rank among those holding its current value (and, for a
parameter, its optimizer state): the replicas of a stage share its tensors out by bytes, so
no tensor is written twice and the replicas write in parallel. A save writes into
DIR.tmp-<token>; when every rank has finished, rank 0 renames the old DIR aside, renames the
new one into place and deletes the old: a rank that dies mid-save leaves DIR as it was.

[Note: checkpoint memory] No rank ever holds more than its own state plus one tensor: the
writer streams each tensor's bytes from its storage (one copy of one tensor for GPU
tensors), the reader reads each tensor's bytes into the tensor that keeps it (the
optimizer's state tensors too, where they exist), and nothing is gathered.
safetensors_io.py says why the safetensors library's own functions are not used.

A checkpoint loaded before the first forward (the plan, so which stages this rank keeps, is
not known yet) is checked at once and read when the first deployment has freed what this
rank does not keep: the weights of every rank's stages, and the optimizer state when the
training mode deploys. The random generators are restored at once (deploying draws from
them nothing, see RaNNCModule._deploy).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import random
import secrets
import shutil
import sys
import weakref
from dataclasses import dataclass

import torch

from . import _C, failure
from . import safetensors_io as sio
from .transport import all_gather_objects

# RaNNCModule -> what its load_checkpoint left to read once the plan is known (_Pending).
_PENDING = weakref.WeakKeyDictionary()

METADATA = "rannc_checkpoint.json"
INDEX = "model.safetensors.index.json"
OPTIMIZER = "optimizer.pt"
EXTRA = "extra.pt"
FORMAT, VERSION = "rannc-checkpoint", 1


def _this_gpu(storage, location: str):
    """torch.load's map_location: CPU storages stay, CUDA ones go to this rank's GPU."""
    if location.startswith("cuda") and torch.cuda.is_available():
        return storage.cuda(torch.cuda.current_device())
    return storage


# ---- the model's state as a checkpoint sees it ------------------------------------------------

@dataclass
class _Entry:
    """One state tensor of the user's module."""
    name: str                    # its first name in module.state_dict()
    aliases: list[str]           # its other names (tied weights)
    tensor: torch.Tensor
    shape: torch.Size            # the full shape (a rank that does not keep it holds it empty)
    holders: list[int]           # ranks holding its current value (and optimizer state)
    here: bool                   # whether this rank keeps it

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.tensor.element_size()


def _entries(wrapped) -> list[_Entry]:
    """The module's parameters and persistent buffers in state_dict order, one entry per
    tensor, with where they live ([Note: freed state] in placement.py)."""
    world = list(range(_C.get_world_size()))
    placement = wrapped.placement.holders()
    entries, by_id = [], {}
    for name, t in wrapped.placement.module_state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        if id(t) in by_id:
            by_id[id(t)].aliases.append(name)
            continue
        shape, holders, here = placement.get(id(t), (t.shape, world, True))
        by_id[id(t)] = _Entry(name, [], t, torch.Size(shape), holders, here)
        entries.append(by_id[id(t)])
    return entries


def _writers(entries: list[_Entry], world_size: int) -> list[int]:
    """The rank that writes each entry: among its holders, the one with the fewest bytes so
    far (the same on every rank: entries and holders agree)."""
    load = [0] * world_size
    chosen = []
    for e in entries:
        r = min(e.holders, key=lambda h: (load[h], h))
        load[r] += e.nbytes
        chosen.append(r)
    return chosen


# ---- agreement ------------------------------------------------------------------------------
def _agree(what: str, action, cleanup=None, gather: bool = False):
    """Runs `action` on every rank (a collective) and returns its result here, or with
    `gather` every rank's result in rank order. If it fails anywhere, every rank runs
    `cleanup` and raises one error naming each failed rank and its cause."""
    result, error = None, None
    try:
        result = action()
    except Exception as e:  # told to every rank below, then raised everywhere
        error = f"{type(e).__name__}: {e}"
    everyone = all_gather_objects((error, result if gather else None))
    failed = [(r, err) for r, (err, _) in enumerate(everyone) if err is not None]
    if failed:
        if cleanup is not None:
            try:
                cleanup()
            except OSError:
                pass
        _C.barrier()  # the cleanup is done when any rank returns
        raise failure.agreed(f"{what} failed: " + "; ".join(f"rank {r}: {err}"
                                                          for r, err in failed))
    return [r for _, r in everyone] if gather else result


# ---- saving ---------------------------------------------------------------------------------
def save_checkpoint(wrapped, directory: str, extra=None) -> None:
    """Writes a sharded checkpoint of `wrapped` (its weights, optimizer state, random
    generators, plans and `extra`) to `directory` (a collective; [Note: checkpoint
    layout]). Replaces an earlier checkpoint there only once the new one is complete."""
    rank, world = _C.get_rank(), _C.get_world_size()
    directory = os.path.abspath(directory)
    what = f"save_checkpoint({directory})"
    wrapped.placement.require_values(what)
    token = _agree(what, lambda: _prepare(directory) if rank == 0 else None, gather=True)[0]
    tmp = f"{directory}.tmp-{token}"
    remove_tmp = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if rank == 0 else None
    entries = _entries(wrapped)
    writers = _writers(entries, world)
    reports = _agree(what, lambda: _write_shards(wrapped, tmp, entries, writers), remove_tmp,
                     gather=True)
    _agree(what, lambda: (_write_metadata(wrapped, tmp, entries, reports, extra)
                          if rank == 0 else None), remove_tmp)
    # no cleanup here: a failed rename may have moved the old checkpoint aside already
    _agree(what, lambda: _replace(directory, tmp, token) if rank == 0 else None)


def _prepare(directory: str) -> str:
    """Rank 0: checks that `directory` may be replaced, removes what earlier saves that died
    left behind, creates the temporary directory; returns its token."""
    if os.path.exists(directory) and not (
            os.path.isdir(directory)
            and (not os.listdir(directory) or os.path.exists(os.path.join(directory, METADATA)))):
        raise _C.Error(f"{directory} exists and is not a rannc checkpoint; save_checkpoint "
                       "replaces only checkpoints (choose another directory or remove it)")
    for stale in glob.glob(glob.escape(directory) + ".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    token = secrets.token_hex(4)
    os.makedirs(os.path.join(f"{directory}.tmp-{token}", "rng"))
    return token


def _shard_name(kind: str, rank: int, writers: list[int]) -> str:
    ranks = sorted(set(writers))
    return f"{kind}-{ranks.index(rank) + 1:05d}-of-{len(ranks):05d}.safetensors"


def _write_shards(wrapped, tmp: str, entries: list[_Entry], writers: list[int]) -> dict:
    """This rank's files: its share of the weights and optimizer state, its generators.
    Returns what the metadata needs of them."""
    rank = _C.get_rank()
    mine = [e for e, w in zip(entries, writers) if w == rank]
    report = {"tensors": {}, "optimizer": {}, "values": {}, "files": {}, "step": None}

    def write(fname, tensors):
        checksums = sio.write_file(os.path.join(tmp, fname), tensors, {"format": "pt"})
        report["files"][fname] = os.path.getsize(os.path.join(tmp, fname))
        return {key: {"file": fname, "shape": list(t.shape), "dtype": sio.dtype_name(t.dtype),
                      "crc32": checksums[key]} for key, t in tensors}

    if mine:
        report["tensors"] = write(_shard_name("model", rank, writers),
                                  [(e.name, e.tensor) for e in mine])
    share = wrapped.optimizer_share
    if mine and share.optimizers:
        tensors, keys = [], {}
        for e in mine:
            for key, value in (share.state(e.tensor) or {}).items():
                if isinstance(value, torch.Tensor):
                    tensors.append((f"{e.name}#{key}", value))
                    keys[f"{e.name}#{key}"] = (e.name, key)
                else:
                    report["values"].setdefault(e.name, {})[key] = value
                if key == "step":
                    step = int(value)
                    report["step"] = step if report["step"] is None else max(step, report["step"])
        if tensors:
            for full, info in write(_shard_name("optimizer", rank, writers), tensors).items():
                name, key = keys[full]
                report["optimizer"].setdefault(name, {})[key] = {**info, "key": full}
    rng = os.path.join("rng", f"rank-{rank:05d}.pt")
    torch.save(_rng_state(), os.path.join(tmp, rng))
    report["files"][rng] = os.path.getsize(os.path.join(tmp, rng))
    return report


def _write_metadata(wrapped, tmp: str, entries: list[_Entry], reports: list[dict], extra):
    """Rank 0: the index, the optimizer's groups, the plans, `extra`, the model's config and,
    last, the metadata."""
    files, tensors, optimizer, values, steps = {}, {}, {}, {}, []
    for report in reports:
        files.update(report["files"])
        tensors.update(report["tensors"])
        optimizer.update(report["optimizer"])
        values.update(report["values"])
        if report["step"] is not None:
            steps.append(report["step"])

    def keep(fname, writer):
        writer(os.path.join(tmp, fname))
        files[fname] = os.path.getsize(os.path.join(tmp, fname))

    index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
             "weight_map": {name: info["file"] for name, info in sorted(tensors.items())}}
    keep(INDEX, lambda path: _write_json(path, index))
    names = {id(e.tensor): e.name for e in entries}
    has_optimizer = wrapped.optimizer is not None
    if has_optimizer:
        groups = []  # of every optimizer, one after another ([Note: several optimizers])
        share = wrapped.optimizer_share
        outside = []  # parameters the optimizers step outside the module: the user's
        for group, (params, _) in zip(share.groups(), share.original_groups()):
            saved = {k: v for k, v in group.items() if k not in ("params", "param_names")}
            saved["params"] = [names[id(p)] for p in params if id(p) in names]
            outside += [tuple(p.shape) for p in params if id(p) not in names]
            groups.append(saved)
        if outside:
            _C.log_warn(f"the optimizer steps {len(outside)} parameter(s) outside the "
                        f"RaNNCModule (shapes {failure.some_of([str(o) for o in outside])}): "
                        "the checkpoint holds neither them nor their optimizer state; save "
                        "them yourself (with torch.save, as under DDP) or make them part of "
                        "the model")
        keep(OPTIMIZER, lambda path: torch.save({"param_groups": groups, "values": values}, path))
    plans = {}
    for mode, deployment in wrapped.deployments.items():
        fname = f"plan-{mode}.rannc"
        keep(fname, lambda path: deployment.save(path))
        plans[mode] = {"file": fname, "summary": deployment.summary()}
    if extra is not None:
        keep(EXTRA, lambda path: torch.save(extra, path))
    for config in (getattr(wrapped.module, "config", None),
                   getattr(wrapped.module, "generation_config", None)):
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(tmp)  # transformers' from_pretrained(dir) needs config.json
    meta = {
        "format": FORMAT, "version": VERSION, "world_size": _C.get_world_size(),
        "model": type(wrapped.module).__qualname__,
        "optimizer_step": max(steps) if steps else None,
        "names": list(wrapped.placement.module_state_dict(keep_vars=True)),
        "tensors": tensors,
        "aliases": {alias: e.name for e in entries for alias in e.aliases},
        "optimizer": {"groups": OPTIMIZER, "state": optimizer} if has_optimizer else None,
        "rng": [os.path.join("rng", f"rank-{r:05d}.pt") for r in range(len(reports))],
        "plans": plans,
        "extra": EXTRA if extra is not None else None,
        "files": files,
    }
    _write_json(os.path.join(tmp, METADATA), meta)


def _write_json(path: str, value) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _replace(directory: str, tmp: str, token: str) -> None:
    """Rank 0: the finished checkpoint takes the place of the old one."""
    old = None
    if os.path.exists(directory):
        old = f"{directory}.old-{token}"
        os.rename(directory, old)
    os.rename(tmp, directory)
    fd = os.open(os.path.dirname(directory), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if old is not None:
        shutil.rmtree(old)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)
    if "numpy" in state:
        import numpy
        numpy.random.set_state(state["numpy"])


# ---- reading ----------------------------------------------------------------------------------
class Source:
    """Named tensors to load: a rannc checkpoint, a Hugging Face checkpoint directory
    (sharded or single safetensors, or pytorch_model.bin), a safetensors file, or a file
    torch.save wrote holding a state_dict. Opening checks that every file is there and
    complete; reading checks each tensor's CRC-32 where the metadata has one. Or a
    state_dict in memory (`path` a mapping; every rank passes the whole dict)."""

    def __init__(self, path: str | collections.abc.Mapping):
        self.meta = None
        self._readers = {}
        self._torch = None
        self.shapes, self._where = {}, {}  # name -> shape, (file, key, crc32)
        if isinstance(path, collections.abc.Mapping):
            self.path = "state_dict"
            self._take_state(path)
            return
        self.path = os.path.abspath(path)
        if os.path.isdir(self.path):
            self._open_directory()
        elif os.path.exists(self.path):
            if self.path.endswith(".safetensors"):
                self._open_safetensors([os.path.basename(self.path)], os.path.dirname(self.path))
            else:
                self._open_torch(self.path)
        else:
            leftovers = sorted(glob.glob(glob.escape(self.path) + ".old-*"))
            hint = (f"; {leftovers[-1]} holds the checkpoint that was there (a save stopped "
                    f"between its two renames): rename it to {self.path}" if leftovers else "")
            raise _C.Error(f"no checkpoint at {self.path}{hint}")

    def _open_directory(self):
        def there(name):
            return os.path.exists(os.path.join(self.path, name))

        if there(METADATA):
            with open(os.path.join(self.path, METADATA)) as f:
                self.meta = json.load(f)
            if self.meta.get("format") != FORMAT or self.meta.get("version", 0) > VERSION:
                raise _C.Error(f"{self.path}: {METADATA} is not a rannc checkpoint of version "
                               f"{VERSION} or older (format {self.meta.get('format')!r}, version "
                               f"{self.meta.get('version')!r})")
            self._check_files()
            for name, info in self.meta["tensors"].items():
                self.shapes[name] = torch.Size(info["shape"])
                self._where[name] = (info["file"], name, info["crc32"])
        elif there(INDEX):
            with open(os.path.join(self.path, INDEX)) as f:
                weight_map = json.load(f)["weight_map"]
            self._open_safetensors(sorted(set(weight_map.values())), self.path)
        elif there("model.safetensors"):
            self._open_safetensors(["model.safetensors"], self.path)
        elif there("pytorch_model.bin"):
            self._open_torch(os.path.join(self.path, "pytorch_model.bin"))
        else:
            raise _C.Error(f"{self.path} holds no checkpoint: none of {METADATA}, {INDEX}, "
                           "model.safetensors or pytorch_model.bin is there")

    def _check_files(self):
        """Every file the metadata lists is there, with its size."""
        problems = []
        for fname, size in self.meta["files"].items():
            path = os.path.join(self.path, fname)
            if not os.path.exists(path):
                problems.append(f"{fname} is missing")
            elif os.path.getsize(path) != size:
                problems.append(f"{fname} has {os.path.getsize(path)} bytes, not {size} "
                                "(truncated or overwritten)")
        if problems:
            raise _C.Error(f"the checkpoint {self.path} is incomplete: " + "; ".join(problems))

    def _open_safetensors(self, fnames, directory):
        self.path = directory
        for fname in fnames:
            reader = self._reader(fname)
            for key in reader.keys():
                self.shapes[key] = reader.shape(key)
                self._where[key] = (fname, key, None)

    def _open_torch(self, path):
        # mmap: a rank reads the pages of the tensors it takes, not the whole file
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, collections.abc.Mapping):
            raise _C.Error(f"{path} holds a {type(state).__name__}, not a state_dict")
        self._take_state(state)

    def _take_state(self, state: collections.abc.Mapping):
        self._torch = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        for k, v in self._torch.items():
            self.shapes[k] = v.shape

    def _reader(self, fname) -> sio.Reader:
        if fname not in self._readers:
            try:
                self._readers[fname] = sio.Reader(os.path.join(self.path, fname))
            except (OSError, ValueError) as e:
                raise _C.Error(f"cannot read {os.path.join(self.path, fname)}: {e}") from None
        return self._readers[fname]

    def keys(self):
        return self.shapes.keys()

    def read(self, name: str, dest: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` read into `dest` (cast to its dtype and device) or a new CPU tensor."""
        if self._torch is not None:
            value = self._torch[name]
            if dest is None:
                return value.clone()
            with torch.no_grad():
                dest.copy_(value)
            return dest
        fname, key, crc = self._where[name]
        return self._read_file(fname, key, crc, dest)

    def _read_file(self, fname, key, crc, dest):
        tensor, found = self._reader(fname).read_into(key, dest)
        if crc is not None and found != crc:
            raise _C.Error(f"{os.path.join(self.path, fname)}: the bytes of {key} do not match "
                           "their CRC-32 in the metadata (the file is corrupt)")
        return tensor

    # -- what only a rannc checkpoint has
    @property
    def aliases(self) -> dict:
        return self.meta["aliases"] if self.meta else {}

    def optimizer_groups(self) -> dict | None:
        if not self.meta or not self.meta.get("optimizer"):
            return None
        return torch.load(os.path.join(self.path, self.meta["optimizer"]["groups"]),
                          map_location="cpu", weights_only=False)

    def optimizer_state(self, name: str, values: dict, existing: dict) -> dict:
        """Parameter `name`'s optimizer state: its tensors read (into `existing`'s tensors
        of the same shape and dtype, where there are) and its other values."""
        state = dict(values.get(name, {}))
        for key, info in self.meta["optimizer"]["state"].get(name, {}).items():
            old = existing.get(key)
            fits = (isinstance(old, torch.Tensor) and list(old.shape) == info["shape"]
                    and old.dtype == sio.torch_dtype(info["dtype"]))
            state[key] = self._read_file(info["file"], info["key"], info["crc32"],
                                         old if fits else None)
        return state

    def rng_state(self, rank: int) -> dict | None:
        if not self.meta:
            return None
        files = self.meta["rng"]
        return torch.load(os.path.join(self.path, files[rank % len(files)]), map_location="cpu",
                          weights_only=False)

    def extra(self):
        if not self.meta or not self.meta.get("extra"):
            return None
        # CUDA tensors rank 0 saved come back on this rank's GPU, not on rank 0's
        return torch.load(os.path.join(self.path, self.meta["extra"]), map_location=_this_gpu,
                          weights_only=False)

    def close(self):
        for reader in self._readers.values():
            reader.close()
        self._readers, self._torch = {}, None


# ---- loading ----------------------------------------------------------------------------------
@dataclass
class _Pending:
    """A checkpoint loaded before the plan said what this rank keeps."""
    source: Source
    matched: dict                   # entry name -> the source's key
    weights: bool = True
    optimizer: bool = False
    what: str = ""
    groups: dict | None = None      # the checkpoint's optimizer groups and values
    # [Note: edits after a load] entry name -> (the tensor, its fingerprint) at the load
    at_load: dict = dataclasses.field(default_factory=dict)
    early: bool = False  # loaded before the first call: the groups took its hyperparameters


# [Note: edits after a load] load_checkpoint before the first call reads the tensors once
# the plan says which ranks keep them. A fine-tuning script edits the model after loading
# (a new head: `model.module.fc.weight.normal_()`, a new lr: `group["lr"] = 2e-3`), and the
# first call read the checkpoint over those edits without a word. So the checkpoint's
# hyperparameters go to the optimizer's groups at the load (its state still waits), and at
# the first call a tensor that is no longer the one loaded into (a module replaced) or
# whose values changed since the load (a fingerprint: sum and sum of squares in float64;
# `.data` edits bump no version counter) keeps what the script gave it; rank 0 names them.
def _fingerprint(t: torch.Tensor) -> tuple:
    if t.is_meta or not t.numel():
        return ()
    d = t.detach().double()
    return (float(d.sum()), float((d * d).sum()))


def load_checkpoint(wrapped, path: str, strict: bool = True):
    """Loads a checkpoint into `wrapped` (a collective): a rannc checkpoint (weights,
    optimizer state, random generators), or the weights of a Hugging Face checkpoint
    directory or a state_dict file. Each rank reads only the tensors it keeps, whatever
    layout saved them. Returns the `extra` object saved with it (None if none).
    With `strict`, the names must match the module's as in torch's load_state_dict."""
    source, _, _ = _open_pending(wrapped, path, strict, f"load_checkpoint({os.path.abspath(path)})")
    rng = source.rng_state(_C.get_rank())
    if rng is not None:
        _set_rng_state(rng)
    extra = source.extra()
    if wrapped.deployments:
        apply_pending(wrapped)
    return extra


def load_state_dict_later(wrapped, state_dict, strict: bool = True):
    """load_state_dict before the first call of a model built on the meta device (a
    collective; every rank passes the whole dict): its parameters get storage only once the
    plan says which ranks keep them, so the dict is read then, as a checkpoint loaded
    before the first call is. Returns torch's (missing_keys, unexpected_keys)."""
    _, missing, unexpected = _open_pending(wrapped, state_dict, strict, "load_state_dict")
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def _open_pending(wrapped, path, strict: bool, what: str):
    """Opens `path` (a checkpoint or a state_dict in memory) and matches its names with the
    module's on every rank, as what is left to read once the plan is known; the source and
    the module's keys it lacks and its keys the module lacks."""
    opened = []  # closed again if any rank fails

    def open_and_match():
        opened.append(Source(path))
        if not wrapped.deployments:
            _load_into_resizing_modules(wrapped, opened[0])
        return _match(_entries(wrapped), opened[0], strict, type(wrapped.module).__name__)

    matched, missing, unexpected = _agree(what, open_and_match,
                                          cleanup=lambda: [s.close() for s in opened])
    source = opened[0]
    if wrapped.optimizer is None:
        _adopt_optimizer_built_over(wrapped)
    groups = source.optimizer_groups() if wrapped.optimizer is not None else None
    pending = _Pending(source, matched, weights=True, optimizer=groups is not None, what=what,
                       groups=groups)
    if not wrapped.deployments:  # [Note: edits after a load]
        pending.at_load = {e.name: (e.tensor, _fingerprint(e.tensor)) for e in _entries(wrapped)
                           if e.here and e.name in matched and not e.tensor.is_meta}
        if groups is not None:
            pending.early = _hyperparameters_now(wrapped, groups)
    forget_pending(wrapped)
    _PENDING[wrapped] = pending
    return source, missing, unexpected


# [Note: modules that resize their state at a load] Some modules' state has its shape only
# once it has seen data, and their own _load_from_state_dict resizes it to the checkpoint's:
# torch.ao.quantization's FakeQuantize (scale and zero_point [1] until a per-channel
# observer has run) and its observers (min_val, max_val empty). Resuming QAT from a
# checkpoint before the first call failed with "size mismatch" where PyTorch loads. Before
# the first call every rank holds the whole module, so such a module (one that overrides
# _load_from_state_dict, with a tensor whose shape differs from the checkpoint's) loads its
# own tensors at once, through its own method; the trace then sees the resumed state, and
# the pending load reads the same values again once the plan says who keeps them.
def _load_into_resizing_modules(wrapped, source: Source) -> None:
    keys = set(source.keys())
    owners = {}  # prefix -> the submodule
    for e in _entries(wrapped):
        key = next((n for n in (e.name, *e.aliases) if n in keys), None)
        # e.shape: the full shape, where a model built with empty weights holds none yet
        if key is None or not e.here or e.tensor.is_meta or source.shapes[key] == e.shape:
            continue
        prefix = e.name.rpartition(".")[0]
        owner = wrapped.module.get_submodule(prefix)
        if type(owner)._load_from_state_dict is not torch.nn.Module._load_from_state_dict:
            owners[prefix] = owner
    for prefix, owner in owners.items():
        dot = prefix + "." if prefix else ""
        own = {name: t for name, t in [*owner.named_parameters(recurse=False),
                                       *owner.named_buffers(recurse=False)]
               if dot + name in keys}
        state = {name: source.read(dot + name) for name in own}
        owner.load_state_dict(state, strict=False)


def _adopt_optimizer_built_over(wrapped) -> None:
    """[Note: checkpoints of optimizers made after wrapping] DDP's habit builds the optimizer
    over the wrapper's parameters and resumes before the first step:

        model = rannc.RaNNCModule(model); opt = AdamW(model.parameters())
        model.load_checkpoint(path)

    The optimizer becomes the module's at its first step ([Note: optimizers made after
    wrapping] in optimizer_share.py), after the checkpoint was read: its state and
    hyperparameters were dropped without a word (Adam's step count restarted, the loss off
    at the first resumed step). So a load finds the live optimizer over the module's
    parameters and makes it the module's now, as if passed; several found are named, since
    their order in the checkpoint is the order they were adopted in."""
    from .optimizer_share import built_over
    found = built_over(wrapped)
    if len(found) == 1:
        if wrapped._deployed.get(True) is not None:
            wrapped.adopt_optimizer(found[0])
        else:
            wrapped.optimizer_share.add(found[0])
    elif found and _C.get_rank() == 0:
        _C.log_warn(f"{len(found)} optimizers ({', '.join(type(o).__name__ for o in found)}) hold "
                    "the module's parameters but none was passed to RaNNCModule: the checkpoint's "
                    "optimizer state is not read into them; pass them to RaNNCModule (in the order "
                    "they were when the checkpoint was saved) to resume their state")


def _hyperparameters_now(wrapped, saved: dict) -> bool:
    """The checkpoint's hyperparameters (lr, betas, weight decay) into the optimizer's groups
    at the load ([Note: edits after a load]); False where the group counts differ (the
    state's load names that)."""
    groups = wrapped.optimizer_share.groups()
    if len(groups) != len(saved["param_groups"]):
        return False
    for group, saved_group in zip(groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k not in ("params", "param_names")})
    return True


def _match(entries, source: Source, strict: bool, model: str) -> tuple[dict, list, list]:
    """Entry name -> the source's key for it (any of the tensor's names, or an alias the
    checkpoint recorded), the entries it lacks and its keys no entry has; checks shapes,
    and with `strict`, missing and unexpected keys."""
    keys = set(source.keys())
    known = {n for e in entries for n in (e.name, *e.aliases)}
    matched, missing, errors = {}, [], []
    for e in entries:
        key = next((n for n in (e.name, *e.aliases) if n in keys), None)
        if key is None:
            missing.append(e.name)
            continue
        if source.shapes[key] != e.shape:
            errors.append(f"size mismatch for {e.name}: copying a param with shape "
                          f"{source.shapes[key]} from checkpoint, the shape in current model "
                          f"is {e.shape}.")
        matched[e.name] = key
    unexpected = sorted(keys - known - set(source.aliases))
    if strict and missing:
        errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if strict and unexpected:
        errors.append("Unexpected key(s) in state_dict: "
                      + ", ".join(f'"{k}"' for k in unexpected) + ".")
    if errors:
        raise _C.Error(f"Error(s) in loading {source.path} into {model}:\n\t" + "\n\t".join(errors))
    return matched, missing, unexpected


def load_weights(wrapped, path: str, strict: bool = True) -> None:
    """Reads the weights of a checkpoint (or of a Hugging Face directory or a state_dict
    file) into the tensors this rank keeps, now (a collective): nothing else (no optimizer
    state, generators or extra). For copies of a model ([Note: copies of a wrapped model] in
    copies.py), whose tensors are swapped into `wrapped`'s."""
    opened = []

    def read():
        opened.append(Source(path))
        entries = _entries(wrapped)
        matched, _, _ = _match(entries, opened[0], strict, type(wrapped.module).__name__)
        for e in entries:
            if e.here and e.name in matched:
                opened[0].read(matched[e.name], e.tensor)

    try:
        _agree(f"load_checkpoint({path})", read)
    finally:
        for s in opened:
            s.close()


def forget_pending(wrapped, weights: bool = True, optimizer: bool = True) -> None:
    """A later load replaces what an earlier load_checkpoint left to read."""
    pending = _PENDING.get(wrapped)
    if pending is None:
        return
    pending.weights &= not weights
    pending.optimizer &= not optimizer
    if not (pending.weights or pending.optimizer):
        pending.source.close()
        del _PENDING[wrapped]


def apply_pending(wrapped, everything: bool = False) -> None:
    """Reads what a load_checkpoint left to read (a collective): the weights this rank keeps
    and, once the optimizer holds only this rank's parameters (or with `everything`,
    before any deployment), its optimizer state."""
    pending = _PENDING.get(wrapped)
    if pending is None or wrapped.placement.without_values():
        return  # built on meta: nothing has storage before the first call
    entries = _entries(wrapped)
    edited = _edited_since_load(pending, entries)  # [Note: edits after a load]
    if pending.weights:
        def read_weights():
            for e in entries:
                if e.here and e.name in pending.matched and e.name not in edited:
                    pending.source.read(pending.matched[e.name], e.tensor)
        try:
            _agree(pending.what, read_weights)
        except Exception:
            forget_pending(wrapped)
            raise
        wrapped.placement.current_everywhere()
        wrapped.placement.loaded([e.tensor for e in entries if e.here and e.name in pending.matched
                                  and e.name not in edited])
        forget_pending(wrapped, weights=True, optimizer=False)
    if pending.optimizer and (wrapped.optimizer_share.patched or everything):
        try:
            _agree(pending.what, lambda: _load_optimizer(wrapped, pending, entries))
        finally:
            forget_pending(wrapped, weights=False, optimizer=True)


def _edited_since_load(pending: _Pending, entries) -> set:
    """The entries the script replaced or changed since load_checkpoint ([Note: edits after
    a load]); rank 0 names those it holds."""
    edited = set()
    for e in entries:
        loaded = pending.at_load.get(e.name)
        # a tensor this rank does not hold was freed by the plan, not edited (and is not read)
        if e.here and loaded is not None and \
                (loaded[0] is not e.tensor or _fingerprint(e.tensor) != loaded[1]):
            edited.add(e.name)
    if edited and _C.get_rank() == 0:
        _C.log_info(f"{failure.some_of(sorted(edited))} changed after {pending.what}: kept as the "
                    "script set them, not read from the checkpoint ([Note: edits after a load] "
                    "in checkpoint.py)")
    return edited


def _load_optimizer(wrapped, pending: _Pending, entries) -> None:
    """The optimizer's state for the parameters it holds here, in torch's state_dict format
    with the checkpoint's hyperparameters, through its own load_state_dict."""
    share, saved = wrapped.optimizer_share, pending.groups
    groups = share.groups()  # of every optimizer, one after another ([Note: several optimizers])
    names = {id(e.tensor): e.name for e in entries}
    if len(saved["param_groups"]) != len(groups):
        raise _C.Error(f"the optimizer{'s have' if len(share.optimizers) > 1 else ' has'} "
                       f"{len(groups)} parameter groups, the checkpoint's has "
                       f"{len(saved['param_groups'])}")
    local = {"state": {}, "param_groups": []}
    index = 0
    for g, (group, saved_group) in enumerate(zip(groups, saved["param_groups"])):
        in_saved = set(saved_group["params"])
        # the hyperparameters went to the groups at the load, and the script may have set
        # them since ([Note: edits after a load])
        hyper = group if pending.early else saved_group
        mine = {k: v for k, v in hyper.items() if k not in ("params", "param_names")}
        mine["params"] = []
        if "param_names" in group:
            mine["param_names"] = list(group["param_names"])
        for p in group["params"]:
            name = names.get(id(p))
            if name is None:  # outside the module (the user's): its state stays as it is
                state = share.state(p)
            elif name not in in_saved:
                raise _C.Error(f"parameter {name} is in group {g} of the optimizer but not in "
                               f"group {g} of the checkpoint's optimizer")
            else:
                state = pending.source.optimizer_state(
                    pending.matched.get(name, name), saved["values"], share.state(p) or {})
            if state:
                local["state"][index] = state
            mine["params"].append(index)
            index += 1
        local["param_groups"].append(mine)
    share.load(local)


# ---- consolidation (no MPI) ---------------------------------------------------------------
def consolidate(directory: str, out: str, optimizer_out: str | None = None) -> None:
    """Writes the whole model state of a sharded checkpoint as one plain PyTorch state_dict
    (every name, tied weights sharing one tensor) to `out`, and with `optimizer_out` the
    optimizer's state in torch's format (parameters numbered across the groups as the
    original optimizer numbered them)."""
    source = Source(directory)
    try:
        names = source.meta["names"] if source.meta else sorted(source.keys())
        aliases = source.aliases
        state = collections.OrderedDict()
        for name in names:
            key = aliases.get(name, name)
            state[name] = state[key] if key in state else source.read(key)
        torch.save(state, out)
        if optimizer_out is not None:
            saved = source.optimizer_groups()
            if saved is None:
                raise _C.Error(f"{directory} holds no optimizer state")
            result = {"state": {}, "param_groups": []}
            index = 0
            for saved_group in saved["param_groups"]:
                group = {k: v for k, v in saved_group.items() if k != "params"}
                group["params"] = []
                for name in saved_group["params"]:
                    s = source.optimizer_state(name, saved["values"], {})
                    if s:
                        result["state"][index] = s
                    group["params"].append(index)
                    index += 1
                result["param_groups"].append(group)
            torch.save(result, optimizer_out)
    finally:
        source.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rannc.checkpoint",
                                 description="Tools for rannc's sharded checkpoints.")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one plain PyTorch state_dict file")
    c.add_argument("directory")
    c.add_argument("out")
    c.add_argument("--optimizer", metavar="PATH",
                   help="also write the optimizer's state_dict (torch's format) to PATH")
    a = ap.parse_args(argv)
    try:
        consolidate(a.directory, a.out, a.optimizer)
    except _C.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
