"""Runs one rank of a multi-rank test: `python rank_main.py <script> args...` runs the script
as __main__ after asking faulthandler to print every thread's Python stack when the rank is
terminated. When one rank fails, mpirun sends the others SIGTERM (then SIGKILL a second
later), so a rank stuck elsewhere than a collective (a DataLoader worker, a lock) says where
it was instead of vanishing silently from the test's output; so does a rank that crashes."""
import faulthandler
import os
import runpy
import signal
import sys

faulthandler.enable(all_threads=True)  # a crash (SIGSEGV, SIGABRT) too
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
