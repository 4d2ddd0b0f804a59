import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# the package from this checkout (the build copies rannc/_C there), not an older install
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'python'))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', '..', 'examples'))
torch.set_num_threads(1)

from report import pytest_runtest_logreport  # noqa: E402,F401 (a hook)
