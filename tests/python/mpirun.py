"""Runs a script under real `mpirun` on CPU ranks, for the multi-rank tests."""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def mpirun(script, np, *args, timeout=300, env=None):
    """Runs tests/python/mpi/<script> on `np` ranks; returns the CompletedProcess (output
    of all ranks in .stdout). Raises subprocess.TimeoutExpired if the job outlives
    `timeout` seconds (a hang)."""
    launcher = shutil.which("mpirun")
    assert launcher, "mpirun not found (apt-get install openmpi-bin)"
    full_env = dict(os.environ)
    full_env.update({
        "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMP_NUM_THREADS": "1",
        # the checkout's package and the examples
        "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "python"), os.path.join(ROOT, "examples"),
                                       HERE, full_env.get("PYTHONPATH", "")]),
    })
    full_env.update(env or {})
    cmd = [launcher, "--oversubscribe", "-np", str(np),
           # shared memory on one host; no ptrace-based single copy (blocked in containers)
           "--mca", "btl", "self,vader", "--mca", "btl_vader_single_copy_mechanism", "none",
           sys.executable, os.path.join(HERE, "rank_main.py"), os.path.join(HERE, "mpi", script),
           *map(str, args)]
    res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         timeout=timeout, env=full_env)
    if res.returncode != 0:
        res.stdout += first_errors(res.stdout)
    return res


def first_errors(output: str) -> str:
    """What a failed run's ranks said went wrong, appended to its output: the lines that name
    an error (once each, in order), then the stacks faulthandler printed for the ranks
    mpirun stopped (rank_main.py). Tests show the output's tail, and with several ranks the
    tail is the last rank's traceback, not the first rank's cause."""
    errors, stacks, seen, in_stack = [], [], set(), False
    for line in output.splitlines():
        if line.lstrip("[]rank0123456789: ").startswith(("Current thread", "Thread 0x")):
            in_stack = True
            stacks.append(line[:300])
        elif in_stack and "File \"" in line:
            if "<frozen runpy>" not in line and "rank_main.py" not in line:
                stacks.append(line[:300])
        else:
            in_stack = False
            if any(m in line for m in ("Error", "Exception", "Timeout", "FAILED")) \
                    and line not in seen:
                seen.add(line)
                errors.append(line[:300])
    if not errors and not stacks:
        return ""
    return ("\n===== what went wrong, in order (tests/python/mpirun.py) =====\n"
            + "\n".join(errors[:20] + stacks[:40]) + "\n")
