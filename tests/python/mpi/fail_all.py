"""For scripts run under mpirun: an uncaught exception on one rank ends every rank (the
others may be waiting for it), through rannc's failure notices."""
import sys

import rannc


def install():
    """Makes an uncaught exception report a failure to every rank before the usual trace."""
    rank = rannc.get_rank()

    def hook(kind, value, tb):
        rannc._C.report_failure(f"rank {rank}: {kind.__name__}: {value}")
        sys.__excepthook__(kind, value, tb)

    sys.excepthook = hook
