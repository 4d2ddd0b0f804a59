"""`python -m rannc.plan path/to/script.py:factory --world-size 32 --devices-per-node 8
--device-memory 32GiB [--optimizer adam]`: plans a model without its devices.

The script is run as a script would be (its folder first on sys.path, __name__ not
"__main__", so a `if __name__ == "__main__":` block does not start training), then
`factory()` is called and must return (model, args) or (model, args, kwargs). Prints the
plan's summary; exits with status 2 and the memory a plan would need when none fits.
Under `mpirun -np N python -m rannc.plan ...` the profiling is spread over the N ranks.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys

from . import _C
from . import planning


def _load_factory(target: str):
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise SystemExit(f"rannc.plan: expected path/to/script.py:factory, got {target!r}")
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise SystemExit(f"rannc.plan: no such script {path}")
    sys.path.insert(0, os.path.dirname(path))
    namespace = runpy.run_path(path, run_name="__rannc_plan__")
    if name not in namespace or not callable(namespace[name]):
        raise SystemExit(f"rannc.plan: {path} defines no function {name!r}")
    return namespace[name]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m rannc.plan", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Options of the planner and the profiler:\n" + planning.option_docs())
    p.add_argument("target", help="path/to/script.py:factory")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--devices-per-node", type=int, default=8)
    p.add_argument("--device-memory", default="32GiB", help="bytes per device (32GiB, 16e9, ...)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd_momentum", "sgd"])
    p.add_argument("--cost-model", default="profile", choices=["profile", "analytic"])
    p.add_argument("--profile-cache", default="", help="load/save measured pieces in this file")
    p.add_argument("--profile-device", default=None,
                   help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--save-plan", default="", help="write the plan to this file")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="any other option of rannc.plan (repeatable)")
    a = p.parse_args(argv)

    options = {}
    for item in a.option:
        name, eq, value = item.partition("=")
        if not eq:
            raise SystemExit(f"rannc.plan: --option takes NAME=VALUE, got {item!r}")
        # Options.resolve converts the text as it converts RANNC_<NAME> variables.
        options[name] = value
    if a.profile_device:
        options["profile_device"] = a.profile_device

    made = _load_factory(a.target)()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise SystemExit("rannc.plan: the factory must return (model, args) or (model, args, kwargs)")
    model, args = made[0], made[1]
    kwargs = made[2] if len(made) == 3 else None
    try:
        result = planning.plan(model, args, kwargs, world_size=a.world_size,
                               devices_per_node=a.devices_per_node, device_memory=a.device_memory,
                               optimizer=a.optimizer, cost_model=a.cost_model,
                               profile_cache=a.profile_cache or None, **options)
    except _C.InfeasiblePlanError as e:
        needed = getattr(e, "bytes_needed", 0)
        if _C.get_rank() == 0:
            print(f"rannc.plan: no plan fits: {e}", file=sys.stderr)
            if needed:
                print(f"rannc.plan: a plan needs at least {needed} bytes ({planning.format_bytes(needed)}) "
                      f"of usable memory per device", file=sys.stderr)
        return 2
    if _C.get_rank() == 0:
        print(result.summary())
        if a.save_plan:
            result.save(a.save_plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
else:
    # `import rannc.plan` would replace the function rannc.plan by this module; keep it
    # callable as the function.
    import types

    class _CallableModule(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return planning.plan(*args, **kwargs)

    sys.modules[__name__].__class__ = _CallableModule
