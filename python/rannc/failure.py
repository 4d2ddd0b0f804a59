"""A failing rank ends the job in seconds on every rank, whatever failed.

[Note: failure notices] An error inside rannc is reported to every peer before it is
raised (RaNNCModule.forward, planning). An exception anywhere else on a rank (the user's
loop between steps, a data loader) would leave the peers waiting in their next
collective for the whole comm_timeout, and the raising rank's MPI shutdown waiting for
them. So rannc hooks uncaught exceptions: the hook sends a failure notice naming the rank
and the exception to every peer, then lets the usual traceback print. A peer waiting in
rannc sees the notice within milliseconds and raises CommError("rank 0 stops because rank 1
failed: rank 1: ValueError: ..."), which is uncaught in turn and ends it. The failed rank
waits a moment (RANNC_FAILURE_GRACE seconds, default 2) before exiting, so that the peers
print the cause before its exit aborts the MPI job ([Note: at exit] in csrc/comm/world.cpp).
"""
from __future__ import annotations

import os
import sys
import time
import traceback

from . import _C

_installed = False


def agreed(message: str) -> _C.Error:
    """An error that every rank raises in the same call (from values all ranks gathered): no
    failure notice, and the job can go on if the user catches it."""
    error = _C.Error(message)
    error.on_every_rank = True
    return error


def some_of(names: list[str], shown: int = 3) -> str:
    """"a, b, c and 4 more": the first names of a list, for a message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def describe(error: BaseException) -> str:
    """'ValueError: boom (at train.py:42)': the exception and the innermost frame."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    notes = "".join(f"; {n}" for n in getattr(error, "__notes__", []))
    return f"{type(error).__name__}: {error}{where}{notes}"


def _hook(previous):
    def hook(kind, value, tb):
        reported = False
        try:
            if _C.mpi_initialized() and _C.get_world_size() > 1:
                # After a peer's notice this is a no-op; after a timeout it still ends the
                # job (the rank aborts at exit instead of waiting in MPI's shutdown).
                _C.report_failure(f"rank {_C.get_rank()}: {describe(value)}")
                reported = True
        except Exception:  # the hook must never hide the original error
            pass
        previous(kind, value, tb)
        if reported and (not isinstance(value, _C.CommError)
                         or isinstance(value, _C.CommTimeoutError)):
            sys.stderr.flush()
            time.sleep(float(os.environ.get("RANNC_FAILURE_GRACE", "2")))

    return hook


def install() -> None:
    """Chains rannc's hook in front of sys.excepthook (once per process)."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.excepthook = _hook(sys.excepthook)


# what to do about local batches of other sizes on the ranks (a DDP loop's last batch)
UNEQUAL_CURE = ("; the last batch of an epoch is the usual cause: drop it (DataLoader(..., "
                "drop_last=True)) or give every rank as many rows (DistributedSampler pads "
                "the dataset to a multiple of the ranks)")
