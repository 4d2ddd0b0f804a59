"""GPU tests: run on a machine with a CUDA device and rannc built against CUDA torch
(`bash scripts/test_gpu.sh`). Not part of scripts/test.sh (CI has no GPU).

Without a CUDA device, or with a CPU-only build of rannc, the session stops with an error
instead of skipping: a GPU run that tested nothing must not read as passed."""
import os
import sys

import pytest
import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "python"))  # zoo, shared with the CPU tests
# the package from this checkout (the build copies rannc/_C there), not an older install
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
torch.set_num_threads(1)

from report import pytest_runtest_logreport  # noqa: E402,F401 (a hook)


def pytest_sessionstart(session):
    from rannc import _C
    why = None
    if not torch.cuda.is_available():
        why = f"no CUDA device (torch {torch.__version__}, CUDA {torch.version.cuda})"
    elif not _C.has_cuda_profiler:
        why = "rannc was built against a torch without CUDA (rebuild on this machine)"
    if why:
        pytest.exit(f"tests/gpu need a CUDA device: {why}", returncode=3)
