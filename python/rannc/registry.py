"""The RaNNCModules alive, for the torch functions that rannc makes see every stage
(clipping.py, amp.py) and for optimizers built after wrapping (optimizer_share.py). Oldest
first, so every rank walks them in the same order."""
from __future__ import annotations

import weakref

# A dict keeps insertion order; a module collected leaves it.
_MODULES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def register(module) -> None:
    _MODULES[id(module)] = module


def modules() -> list:
    return list(_MODULES.values())


def holds(optimizer, module) -> bool:
    """Whether `optimizer`'s groups hold any of `module`'s parameters (freed ones too: the
    same answer on every rank)."""
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return any(id(p) in held for p in module.module.parameters())


def owners(optimizer) -> list:
    """The RaNNCModules whose parameters `optimizer` steps: as one passed to them (which
    holds this rank's share) or as one over the model's parameters (whose freed ones have
    no gradient here). The same on every rank."""
    return [m for m in modules() if any(o is optimizer for o in m.optimizers) or holds(optimizer, m)]

