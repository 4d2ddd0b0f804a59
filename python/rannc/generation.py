"""transformers' generate() on a model that rannc splits over the ranks.

[Note: generation through the pipeline] Evaluating a fine-tuned language model by what it
writes (samples during training, a ROUGE or exact-match metric, an RL step that samples from
the policy) calls transformers' `generate()`, which loops over the model's forward, one new
token per call. Under rannc no rank holds the whole model, so `model.module.generate` is
refused ([Note: the module's own state_dict] in placement.py) and RaNNCModule.generate runs
transformers' own loop (every decoding strategy, logits processor and stopping criterion as
the user configures them) with each forward routed through the pipeline:

- Every rank calls generate() together, each with its own prompts (its rows of the global
  batch, as in training). transformers' `synced_gpus` keeps a rank whose sequences are done
  calling the forward until every rank is done; the ranks agree on that in rannc's own
  handshake, so no torch.distributed group is needed.
- Without a key-value cache (the stages hold no state between calls), each forward runs
  over the whole sequence so far. Each new sequence length would be traced again ([Note:
  new input shapes] in module.py), so the sequence is padded on the right to a multiple of
  `length_step` tokens, the same on every rank (the longest rank's): a causal model's logits
  at a position do not depend on later positions, so the padding changes nothing before it,
  and a generation of n tokens is traced about n / length_step times, once per length for
  every later generation. Padded positions are masked out and their ids and positions are 0.
- The logits come back for the real positions only (transformers asks for the last one).
- It runs in eval mode (a model in training mode returns to it after): its forwards are
  eval calls, which may take other arguments than the evaluation's ([Note: other
  arguments] in module.py); generating with dropout is rarely what a user means.

Decoder-only models only: an encoder-decoder's generate() runs its encoder alone, outside
the pipeline. The cost is a forward over the whole sequence per token (a cache makes it one
token's): fine for evaluation, not a serving engine.
"""
from __future__ import annotations

import contextlib
import functools
import math

import torch

from . import _C, handshake
from .placement import _own_access

# Sequence lengths are padded to a multiple of this (see the note): few traces, little waste.
LENGTH_STEP = 32


def generate(wrapped, args: tuple, kwargs: dict, length_step: int = LENGTH_STEP):
    """[Note: generation through the pipeline] transformers' generate() of the model inside
    `wrapped` (a RaNNCModule), its forwards run by `wrapped` in eval mode."""
    model = wrapped.module
    config = getattr(model, "config", None)
    if not hasattr(model, "generate") or config is None:
        raise AttributeError(f"'RaNNCModule' object has no attribute 'generate' (nor has its "
                             f"model, a {type(model).__name__})")
    if getattr(config, "is_encoder_decoder", False):
        raise _C.Error(
            f"generate() of {type(model).__name__}, an encoder-decoder model, through a "
            "RaNNCModule: its generate() runs the encoder alone, which no rank holds whole. "
            "Only decoder-only models generate through the pipeline")
    if kwargs.get("use_cache"):
        _C.log_warn("generate(use_cache=True) through a RaNNCModule runs without a cache: "
                    "the stages keep nothing between calls (each forward reads the whole "
                    "sequence so far)")
    kwargs = dict(kwargs, use_cache=False)
    if handshake.active():
        kwargs.setdefault("synced_gpus", True)
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    forward = _PipelinedForward(wrapped, model.forward, length_step, limit)
    training = model.training
    if training and _C.get_rank() == 0:
        _C.log_info("generate() runs the model in eval mode (no dropout), then returns it to "
                    "training mode")
    wrapped.eval()
    try:
        with _routed(model, forward), _own_access():  # the hook that refuses model.module(x)
            return model.generate(*args, **kwargs)
    finally:
        wrapped.train(training)


@contextlib.contextmanager
def _routed(model, forward: "_PipelinedForward"):
    """While generate() runs, the model's forward and transformers' agreement on finished
    sequences are the pipeline's (instance attributes over the class's)."""
    model.forward = forward
    model._has_unfinished_sequences = _unfinished_anywhere
    try:
        yield
    finally:
        del model.forward
        del model._has_unfinished_sequences


def _unfinished_anywhere(this_peer_finished: bool, synced_gpus: bool, device=None) -> bool:
    """transformers' _has_unfinished_sequences, agreed over rannc's ranks: whether any rank
    has sequences to extend (each rank keeps calling the forward until none has)."""
    flags = handshake.exchange("generate()", torch.tensor([0.0 if this_peer_finished else 1.0]))
    return bool(flags.sum() > 0) if synced_gpus else not this_peer_finished


class _PipelinedForward:
    """The model's forward as generate() calls it, run by the RaNNCModule on padded
    sequences ([Note: generation through the pipeline])."""

    def __init__(self, wrapped, original, length_step: int, limit: int | None):
        self.wrapped, self.original = wrapped, original
        self.length_step, self.limit = length_step, limit
        functools.update_wrapper(self, original)  # generate() reads its signature

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None,
                 logits_to_keep=0, **rest):
        if input_ids is None:
            raise _C.Error("generate() through a RaNNCModule takes input_ids (inputs_embeds "
                           "are computed inside the model, which no rank holds whole)")
        for unused in ("use_cache", "return_dict", "cache_position", "past_key_values",
                       "output_attentions", "output_hidden_states"):
            value = rest.pop(unused, None)
            if unused.startswith("output_") and value:
                raise _C.Error(f"generate(..., {unused}=True) through a RaNNCModule: only "
                               "the logits come back from the pipeline")
        rows, length = input_ids.shape
        padded = self._agreed_length(length)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        inputs = {"input_ids": _pad(input_ids, padded), "attention_mask": _pad(attention_mask, padded)}
        if position_ids is not None:
            inputs["position_ids"] = _pad(position_ids, padded)
        for name, value in rest.items():  # token_type_ids and the like: per position
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, length):
                value = _pad(value, padded)
            inputs[name] = value
        model = self.wrapped.module
        del model.forward  # the RaNNCModule traces the model's own forward
        try:
            outputs = self.wrapped(**inputs)
        finally:
            model.forward = self
        logits = outputs["logits"][:, :length]
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, length - logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            logits = logits[:, logits_to_keep]
        outputs["logits"] = logits
        return outputs

    def _agreed_length(self, length: int) -> int:
        """The padded length of this forward: the longest rank's, rounded up to the step
        (finished ranks keep calling with their last, shorter, sequence)."""
        lengths = handshake.exchange("generate()", torch.tensor([float(length)]))
        longest = int(lengths.max())
        padded = math.ceil(longest / self.length_step) * self.length_step
        return min(padded, self.limit) if self.limit else padded


def _pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """`t` padded with zeros on the right of dimension 1 to `length`."""
    if t.shape[1] >= length:
        return t
    return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]))
