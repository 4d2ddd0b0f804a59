"""The MPI data plane and failure handling under real mpirun."""
import re
import time

import pytest

from mpirun import mpirun


@pytest.mark.parametrize("np", [1, 2, 4])
def test_data_plane_moves_and_reduces_tensors(np):
    res = mpirun("comm_check.py", np, timeout=240)
    assert res.returncode == 0, res.stdout
    for r in range(np):
        assert f"OK rank {r}" in res.stdout, res.stdout


def test_a_failing_rank_ends_every_rank_with_its_name():
    start = time.monotonic()
    res = mpirun("failure_check.py", 3, "raise", timeout=120)
    assert res.returncode != 0
    assert "FAILED rank 1 | stage 1: ValueError: shape mismatch in stage 1" in res.stdout, res.stdout
    for r in (0, 2):
        assert f"FAILED rank {r} | stage {r}: CommError: rank {r} stops because rank 1 failed" \
            in res.stdout, res.stdout
    assert time.monotonic() - start < 100


def test_after_a_caught_failure_every_wait_fails_at_once_naming_it():
    """[Note: failures stay] in csrc/comm/world.cpp: a script that catches a rank's failure
    and goes on would pair one rank's collective with another's (MPI_ERR_TRUNCATE, a
    transfer into the wrong buffer) or wait out the whole timeout; each later wait fails
    at once with the first failure instead, on the failing rank too."""
    res = mpirun("failure_check.py", 3, "again", timeout=120)
    assert res.returncode != 0
    for r in range(3):
        assert f"CAUGHT rank {r}" in res.stdout, res.stdout
        line = next((ln for ln in res.stdout.splitlines() if f"AGAIN rank {r} " in ln), None)
        assert line is not None, res.stdout
        assert "the job failed before" in line and "shape mismatch in stage 1" in line, line
        assert "end the script" in line, line
        seconds = float(line.split(" after ")[1].split(" s:")[0])
        assert seconds < 5, line  # not the 120 s wait


def test_a_failed_run_shows_where_a_rank_outside_collectives_was():
    """When one rank fails, mpirun stops the others; a rank stuck elsewhere than rannc (in a
    DataLoader, a lock) printed nothing before, and the test's output tail held only the
    failing rank's traceback (a CI failure of the Trainer test said no more). The test
    harness (rank_main.py, mpirun.first_errors) puts both at the end of the output."""
    res = mpirun("stuck_rank.py", 2, timeout=120)
    assert res.returncode != 0
    tail = res.stdout[-2000:]
    assert "RuntimeError: rank 1 fails on purpose" in tail, res.stdout
    assert "in waiting_for_something_else" in tail, res.stdout


def test_a_stuck_peer_times_out_instead_of_hanging():
    start = time.monotonic()
    res = mpirun("failure_check.py", 3, "hang", timeout=120)
    assert time.monotonic() - start < 100
    assert res.returncode != 0
    assert "FAILED rank 0 | stage 0: CommTimeoutError" in res.stdout, res.stdout
    assert "did not complete within 2 s" in res.stdout, res.stdout
    # rank 2 learns of it while waiting; rank 1 either learns of it in its barrier or is
    # ended by the abort that a failed rank makes on exit (so nothing hangs).
    assert "FAILED rank 2 | stage 2: CommError: rank 2 stops because rank 0 failed" in res.stdout, res.stdout


def test_a_caught_timeout_tells_the_peers_and_fails_the_next_wait_at_once():
    """[Note: a timeout is a failure] in csrc/comm/world.cpp: a CommTimeoutError the script
    caught left its request in flight and the peers waiting out their own timeouts; the
    next call paired with a peer's late collective (an InternalError calling itself a bug).
    Now the peers stop at once naming the timeout, and the next wait fails at once."""
    res = mpirun("failure_check.py", 3, "caught_timeout", timeout=120)
    assert res.returncode != 0
    assert "CAUGHT rank 0: rank 0: MPI recv" in res.stdout, res.stdout
    again = {int(m[0]): (float(m[1]), m[2]) for m in
             re.findall(r"AGAIN rank (\d) at ([\d.]+) s: (.*)", res.stdout)}
    assert {0, 2} <= again.keys(), res.stdout  # (the stuck rank 1 is ended by their abort)
    at, message = again[0]
    assert at < 4 and "cannot communicate: the job failed before" in message, res.stdout
    # rank 2 learns while rank 1 still sleeps: the timeout itself told it
    at, message = again[2]
    assert at < 5 and "stops because rank 0 failed: rank 0: MPI recv" in message and \
        "did not complete within 2 s" in message, res.stdout


def test_processes_a_rank_starts_see_its_rank_and_never_start_mpi():
    """[Note: processes a rank starts] in csrc/comm/world.cpp: a spawned DataLoader worker
    reading rannc.get_rank() and a subprocess calling rannc crashed in MPI_Init (they
    inherited the rank's launcher variables); they see the rank that started them, and a
    RaNNCModule there is an error saying why (mpi/child_processes_check.py)."""
    res = mpirun("child_processes_check.py", 2, timeout=240)
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
