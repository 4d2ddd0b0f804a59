"""RaNNCModule: an ordinary nn.Module in, a pipelined, data-parallel module out.

    model = rannc.RaNNCModule(model, optimizer)
    loss = model(x, y)        # first call: trace, plan (all ranks agree), deploy
    loss.backward()           # applies the seed's scale to the gradients of this rank's stage
    optimizer.step()

Each mode (training, eval) that has been called is a Deployed (deployed.py): its trace,
plan and engine. This module is what the user holds: the calls, state, checkpoints, devices,
and what transformers' Trainer and accelerate read of a model.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import sys
import time
import zlib

import torch
from torch.utils.hooks import RemovableHandle

from . import _C, clipping, failure, full_state, handshake, registry, trainer_support
from .deployed import autocast_off, Deployed, module_modes, reads_every_gradient, traced_shapes
from .graph import TracedGraph
from ._trace import (attribute_values, autocast_dtype, chosen_by, module_hooks,
                     traced_differently)
from ._trace import flatten_args as _trace_flat
from .options import PRECISIONS, Options
from .call_layout import CallLayouts
from .optimizer_share import OptimizerShare
from .padding import CallPadding
from .placement import StatePlacement
from .process_group import refuse_other_launchers
from .transport import resolve_device, uses_nccl


def _inspected_model(model) -> torch.nn.Module:
    """The model callers inspect: the base model of a PEFT model, whose own forward takes
    *args, **kwargs (as Trainer inspects a PeftModel), else the model."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and type(model).__module__.startswith("peft."):
        return base()
    return model


def _agree_on_rows(args, kwargs) -> None:
    """Ranks whose first tensor arguments have different rows (dimension 0) are an error on
    every rank before tracing: a trace that fails on one rank alone (one row takes a path of
    its own) left the others in a collective, and the job ended instead of raising the
    agreed error on every rank that the check after tracing gives."""
    tensors = [t for t in _trace_flat(args, kwargs).tensors if t.dim() >= 1]
    mine = torch.tensor([tensors[0].shape[0] if tensors else -1], dtype=torch.int64)
    comm = _C.Communicator.world_cpu()
    everyone = torch.empty(comm.size, 1, dtype=torch.int64)
    comm.all_gather(mine, everyone).wait()
    rows = everyone[:, 0].tolist()
    if len(set(rows)) > 1:
        raise failure.agreed(f"local batches must have the same size on every rank; got "
                             f"{dict(enumerate(rows))} (rank: rows of dimension 0 of the first "
                             f"tensor argument){failure.UNEQUAL_CURE}")


def _checkpointing_on(model) -> bool:
    """Whether activation (gradient) checkpointing is on in a transformers or diffusers model,
    the wrapped one or one inside it (a UNet inside the module that computes its loss:
    only the outer was asked, so the request was lost without a word)."""
    def on(m) -> bool:
        flag = getattr(m, "is_activation_checkpointing", None)  # transformers 5
        if flag is None:
            flag = getattr(m, "is_gradient_checkpointing", False)  # older, and diffusers
        return bool(flag)
    return any(on(m) for m in model.modules()
               if hasattr(type(m), "is_activation_checkpointing")
               or hasattr(type(m), "is_gradient_checkpointing"))


def _with_forward_signature(cls: type, signature: inspect.Signature, model: str) -> type:
    """A subclass of `cls` whose forward shows `signature` (the wrapped model's), for callers
    that inspect the class rather than the instance: transformers' find_labels reads the
    labels from its forward and, for a model whose class name says QuestionAnswering, takes
    start_positions and end_positions too. So its name is "RaNNCModule[<the model's
    class>]" (its qualified name, which its repr shows, stays RaNNCModule)."""
    def forward(self, *args, **kwargs):
        return cls.forward(self, *args, **kwargs)

    forward.__signature__ = signature
    return type(f"{cls.__name__}[{model}]", (cls,),
                {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _checkpoint():
    """checkpoint.py, imported on first use: `python -m rannc.checkpoint` runs it as
    __main__, which must not have been imported with the package."""
    from . import checkpoint
    return checkpoint


def _accelerate_running() -> bool:
    """Whether an Accelerator was made in this process."""
    accelerate = sys.modules.get("accelerate.state")
    return accelerate is not None and bool(accelerate.AcceleratorState._shared_state)


def _accelerate_mixed_precision():
    """The autocast dtype of the running accelerate (None: fp32 or no accelerate)."""
    if not _accelerate_running():
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
        sys.modules["accelerate.state"].AcceleratorState().mixed_precision)


def _traced_together(trace):
    """[Note: trace errors agreed] `trace()`'s graph, after the ranks agree that each traced:
    a TraceError (the model cannot be traced as written) is raised on every rank together,
    so a script that catches it and goes on (tries another model, a fallback) can. Before,
    each failing rank told the others it had failed, which ends the job: a new, valid
    RaNNCModule after the caught error failed with "rank 0 stops because rank 1 failed".
    Likewise an error the model itself raises while traced (int32 labels into
    cross_entropy, float64 features into a float32 layer: what plain PyTorch raises at that
    batch), at the first call or at new input shapes: a loop that catches a bad batch and
    goes on trains on (before, the notice broke every later call, and a receive cut short
    could write into freed memory). Such an error, and another rank's, may come from this
    batch's values (labels out of range), so it marks `depends_on_batch`: the shapes are
    traced again at their next call instead of being refused as a plan's rule is."""
    failed = None
    try:
        graph = trace()
    except _C.CommError:
        raise  # a peer failed or is stuck: no agreement to be had
    except Exception as e:  # noqa: BLE001 (agreed, then raised on every rank)
        failed = e
    if handshake.active():
        flags = handshake.exchange("tracing the model", torch.tensor([float(failed is not None)]))
        failing = [r for r, f in enumerate(flags[:, 0].tolist()) if f]
        if failing and failed is None:
            error = failure.agreed(f"tracing the model failed on rank{'s' if len(failing) > 1 else ''} "
                                   f"{', '.join(map(str, failing))} (their error says why)")
            error.depends_on_batch = True  # their batches
            raise error
    if failed is not None:
        failed.on_every_rank = True
        failed.depends_on_batch = not isinstance(failed, _C.TraceError)
        raise failed
    return graph


def _precision_name(amp) -> str:
    return "fp32 (no autocast)" if amp is None else f"autocast {str(amp).replace('torch.', '')}"


_OPTIMIZER_KINDS = ("sgd", "sgd_momentum", "adam")  # by the state each keeps per parameter


def _optimizer_kind(optimizer) -> str:
    if optimizer is None:
        return "sgd"
    name = type(optimizer).__name__.lower()
    if "adam" in name:
        return "adam"
    if name == "sgd" and any(g.get("momentum", 0) for g in optimizer.param_groups):
        return "sgd_momentum"
    return "sgd" if name == "sgd" else "adam"


# [Note: buffers written per micro-batch] A stage runs its forward once per micro-batch, so
# a buffer the forward writes (a VQ-VAE's codebook kept by an EMA under no_grad, DINO's
# centre) moves once per micro-batch and each later micro-batch reads what the earlier ones
# wrote: with several micro-batches the step differs from one process (a codebook 34% off
# after a few steps), as documented, but without a word. Rank 0 names such buffers at the
# first training call; batch norm's statistics, per micro-batch as in GPipe, are not named.
def _say_buffers_per_micro_batch(model: torch.nn.Module, written: list[str], deployed) -> None:
    from .planning import spectral_norms
    micro_batches = deployed.deployment.micro_batches
    if _C.get_rank() != 0 or micro_batches <= 1:
        return
    # batch norms' statistics (as GPipe's), and spectral norms' vectors, which planning
    # names already ([Note: spectral norm per micro-batch] in planning.py)
    named_elsewhere = set(spectral_norms(model))
    norms = {f"{name}.{b}" if name else b for name, m in model.named_modules()
             if isinstance(m, torch.nn.modules.batchnorm._NormBase)
             or (name or "the model") in named_elsewhere
             for b, _ in m.named_buffers()}
    named = [n for n in written if n not in norms]
    if named:
        _C.log_warn(f"the forward writes the buffer(s) {failure.some_of(named)}, which a stage "
                    f"writes once per micro-batch: with {micro_batches} micro-batches they move "
                    f"{micro_batches} times per step, each micro-batch reading what the ones "
                    "before wrote, unlike one process (num_microbatches=1 is exact; [Note: "
                    "buffers written per micro-batch] in module.py)")


class RaNNCModule(torch.nn.Module):
    """Wraps `model` so that it trains pipelined and data-parallel across the MPI ranks.

    Every rank passes its own local batch (like DDP); the result equals single-process
    PyTorch on the concatenation of the ranks' batches. Options: see docs/options.md.
    """

    def __init__(self, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer] | None = None,
                 **options):
        super().__init__()
        refuse_other_launchers()  # [Note: launched by another launcher] in process_group.py
        scripted = []  # the outermost scripted modules (their submodules are scripted too)
        for name, m in model.named_modules():
            if isinstance(m, torch.jit.ScriptModule) and not any(
                    s == "" or name.startswith(s + ".") for s in scripted):
                scripted.append(name)
        if scripted:  # torch's errors named rannc's hooks, or an "active trace"
            named = [f"submodule '{n}'" if n else "the model" for n in scripted]
            raise _C.TraceError(
                f"{failure.some_of(named, shown=2)} is compiled by torch.jit.script: rannc "
                "traces the eager forward of the model and cuts its ops into stages, and a "
                "trace cannot call a scripted module. Pass the module before torch.jit.script "
                "(scripted functions without control flow trace with the rest)")
        self.options = Options.resolve(options)
        if self.options.log_level:
            _C.set_log_level(self.options.log_level)
        _C.set_comm_timeout(self.options.comm_timeout)
        self.module = model
        # [Note: several optimizers] in optimizer_share.py
        optimizers = ([] if optimizer is None else list(optimizer)
                      if isinstance(optimizer, (list, tuple)) else [optimizer])
        self.optimizer_share = OptimizerShare(optimizers)
        # [Note: placement] in placement.py
        self.device = resolve_device(self.options.device, model)
        if self.device.type == "cuda":  # the user's `.cuda()` and `torch.cuda.*` mean this GPU
            torch.cuda.set_device(self.device)
        self.nccl = uses_nccl(self.device, self.options.data_plane)
        # [Note: home device] in _trace.py; a model built on meta runs where its stages do
        first = next((t for t in itertools.chain(model.parameters(), model.buffers())
                      if not t.is_meta), None)
        self._home = first.device if first is not None else self.device
        self.placement = StatePlacement(model, self._home, self.device, self.optimizer_share)
        from . import planning
        self.profile_cache = planning.default_profile_cache()
        if self.options.profile_cache:
            self.profile_cache = _C.ProfileCache()
            self.profile_cache.load(self.options.profile_cache)
        self._deployed = {}
        # [Note: other arguments] An evaluation may pass other arguments than the first eval
        # call (labels or none, another mask, generate()'s position ids): the trace bakes in
        # the arguments' structure and the values of those that are not tensors, so such a
        # call is another program, traced and planned on its own (on every rank together,
        # as the first call of a mode is), and kept beside the mode's first; a training call
        # too ([Note: other training arguments]). Keys: (mode, arguments).
        #
        # [Note: other training arguments] A training call whose arguments differ from the
        # first training call's (a multimodal batch without its images, a string choosing
        # another task's head, output_hidden_states on a logging step) is another program,
        # traced and planned on its own; its stages may hold a parameter on other ranks
        # than the first program's. Each parameter has one set of trainers, the ranks that
        # hold its gradient, its optimizer state and, after a step, its current value: the
        # stages of the first training program that uses it (placement._trainers), so a
        # head that only a later program uses is trained where that program runs it, and
        # the optimizer's share grows by it (until then every rank's share holds it, with
        # the state a checkpoint gave it: placement.optimized_elsewhere). Before such a call its
        # ranks get the weights that training updated (as before an eval call); its own
        # engine sums each gradient over its replicas, then the gradient goes from the
        # first rank running it to the trainers that do not run it, and the ranks running
        # it without training it drop theirs (deployed.py, _route_grads); after its
        # forward, the buffers its stages ran (batch norm's statistics) go to their
        # trainers likewise. So clipping, loss scaling, checkpoints and
        # optimizer_state_dict() see one gradient and one value per parameter, as with a
        # single program. The costs: the weights the programs place differently move
        # before each call that follows a step, and a rank keeps the parameters of every
        # program's stages on it, which no plan counted in its memory. A first call that
        # runs every part of the model (images included) places them all in one plan.
        # Under no_sync() such a call is an error (its gradients are routed only once
        # summed).
        self._deployed_by_arguments = {}
        self._anchor = torch.zeros((), requires_grad=True)
        # [Note: unsynced steps] in csrc/runtime/engine.h
        self._grad_sync = True  # False inside no_sync()
        self._held_unsynced = False  # .grad holds shares that calls under no_sync() left
        registry.register(self)  # [Note: torch's clip_grad_norm_], [Note: agreed steps]
        self._say_shared_optimizers()
        self.gather_serial = handshake.register_source(self)  # [Note: gathers asked by some ranks]
        # where the script imported transformers' Trainer: taught before a Trainer is made,
        # which inspects its model at once ([Note: PEFT models in Trainer] in trainer_support.py)
        trainer_support.prepare_trainer()
        # Callers that read the model's argument names from forward's signature (transformers'
        # Trainer drops the dataset's columns that forward does not name) see the model's.
        # torch.compile(RaNNCModule(...)): dynamo leaves the call to rannc's stages instead of
        # tracing through the runtime ([Note: compiled models] in _trace.py)
        forward = functools.partial(torch.compiler.disable(type(self).forward), self)
        forward.__signature__ = inspect.signature(_inspected_model(model).forward)
        self.forward = forward
        # Trainer reads the label names from the class's forward (transformers' find_labels)
        self.__class__ = _with_forward_signature(type(self), forward.__signature__,
                                                 type(_inspected_model(model)).__name__)
        clipping.warn_early_imports()
        # [Note: call layouts]: the forward that binds the call (a PEFT model's own)
        self._layouts = CallLayouts(inspect.signature(model.forward))
        # [Note: padding calls] in padding.py
        self._padding = (CallPadding(self.options.pad_values, model, forward.__signature__,
                                     self.options.pad_multiple_of)
                         if self.options.pad_values is not None else None)
        self._recompute_given = "recompute" in options or "RANNC_RECOMPUTE" in os.environ
        if _checkpointing_on(model):
            self._recompute_everywhere("the model's gradient checkpointing is on")
        if _C.get_rank() == 0:
            for warning in traced_differently(model):
                _C.log_warn(warning)
        # [Note: hooks registered later]
        self._hook_ids = RemovableHandle.next_id
        self._hooked = {kind: set(module_hooks(model, backward=kind == "backward"))
                        for kind in ("forward", "backward")}

    # [Note: hooks registered later] A module's hook registered after the model was traced
    # (a feature extractor's forward hook added for evaluation, a backward hook added to
    # watch gradients) never runs in rannc's steps, which run the traced graph; before, it
    # was dropped without a word. Any hook registered anywhere takes the next id of torch's
    # RemovableHandle, so a call looks at the modules' hooks only when that id moved, and
    # rank 0 warns, naming the modules, once per hook's module.
    def _watch_hooks(self) -> None:
        self._hook_ids = RemovableHandle.next_id
        traced = bool(self._deployed or self._deployed_by_arguments)
        for kind in ("forward", "backward"):
            now = set(module_hooks(self.module, backward=kind == "backward"))
            new = sorted(now - self._hooked[kind])
            self._hooked[kind] = now
            if not new or _C.get_rank() != 0:
                continue
            where = failure.some_of(new)
            if kind == "forward" and not traced:  # the first trace runs them, as at wrapping
                _C.log_warn(f"forward hooks on {where} run while rannc traces the model, not in "
                            "each step: their side effects (storing activations, logging) happen "
                            "at tracing only ([Note: hooks] in _trace.py)")
            elif kind == "forward":
                _C.log_warn(f"forward hooks on {where} were registered after rannc traced the "
                            "model: its steps run the traced graph, so they never run (register "
                            "them before the first call to have them traced; their side effects "
                            "happen at tracing only) ([Note: hooks registered later] in module.py)")
            elif traced:  # before the first call, tracing refuses them
                _C.log_warn(f"backward hooks on {where} were registered after rannc traced the "
                            "model: they never run, and the gradients they would change train "
                            "as they come. Remove them, or hook the parameters "
                            "(param.register_hook) ([Note: hooks registered later] in module.py)")

    def forward(self, *args, **kwargs):
        if RemovableHandle.next_id != self._hook_ids:  # [Note: hooks registered later]
            self._watch_hooks()
        mode = self.module.training
        world = _C.get_world_size()
        if self._prepared_by_accelerate and world > 1 and \
                kwargs.get("num_items_in_batch") is not None:  # [Note: accelerate]
            kwargs["num_items_in_batch"] = kwargs["num_items_in_batch"] * world
        # [Note: named collectives]
        out = self._call(mode, "a training call" if mode else "an eval call", args, kwargs)
        if self._accelerate_precision is not None:  # [Note: accelerate]
            from accelerate.utils import convert_to_fp32
            out = convert_to_fp32(out)
        return out

    def _call(self, mode: bool, what: str, args, kwargs, copy=None):
        """Runs a call of `mode` (a collective named `what`); with `copy` (a
        PlanSharingCopy), on the copy's tensors ([Note: copies of a wrapped model] in
        copies.py)."""
        args, kwargs = self._layouts.arrange(args, kwargs)  # [Note: call layouts]
        if self._padding is not None and handshake.active():
            try:  # [Note: padding calls] in padding.py
                args, kwargs = self._padding.pad(what, args, kwargs)
            except _C.Error as e:
                if not getattr(e, "on_every_rank", False):
                    _C.report_failure(f"rank {_C.get_rank()} failed: {failure.describe(e)}")
                raise
        deployed = self._deployed.get(mode)
        arguments = None  # other arguments than the mode's first call ([Note: other arguments])
        if deployed is not None and not deployed.graph.takes(args, kwargs):
            arguments = TracedGraph.arguments_of(args, kwargs)
        modes = module_modes(self.module)
        if deployed is not None and modes != deployed.modes:
            # [Note: modules' modes] in deployed.py: another program, as other arguments are
            arguments = (arguments, "modules' modes", modes)
        if deployed is not None and arguments is None and deployed.graph._trace.choosing:
            # [Note: tensors that choose the program] in _trace.py
            trace = deployed.graph._trace
            values = chosen_by(_trace_flat(args, kwargs), trace.choosing)
            if values != chosen_by(trace.inputs, trace.choosing):
                arguments = (None, "arguments' values", values)
        if deployed is not None and deployed.attributes:
            values = attribute_values(deployed.attributes)
            if values != deployed.attribute_values:  # [Note: attributes read] in _trace.py
                arguments = (arguments, "modules' attributes", values)
        if arguments is not None:
            deployed = self._deployed_by_arguments.get((mode, arguments))
            # the collective names the program, so that ranks passing other arguments than
            # each other raise together instead of meeting in different programs
            what += f" with other arguments ({zlib.crc32(repr(arguments).encode()):08x})"
        try:
            amp = self._precision()
            if deployed is not None and deployed.amp != amp:
                raise _C.Error(
                    f"this {'training' if mode else 'eval'} call runs in {_precision_name(amp)}, "
                    f"but the model was traced and planned for {_precision_name(deployed.amp)} "
                    "in this mode: rannc bakes the precision into the plan, so every call of a "
                    "mode (train, eval) must use the same torch.autocast state (or use the "
                    "option precision)")
            # [Note: mixed precision] in _trace.py: the casts are ops of the traced graph, so
            # the stages run them as recorded, with autocast off.
            with autocast_off(self.device.type, amp):
                # Training updates each parameter on the ranks of its stage only; before a
                # mode whose plan may place it elsewhere runs, the owners share the weights.
                fresh = deployed is None
                # the ranks that run a call of another program than the first training call
                # get the weights that training updated (those of a new program's stages that
                # a third program's left stale too, before its deployment fills the others)
                sync = not ((mode and arguments is None) or copy is not None)
                if fresh:
                    handshake.enter(what)
                    if arguments is not None:
                        self._check_other_arguments(mode, arguments, args, kwargs, copy)
                    if sync:
                        self.placement.before_eval()
                    deployed = self._deploy(mode, args, kwargs, amp, arguments=arguments)
                # after the first call the collective's name travels with the call's sizes
                # in one all-gather
                call = deployed.agree(args, kwargs, what, copy is not None and copy.changed())
                if arguments is not None and not fresh:
                    self._check_other_arguments(mode, arguments, args, kwargs, copy)
                if copy is not None:
                    if sync and not fresh:
                        self.placement.before_eval()
                    return copy.run(deployed, call, args, kwargs)
                # the plan that runs the call's shapes: its program's, or another program's
                # ([Note: programs at other shapes]), deployed first if they are new
                target = deployed.variant(call, args, kwargs)
                key = target.program_key
                if mode and key is not None and arguments is None and not self._grad_sync:
                    raise failure.agreed(
                        "a training call under no_sync() at input shapes where the model is "
                        "another program than at the first training call's: its gradients go "
                        "to the ranks that train each parameter ([Note: programs at other "
                        "shapes] in module.py), which needs them summed over its replicas; "
                        "call it outside no_sync(), or keep its shapes")
                sync = not (mode and key is None)
                if sync and not (fresh and key == deployed.program_key):
                    self.placement.before_eval()
                before = self.placement.buffers_before() if mode and key is None else None
                out = target._run(call.local, call.flat, call.rows)
                if mode:
                    self.placement.trained()
                    if key is not None:  # [Note: other training arguments]
                        self.placement.after_other_training(key)
                    else:  # [Note: buffers of replicas] in placement.py
                        written = self.placement.share_written_buffers(before)
                        if written:
                            _say_buffers_per_micro_batch(self.module, written, deployed)
                return out
        except _C.CommError:
            raise
        except (Exception, KeyboardInterrupt, SystemExit) as e:
            if getattr(e, "on_every_rank", False):
                raise  # every rank raises it together: nobody is left waiting, nothing to tell
            # Say where before telling the others: their abort may end this process. A
            # signal's KeyboardInterrupt or SystemExit (a preemption handler's sys.exit)
            # halfway through a call leaves the peers waiting on this rank's stages until
            # comm_timeout unless they are told too.
            stage = (f" | stage {'/'.join(map(str, deployed.engine.stages))}" if deployed is not None
                     else "")
            how = "failed" if isinstance(e, Exception) else f"stopped inside {what}"
            message = f"rank {_C.get_rank()}{stage} {how}: {failure.describe(e)}"
            print(f"[rannc] {message}", file=sys.stderr, flush=True)
            _C.report_failure(message)
            raise

    # A program for each value of a Python number that changes every call (a step counter, a
    # schedule's temperature) would trace and plan without end.
    _MAX_PROGRAMS = 16

    def _check_other_arguments(self, mode: bool, arguments: tuple, args, kwargs, copy) -> None:
        """Raises, on every rank (they agreed on the program), where a call of other arguments
        than the mode's first cannot run ([Note: other arguments])."""
        def differs() -> str:  # for the message only: not on every call's path
            return self._deployed[mode].graph._differs(_trace_flat(args, kwargs))

        if mode and copy is not None:
            raise failure.agreed(
                f"a copy of the module called in training mode with other arguments than the "
                f"module's first training call ({differs()}): a copy runs the module's training "
                "plan, or call it in eval mode")
        if mode and not self._grad_sync:
            raise failure.agreed(
                f"a training call under no_sync() with other arguments than the first training "
                f"call ({differs()}): its gradients go to the ranks that train each parameter "
                "([Note: other training arguments] in module.py), which needs them summed over "
                "its replicas; call it outside no_sync()")
        if (mode, arguments) in self._deployed_by_arguments:
            return  # a program it has
        programs = sum(1 for m, _ in self._deployed_by_arguments if m == mode)
        attributes = len(arguments) == 3 and arguments[1] == "modules' attributes"
        if programs >= self._MAX_PROGRAMS and attributes:
            raise failure.agreed(
                f"{'training' if mode else 'eval'} calls have met {programs + 1} different "
                f"values of the model's attributes ({self._deployed[mode]._attributes_changed(arguments[2])}): "
                "a number the forward reads from a module is baked into a trace, so each value "
                "is another program, traced and planned on its own. Keep a number that changes "
                "every step in a buffer (self.register_buffer('temperature', torch.tensor(1.0)), "
                "then module.temperature.fill_(t)): the steps read it as an input")
        if programs >= self._MAX_PROGRAMS:
            raise failure.agreed(
                f"{'training' if mode else 'eval'} calls have passed {programs + 1} different sets "
                f"of arguments ({differs()}): the structure of the arguments and the values that "
                "are not tensors are baked into a trace, so each is another program, traced and "
                "planned on its own. Pass a number that changes between calls as a tensor "
                "(torch.tensor(value)), or keep the arguments' structure and constants fixed")
        if _C.get_rank() == 0:
            base = self._deployed[mode]
            changed = (f"with {base._modes_changed(arguments[2])}"
                       if len(arguments) == 3 and arguments[1] == "modules' modes"
                       else f"with {base._attributes_changed(arguments[2])}" if attributes
                       else f"with other values of {failure.some_of([p for p, _ in arguments[2]])} "
                            "than the first, which chose the traced program ([Note: tensors "
                            "that choose the program] in _trace.py)"
                       if len(arguments) == 3 and arguments[1] == "arguments' values"
                       else f"with other arguments than the first ({differs()})")
            plain = not attributes and not (len(arguments) == 3 and arguments[1] in
                                            ("modules' modes", "arguments' values"))
            # a third program of the same structure as one before but other constants: most
            # likely a number that changes every step (mixup's lam), each value traced and
            # planned again
            structures = {repr(base.graph._trace.inputs.spec)} | {
                a[0] for m, a in self._deployed_by_arguments if m == mode and isinstance(a[0], str)}
            numbers = plain and programs >= 2 and arguments[0] in structures
            say = _C.log_warn if numbers else _C.log_info
            say(f"{'a training' if mode else 'an eval'} call {changed}: traced and planned as "
                f"another program ({programs + 1} so far; [Note: other arguments] in module.py)"
                + ("; a number that changes between calls (mixup's lam) is better passed as a "
                   "tensor, torch.tensor(value), which the steps read as an input"
                   if numbers else ""))

    # ---- deployment ([Note: freed state] in placement.py) ------------------------------------
    def _precision(self):
        """The autocast dtype this call computes in (None: fp32): the option precision, else
        the caller's torch.autocast state for the device the stages run on, else the mixed
        precision of the accelerate run that prepared the module ([Note: accelerate])."""
        forced = PRECISIONS[self.options.precision]
        if forced is not None:
            caller = autocast_dtype(self.device.type)
            if caller is not None and caller != getattr(torch, forced) and \
                    not self._said_precision and _C.get_rank() == 0:
                self._said_precision = True
                _C.log_warn(f"the call runs under torch.autocast with {caller}, but the option "
                            f"precision is {self.options.precision!r}: the stages compute in "
                            f"{forced}, as the option says")
            return getattr(torch, forced)
        return autocast_dtype(self.device.type) or self._accelerate_precision

    def _deploy(self, mode, args, kwargs, amp, plan_from=None, arguments=None,
                new_programs=True):
        """Traces, plans and deploys `mode` (a collective) in precision `amp`, then frees the
        state tensors that no deployed stage on this rank uses. `plan_from`: the mode's
        deployment at other input shapes, whose plan the new trace runs, else the plan of a
        program planned at other shapes before, else (`new_programs`) a plan of its own
        ([Note: programs at other shapes]); `arguments`: an eval call's arguments other than
        the mode's first ([Note: other arguments])."""
        # Profiling runs the pieces on the module's own buffers, and a batch norm in training
        # mode updates its running statistics each time: keep the values from before.
        if not (self._deployed or self._deployed_by_arguments):
            self._refuse_shared_parameters()
        if plan_from is None and _C.get_world_size() > 1:
            _agree_on_rows(args, kwargs)
        if not (self._deployed or self._deployed_by_arguments) and _C.get_world_size() == 1 \
                and self.device.type == "cuda":
            self._move(self.device)  # [Note: one rank traces on its GPU]
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        try:
            # Traced where the model is, in the precision the stages' device would compute in.
            home = self._home.type
            start = time.perf_counter()
            # no rank gathers the whole model ([Note: freed state] in placement.py)
            state = self.placement.trace_tensors()
            # Deploying draws no random numbers from the user's generators (profiling fills
            # inputs at random), so a run resumed from a checkpoint, which deploys after
            # restoring them, draws what the uninterrupted run drew.
            devices = sorted({d.index or 0 for d in (self._home, self.device) if d.type == "cuda"})
            with torch.random.fork_rng(devices=devices):
                with (torch.autocast(home, dtype=amp) if amp is not None
                      else torch.autocast(home, enabled=False)):
                    graph = _traced_together(lambda: TracedGraph(
                        self.module, args, kwargs, state_tensors=state, home=self._home))
                del state
                seconds = time.perf_counter() - start
                if plan_from is None:
                    deployed = Deployed(self, graph, args, kwargs, amp, seconds)
                else:
                    deployed, new = self._rebound(mode, graph, args, kwargs, amp, seconds,
                                                  plan_from, new_programs)
        finally:
            with torch.no_grad():
                for b, before in buffers:
                    if b.shape != before.shape:  # a per-channel observer sizes its range at its first call
                        b.resize_(before.shape)
                    b.copy_(before)
            del buffers
        if plan_from is not None and new is None:
            return deployed  # a plan deployed before: each tensor's ranks are as before
        if plan_from is not None:
            arguments = new  # [Note: programs at other shapes]
            plan_from.shape_programs.append(deployed)
        if arguments is not None:
            deployed.program_key = (mode, arguments)
            self._deployed_by_arguments[(mode, arguments)] = deployed
            self.placement.add_mode((mode, arguments), deployed)
            if mode:  # [Note: other training arguments]
                deployed.routing_key = (mode, arguments)
                self.optimizer_share.cut(self.placement.optimized_elsewhere())
            return deployed
        self._deployed[mode] = deployed
        self.placement.add_mode(mode, deployed)
        if mode:
            self.optimizer_share.cut(self.placement.optimized_elsewhere())
        _checkpoint().apply_pending(self)  # a checkpoint loaded before the plan was known
        self.placement.initialize()  # parameters built on meta that it did not fill
        return deployed

    # [Note: modules wrapped twice] Each RaNNCModule places its model's tensors on the
    # ranks of its own stages and frees them elsewhere, so two that share a module (two
    # tasks over one encoder, a model wrapped again while the first wrapper lives) cannot
    # both run: the second's trace failed inside torch on a rank whose tensors the first had
    # freed ("mat2 must be a matrix"). The first call of a module sharing parameters with
    # another that has run is an error on every rank naming them.
    def _refuse_shared_parameters(self) -> None:
        mine = {id(p): n for n, p in self.module.named_parameters()}
        for other in registry.modules():
            if other is self or not (other._deployed or other._deployed_by_arguments):
                continue
            shared = [mine[id(p)] for p in other.module.parameters() if id(p) in mine]
            if shared:
                raise failure.agreed(
                    f"the model shares {len(shared)} parameter(s) ({failure.some_of(shared)}) "
                    "with another RaNNCModule that has run: each places its model's tensors "
                    "on its own stages and frees them on the other ranks, so two cannot share "
                    "a module. Wrap one module that holds both (its forward taking the task "
                    "as an argument: each task is then a program of its own, [Note: other "
                    "training arguments] in module.py), or delete the first wrapper "
                    "([Note: modules wrapped twice] in module.py)")

    def _deploy_shapes(self, deployed, args, kwargs, new_programs=True):
        """The deployment of `deployed`'s program for this call's new input shapes (a
        collective, [Note: new input shapes]): its plan's, or another program's ([Note:
        programs at other shapes])."""
        return self._deploy(self.module.training, args, kwargs, deployed.amp, plan_from=deployed,
                            new_programs=new_programs)

    # [Note: programs at other shapes] At some input shapes the model is another program
    # than at the shapes a plan was made for: nn.MultiheadAttention's projections reshape a
    # sequence of length 1 otherwise than longer ones, so greedy decoding from one token
    # (length 1, then 2, 3, ...) failed at its second call, and so did a branch on the
    # length (`if T > window`) or a cache grown past a table built in __init__. Such a
    # call's trace runs the plan of the shapes' first program where it can
    # (partition::rebindDeployment checks the same ops in the same order), else the plan
    # of a program planned at other shapes before (length 3 runs length 2's), else it is
    # planned on its own, as a call of other arguments is ([Note: other arguments],
    # [Note: other training arguments]: its stages may place a parameter elsewhere, its
    # ranks get the current weights before it runs, a training call's gradients go to the
    # parameters' trainers), and counts as one of the mode's programs (_MAX_PROGRAMS). Each
    # call of it needs no new trace. Under no_sync() a training call of such a program is
    # an error, as one of other arguments is (its gradients are routed only once summed),
    # and so is one on a copy of the module ([Note: copies of a wrapped model] in copies.py).
    def _rebound(self, mode, graph, args, kwargs, amp, seconds, plan_from, new_programs):
        """`graph` (traced at new shapes) deployed on `plan_from`'s plan, else on that of a
        program planned at other shapes from it, else planned on its own: (the deployment,
        None or, where planned on its own, its key among the mode's programs) ([Note:
        programs at other shapes])."""
        for program in [plan_from] + plan_from.shape_programs:
            try:
                deployed = Deployed(self, graph, args, kwargs, amp, seconds, plan_from=program)
            except Exception as e:
                if getattr(e, "another_program", None) is None:
                    raise
                error = e
                continue
            deployed.program_key, deployed.routing_key = program.program_key, program.routing_key
            return deployed, None
        base = plan_from.program_key[1] if plan_from.program_key is not None else None
        programs = sum(1 for m, _ in self._deployed_by_arguments if m == mode)
        if not new_programs:
            error.add_note("rannc: a copy of the module runs the module's programs only "
                           "([Note: programs at other shapes] in module.py)")
            raise error
        if programs >= self._MAX_PROGRAMS:
            error.add_note(f"rannc: the {'training' if mode else 'eval'} calls have {programs + 1} "
                           "programs; no more are planned ([Note: programs at other shapes] in "
                           "module.py)")
            raise error
        if _C.get_rank() == 0:
            _C.log_info(f"{'a training' if mode else 'an eval'} call at new input shapes "
                        f"({plan_from.describe_shapes(traced_shapes(graph))}) where the "
                        f"model is another program than the one planned "
                        f"({error.another_program.split(': ', 1)[-1].split('; rannc ')[0]}): "
                        "traced and planned as "
                        f"another program ({programs + 1} so far; [Note: programs at other "
                        "shapes] in module.py)")
        deployed = Deployed(self, graph, args, kwargs, amp, seconds)
        return deployed, (base, "input shapes", deployed.shapes)

    def held_bytes(self) -> int:
        """Bytes this rank holds on the stages' device for the programs deployed so far:
        parameters, buffers, gradients and optimizer state, each storage once ([Note: memory
        the programs before hold] in deployed.py). 0 before the first program deploys."""
        if not (self._deployed or self._deployed_by_arguments):
            return 0
        storages = {}

        def hold(t):
            if isinstance(t, torch.Tensor) and t.device.type == self.device.type:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()

        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            hold(t)
            hold(t.grad)
        for optimizer in self.optimizer_share.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    hold(value)
        storages.pop(0, None)  # empty storages (freed tensors)
        return sum(storages.values())

    @property
    def deployments(self) -> dict:
        """The plans this rank runs, by mode: {"train": Deployment, "eval": Deployment}, each
        once its first call traced and planned it."""
        return {"train" if mode else "eval": d.deployment for mode, d in self._deployed.items()}

    # ---- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, directory: str, extra=None) -> None:
        """Every rank writes the weights and optimizer state of its stages to `directory` at
        once, with the random generators, the plans and `extra` (anything torch.save takes,
        such as an LR scheduler's state_dict); a collective. Sharded safetensors that
        transformers and safetensors read; see checkpoint.py."""
        handshake.enter("save_checkpoint()")  # [Note: named collectives]
        _checkpoint().save_checkpoint(self, directory, extra)

    def load_checkpoint(self, path: str, strict: bool = True):
        """Loads a checkpoint saved by save_checkpoint in any world size or plan (each rank
        reads only its stages' tensors), or the weights of a Hugging Face checkpoint
        directory or a state_dict file; a collective. Returns the saved `extra`."""
        handshake.enter("load_checkpoint()")
        return _checkpoint().load_checkpoint(self, path, strict)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The full model state under the original names on every rank (a collective that
        gathers the whole model on every rank: for small models; large ones use
        save_checkpoint); see full_state.gather_state_dict."""
        handshake.gather("state_dict()", self)
        return self._gather_state(*args, destination=destination, prefix=prefix,
                                  keep_vars=keep_vars)

    def _gather_state(self, *args, keep=True, **kwargs):
        self.placement.require_values("state_dict()")
        _checkpoint().apply_pending(self, everything=True)
        # [Note: accelerate]: Trainer writes it with safetensors' save_file
        return full_state.gather_state_dict(self, *args, keep=keep,
                                            untied=self._prepared_by_accelerate, **kwargs)

    _ADAPTERS = 1  # the part of state_dict() that adapter_state_dict() gathers

    def adapter_state_dict(self) -> dict:
        """The state of the wrapped PEFT model's adapters under the model's names (what
        PEFT's save_pretrained saves of a state_dict), gathered as state_dict() is, on every
        rank or on rank 0 alone, without moving the frozen base model's weights."""
        handshake.gather("state_dict()", self, RaNNCModule._ADAPTERS)
        return self._gather_state(only=trainer_support.adapter_keys(self))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full model state into the tensors this rank keeps; see
        full_state.load_state_dict. Before the first call of a model built on the meta
        device, read at that call, as a checkpoint loaded then is."""
        handshake.enter("load_state_dict()")
        if self.placement.without_values():
            return _checkpoint().load_state_dict_later(self, state_dict, strict)
        _checkpoint().forget_pending(self, weights=True, optimizer=False)
        return full_state.load_state_dict(self, state_dict, strict=strict, assign=assign)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """The optimizer's full state in the original optimizer's format, on every rank (a
        collective that gathers it whole); with several optimizers, the groups of all one
        after another, or those of `optimizer` (what its own state_dict() gives); see
        full_state.gather_optimizer_state."""
        part = self._optimizer_part(optimizer)
        handshake.gather("optimizer_state_dict()", self, part)
        return self._gather_optimizer_state(part)

    def _optimizer_part(self, optimizer) -> int:
        """0 for every optimizer of the module (None), else 1 + `optimizer`'s position
        ([Note: several optimizers] in optimizer_share.py)."""
        if optimizer is None:
            return 0
        return 1 + next(i for i, o in enumerate(self.optimizers) if o is optimizer)

    def _gather_optimizer_state(self, part: int = 0) -> dict:
        self.placement.require_values("optimizer_state_dict()")
        _checkpoint().apply_pending(self, everything=True)
        return full_state.gather_optimizer_state(self, self.optimizers[part - 1] if part else None)

    # [Note: activation checkpointing] transformers' gradient checkpointing recomputes each
    # layer's forward in the backward (torch.utils.checkpoint). Traced, those are plain
    # ops: rannc's stages keep their activations unless the plan recomputes the stage. A
    # request for checkpointing (the model's flag when wrapped; Trainer's
    # gradient_checkpointing=True, which calls the methods below) becomes the plan's
    # recompute="always", every stage recomputed, as the user asked for that memory
    # rather than speed; an explicit recompute option wins. Without a request the plan
    # recomputes only the stages whose memory needs it (recompute="auto").
    def activation_checkpointing_enable(self, *args, **kwargs) -> None:
        """Trainer's activation_checkpointing=True: every stage recomputes its forward in
        the backward ([Note: activation checkpointing])."""
        self._recompute_everywhere("activation checkpointing was enabled")

    def gradient_checkpointing_enable(self, *args, **kwargs) -> None:
        """transformers' older name of activation_checkpointing_enable."""
        self._recompute_everywhere("gradient checkpointing was enabled")

    def _recompute_everywhere(self, why: str) -> None:
        if self._recompute_given:
            if _C.get_rank() == 0:
                _C.log_info(f"{why}; the option recompute={self.options.recompute!r} decides "
                            "which stages recompute")
            return
        if True in self._deployed and self.options.recompute != "always":
            raise _C.Error(f"{why} after the first training call, which planned the stages "
                           f"(recompute={self.options.recompute!r}): enable it before that "
                           "call, or pass the option recompute=\"always\" to RaNNCModule")
        self.options.recompute = "always"
        if _C.get_rank() == 0:
            _C.log_info(f"{why}: every stage recomputes its forward in the backward "
                        "(recompute=\"always\"; recompute=\"auto\" recomputes only where memory "
                        "needs it)")

    # [Note: moving a wrapped model] DDP scripts and transformers' Trainer move the model to
    # the rank's device: `model.cuda()`, `model.to(device)`, Trainer in its __init__. On a
    # RaNNCModule, nn.Module's would move the whole model onto every rank's GPU (a copy per
    # rank sharing it: what a model that needs a pipeline does not fit in), and after the
    # first call it would move the stages' tensors from under the engine. Here the stages'
    # device is rannc's (option device; each rank moves only its stages' tensors there at
    # the first call), so a device of that kind is where they are or will be: nothing moves,
    # except that one rank alone moves the whole model before its first call, as one process
    # would (and `cuda:N` picks its GPU). Another kind of device is an error naming the
    # option. A dtype (`.to(torch.bfloat16)`, `.half()`) converts the model before the first
    # call and is an error after it (the plan, the stages and the optimizer hold the tensors).
    def to(self, *args, **kwargs):
        """[Note: moving a wrapped model]"""
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format is not None or (dtype is not None and self._converts(
                lambda t: t.to(dtype) if t.is_floating_point() or t.is_complex() else t)):
            self._before_first_call(f"converting its tensors to {dtype or memory_format}")
            self.module.to(dtype=dtype, non_blocking=non_blocking, memory_format=memory_format)
        if device is not None:
            self._move(torch.device(device))
        return self

    def cuda(self, device=None):
        """[Note: moving a wrapped model]"""
        if device is None or isinstance(device, int):
            return self.to(torch.device("cuda", device))
        return self.to(torch.device(device))

    def cpu(self):
        """[Note: moving a wrapped model]"""
        return self.to(torch.device("cpu"))

    def _apply(self, fn, recurse=True):
        # .half(), .float(), .bfloat16(), .type(), share_memory(): nn.Module's conversions
        if self._deployed and not self._converts(fn):
            return self  # a model already so (`.float()` of an fp32 model): nothing to do
        self._before_first_call("converting its tensors (.half(), .float(), .type()...)")
        return super()._apply(fn, recurse)

    def _converts(self, fn) -> bool:
        """Whether `fn` (a conversion of nn.Module._apply) changes the dtype or device of
        any of the model's tensors; stops at the first that it changes."""
        for t in itertools.chain(self.module.parameters(), self.module.buffers()):
            out = fn(t)
            if out is not t and (out.dtype != t.dtype or out.device != t.device):
                return True
        return False

    def _before_first_call(self, what: str) -> None:
        if self._deployed:
            raise _C.Error(
                f"{what} on rank {_C.get_rank()} after a RaNNCModule's first call: its plan, "
                "its stages and the optimizer hold the tensors as they were. Convert the model "
                "before wrapping it or before the first call; for mixed precision use "
                "torch.autocast or the option precision")

    def _move(self, device: torch.device) -> None:
        """[Note: moving a wrapped model]"""
        rank = _C.get_rank()
        if device.type != self.device.type:
            raise _C.Error(
                f"RaNNCModule.to({str(device)!r}) on rank {rank}: this rank's stages run on "
                f"{self.device} (option device={self.options.device!r}), where rannc moves "
                "each rank's share of the model itself; to run them on "
                f"{device.type}, pass device={device.type!r} to RaNNCModule")
        one = _C.get_world_size() == 1
        if one and device.index is not None and device != self.device:
            if self._deployed:
                raise _C.Error(f"RaNNCModule.to({str(device)!r}): its stages run on "
                               f"{self.device} since its first call; wrap the model again "
                               "to run it elsewhere")
            self.device = self.placement.device = device
            torch.cuda.set_device(device)
        # [Note: one rank traces on its GPU] One rank runs the whole model on its GPU, so the
        # model goes there before the first trace too, wrapped on the CPU or not: tracing on
        # the CPU ran a BERT-large forward twice on the host (26 s of the first step on an
        # H200, where the GPU takes 0.1 s), and under torch.autocast("cuda") it recorded the
        # CPU's autocast casts, not the ones plain PyTorch makes on the GPU.
        if one and not self._deployed and self._home != self.device \
                and not self.placement.not_current_here():
            self.module.to(self.device)
            self._home = self.placement.home = self.device

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        """transformers' save_pretrained of the wrapped model with its whole weights:
        config.json and the weights, which from_pretrained loads. Called on every rank, or on
        rank 0 alone (the other ranks serve the gather, as for state_dict()); the rank with
        `is_main_process` (default: rank 0) writes. Under DDP scripts write
        model.module.save_pretrained, which here would save the empty tensors of the
        layers on other ranks and is refused."""
        save = self._model_attribute("save_pretrained")
        state = kwargs.pop("state_dict", None)
        if state is None:  # a PEFT model saves its adapters alone
            state = (self.adapter_state_dict() if trainer_support.is_peft_model(self.module)
                     else self.state_dict())
        kwargs.setdefault("is_main_process", _C.get_rank() == 0)
        if "state_dict" in inspect.signature(save).parameters:
            save(save_directory, *args, state_dict=state, **kwargs)
            return
        # diffusers' ModelMixin.save_pretrained takes no state_dict (its **kwargs swallowed
        # it) and saves self.state_dict(), which is refused where a rank lacks tensors:
        # for the call, the module's state_dict() is the gathered one
        self.module.state_dict = lambda *_, **__: state
        try:
            save(save_directory, *args, **kwargs)
        finally:
            del self.module.state_dict

    def load_adapter(self, model_id, adapter_name: str = "default", **kwargs):
        """PEFT's load_adapter for a wrapped PEFT model: the weights of an adapter the
        model has, read from `model_id` into the ranks that keep them, on every rank
        together (as Trainer resumes from an adapter checkpoint); see
        trainer_support.load_adapter."""
        return trainer_support.load_adapter(self, model_id, adapter_name, **kwargs)

    def generate(self, *args, **kwargs):
        """transformers' generate() of the wrapped language model, its forwards run through
        the pipeline, on every rank together, each with its own prompts ([Note: generation
        through the pipeline] in generation.py). Under DDP scripts call
        model.module.generate, which here would need the whole model on one rank."""
        from . import generation
        return generation.generate(self, args, kwargs)

    def serve_gather(self, what: str, part: int = 0) -> None:
        """Takes part in gather `what` (of `part`, for an optimizer's state: see
        _optimizer_part) of this module that other ranks asked for, keeping nothing ([Note:
        gathers asked by some ranks] in handshake.py)."""
        if what == "state_dict()":
            self._gather_state(keep=False, only=trainer_support.adapter_keys(self)
                               if part == RaNNCModule._ADAPTERS else None)
        else:
            self._gather_optimizer_state(part)

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Loads an optimizer state in the original optimizer's format; see
        full_state.load_optimizer_state."""
        handshake.enter("load_optimizer_state_dict()")
        _checkpoint().forget_pending(self, weights=False, optimizer=True)
        full_state.load_optimizer_state(self, state_dict)

    def share_of_optimizer_state(self, state_dict: dict, optimizer=None) -> dict:
        """What the optimizer's own load_state_dict(state_dict) loads here: this rank's
        share of a whole state ([Note: the optimizer's own state_dict] in optimizer_share.py)."""
        handshake.enter("load_optimizer_state_dict()")
        _checkpoint().forget_pending(self, weights=False, optimizer=True)
        return full_state.optimizer_state_share(self, state_dict, optimizer)

    # what the training plan counted (adopt_optimizer); None: unknown (option load_plan)
    _planned_optimizer_kind = "sgd"

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The module's (first) optimizer."""
        return self.optimizer_share.optimizer

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The module's optimizers ([Note: several optimizers] in optimizer_share.py)."""
        return list(self.optimizer_share.optimizers)

    def optimizer_kind_to_plan(self) -> str:
        """The optimizer state the training plan counts: the largest of the module's
        optimizers', else of the live optimizers over the model's parameters, which their
        first step makes the module's ([Note: optimizers made after wrapping] in
        optimizer_share.py; one added later that keeps more draws a warning then)."""
        from .optimizer_share import built_over
        mine = self.optimizers
        later = [] if mine else built_over(self)
        kinds = [_optimizer_kind(o) for o in mine + later] or ["sgd"]
        kind = max(kinds, key=_OPTIMIZER_KINDS.index)
        if later and _C.get_rank() == 0:
            names = sorted({type(o).__name__ for o in later})
            _C.log_info(f"planned for the state of {' or '.join(names)} ({kind}), built after "
                        "RaNNCModule over its parameters: its first step makes it the "
                        "module's optimizer")
        self._planned_optimizer_kind = kind
        return kind

    def _say_shared_optimizers(self) -> None:
        """Rank 0 warns where one optimizer steps the parameters of two RaNNCModules: each
        module cuts its groups to its own share, so training is right, but the optimizer's
        state_dict() and checkpoints hold only part of its state (docs/checkpoints.md)."""
        if _C.get_rank() != 0:
            return
        for optimizer in self.optimizers:
            if len(registry.owners(optimizer)) > 1 and \
                    not getattr(optimizer, "_rannc_said_shared", False):
                optimizer._rannc_said_shared = True
                _C.log_warn(f"{type(optimizer).__name__} steps the parameters of two "
                            "RaNNCModules: it trains right, but its state_dict() and the "
                            "modules' checkpoints hold only part of its state; wrap the model "
                            "as one module, or give each module an optimizer of its own")

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Makes `optimizer`, built after wrapping over the model's parameters, this module's,
        as if passed to it ([Note: optimizers made after wrapping] in optimizer_share.py)."""
        stages = len(self._deployed[True].deployment.stages)
        if stages > 1 and _C.get_world_size() > 1 and reads_every_gradient(optimizer):
            raise failure.agreed(
                f"{type(optimizer).__name__} was built after RaNNCModule's first training call, "
                f"which cut the model into {stages} stages, each rank holding its stages' "
                f"gradients only; {type(optimizer).__name__} reads every gradient of the model "
                "at each step: build it before that call (the model is then planned as one "
                "stage) or use another optimizer ([Note: optimizers that read every gradient] "
                "in deployed.py)")
        self.optimizer_share.add(optimizer)
        self.optimizer_share.cut(self.placement.optimized_elsewhere())
        self._say_shared_optimizers()
        planned = self.options.optimizer_kind or self._planned_optimizer_kind
        kind = _optimizer_kind(optimizer)
        if _C.get_rank() == 0 and planned is not None and \
                _OPTIMIZER_KINDS.index(kind) > _OPTIMIZER_KINDS.index(planned):
            _C.log_warn(
                f"{type(optimizer).__name__} was built after RaNNCModule's first training "
                f"call and steps its parameters: it is now "
                f"{'the' if len(self.optimizers) == 1 else 'one of the'} module's optimizer"
                f"{'' if len(self.optimizers) == 1 else 's'} "
                f"(checkpoints and optimizer_state_dict() hold its state), but the plan was "
                f"made for {planned} and did not count the {kind} state in each stage's "
                f"memory; build it before that call, pass it to RaNNCModule, or pass the "
                f"option optimizer_kind=\"{kind}\" for a plan that counts it")

    # ---- transformers' Trainer and accelerate ------------------------------------------------
    # [Note: accelerate] transformers' Trainer hands the model to accelerate, which on
    # several processes wraps it in DistributedDataParallel: a second data parallelism over
    # rannc's own, whose first act broadcasts every parameter from rank 0 (each rank holds
    # another share). accelerate leaves alone a model that says it is already prepared, so a
    # RaNNCModule says so; what accelerate would then not do is done here: a run in bf16 or
    # fp16 (TrainingArguments(bf16=True)) computes in that precision, and its outputs come
    # back in fp32, as accelerate's autocast wrapper gives them. Trainer saves a model that
    # is not a PreTrainedModel with safetensors' save_file, which refuses tensors sharing
    # memory: so the state_dict() of a prepared module gives a tied weight's second name a
    # copy of its own; and since that file alone does not load with from_pretrained, a
    # module prepared by accelerate has Trainer save the wrapped model with save_pretrained
    # ([Note: Trainer's saved models] in trainer_support.py).
    # Trainer saves it on rank 0 alone ([Note: gathers asked by some ranks] in
    # handshake.py). With gradient accumulation Trainer weights each accumulated batch by
    # its tokens: it counts the items of all of them over all ranks and passes the count as
    # `num_items_in_batch`, which the model divides its sum by; rannc adds such a sum up
    # over the shares (csrc/ir/reduction.h), so the module's loss is the whole batch's
    # share of the step. Trainer then multiplies it by the number of processes, as a DDP
    # rank's loss is its own rows' share and DDP averages the ranks' gradients: a module
    # prepared by accelerate hands the model the count times the number of processes, and
    # Trainer's product is the step's share again, as in one process. The count must be
    # the same on every rank (average_tokens_across_devices=True, Trainer's default): a
    # 0-dim argument that differs between ranks is an agreed error (_scalars_differ).
    # accelerate's prepare_model() returns a model that says it is prepared as it is, without
    # saying so to it (Trainer's evaluate() before train() prepares the model that way):
    # being asked is being prepared. Before session 30 that evaluation's loss on N ranks
    # was N times the loss, Trainer multiplying a count that was not.
    @property
    def _is_accelerate_prepared(self) -> bool:
        if _accelerate_running():
            self._is_accelerate_prepared = True
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, prepared: bool) -> None:
        if prepared:
            self._prepared_by_accelerate = True
            self._accelerate_precision = _accelerate_mixed_precision()
            trainer_support.prepare_trainer()

    _prepared_by_accelerate = False
    _said_precision = False
    _said_outside_gradients = False  # [Note: gradients made outside] in optimizer_share.py
    _loss_scaler = None  # the GradScaler that steps its optimizer ([Note: scaled seeds] in amp.py)
    _accelerate_precision = None

    # What transformers' Trainer reads of the model it is given (its RaNNCModule): the
    # config (Trainer sets config.use_cache, aligns the special tokens), the loss type
    # (whether it counts a causal loss's items without each row's first label), the class
    # name (whether its label smoother shifts a causal LM's labels) and the input
    # embeddings (NEFTune's noise is a forward hook on them, registered before training
    # starts, so the training trace holds it). The wrapped model's, so that Trainer does
    # what it does for the model in one process.
    # dtype and device: what diffusers' pipelines and transformers' users read of a model
    _MODEL_ATTRIBUTES = frozenset({"config", "generation_config", "loss_type", "dtype", "device",
                                   "get_input_embeddings", "get_output_embeddings"})

    def _get_name(self) -> str:
        return self.module._get_name()

    def __repr__(self) -> str:
        # nn.Module's repr would open with _get_name(): the model's
        body = torch.nn.modules.module._addindent(repr(self.module), 2)
        return f"RaNNCModule(\n  (module): {body}\n)"

    # What Trainer reads of a PEFT model ([Note: PEFT models in Trainer] in trainer_support.py)
    _PEFT_ATTRIBUTES = frozenset({"peft_config", "active_adapters", "active_adapter",
                                  "get_base_model", "base_model"})

    def __getattr__(self, name: str):
        if name in RaNNCModule._MODEL_ATTRIBUTES or (
                name in RaNNCModule._PEFT_ATTRIBUTES
                and trainer_support.is_peft_model(self.__dict__["_modules"]["module"])):
            return self._model_attribute(name)
        return super().__getattr__(name)

    def _model_attribute(self, name: str):
        """The wrapped model's attribute `name`, or an AttributeError naming both."""
        model = self.__dict__["_modules"]["module"]
        if not hasattr(model, name):
            raise AttributeError(f"'RaNNCModule' object has no attribute '{name}' (nor has "
                                 f"its model, a {type(model).__name__})")
        return getattr(model, name)

    @property
    def accepts_loss_kwargs(self) -> bool:
        """Whether Trainer may pass num_items_in_batch ([Note: accelerate])."""
        own = getattr(self.module, "accepts_loss_kwargs", None)
        if own is not None:
            return own
        return any(p.kind == inspect.Parameter.VAR_KEYWORD
                   for p in inspect.signature(self.module.forward).parameters.values())

    def __deepcopy__(self, memo):
        """A copy that runs on this module's plan with weights of its own, for eval calls:
        an EMA (torch.optim.swa_utils.AveragedModel, timm's ModelEmaV3), a frozen reference
        model ([Note: copies of a wrapped model] in copies.py). Every rank copies alike."""
        from .copies import PlanSharingCopy
        return PlanSharingCopy(self, self.module, memo)

    def __getstate__(self):
        # pickle (torch.save(model)) ends here: say what to do instead of failing on a
        # pybind object
        raise _C.Error(
            "a RaNNCModule cannot be pickled (torch.save(model)): it holds this rank's share "
            "of a model spread over the ranks, with their communicators. Save its weights "
            "with state_dict() or save_checkpoint(dir) on every rank")

    @contextlib.contextmanager
    def no_sync(self):
        """As DistributedDataParallel.no_sync(), for gradient accumulation: the training
        calls inside keep each rank's gradients to itself instead of summing them over the
        ranks that share each parameter, and the first training call after it sums what
        they left in .grad together with its own. Every rank must run the same calls in it.
        Step the optimizer (or clip) only after a summed call, as with DDP."""
        before = self._grad_sync
        self._grad_sync = False
        try:
            yield
        finally:
            self._grad_sync = before

    # [Note: DDP's other methods] A script moved from DistributedDataParallel may call its
    # join(), register_comm_hook() or _set_static_graph(); an AttributeError named none of
    # what rannc does instead.
    def join(self, *args, **kwargs):
        """DDP's join() for uneven inputs has no counterpart: an error saying what to do."""
        raise _C.Error(
            "RaNNCModule has no join() (DDP's context for ranks with uneven inputs): a rank "
            "holds stages that every other rank's steps run through, so every rank must make "
            "the same calls. Give each rank as many batches (DistributedSampler(..., "
            "drop_last=True), or stop every rank at the shortest rank's count)")

    def register_comm_hook(self, state, hook):
        """DDP's gradient communication hooks have no counterpart: an error saying so."""
        raise _C.Error(
            f"RaNNCModule has no register_comm_hook() ({getattr(hook, '__name__', hook)}): "
            "rannc sums each stage's gradients over its replicas itself, in buckets overlapped "
            "with the backward, in the parameters' dtype; it has no compression hooks. Remove "
            "the call")

    def _set_static_graph(self) -> None:
        """DDP's hint that the graph never changes: rannc's traced graph is static."""

    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0,
                       scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
        """Clips the gradients of all stages by their global norm; returns that norm. With a
        loss `scaler`, unscales the gradients first unless unscale_ already did (clipping
        scaled gradients would clip by the wrong norm, as PyTorch documents)."""
        deployed = self._deployed.get(True)
        if deployed is None:
            raise _C.Error("clip_grad_norm before the first training step")
        if scaler is not None and scaler.is_enabled():
            if self.optimizer is None:
                raise _C.Error("clip_grad_norm with a scaler needs the optimizer passed to "
                               "RaNNCModule")
            from torch.amp.grad_scaler import OptState
            for optimizer in self.optimizers:
                if scaler._per_optimizer_states[id(optimizer)]["stage"] is not OptState.UNSCALED:
                    scaler.unscale_(optimizer)
        return clipping.clip_module_(self, max_norm, float(norm_type))
