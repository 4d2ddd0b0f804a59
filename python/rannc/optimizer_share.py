"""The user's optimizer, cut down to the parameters this rank's training stage updates.

The optimizer object stays the user's (its step, zero_grad, hyperparameters and schedulers
work as before); once training is deployed its param groups hold only this rank's
parameters (the same tensor objects) and the state of the others is dropped. The groups as
the user built them are remembered: checkpoints and optimizer_state_dict() name and number
parameters as the original optimizer did.
"""
from __future__ import annotations

import torch


class OptimizerShare:
    def __init__(self, optimizer: torch.optim.Optimizer | None):
        self.optimizer = optimizer
        self._original = None  # per group: (params, param_names or None), before patching

    @property
    def patched(self) -> bool:
        """Whether the groups hold only this rank's parameters (training is deployed)."""
        return self._original is not None

    def original_groups(self) -> list[tuple[list[torch.Tensor], list[str] | None]]:
        """Per param group: (its parameters, its param_names or None) as the user built it."""
        if self._original is not None:
            return self._original
        return [(list(g["params"]), None if g.get("param_names") is None else list(g["param_names"]))
                for g in self.optimizer.param_groups]

    def keep_only(self, own: set[int]) -> None:
        """Cuts every group down to the parameters whose id() is in `own` and drops the
        others' state; once (later training deployments keep the first cut)."""
        if self.optimizer is None or self.patched:
            return
        self._original = []
        for group in self.optimizer.param_groups:
            params, names = list(group["params"]), group.get("param_names")
            self._original.append((params, None if names is None else list(names)))
            keep = [id(p) in own for p in params]
            group["params"] = [p for p, k in zip(params, keep) if k]
            if names is not None:
                group["param_names"] = [n for n, k in zip(names, keep) if k]
            for p, k in zip(params, keep):
                if not k:
                    self.optimizer.state.pop(p, None)
