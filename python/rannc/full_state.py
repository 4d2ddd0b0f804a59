"""The whole state of a RaNNCModule in memory, for small models: the full model state and
the optimizer's state gathered under the original names and indices on every rank, and
loaded back from plain PyTorch's format (from any world size), though each rank keeps only
its stages' state ([Note: freed state] in placement.py). All gathers are collectives. Large
models save and load sharded checkpoints instead (checkpoint.py): nothing is gathered."""
from __future__ import annotations

import collections
import copy

import torch

from . import _C
from .transport import all_gather_objects


def gather_state_dict(wrapped, *args, destination=None, prefix="", keep_vars=False, keep=True,
                      untied=False, only: set[str] | None = None):
    """The full model state (parameters and persistent buffers) under the original names,
    as `module.state_dict()` of plain PyTorch gives it, on every rank (a collective:
    every rank must call it). The tensors are fresh copies on the CPU (the whole model
    need not fit on one device); the model keeps only its stage's state. A rank that
    only serves the gather (`keep=False`) keeps no tensor past its broadcast and gets None.
    With `untied`, the names of one tied tensor get copies of their own (safetensors' save_file
    refuses tensors that share memory). With `only`, the state under those names alone
    (every rank passing the same names): the rest moves nowhere."""
    placement = wrapped.placement
    if not placement.deployed:
        if not keep:
            return None
        out = _only(placement.module_state_dict(*args, destination=destination, prefix=prefix,
                                                keep_vars=keep_vars), only, prefix)
        return _untied(out) if untied else out
    comm, rank = _C.Communicator.world_cpu(), _C.get_rank()
    world = set(range(_C.get_world_size()))
    out = _only(placement.module_state_dict(*args, destination=destination, prefix=prefix,
                                            keep_vars=True), only, prefix)
    wanted = None if only is None else {id(v) for v in out.values()}
    gathered = {}
    sources = placement.sources()
    resized = _resized_buffers(placement, sources, rank)
    for i, (t, (owner, current)) in enumerate(zip(placement.tensors(), sources)):
        if wanted is not None and id(t) not in wanted:
            continue
        if current == world:
            if not keep:
                continue
            value = t.detach().to("cpu", copy=True)
        else:
            value = (t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
                     if rank == owner
                     else torch.empty(resized.get(i, placement.full_shape(i, t)), dtype=t.dtype))
            comm.broadcast(value, owner).wait()
        if keep:
            gathered[id(t)] = value
    if not keep:
        return None
    for k, v in out.items():
        if isinstance(v, torch.Tensor) and id(v) in gathered:
            out[k] = gathered[id(v)]
    return _untied(out) if untied else out


def _resized_buffers(placement, sources, rank: int) -> dict[int, tuple]:
    """The owners' shapes of the buffers a forward resized since they were freed elsewhere
    (a per-channel observer sizes its range at its first call: the others' empty shapes
    made the broadcast MPI_ERR_TRUNCATE). One all-gather of each owner's buffers' shapes."""
    from .transport import all_gather_objects
    tensors = placement.tensors()
    first_buffer = placement.first_buffer()
    mine = {i: tuple(tensors[i].shape) for i in range(first_buffer, len(tensors))
            if sources[i][0] == rank}
    shapes = {}
    for owned in all_gather_objects(mine):
        shapes.update(owned)
    return {i: shape for i, shape in shapes.items()
            if shape != tuple(placement.full_shape(i, tensors[i]))}


def _only(state: dict, names: set[str] | None, prefix: str = "") -> dict:
    """`state` restricted to `names` (module names, under `prefix`); all of it for None."""
    if names is None:
        return state
    for k in [k for k in state if k[len(prefix):] not in names]:
        del state[k]
    return state


def _untied(state: dict) -> dict:
    """`state` with each tied tensor's second and later names given a copy of their own
    (state_dict() detaches each name's tensor anew: ties are found by their memory)."""
    given = set()
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            at = v.untyped_storage().data_ptr() if v.device.type != "meta" else 0
            key = (v.device, at, v.storage_offset(), tuple(v.shape)) if at else id(v)
            if key in given:
                state[k] = v.detach().clone()
            given.add(key)
    return state


def load_state_dict(wrapped, state_dict, strict: bool = True, assign: bool = False):
    """Loads a full model state (from plain PyTorch or another world size; every rank
    passes the whole dict) into the tensors this rank keeps. Keys and shapes are checked
    as torch does, the freed tensors' included."""
    if assign and wrapped.deployments:
        raise _C.Error("load_state_dict(assign=True) would replace the tensors the deployed "
                       "stages run with; load with assign=False (the default)")
    freed_here = wrapped.placement.freed()
    tensors = wrapped.placement.tensors()
    freed = {id(tensors[i]): shape for i, shape in freed_here.items()}
    own = wrapped.placement.module_state_dict(keep_vars=True)
    shapes = {k: freed[id(v)] for k, v in own.items()
              if isinstance(v, torch.Tensor) and id(v) in freed}  # the freed tensors' keys
    # [Note: a load that fails changes nothing] The shapes of every key are checked before
    # any is copied, the kept tensors' too (but where a module loads its own way, as an
    # observer that resizes its range): torch copies the keys that fit and raises after,
    # and here each rank copied its own stages' keys, so a load caught and gone on from
    # left the model half-loaded, another half on each rank.
    plain = _loads_plainly(wrapped.module)
    whole = {k: shapes.get(k, v.shape) for k, v in own.items()
             if isinstance(v, torch.Tensor) and (k in shapes or k.rpartition(".")[0] in plain)}
    errors = [f"size mismatch for {k}: copying a param with shape {state_dict[k].shape} from "
              f"checkpoint, the shape in current model is {whole[k]}."
              for k in whole if k in state_dict and isinstance(state_dict[k], torch.Tensor)
              and state_dict[k].shape != whole[k]]
    if errors:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(wrapped.module).__name__}:"
                           "\n\t" + "\n\t".join(errors))
    if not freed_here:
        result = wrapped.placement.module_load_state_dict(state_dict, strict=strict, assign=assign)
        wrapped.placement.loaded(_loaded(wrapped, state_dict))
        return result
    kept = collections.OrderedDict((k, v) for k, v in state_dict.items() if k not in shapes)
    if getattr(state_dict, "_metadata", None) is not None:
        kept._metadata = state_dict._metadata
    result = wrapped.placement.module_load_state_dict(kept, strict=False)
    wrapped.placement.loaded(_loaded(wrapped, kept))
    missing = [k for k in result.missing_keys if k not in state_dict]
    unexpected = list(result.unexpected_keys)
    if strict and (missing or unexpected):
        errors = []
        if missing:
            errors.append("Missing key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in missing) + ". ")
        if unexpected:
            errors.append("Unexpected key(s) in state_dict: "
                          + ", ".join(f'"{k}"' for k in unexpected) + ". ")
        raise RuntimeError(f"Error(s) in loading state_dict for {type(wrapped.module).__name__}:"
                           "\n\t" + "\n\t".join(errors))
    return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


def _loads_plainly(model: torch.nn.Module) -> set[str]:
    """The names of the modules that load their tensors as nn.Module does (no
    _load_from_state_dict of their own)."""
    default = torch.nn.Module._load_from_state_dict
    return {name for name, m in model.named_modules()
            if type(m)._load_from_state_dict is default}


def _loaded(wrapped, state_dict) -> list[torch.Tensor]:
    """The module's tensors that `state_dict` gave values to."""
    own = wrapped.placement.module_state_dict(keep_vars=True)
    return [own[k] for k in state_dict if isinstance(own.get(k), torch.Tensor)]


def gather_optimizer_state(wrapped, optimizer=None) -> dict:
    """The optimizer's full state in the format of the original optimizer's state_dict()
    ('state' keyed by each parameter's index in the original param_groups, 'param_groups'
    with the original index lists), gathered from the ranks that update each parameter,
    on every rank (a collective). It loads into a plain torch optimizer over the same
    model's parameters. With several optimizers, their groups one after another, or those
    of `optimizer` alone ([Note: several optimizers] in optimizer_share.py)."""
    if wrapped.optimizer is None:
        raise _C.Error("optimizer_state_dict: this RaNNCModule was built without an optimizer")
    share = wrapped.optimizer_share
    if not share.patched:
        if optimizer is not None or len(share.optimizers) == 1:
            return (optimizer or share.optimizer).state_dict()
        return _concatenated([o.state_dict() for o in share.optimizers])
    rank = _C.get_rank()
    position = {id(t): i for i, t in enumerate(wrapped.placement.tensors())}
    sources = wrapped.placement.sources()
    groups, mine, start = [], {}, 0
    for group, (params, names) in zip(share.groups(optimizer), share.original_groups(optimizer)):
        packed = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        packed["params"] = list(range(start, start + len(params)))
        if names is not None:
            packed["param_names"] = list(names)
        for index, p in zip(packed["params"], params):
            i = position.get(id(p))
            # a parameter no stage uses, or one outside the module (the user's, stepped on
            # every rank as under DDP): every rank's share holds its state; rank 0 gives it
            owner = 0 if i is None or sources[i][0] is None else sources[i][0]
            if owner == rank and share.state(p):
                mine[index] = share.state(p)
        start += len(params)
        groups.append(packed)
    state = {}
    for part in all_gather_objects(mine):
        state.update(part)
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def _concatenated(state_dicts: list[dict]) -> dict:
    """Several optimizers' state_dicts as one: their groups one after another, the
    parameters numbered on."""
    result, start = {"state": {}, "param_groups": []}, 0
    for sd in state_dicts:
        count = sum(len(g["params"]) for g in sd["param_groups"])
        renumber = {j: start + k for k, j in enumerate(j for g in sd["param_groups"]
                                                       for j in g["params"])}
        result["param_groups"] += [{**g, "params": [renumber[j] for j in g["params"]]}
                                   for g in sd["param_groups"]]
        result["state"].update({renumber[j]: v for j, v in sd["state"].items()})
        start += count
    return result


def load_optimizer_state(wrapped, state_dict: dict) -> None:
    """Loads an optimizer state in the original optimizer's format (from
    optimizer_state_dict(), from a plain torch optimizer over the same model, or from
    another world size; every rank passes the whole dict): each rank takes the state of
    the parameters it updates. Hyperparameters come from the dict, as in torch."""
    if wrapped.optimizer is None:
        raise _C.Error("load_optimizer_state_dict: this RaNNCModule was built without an "
                       "optimizer")
    wrapped.optimizer_share.load(optimizer_state_share(wrapped, state_dict))


def optimizer_state_share(wrapped, state_dict: dict, optimizer=None) -> dict:
    """This rank's share of an optimizer state in the original optimizer's format (of all
    the module's optimizers, or of `optimizer`), in the format of the optimizers as cut
    (see load_optimizer_state)."""
    share = wrapped.optimizer_share
    if not share.patched:
        return {**state_dict, "state": copy.deepcopy(state_dict["state"])}
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(share.original_groups(optimizer)):
        raise ValueError("loaded state dict has a different number of parameter groups")
    local = {"state": {}, "param_groups": []}
    for saved, group, (params, _) in zip(saved_groups, share.groups(optimizer),
                                         share.original_groups(optimizer)):
        if len(saved["params"]) != len(params):
            raise ValueError("loaded state dict contains a parameter group that doesn't "
                             "match the size of optimizer's group")
        keep = {id(p) for p in group["params"]}
        chosen = [j for j, p in enumerate(params) if id(p) in keep]
        mine = {k: v for k, v in saved.items() if k not in ("params", "param_names")}
        mine["params"] = [saved["params"][j] for j in chosen]
        if "param_names" in saved:
            mine["param_names"] = [saved["param_names"][j] for j in chosen]
        local["param_groups"].append(mine)
        for index in mine["params"]:
            if index in state_dict["state"]:
                local["state"][index] = state_dict["state"][index]
    # torch keeps Adam's `step` tensors of the dict it loads; a copy keeps the caller's
    # dict (perhaps another optimizer's live state) apart from this optimizer's.
    local["state"] = copy.deepcopy(local["state"])
    return local
