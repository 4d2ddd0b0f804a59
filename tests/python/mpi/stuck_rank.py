"""tests/python/test_comm.py: rank 1 fails at once while rank 0 waits outside any collective
(as a rank waiting for a DataLoader worker does); the test's output must show both."""
import time

import rannc


def waiting_for_something_else():
    time.sleep(120)


if rannc.get_rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
waiting_for_something_else()
