"""A pytest hook shared by tests/python and tests/gpu: with RANNC_FAILURES_AT_ONCE=1 a failed
test's report (the tail of its assertion message and traceback) is printed the moment it
fails, not in the summary at the end, and a passed test's duration. The GPU session runs under a time limit that can stop
pytest before its summary, which then named the failed tests and not one cause."""
import os
import sys


def pytest_runtest_logreport(report):
    if os.environ.get("RANNC_FAILURES_AT_ONCE") != "1":
        return
    if report.when == "call" and report.passed:  # what each test costs the session
        sys.__stderr__.write(f"\n----- {report.nodeid} passed in {report.duration:.0f} s\n")
    if report.failed:
        text = report.longreprtext
        sys.__stderr__.write(f"\n----- {report.nodeid} failed ({report.when}); its report's last "
                             f"6000 characters:\n{text[-6000:]}\n----- end of {report.nodeid}\n")
        sys.__stderr__.flush()
