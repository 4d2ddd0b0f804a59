"""The pipeline engine as Python sees it: `_C.PipelineEngine` (csrc/runtime/engine.h) runs
this rank's stage of a plan for one step in one call: the schedule lowered with the
transfers into typed actions (print them with `engine.program()`), the receives posted one
action ahead, the bucketed gradient all-reduce overlapped with the last backward. This
wrapper adds what RaNNCModule reads of the IR: its values (read-only `_C.IrValue`), cached.
"""
from __future__ import annotations

import torch

from . import _C


class Engine:
    """Runs one rank's stage of a deployment (see _C.PipelineEngine)."""

    def __init__(self, traced, deployment, rank: int, world_size: int, local_batch: int,
                 state: dict, device: torch.device = torch.device("cpu"),
                 nccl: bool = False):
        """`state`: value id -> the module's tensor (this rank's stage's ones must be on
        `device` before the first step); `nccl`: CUDA stages talk over NCCL. Collective:
        creates the communicators of the gradient groups."""
        self.traced, self.ir = traced, traced.ir
        self.device, self.deployment = device, deployment
        self.rank, self.world_size = rank, world_size
        self._engine = _C.PipelineEngine(traced, deployment, rank, world_size, local_batch, state,
                                         str(device), nccl)
        self.stage, self.copy, self.replica = (self._engine.stage, self._engine.copy,
                                               self._engine.replica)
        self.pieces = self._engine.pieces
        self.loss_vid = self._engine.loss_vid
        self._values = {}

    def __getattr__(self, name):
        return getattr(self._engine, name)  # layout, use_batch, step, program, ...

    def value(self, vid: int) -> "_C.IrValue":
        if vid not in self._values:
            self._values[vid] = self.ir.value(vid)
        return self._values[vid]

    def empty(self, vid: int, device="cpu") -> torch.Tensor:
        """A tensor shaped like the traced value `vid` (a value without a batch dimension)."""
        v = self.value(vid)
        return torch.empty(v.shape, dtype=DTYPES[v.dtype], device=device)


DTYPES = {
    "Float32": torch.float32, "Float64": torch.float64, "Float16": torch.float16,
    "BFloat16": torch.bfloat16, "Int64": torch.int64, "Int32": torch.int32,
    "Int16": torch.int16, "Int8": torch.int8, "UInt8": torch.uint8, "Bool": torch.bool,
}
