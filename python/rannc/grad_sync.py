"""Summing the step's gradients over the ranks that share each parameter (a stage's
replicas, and stages that share tied weights), overlapped with the last backward.

[Note: bucketed all-reduce] Each gradient group (ranks, parameters) is cut into buckets of
about `bucket_bytes`, parameters in descending value id (the order backward finishes them,
roughly). During the stage's last backward of the step, a parameter's gradient is final
once autograd has accumulated it (a post-accumulate-grad hook); a bucket's all-reduce
starts as soon as all its parameters are final and every earlier bucket has started, so
every member of a group starts the group's all-reduces in the same order (MPI and NCCL
need that) while the rest of the backward runs. Buckets whose parameters got no gradient
start at the end.
"""
from __future__ import annotations

import torch


class GradBuckets:
    def __init__(self, groups, own: dict, bucket_bytes: int = 4 << 20):
        """groups: [(communicator or None, [value id])] of this rank; own: value id ->
        parameter tensor this rank updates."""
        self.own = own
        self.buckets = []  # (communicator, [value id])
        for comm, vids in groups:
            if comm is None or not vids:
                continue
            current, size = [], 0
            for v in sorted(vids, reverse=True):
                current.append(v)
                size += own[v].numel() * own[v].element_size()
                if size >= bucket_bytes:
                    self.buckets.append((comm, current))
                    current, size = [], 0
            if current:
                self.buckets.append((comm, current))
        self._hooks, self._launched, self._ready = [], [], set()

    def arm(self):
        """Called right before the last backward of the step: start watching gradients."""
        self._ready.clear()
        for _, vids in self.buckets:
            for v in vids:
                self._hooks.append(self.own[v].register_post_accumulate_grad_hook(
                    lambda t, v=v: self._final(v)))

    def _final(self, vid):
        self._ready.add(vid)
        self._launch(lambda vids: all(v in self._ready for v in vids))

    def _launch(self, ready):
        while len(self._launched) < len(self.buckets):
            comm, vids = self.buckets[len(self._launched)]
            if not ready(vids):
                return
            flat = torch.cat([self._grad(v).reshape(-1) for v in vids])
            self._launched.append((vids, flat, comm.all_reduce(flat)))

    def _grad(self, v):
        t = self.own[v]
        return t.grad if t.grad is not None else torch.zeros_like(t)

    def disarm(self):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def finish(self, step_grads: dict):
        """After the step's backwards (before .grad is restored): starts what is left,
        waits, and puts the summed gradients into step_grads."""
        self.disarm()
        self._launch(lambda vids: True)
        for vids, flat, work in self._launched:
            work.wait()
            offset = 0
            for v in vids:
                n = self.own[v].numel()
                step_grads[v] = flat[offset:offset + n].view_as(self.own[v])
                offset += n
        self._launched.clear()
