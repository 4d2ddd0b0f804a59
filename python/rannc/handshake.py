"""Which collective each rank is in, agreed before any of them communicates.

[Note: named collectives] A RaNNCModule's calls are collectives: a call, state_dict(),
save_checkpoint() and the others exchange tensors with every rank. A rank that makes a call
the others do not make, most often DistributedDataParallel's habit

    if rank == 0:
        torch.save(model.state_dict(), path)      # or an evaluation on rank 0 only

meets another operation on the other ranks, and two different MPI collectives matched on
one communicator hang, fail somewhere unrelated or exchange the wrong bytes. So each of them
begins with the same small all-gather of a code naming it; where the codes differ, every
rank raises an error naming what each rank called, before anything else is exchanged (a
rank that is in no collective at all leaves the others waiting until the option
comm_timeout). Where the operation already begins with a small exchange (a norm's sum, a
found-inf flag), the code travels in it: no extra round trip.

[Note: gathers asked by some ranks] DDP's habit of saving on rank 0 alone is also
transformers' Trainer's: its checkpoints call `model.state_dict()` and
`optimizer.state_dict()` on rank 0 only, then every rank goes on training. Those two are
gathers: the ranks other than the askers send and receive nothing they keep. So where the
codes differ because some ranks are in one gather (of one module, named by its serial
number in the row) and the others in any other collective, the others serve it: they take
part in the gather, drop what it gives them, and then meet again in their own collective.
At the end of the script every rank enters a last collective, "the end of the script",
which serves the same way, so a rank-0 save after training (Trainer.save_model) completes
and a rank that stops early meets a named error instead of a peer's timeout. The values a
rank serves are those its program order gives at its next collective, as the asker's are;
a module's optimizer.step() is one ([Note: a step is a collective] in optimizer_share.py), so
a state read between backward and step holds every parameter before the update.
A rank waiting in a world collective of torch.distributed serves too ([Note:
torch.distributed agrees with rannc] in process_group.py); one waiting elsewhere (a
subgroup, another library) cannot, and the asker fails after comm_timeout.
"""
from __future__ import annotations

import atexit
import itertools
import sys
import weakref
import zlib

import torch

from . import _C, failure

# What the codes name, for the message; a code's value is a hash of its name, so every
# rank computes the same one without agreeing on a table.
NAMES = ("a training call", "an eval call", "a copy's call", "state_dict()", "load_state_dict()",
         "optimizer_state_dict()", "load_optimizer_state_dict()", "save_checkpoint()",
         "load_checkpoint()", "clip_grad_norm", "torch.nn.utils.clip_grad_norm_()",
         "torch.nn.utils.get_total_norm()", "GradScaler.unscale_()", "generate()",
         "optimizer.step()", "a fill-drain backward",
         "the end of the script", "rannc.barrier()")
# torch.distributed's collectives on the world, which agree with rannc's once a RaNNCModule
# exists ([Note: torch.distributed agrees with rannc] in process_group.py)
TORCH_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object",
                     "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
                     "gather", "gather_object", "scatter", "scatter_object_list", "reduce",
                     "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                     "all_to_all_single")
NAMES += tuple(f"torch.distributed.{n}" for n in TORCH_COLLECTIVES)
# The collectives that gather to the ranks that call them ([Note: gathers asked by some ranks])
GATHERS = ("state_dict()", "optimizer_state_dict()")
_CODES = {n: zlib.crc32(n.encode()) for n in NAMES}
_NAMES = {c: n for n, c in _CODES.items()}
_GATHER_CODES = {_CODES[n] for n in GATHERS}

# What a gather's serial number names: the objects whose state the ranks gather (RaNNCModules
# and their copies, made in the same order on every rank), with a serve_gather(what) method.
_SOURCES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_serials = itertools.count(1)


def _code(what: str) -> int:
    """The code of collective `what`: one of NAMES, or a name made at run time (a call of a
    program of other arguments: [Note: other arguments] in module.py), learnt here."""
    code = _CODES.get(what)
    if code is None:
        code = _CODES[what] = zlib.crc32(what.encode())
        _NAMES[code] = what
    return code


def active() -> bool:
    """Whether there are other ranks to agree with."""
    return _C.mpi_initialized() and _C.get_world_size() > 1


def enter(what: str) -> None:
    """Every rank is in `what` (a collective), or every rank raises saying who is where."""
    if active():
        exchange(what, torch.zeros(0, dtype=torch.float64))


def barrier(timeout_s: float | None = None) -> None:
    """Blocks until every rank calls it (rannc.barrier; `timeout_s`: at most that long,
    else the option comm_timeout). Once a RaNNCModule exists it is a named collective: it
    serves a gather that ranks ask alone (DDP's `if rank == 0: torch.save(model.state_dict(),
    p)` then a barrier; before, MPI_ERR_TRUNCATE), and where a rank is in another
    collective, every rank raises naming where each is."""
    if active() and sources_made():
        enter("rannc.barrier()")  # an all-gather: no rank leaves before all came
    else:
        _C.barrier(timeout_s)


def sources_made() -> bool:
    """Whether a RaNNCModule (or a copy) was ever made here: the same on every rank, unlike
    whether one is still alive (the garbage collector frees cycles when it runs)."""
    return _made


_made = False


def register_source(source) -> int:
    """A serial number naming `source` in the gathers of its state, the same on every rank
    (sources are made in the same order everywhere). The first one makes the end of the
    script a collective ([Note: gathers asked by some ranks])."""
    global _made
    if not _made:
        _made = True
        atexit.register(_at_exit)
    serial = next(_serials)
    _SOURCES[serial] = source
    return serial


def gather(what: str, source, part: int = 0) -> None:
    """Enter gather `what` of `source`'s state (of its `part`, which source.serve_gather
    takes: one of its optimizers): with every rank, or with the ranks that are elsewhere
    serving it ([Note: gathers asked by some ranks])."""
    if active():
        exchange(what, torch.tensor([float(source.gather_serial), float(part)],
                                    dtype=torch.float64))


# Values a collective may send with its code. Every collective's row has this width, so
# that ranks in different collectives still exchange messages of one size (and learn so).
PAYLOAD = 6


def exchange(what: str, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's `mine` (at most PAYLOAD values, as many on every rank in `what`), row r
    from rank r, after checking that every rank is in `what`. One all-gather."""
    mine = mine.double().view(-1)
    if mine.numel() > PAYLOAD:
        raise ValueError(f"{what} sends {mine.numel()} values; the handshake carries {PAYLOAD}")
    if not active():
        return mine.view(1, -1)
    comm = _C.Communicator.world_cpu()
    row = torch.zeros(1 + PAYLOAD, dtype=torch.float64)
    row[0], row[1:1 + mine.numel()] = float(_code(what)), mine
    everyone = torch.empty(comm.size, row.numel(), dtype=torch.float64)
    while True:
        comm.all_gather(row, everyone.view(-1)).wait()
        codes = [int(c) for c in everyone[:, 0].tolist()]
        # a gather names its source and part: two ranks gathering different modules differ too
        keys = [(c, (int(s), int(p)) if c in _GATHER_CODES else (0, 0))
                for c, s, p in zip(codes, everyone[:, 1].tolist(), everyone[:, 2].tolist())]
        if len(set(keys)) == 1:
            return everyone[:, 1:1 + mine.numel()]
        asked = {k for k in keys if k[0] in _GATHER_CODES}
        if len(asked) != 1:
            raise failure.agreed(_mismatch(keys))
        (code, (serial, part)), = asked
        if keys[comm.rank] == (code, (serial, part)):
            return everyone[:, 1:1 + mine.numel()]  # the askers go on with their gather
        _serve(_NAMES[code], serial, part)


def _serve(what: str, serial: int, part: int) -> None:
    """Take part in gather `what` that other ranks asked for, dropping what it gives."""
    source = _SOURCES.get(serial)
    if source is None:  # this rank alone knows: not an agreed error, its peers are told
        raise _C.Error(f"rank {_C.get_rank()} has no model numbered {serial}, whose {what} "
                       "other ranks gather: build the same models on every rank")
    source.serve_gather(what, part)


def _at_exit() -> None:
    """The end of the script as a last collective ([Note: gathers asked by some ranks]):
    serves a gather that other ranks still wait in. It waits without a time limit, as
    MPI's own shutdown would; a rank that failed has already told its peers and skips it."""
    if not active() or _C.failure_reported():
        return
    try:
        _C.set_comm_timeout(1e8)  # no limit
        enter("the end of the script")
    except Exception as e:  # at exit: say why, and let the peers' errors end the job
        print(f"rannc: rank {_C.get_rank()} at the end of the script: {e}", file=sys.stderr,
              flush=True)
        _C.report_failure(f"rank {_C.get_rank()}: {e}")


def _mismatch(keys: list[tuple[int, tuple[int, int]]]) -> str:
    """The error for ranks in different collectives; `keys`: per rank, (code, (serial of the
    gathered model, its part) or (0, 0))."""
    serials = sorted({s for c, (s, _) in keys if c in _GATHER_CODES})
    parts = {(c, s): {p for c2, (s2, p) in keys if (c2, s2) == (c, s)} for c, (s, _) in keys}
    calls = {}
    for rank, (c, (s, p)) in enumerate(keys):
        name = _NAMES.get(c, "another collective")
        if c in _GATHER_CODES and len(serials) > 1:
            name += f" of model #{serials.index(s) + 1}"
        if c == _CODES["state_dict()"] and len(parts[(c, s)]) > 1:  # adapter_state_dict()
            name += " of the adapters" if p else " of the whole model"
        elif c in _GATHER_CODES and len(parts[(c, s)]) > 1:  # [Note: several optimizers]
            name += f" of {f'optimizer #{p}' if p else 'every optimizer'}"
        calls.setdefault(name, []).append(rank)
    where = "; ".join(f"{what} on rank{'s' if len(r) > 1 else ''} {_ranks(r)}"
                      for what, r in calls.items())
    message = (f"the ranks are in different RaNNCModule collectives: {where}. Every rank must "
               "make the same calls in the same order")
    gathers = {c for c, _ in keys if c in _GATHER_CODES}
    if len(gathers) > 1 or len({k for k in keys if k[0] in _GATHER_CODES}) > 1:
        message += (": some ranks may gather state_dict() or optimizer_state_dict() while the "
                    "others go on, but the ranks that gather must gather the same one of the "
                    "same model")
    elif "save_checkpoint()" in calls:
        message += (": save_checkpoint() writes on every rank, so call it on every rank at the "
                    "same point" + (" (not under `if rank == 0:` as with DistributedDataParallel)"
                                    if calls["save_checkpoint()"] == [0] else
                                    " (a rank that saves after its own error, in `except` or "
                                    "`finally`, meets the others elsewhere)"))
    elif any("with other arguments" in n for n in calls) or (
            "another collective" in calls and calls.keys() & {"a training call", "an eval call"}):
        message += (": in a call, every rank must pass arguments of the same structure and "
                    "the same values that are not tensors (each such set is another program, "
                    "[Note: other arguments] in module.py)")
    elif {"a training call", "an eval call"} <= calls.keys():
        message += (": evaluate on every rank, each with its share of the evaluation data "
                    "(not on rank 0 alone), and end loops together (a generation loop that "
                    "stops when this rank's sequences are done must go on until every rank's "
                    "are: agree on stopping, as with torch.distributed.all_reduce of a flag)")
    return message


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) < 6 else f"{ranks[0]}-{ranks[-1]}"
