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
"""
from __future__ import annotations

import zlib

import torch

from . import _C, failure

# What the codes name, for the message; a code's value is a hash of its name, so every
# rank computes the same one without agreeing on a table.
NAMES = ("a training call", "an eval call", "a copy's call", "state_dict()", "load_state_dict()",
         "optimizer_state_dict()", "load_optimizer_state_dict()", "save_checkpoint()",
         "load_checkpoint()", "clip_grad_norm", "GradScaler.unscale_()")
_CODES = {n: zlib.crc32(n.encode()) for n in NAMES}
_NAMES = {c: n for n, c in _CODES.items()}


def active() -> bool:
    """Whether there are other ranks to agree with."""
    return _C.mpi_initialized() and _C.get_world_size() > 1


def enter(what: str) -> None:
    """Every rank is in `what` (a collective), or every rank raises saying who is where."""
    if active():
        exchange(what, torch.zeros(0, dtype=torch.float64))


# Values a collective may send with its code. Every collective's row has this width, so
# that ranks in different collectives still exchange messages of one size (and learn so).
PAYLOAD = 4


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
    row[0], row[1:1 + mine.numel()] = float(_CODES[what]), mine
    everyone = torch.empty(comm.size, row.numel(), dtype=torch.float64)
    comm.all_gather(row, everyone.view(-1)).wait()
    codes = [int(c) for c in everyone[:, 0].tolist()]
    if len(set(codes)) > 1:
        raise failure.agreed(_mismatch(codes))
    return everyone[:, 1:1 + mine.numel()]


def _mismatch(codes: list[int]) -> str:
    calls = {}
    for rank, c in enumerate(codes):
        calls.setdefault(_NAMES.get(c, "another collective"), []).append(rank)
    where = "; ".join(f"{what} on rank{'s' if len(r) > 1 else ''} {_ranks(r)}"
                      for what, r in calls.items())
    message = (f"the ranks are in different RaNNCModule collectives: {where}. Every rank must "
               "make the same calls in the same order")
    if calls.keys() & {"state_dict()", "optimizer_state_dict()", "save_checkpoint()"}:
        message += (": state_dict(), optimizer_state_dict() and save_checkpoint() gather from "
                    "or write on every rank, so call them on every rank and write the file on "
                    "rank 0 only (not under `if rank == 0:` as with DistributedDataParallel)")
    elif {"a training call", "an eval call"} <= calls.keys():
        message += (": evaluate on every rank, each with its share of the evaluation data "
                    "(not on rank 0 alone)")
    return message


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) < 6 else f"{ranks[0]}-{ranks[-1]}"
