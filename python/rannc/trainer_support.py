"""What transformers' Trainer and PEFT need from a RaNNCModule: the directories Trainer
saves and loads, and a PEFT model's adapters read into the stages."""
from __future__ import annotations

import functools
import sys
import warnings

import torch


def is_peft_model(model) -> bool:
    """Whether `model` is a PEFT model (PeftModel or PeftMixedModel), without importing peft."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, (peft.PeftModel, peft.PeftMixedModel))


def wrapped_peft_model(model):
    """The PEFT model a RaNNCModule wraps, else None."""
    from .module import RaNNCModule
    if isinstance(model, RaNNCModule) and is_peft_model(model.module):
        return model.module
    return None


def _required_peft_model(wrapped, what: str):
    """The PEFT model `wrapped` wraps, or an AttributeError naming `what` needed it."""
    peft_model = wrapped_peft_model(wrapped)
    if peft_model is None:
        raise AttributeError(f"{what}: the RaNNCModule wraps a {type(wrapped.module).__name__}, "
                             "not a PEFT model")
    return peft_model


# [Note: Trainer's saved models] transformers' Trainer saves a model with save_pretrained only
# where the model, or what accelerate's unwrap_model takes out of it (DDP, DataParallel,
# DeepSpeed and FSDP, known by class), is a PreTrainedModel or a PEFT model; a RaNNCModule is
# neither, so its checkpoints and save_model() held the weights file of the gathered
# state_dict alone: without config.json, from_pretrained(dir) failed on them, and a LoRA run's
# directories held the whole base model instead of PEFT's adapter files, which
# PeftModel.from_pretrained(base, dir) reads. Once a module is prepared by accelerate,
# Trainer's _save (the method its documentation says to override for custom saving) is
# wrapped once: where the model is a RaNNCModule of a PreTrainedModel or a PEFT model, the
# writing rank gathers the state (the other ranks serve it, [Note: gathers asked by some
# ranks] in handshake.py) and runs Trainer's own _save with the wrapped model in the
# module's place, so that save_pretrained writes the directory as it does for the model in
# one process.
#
# [Note: PEFT models in Trainer] Trainer asks whether its model is a PEFT model
# (transformers' _is_peft_model, by class) to load adapters from checkpoints (resuming, and
# the best model at the end), to inspect the base model's forward, and to name the model
# whose labels its label smoother shifts (a causal LM's): a RaNNCModule of a PeftModel was
# none, so LoRA with label smoothing computed the loss unshifted (1.7% off on GPT-2, without
# a word), and adapter checkpoints would not load. The check is widened to a RaNNCModule of a
# PEFT model, which answers what Trainer then reads (peft_config, active_adapters,
# get_base_model, base_model: the wrapped model's) and loads adapters itself (load_adapter).
def prepare_trainer() -> None:
    """Teach transformers' Trainer, once, about RaNNCModules (the two notes above): when a
    RaNNCModule is made, where the script has imported Trainer already, and when accelerate
    prepares one (Trainer imported later), so that a Trainer made over a wrapped PEFT model
    reads it as it reads a PeftModel from its construction on."""
    trainer = sys.modules.get("transformers.trainer")
    save = getattr(getattr(trainer, "Trainer", None), "_save", None)
    if save is None or getattr(save, "__rannc__", False):
        return

    @functools.wraps(save)
    def _save(self, output_dir=None, state_dict=None):
        from transformers import PreTrainedModel
        from .module import RaNNCModule
        model = self.model
        if not (isinstance(model, RaNNCModule) and self.args.should_save
                and (isinstance(model.module, PreTrainedModel) or is_peft_model(model.module))):
            return save(self, output_dir, state_dict)
        if state_dict is None:  # a PEFT model's adapters alone: the base model stays put
            state_dict = (model.adapter_state_dict() if is_peft_model(model.module)
                          else model.state_dict())
        self.model = model.module
        try:
            save(self, output_dir, state_dict)
        finally:
            self.model = model

    _save.__rannc__ = True
    trainer.Trainer._save = _save
    for name in ("transformers.trainer", "transformers.trainer_utils",
                 "transformers.integrations.neftune"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "_is_peft_model"):
            module._is_peft_model = _widened(module._is_peft_model)


def _widened(is_peft):
    if getattr(is_peft, "__rannc__", False):
        return is_peft

    @functools.wraps(is_peft)
    def _is_peft_model(model):
        return is_peft(model) or wrapped_peft_model(model) is not None

    _is_peft_model.__rannc__ = True
    return _is_peft_model


def adapter_names(peft_model, adapter_name: str) -> dict:
    """{the module's name: the name in PEFT's adapter files} for adapter `adapter_name`,
    as get_peft_model_state_dict names what it saves (without the adapter's name, the
    modules_to_save without their wrapper), found by running it over stand-ins."""
    from peft.utils import get_peft_model_state_dict
    stand_ins = {}
    for name, _ in _named_state(peft_model):
        stand_ins.setdefault(name, torch.empty(0))
    saved = get_peft_model_state_dict(peft_model, state_dict=stand_ins, adapter_name=adapter_name)
    by_id = {id(t): name for name, t in stand_ins.items()}
    computed = [k for k, t in saved.items() if id(t) not in by_id]
    if computed:
        raise NotImplementedError(
            f"adapter {adapter_name!r} ({peft_model.peft_config[adapter_name].peft_type}) saves "
            f"tensors PEFT computes from the model ({', '.join(computed[:3])}), which a "
            "RaNNCModule cannot read back into its stages; adapters whose saved tensors are "
            "the model's own (LoRA, IA3, ...) load")
    return {by_id[id(t)]: k for k, t in saved.items()}


def adapter_keys(wrapped) -> set[str]:
    """The names of every adapter's tensors in a RaNNCModule's PEFT model (what its
    save_pretrained saves), the same on every rank."""
    peft_model = _required_peft_model(wrapped, "adapters")
    return set().union(*(adapter_names(peft_model, a) for a in peft_model.peft_config))


def _named_state(model):
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def load_adapter(wrapped, model_id: str, adapter_name: str = "default", **kwargs):
    """PeftModel.load_adapter for a RaNNCModule of a PEFT model: reads the weights of adapter
    `adapter_name`, which the model must have already (a new adapter would be a model the
    plan was not made for), from `model_id` (a directory or a Hub id, as PEFT takes) into
    the ranks that keep them. Returns load_state_dict's missing and unexpected keys."""
    from peft.utils import load_peft_weights
    peft_model = _required_peft_model(wrapped, "load_adapter")
    if adapter_name not in peft_model.peft_config:
        raise ValueError(
            f"load_adapter: the model has no adapter {adapter_name!r} (it has "
            f"{', '.join(map(repr, peft_model.peft_config))}); a RaNNCModule runs the model it was "
            "planned for, so add the adapter with PEFT before wrapping the model")
    kwargs.pop("is_trainable", None)  # an adapter the model has keeps its trainability, as in PEFT
    hub = {k: kwargs[k] for k in ("revision", "subfolder", "token", "cache_dir") if k in kwargs}
    weights = load_peft_weights(model_id, device="cpu", **hub)
    ours = {saved: name for name, saved in adapter_names(peft_model, adapter_name).items()}
    unknown = [k for k in weights if k not in ours]
    if unknown:
        warnings.warn(f"load_adapter: {model_id} holds {len(unknown)} tensors adapter "
                      f"{adapter_name!r} does not have ({', '.join(unknown[:3])}); they are ignored")
    result = wrapped.load_state_dict({ours[k]: v for k, v in weights.items() if k in ours},
                                     strict=False)
    adapter = set(ours.values())
    result.missing_keys[:] = [k for k in result.missing_keys if k in adapter]
    result.unexpected_keys[:] = unknown
    return result
