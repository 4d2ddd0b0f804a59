"""Dynamic padding across ranks: every rank's batch padded to the longest sequence of the
global batch.

    batch = collator(examples)              # padded to this rank's longest sequence
    batch = rannc.pad_to_same_length(batch, {"input_ids": tokenizer.pad_token_id,
                                             "attention_mask": 0, "labels": -100})
    loss = model(**batch).loss

or, where the loop is not the user's (transformers' Trainer, a collator in DataLoader
workers), the module pads each call's arguments itself:

    model = rannc.RaNNCModule(model, pad_values="transformers")   # or a dict as above

The ranks' batches are rows of one global batch, so in each call every rank must pass the
same shapes ([Note: new input shapes] in deployed.py); a per-rank collator pads each rank to
its own longest sequence. Padding with what the model ignores (a pad token under an
attention mask of 0, labels of -100) computes what the model computes on the unpadded
rows, as transformers' own padding does. `multiple_of` rounds the length up, so fewer
distinct lengths are traced.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from . import _C, failure, handshake


def _padded(t: torch.Tensor, length: int, value, dim: int, side: str) -> torch.Tensor:
    """`t` padded along `dim` with `value` to `length`."""
    shape = list(t.shape)
    shape[dim] = length - t.shape[dim]
    if shape[dim] <= 0:
        return t
    fill = torch.full(shape, value, dtype=t.dtype, device=t.device)
    return torch.cat([t, fill] if side == "right" else [fill, t], dim=dim)


def _rounded(length: int, multiple_of: int) -> int:
    return -(-length // multiple_of) * multiple_of


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
        out[key] = _padded(batch[key], _rounded(length, multiple_of), pad_values[key], dim, side)
    return out


# [Note: padding calls] A per-rank collator pads each rank's batch to its own longest
# sequence, but the ranks' batches are rows of one global batch and must have one shape
# in each call ([Note: new input shapes] in deployed.py). Where the loop is the user's,
# pad_to_same_length pads after the collator; where it is not (transformers' Trainer, whose
# collator runs inside its DataLoader, maybe in worker processes where no collective may
# run), the option pad_values makes each call pad its arguments: the module exchanges
# the lengths of the arguments it names (dimension 1) in the call's own handshake and,
# where they differ between ranks, pads each on the right to the longest, rounded up to
# pad_multiple_of so that fewer lengths are traced. Padding with what the model ignores
# computes what it computes on the unpadded rows; outputs along that dimension come back
# at the padded length, as from a collator that padded more. Where every rank passes one
# length nothing is padded. "transformers" names transformers' own padding values; since
# a padded token is only ignored under an attention mask of 0, padding input_ids without
# its mask in the call is an error on every rank, naming it.
TRANSFORMERS = "transformers"
_MASK_OF = {"input_ids": "attention_mask", "decoder_input_ids": "decoder_attention_mask"}


def transformers_pad_values(model: torch.nn.Module) -> dict:
    """What transformers' collators pad each model argument with."""
    config = getattr(model, "config", None)
    pad = getattr(config, "pad_token_id", None)
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad
    pad = 0 if pad is None else int(pad)
    return {"input_ids": pad, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0,
            "labels": -100, "decoder_input_ids": pad, "decoder_attention_mask": 0}


class CallPadding:
    """Pads each call's named arguments to the longest of the call over the ranks
    ([Note: padding calls])."""

    DIM = 1

    def __init__(self, values, model: torch.nn.Module, signature, multiple_of: int):
        self.check_masks = values == TRANSFORMERS
        values = transformers_pad_values(model) if self.check_masks else dict(values)
        params = signature.parameters
        positional = [n for n, p in params.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        open_kwargs = any(p.kind == p.VAR_KEYWORD for p in params.values())
        # names the model cannot take are never passed: fewer lengths to exchange
        self.values = {n: v for n, v in values.items() if n in params or open_kwargs}
        self.position = {n: positional.index(n) for n in self.values if n in positional}
        self.multiple_of = multiple_of

    def _argument(self, name, args, kwargs):
        if name in kwargs:
            t = kwargs[name]
        elif name in self.position and self.position[name] < len(args):
            t = args[self.position[name]]
        else:
            return None
        return t if isinstance(t, torch.Tensor) and t.dim() > self.DIM else None

    def pad(self, what: str, args, kwargs):
        """(args, kwargs) with the named arguments padded where the ranks' lengths differ
        (a collective: every rank in call `what`)."""
        names = list(self.values)
        given = {n: self._argument(n, args, kwargs) for n in names}
        mine = torch.tensor([given[n].shape[self.DIM] if given[n] is not None else -1
                             for n in names], dtype=torch.float64)
        # the lengths travel in the call's own handshake, a few at a time
        rows = [handshake.exchange(what, mine[i:i + handshake.PAYLOAD])
                for i in range(0, len(names), handshake.PAYLOAD)] or [torch.zeros(1, 0)]
        everyone = torch.cat(rows, dim=1).long()
        targets = {}
        for i, n in enumerate(names):
            lengths = [x for x in everyone[:, i].tolist() if x >= 0]
            if given[n] is not None and len(set(lengths)) > 1:
                targets[n] = _rounded(max(lengths), self.multiple_of)
        unmasked = [n for n in targets if self.check_masks and n in _MASK_OF
                    and given.get(_MASK_OF[n]) is None]
        if unmasked:
            raise failure.agreed(
                f"option pad_values=\"transformers\" would pad {unmasked[0]} to "
                f"{targets[unmasked[0]]} tokens (the ranks' lengths differ), but the call has no "
                f"{_MASK_OF[unmasked[0]]}: the model would attend to the padding. Pass the "
                f"attention mask, or give pad_values as a dict (your padding, your semantics)")
        if not targets:
            return args, kwargs
        args, kwargs = list(args), dict(kwargs)
        for n, length in targets.items():
            t = _padded(given[n], length, self.values[n], self.DIM, "right")
            if n in kwargs:
                kwargs[n] = t
            else:
                args[self.position[n]] = t
        return tuple(args), kwargs
