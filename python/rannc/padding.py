"""Dynamic padding across ranks: every rank's batch padded to the longest sequence of the
global batch.

    batch = collator(examples)              # padded to this rank's longest sequence
    batch = rannc.pad_to_same_length(batch, {"input_ids": tokenizer.pad_token_id,
                                             "attention_mask": 0, "labels": -100})
    loss = model(**batch).loss

The ranks' batches are rows of one global batch, so in each call every rank must pass the
same shapes ([Note: new input shapes] in module.py); a per-rank collator pads each rank to
its own longest sequence. Padding with what the model ignores (a pad token under an
attention mask of 0, labels of -100) computes what the model computes on the unpadded
rows, as transformers' own padding does. `multiple_of` rounds the length up, so fewer
distinct lengths are traced.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _C


def pad_to_same_length(batch: Mapping, pad_values: Mapping, dim: int = 1,
                       multiple_of: int = 1, side: str = "right") -> dict:
    """`batch` (a dict of tensors, as a transformers collator returns) with every tensor
    named in `pad_values` padded along `dim` with its value to the longest that entry is on
    any rank, rounded up to `multiple_of` (a collective: every rank calls it in the same
    step with the same keys). `side`: "right" (transformers' default) or "left". Other entries are
    returned as they are."""
    if side not in ("right", "left"):
        raise _C.Error(f"pad_to_same_length: side must be 'right' or 'left', not {side!r}")
    if multiple_of < 1:
        raise _C.Error(f"pad_to_same_length: multiple_of must be >= 1, not {multiple_of}")
    missing = [k for k in pad_values if k not in batch]
    if missing:
        raise _C.Error(f"pad_to_same_length: the batch has no {missing} (it has {sorted(batch)})")
    keys = list(pad_values)
    for key in keys:
        t = batch[key]
        if not isinstance(t, torch.Tensor) or not -t.dim() <= dim < t.dim():
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise _C.Error(f"pad_to_same_length: {key!r} is {shape}, not a tensor with a "
                           f"dimension {dim} to pad")
    # each entry to its own longest (T5's labels are not as long as its input_ids)
    longest = torch.tensor([batch[k].shape[dim] for k in keys], dtype=torch.int64)
    if _C.get_world_size() > 1:  # starts MPI if the first RaNNCModule has not yet
        comm = _C.Communicator.world_cpu()
        everyone = torch.empty(comm.size, len(keys), dtype=torch.int64)
        comm.all_gather(longest, everyone).wait()
        longest = everyone.max(dim=0).values
    out = dict(batch)
    for key, length in zip(keys, longest.tolist()):
        t = batch[key]
        target = -(-length // multiple_of) * multiple_of
        shape = list(t.shape)
        shape[dim] = target - t.shape[dim]
        if shape[dim] == 0:
            continue
        fill = torch.full(shape, pad_values[key], dtype=t.dtype, device=t.device)
        out[key] = torch.cat([t, fill] if side == "right" else [fill, t], dim=dim)
    return out
