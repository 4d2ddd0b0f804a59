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
           sys.executable, os.path.join(HERE, "mpi", script), *map(str, args)]
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, env=full_env)
