"""One traced, planned and deployed mode (training or eval) of a RaNNCModule on this rank:
its calls agreed by the ranks, run on the pipeline engine, and the backward of their
outputs.

[Note: training inside forward] With a scalar loss the whole 1F1B iteration (forwards and
backwards of every micro-batch) runs inside forward(): the backward seed is known up to a
scale. The gradients of this rank's parameters, summed over replicas and over the stages
that share a parameter, are kept aside; `loss.backward()` adds `grad_output * them` to
`.grad`. So `(c * loss).backward()`, accumulation over several calls and `zero_grad()`
behave as in PyTorch.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import time
import zlib
from typing import TYPE_CHECKING

import torch

from . import _C, failure, handshake, named_backward
from .amp import forward_loss_scale
from .graph import TracedGraph
from ._trace import autocast_off
from .options import format_bytes
from .pipeline import Engine
from .transport import device_memory_default

if TYPE_CHECKING:
    from .module import RaNNCModule


class _ApplyStepGrads(torch.autograd.Function):
    """Carries the loss to the user; its backward scales and adds the step's gradients
    (of this rank's parameters, and of the `inputs` that require grad)."""

    @staticmethod
    def forward(ctx, anchor, loss, deployed, step_grads, *inputs):
        ctx.deployed = deployed
        # this call's own ([Note: calls awaiting their backward] in csrc/runtime/engine.h)
        ctx.step_grads, ctx.call_sync = step_grads, deployed.call_sync
        grads = deployed.engine.input_grads if deployed.grad_input_ids else {}
        ctx.input_grads = [grads[vid] for vid in deployed.grad_input_ids]
        ctx.input_devices = [x.device for x in inputs]  # deployed.grad_inputs, in order
        ctx.loss_scale = deployed.loss_scale
        # saved so that a second backward without retain_graph is PyTorch's error for a
        # freed graph (it added the step's gradients again: twice PyTorch's, without a word)
        ctx.save_for_backward(anchor)
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.saved_tensors  # noqa: B018 (raises where a backward freed the graph)
        _refuse_second_order()
        grad = grad.reshape(())  # a [1] loss's too: the step's gradients scale by it
        # the step's gradients were seeded with the loss scale ([Note: scaled seeds])
        if isinstance(ctx.loss_scale, torch.Tensor):  # read on the device
            grad = grad / ctx.loss_scale.to(grad.device).reshape(grad.shape)
        elif ctx.loss_scale != 1.0:
            grad = grad / ctx.loss_scale
        if _accumulates_into_parameters(ctx.deployed):  # [Note: gradients without .grad]
            # applied again by a later backward of a retained graph: .grad gets a copy
            # ([Note: retained graphs] in csrc/runtime/engine.h)
            step_grads = ctx.step_grads.cloned() if _graph_retained() else ctx.step_grads
            ctx.deployed.apply_grads(grad, step_grads, ctx.call_sync)
        # each input's gradient on that input's device (the stage's GPU may be another)
        return (None, None, None, None) + tuple((grad.to(g.device) * g).to(d)
                                          for g, d in zip(ctx.input_grads, ctx.input_devices))


# [Note: gradients without .grad] torch.autograd.grad(loss, x) (an adversarial example's
# input gradient: FGSM, PGD, or a saliency map) and loss.backward(inputs=[x]) leave the
# parameters' .grad alone in PyTorch: only the gradients asked for are computed. A call's
# step gradients reach .grad in the backward of its outputs, so that backward adds them
# only where autograd accumulates into the leaves it did not name: where the module's
# anchor, a leaf of every call's outputs, will be reached. (Before session 29 an
# adversarial training step added the clean batch's gradients to the adversarial one's.)
# The parameters themselves are not in the outputs' graph (the stages hold their own), so
# torch.autograd.grad(loss, model.parameters()) is PyTorch's error for unused tensors;
# and a gradient of a gradient (create_graph=True: a gradient penalty, a Hessian-vector
# product) is refused: the stages' backwards are not differentiable here.
def _accumulates_into_parameters(deployed: "Deployed") -> bool:
    """Whether the backward running now accumulates into the parameters' .grad (a
    backward() of everything: yes; torch.autograd.grad or backward(inputs=...): no)."""
    anchor = torch.autograd.graph.get_gradient_edge(deployed.owner._anchor)
    return torch._C._will_engine_execute_node(anchor.node)


def _refuse_second_order():
    if torch.is_grad_enabled():  # a backward with create_graph=True runs with grad mode on
        raise _C.Error(
            "a gradient of a gradient through a RaNNCModule (torch.autograd.grad or backward "
            "with create_graph=True: a gradient penalty such as WGAN-GP's or R1, a "
            "Hessian-vector product): its stages' backwards are not differentiable. Compute "
            "the penalty's gradient without create_graph, or on a part of the model outside "
            "the RaNNCModule ([Note: gradients without .grad] in deployed.py)")


def _graph_retained() -> bool:
    """Whether the backward running now was called with retain_graph=True (its graph may
    run again)."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return bool(keep_graph and keep_graph())


class _NoGradientPath(torch.autograd.Function):
    """Marks an output that was computed by a 1F1B training step seeded by the scalar loss:
    gradients cannot flow back through it, and trying says so."""

    @staticmethod
    def forward(ctx, anchor, value, why):
        ctx.why = why
        # not a copy (a language model's logits are the step's largest tensor), nor a view
        # (autograd forbids in-place changes of a custom function's views)
        return value.detach()

    @staticmethod
    def backward(ctx, grad):
        raise _C.Error(ctx.why)

    @staticmethod
    def of_training(name: str) -> str:
        return (f"the output {name} has no gradient path: rannc trains from the scalar loss "
                "inside forward (synchronous 1F1B) and returns the other outputs without one. "
                "Backpropagate from the loss output only, or select the fill-drain schedule "
                "(option schedule='fill_drain', or RANNC_SCHEDULE=fill_drain), whose backward "
                "takes gradients of any output.")

    @staticmethod
    def of_eval(name: str) -> str:
        return (f"the output {name} comes from an eval call (the module is in eval mode), "
                "which rannc plans as forward only. To train with dropout off (PyTorch lets a "
                "model in eval mode train), keep the module in train() and put its dropout "
                "modules in eval(): such a call is planned with them off ([Note: modules' "
                "modes] in deployed.py)")


class _FillDrainOutputs(torch.autograd.Function):
    """Carries the outputs of a fill-drain forward to the user; its backward gets their
    gradients (None where an output was not used) and runs that forward's backwards.
    [Note: calls awaiting their backward] in csrc/runtime/engine.h: several forwards may
    await theirs (a loss over the outputs of several calls)."""

    @staticmethod
    def forward(ctx, anchor, deployed, num_outputs, *tensors_and_inputs):
        """`tensors_and_inputs`: the `num_outputs` float outputs, then the inputs that
        require grad (so that autograd hands their gradients to backward)."""
        ctx.deployed = deployed
        ctx.awaiting = _AwaitingForward(deployed)
        ctx.set_materialize_grads(False)
        return tuple(t.detach().clone() for t in tensors_and_inputs[:num_outputs])

    @staticmethod
    def backward(ctx, *grads):
        _refuse_second_order()
        deployed, awaiting = ctx.deployed, ctx.awaiting
        deployed.drop_forwards()
        if not deployed.engine.awaits_backward(awaiting.id):
            # What PyTorch says of a graph whose saved tensors are gone: the stages keep a
            # forward's activations until its backward, which frees them.
            raise RuntimeError(
                "Trying to backward through the outputs of a rannc forward a second time: "
                "the stages keep a forward's activations until its backward, which frees "
                "them, and one backward takes the gradients of all its outputs. Make one loss "
                "of the outputs you need and call backward once per forward.")
        # a backward called under autocast: the casts are traced
        with autocast_off(deployed.owner.device.type, deployed.amp):
            # backward(retain_graph=True): the stashes stay for the next one ([Note:
            # retained graphs] in csrc/runtime/engine.h)
            deployed.backward_from_outputs(grads, awaiting, retain=_graph_retained(),
                                           to_parameters=_accumulates_into_parameters(deployed))
        like = next((g for g in grads if g is not None), None)
        computed = deployed.engine.input_grads
        input_grads = tuple(computed[vid].to(like.device if like is not None else awaiting.out_device)
                            for vid in awaiting.grad_input_ids)
        return (None, None, None) + (None,) * len(grads) + input_grads


class _AwaitingForward:
    """What the backward of a fill-drain forward needs of its call ([Note: calls awaiting
    their backward] in csrc/runtime/engine.h). When autograd frees the outputs' graph
    without running its backward, the engine frees the forward's stashes: at its next
    call, on the thread that runs it (a graph may be freed on autograd's device threads)."""

    def __init__(self, deployed: "Deployed"):
        self.deployed = deployed
        self.id = deployed.engine.last_forward
        self.float_outputs = deployed._float_outputs
        self.grad_input_ids = deployed.grad_input_ids
        self.out_device = deployed.out_device
        self.call_sync = deployed.call_sync

    def __del__(self):
        self.deployed.unreferenced_forwards.append(self.id)  # atomic: any thread


@dataclasses.dataclass
class _Call:
    """One call's arguments on this rank: flat, by input value, and what the ranks agree on."""
    flat: list
    local: dict
    rows: int
    shapes: tuple
    trainable: tuple | None
    flagged: bool = False  # some rank passed flag=True


class Deployed:
    """One traced and planned mode (train or eval) of the model on this rank."""

    def __init__(self, owner: "RaNNCModule", graph: TracedGraph, args, kwargs, amp,
                 trace_seconds: float = 0.0, plan_from: "Deployed | None" = None):
        """`plan_from`: the deployment of this mode at other input shapes, whose plan this
        one runs ([Note: new input shapes]); None: plan this graph."""
        opts, model = owner.options, owner.module
        self.owner = owner
        from .planning import PlanTimes
        self.times = PlanTimes(tracing=trace_seconds)  # filled by planning
        self.graph = graph
        self.amp = amp  # the autocast dtype traced into the graph (None: fp32)
        ir = self.graph.ir
        rank, world = _C.get_rank(), _C.get_world_size()
        # the arguments' shapes but the batch -> the deployment of this mode that runs them
        self.shapes = traced_shapes(graph)
        self._check_agreement(ir)
        # Training without a single scalar loss to seed 1F1B takes gradients from outside.
        has_loss = sum(1 for v in ir.outputs if ir.value(v).is_loss) == 1
        self.fill_drain = model.training and (opts.schedule == "fill_drain" or not has_loss)
        # schedule=zb_h1 splits each backward ([Note: ZB-H1] in csrc/partition/sim/schedule.h);
        # auto plans 1f1b and zb_h1 ([Note: schedule choice] in csrc/partition/planner.cpp).
        # Forwards only (eval) have no backward to schedule.
        self.schedule = ("fill_drain" if self.fill_drain
                         else "1f1b" if opts.schedule == "fill_drain" or not model.training
                         else opts.schedule)
        if plan_from is None:
            self.example_inputs = self.graph._profiling_inputs(args, kwargs)
            deployment = self._plan(ir, world, opts)
            self.example_inputs = None
            # the local batch the plan was made for (its memory)
            self.planned_rows = self.graph.batch_size
        else:
            # the same ops at other sizes: the plan holds ([Note: new input shapes])
            try:
                deployment = _C.rebind_deployment(plan_from.deployment, plan_from.graph.ir, ir)
            except _C.TraceError as e:
                # every rank traced the same graph (_check_agreement): all fail alike
                error = failure.agreed(str(e) + _sizes_of_one(plan_from, self.shapes))
                error.another_program = str(e)  # [Note: programs at other shapes] in module.py
                raise error from e
            self.planned_rows = plan_from.planned_rows
        self.planned_by = plan_from or self  # whose plan this runs
        self.graph._trace.state_tensors = None  # stand-ins and gathered buffers, for planning
        if opts.verify_plan:
            deployment.validate(ir)
        self.deployment = deployment
        state_tensors = self.graph._trace.state.tensors(model)
        n_state = len(state_tensors)
        self.state_ids = list(ir.inputs[:n_state])
        self.input_ids = list(ir.inputs[n_state:])
        # [Note: shared arguments agree] the arguments without rows, once (not per call)
        self.rowless_inputs = frozenset(vid for vid in self.input_ids if ir.value(vid).batch_dim < 0)
        state = dict(zip(self.state_ids, state_tensors))
        self.engine = Engine(self.graph._trace.traced, deployment, rank, world,
                             self.planned_rows, state, device=owner.device, nccl=owner.nccl)
        # [Note: outputs without rows] outputs combined over the shares as scalars are, once
        # per deployment (asked per call, they read the graph's reductions on the hot path)
        self.combined = frozenset(vid for vid in ir.outputs if _combined_over_shares(ir, vid))
        # scalar outputs that are sums over the batch: added up, not weighted by rows
        self.summed = {vid for vid in ir.outputs if _summed(ir, vid, opts.loss_reduction)}
        self.engine.set_summed_outputs(self.summed)
        # [Note: frozen parameters] which parameters require grad, as traced (training)
        self.params = state_tensors[:len(self.graph._trace.state.param_names)]
        self.trainable = self._trainable()
        self.modes = module_modes(self.owner.module)  # [Note: modules' modes]
        # [Note: attributes read] in _trace.py: what the forward read, as traced
        self.attributes = self.graph._trace.attributes
        self.attribute_values = tuple(value for *_, value in self.attributes)
        self.variants = {(self.shapes, self.trainable): self}
        self.last_trained = self  # the variant the last training call ran (its gradients)
        self.unrunnable = {}  # (input shapes, trainable) -> why the plan cannot run them
        self.own = self.engine.own  # the parameters this rank updates
        self.own_params = list(self.own.values())  # in the engine's order
        self.grad_input_ids, self.grad_inputs = [], []  # arguments that require grad
        self.loss_scale = 1.0  # the last training step's seed factor ([Note: scaled seeds])
        # fill-drain forwards whose outputs autograd freed ([Note: calls awaiting their
        # backward] in csrc/runtime/engine.h)
        self.unreferenced_forwards = collections.deque()
        self.call_sync = True  # whether the last training call summed its gradients
        # a training program of other arguments than the first training call's: its
        # gradients go to each parameter's trainers ([Note: other training arguments])
        self.routing_key = None
        self._routes = self._positions = None  # _route_grads's, once
        # [Note: programs at other shapes] in module.py: the key of the program whose plan
        # this runs in the module's placement (None: the mode's first program), and, on a
        # program that calls at new shapes start from, the programs planned at shapes its
        # plan cannot run
        self.program_key = None
        self.shape_programs = []
        if rank == 0 and plan_from is None:
            print(deployment.report(), flush=True)
            print(self.times.line(), flush=True)
            for i, vid in enumerate(ir.outputs):
                name = f" ({ir.value(vid).name})" if ir.value(vid).name else ""
                if vid in self.summed and opts.loss_reduction == "auto":
                    _C.log_info(f"output #{i}{name} is a sum over the batch "
                                "(reduction=\"sum\", or a sum divided by a count passed in): its "
                                "micro-batches and ranks add up, its terms that are means or the "
                                "same for any rows weighted by their rows (option loss_reduction)")
                elif (opts.loss_reduction == "auto" and vid in self.combined
                      and ir.output_reduction(vid) == "unknown"):
                    _C.log_info(f"output #{i}{name}: the graph does not show whether it is a mean "
                                "or a sum over the batch (a max, a norm, exp of a mean): "
                                "each micro-batch's and rank's value is weighted by its rows, as "
                                "for a mean (option loss_reduction)")
                elif ((deployment.micro_batches > 1 or _C.get_world_size() > 1)
                      and ir.value(vid).batch_dependent and ir.value(vid).batch_dim < 0
                      and vid not in self.combined and ir.value(vid).kind == "Tensor"):
                    _C.log_warn(f"output #{i}{name} is an integer tensor computed from the batch "
                                "that holds no dimension of its rows and is no sum over them: it "
                                "is micro-batch 0's value, not the whole batch's; return what it "
                                "is made from with the batch's rows, or a count over them "
                                "([Note: outputs without rows] in deployed.py)")
            for term in self.engine.token_means["unknown_terms"]:
                # [Note: mixed terms] in csrc/frontend/token_means.h; with several
                # micro-batches such a term (a mixture of experts' load-balancing loss) is
                # each micro-batch's, over fewer rows than a DDP rank's: a warning
                say = _C.log_warn if deployment.micro_batches > 1 else _C.log_info
                say(f"the {term}: the graph does not show whether it is a mean or a sum over "
                    "the batch (a function of one, such as a product of means): each "
                    "micro-batch's and rank's value is weighted by its rows, as for a mean"
                    + (f"; with {deployment.micro_batches} micro-batches each computes it over "
                       "its own rows, fewer than a DistributedDataParallel rank's "
                       "(num_microbatches=1 gives DDP's)" if deployment.micro_batches > 1 else ""))
            for why in self.engine.token_means["row_weighted"]:
                # [Note: token-mean losses] in csrc/frontend/token_means.h
                _C.log_info(f"the mean loss {why}: micro-batches and replicas weigh it by their "
                            "rows (as DistributedDataParallel does), not by its count over the "
                            "global batch")

    def _check_agreement(self, ir):
        """Every rank must trace the same graph with the same local batch size. Where the
        graphs differ, the model's parameters tell the cause: the same parameters traced
        into different graphs means control flow that depends on data, which differs
        between the ranks' batches."""
        comm = _C.Communicator.world_cpu()
        state = self.graph._trace.state.tensors(self.owner.module)
        full_shape = self.owner.placement.full_shape  # freed here or not
        signature = repr([(n, tuple(full_shape(i, t)), str(t.dtype))
                          for i, (n, t) in enumerate(zip(self.graph._trace.state.names, state))])
        passed = self._tensor_arguments(ir)
        # [Note: shared arguments agree], [Note: rows alike on every rank]
        shared = [(path, t) for path, t, dim in passed if dim < 0 and t.dim() >= 1]
        rows = [a for a in passed if a[2] >= 0][:_ROWS_COMPARED]
        mine = torch.tensor([ir.content_hash() & 0x7FFFFFFFFFFFFFFF, self.graph.batch_size,
                             zlib.crc32(signature.encode()), zlib.crc32(repr(self.shapes).encode()),
                             self.owner.held_bytes(), _content_crc([t for _, t in shared])]
                            + [_end_rows_crc(t, dim) for _, t, dim in rows]
                            + [0] * (_ROWS_COMPARED - len(rows)), dtype=torch.int64)
        everyone = torch.empty(comm.size, 6 + _ROWS_COMPARED, dtype=torch.int64)
        comm.all_gather(mine, everyone).wait()
        hashes, batches, models, arguments, held, contents = (everyone[:, i].tolist()
                                                              for i in range(6))
        same = [len(set(everyone[:, 6 + i].tolist())) == 1 and int(everyone[0, 6 + i]) != 0
                for i in range(len(rows))]
        if comm.size > 1 and any(same) and not all(same) and len(set(arguments)) == 1 and \
                comm.rank == 0:  # (one rank's rows are alike on every rank)
            _say_rows_alike([path for (path, _, _), s in zip(rows, same) if s],
                            self.graph.batch_size)
        self.held_bytes = max(held)  # [Note: memory the programs before hold]
        if len(set(batches)) > 1:
            raise failure.agreed(f"local batches must have the same size on every rank; got "
                                 f"{dict(enumerate(batches))} (rank: rows){failure.UNEQUAL_CURE}")
        if len(set(arguments)) > 1:
            raise _shapes_differ(arguments, self.graph._trace.inputs, self.shapes)
        if len(set(contents)) > 1:
            raise _shared_arguments_differ(contents, shared, self.graph.batch_size)
        if len(set(models)) > 1:
            raise failure.agreed("the ranks built different models (their parameters and "
                                 "buffers differ in names, shapes or dtypes); every rank must "
                                 "build the same model")
        if len(set(hashes)) > 1:
            from .transport import all_gather_objects
            where = _first_difference(all_gather_objects(_task_signatures(self.graph)))
            if where is not None and where[1] != "op":
                raise failure.agreed(
                    f"the ranks traced different graphs from the same model: {where[0]}. "
                    + ("A value as large as the data decides (a packed sequence's rows, as "
                       "many as the lengths add up to) has another size on each rank: compute "
                       "what follows from the output of pad_packed_sequence(..., "
                       "total_length=T), whose size is fixed"
                       if where[1] == "shape" else
                       "Whether its rows depend on each other read differently on each rank's "
                       "data (a loss over the hardest examples of the batch, a mask made from "
                       "several rows): compute such a loss outside the module from its outputs"))
            found = where[0] if where is not None else f"graph hash per rank: {[hex(h) for h in hashes]}"
            raise failure.agreed(
                f"the ranks traced different graphs from the same model ({found}): the model's "
                "control flow depends on its input data (an `if` on a tensor's value, a loop "
                "over data), and the ranks' batches took different branches. rannc traces one "
                "program for every batch: make the branch independent of the data "
                "(torch.where, masks), or pass the deciding value as a constant argument")

    def _tensor_arguments(self, ir) -> list[tuple[str, torch.Tensor, int]]:
        """The traced tensor arguments: (path, tensor, batch dimension or -1)."""
        inputs = self.graph._trace.inputs
        n_state = len(self.graph._trace.state.names)
        return [(inputs.paths[slot], t, ir.value(v).batch_dim) for slot, t, v in
                zip(inputs.tensor_slots, inputs.tensors, ir.inputs[n_state:])]

    def _plan(self, ir, world, opts):
        # A plan runs only for the batch and world it was made for: local batch x ranks.
        batch = self.graph.batch_size * world
        opts = self._whole_gradient_optimizers(world, opts)
        if opts.load_plan:
            self.owner._planned_optimizer_kind = None  # the file's plan counted what it did
            return _C.load_deployment(opts.load_plan, ir, batch_size=batch, world_size=world)
        if _C.get_rank() != 0 and self._profiled(opts, world):
            self._make_plan(ir, world, opts)  # profiles a share of the pieces for rank 0
        from .planning import broadcast_plan
        deployment = broadcast_plan(lambda: self._make_plan(ir, world, opts), ir,
                                    batch_size=batch, world_size=world)
        if opts.save_plan and _C.get_rank() == 0:
            deployment.save(opts.save_plan)
        return deployment

    # [Note: optimizers that read every gradient] torch.optim.LBFGS flattens its
    # parameters' gradients into one vector and takes dot products, norms and a line search
    # over it; each rank holds its stages' gradients only, so on several stages every rank
    # stepped by its stages' curvature alone (the loss after a step read 2.29 for PyTorch's
    # 0.32), without a word. One stage holds every gradient, summed over the replicas, on
    # every rank, so a model trained by such an optimizer is planned as one stage, and a
    # plan of more (num_stages, or a plan's file) is an error on every rank naming it.
    # Likewise an optimizer whose step() requires a closure: it evaluates the loss again
    # around something of the whole model, as SAM and its kin (ASAM, GSAM) climb to
    # `rho * g / ||g||`, the norm over every gradient (each rank's would be its stages').
    # An optimizer built after the first training call is checked when it is adopted
    # (module.adopt_optimizer): the plan is made by then.
    def _whole_gradient_optimizers(self, world: int, opts):
        if world == 1 or not self.owner.module.training:
            return opts
        from .optimizer_share import built_over
        optimizers = self.owner.optimizers or built_over(self.owner)
        names = sorted({type(o).__name__ for o in optimizers if reads_every_gradient(o)})
        if not names:
            return opts
        if opts.num_stages > 1 or opts.load_plan:
            given = (f"num_stages={opts.num_stages}" if opts.num_stages > 1
                     else f"the plan in {opts.load_plan}")
            raise failure.agreed(
                f"{' and '.join(names)} reads every gradient of the model at each step, but "
                f"{given} cuts the model into stages, each rank holding its stages' gradients "
                "only: plan one stage (leave num_stages unset, or 1), or use another optimizer "
                "([Note: optimizers that read every gradient] in deployed.py)")
        if _C.get_rank() == 0:
            _C.log_info(f"{' and '.join(names)} reads every gradient of the model at each step: "
                        "planned as one stage, replicated on every rank ([Note: optimizers that "
                        "read every gradient] in deployed.py)")
        return dataclasses.replace(opts, num_stages=1)

    @staticmethod
    def _profiled(opts, world: int) -> bool:
        """Whether planning measures pieces. One stage (num_stages=1, or a single rank, whose
        plan can only be one stage) leaves nothing to search: every rank holds the whole
        model, and only memory decides the micro-batch count and recomputation, which the
        shapes tell. So the first step costs about one forward and backward more than
        plain PyTorch instead of a profiling run."""
        return opts.cost_model == "profile" and opts.num_stages != 1 and world > 1

    # [Note: memory the programs before hold] A program planned while others are deployed
    # (an eval call after training, a training call with other arguments) shares the devices
    # with their state: training's parameters, gradients and optimizer state stay through an
    # evaluation. Each rank counts the bytes it holds on the stages' device (parameters,
    # buffers, gradients, optimizer state; the first program counts none: what it does not
    # use is freed after it deploys), and the plan gets what the fullest rank has left. It
    # is conservative where the new program's stages reuse tensors the rank holds (their
    # weights count twice), so that a plan never counts on memory another program has;
    # before, an eval plan was given the whole device and could run a GPU out of memory at
    # the first evaluation of a model whose training fills it.
    def _programs_before(self) -> str:
        modes = [("training" if m else "eval") for m in self.owner._deployed]
        modes += [("training" if m else "eval") + " with other arguments"
                  for m, _ in self.owner._deployed_by_arguments]
        return ", ".join(f"{m} calls" for m in modes)

    def _make_plan(self, ir, world, opts):
        """Rank 0's plan; with the profiler and several ranks, the other ranks take part
        (profiling their share of the pieces) and get None."""
        from . import planning
        # A forward-only (eval) plan keeps no optimizer state.
        training = self.owner.module.training
        optimizer = ((opts.optimizer_kind or self.owner.optimizer_kind_to_plan())
                     if training else "sgd")
        profiled = self._profiled(opts, world)
        if opts.cost_model == "profile" and not profiled and _C.get_rank() == 0:
            why = "num_stages=1" if opts.num_stages == 1 else "one rank"
            _C.log_info(f"one stage ({why}): nothing to search, so nothing is profiled; "
                        "the plan's times are estimates from shapes")
        # Profiled where the stages will run.
        where = str(self.owner.device)
        # The probe times MPI through host memory: the link of CPU stages and of GPUs that
        # talk over MPI, not NCCL's (NVLink, InfiniBand): there the DeviceSpec figures stand.
        # copies made before the first call (an EMA): [Note: copies of a wrapped model]
        copies = self.model_copies = max(opts.model_copies, self.owner.placement.copy_count())
        if copies and _C.get_rank() == 0:
            _C.log_info(f"the plan counts {copies} cop{'y' if copies == 1 else 'ies'} of the "
                        "parameters and buffers beside the model (an EMA) in each stage's memory")
        # A num_microbatches fixed for training, more than a small first evaluation's batch
        # holds (global batch 2 under num_microbatches=4), made planning it fail on every
        # rank; an eval program runs at most as many as its batch allows.
        micro = opts.num_microbatches
        if micro and not training:
            micro = min(micro, max(1, (opts.batch_size or self.graph.batch_size * world) // world))
        plan_opts = dataclasses.replace(opts, training=training, schedule=self.schedule,
                                        num_microbatches=micro,
                                        model_copies=copies, profile_device=where,
                                        probe_bandwidth=opts.probe_bandwidth and not self.owner.nccl,
                                        cost_model="profile" if profiled else "analytic")
        device = _C.DeviceSpec()
        whole = opts.device_memory or device_memory_default(self.owner.device)
        device.memory_bytes = max(0, whole - self.held_bytes)
        if self.held_bytes and _C.get_rank() == 0:
            _C.log_info(f"planned within {format_bytes(device.memory_bytes)} per device: the "
                        f"programs deployed before hold up to {format_bytes(self.held_bytes)} of "
                        f"the {format_bytes(whole)} on a rank ([Note: memory the "
                        "programs before hold] in deployed.py)")
        device.devices_per_node = max(1, _C.get_local_size())
        update_rate = None
        if profiled and training and not opts.profile_fake_timer:  # fake: times from shapes
            from .update_cost import measure_update_rate
            # Only rank 0 plans; the others profile their share of the pieces.
            timed = time.perf_counter()
            update_rate = measure_update_rate(
                self.owner.placement.shaped_parameters(), self.owner.optimizer, optimizer,
                device=where) if _C.get_rank() == 0 else 0.0
            self.times.profiling += time.perf_counter() - timed
        if not profiled and self.owner.device.type == "cpu":
            # CPU ranks: modest peak and bandwidth; only the ratios matter for the plan.
            device.peak_flops, device.memory_bandwidth = 50e9, 10e9
            device.intra_node_bandwidth = device.inter_node_bandwidth = 5e9
        note = "" if not self.held_bytes else (
            f"the programs deployed before, {self._programs_before()}, hold up to "
            f"{format_bytes(self.held_bytes)} of the {format_bytes(whole)} per device in "
            "parameters, buffers, gradients and optimizer state, which stay through this call: "
            "use more devices, a smaller batch for this call, or set device_memory if the "
            "devices have more; [Note: memory the programs before hold] in deployed.py")
        deployment = planning.plan_graph(
            self.graph, self.example_inputs, plan_opts, world_size=world, device=device,
            optimizer=optimizer, broadcast=False, profile_cache=self.owner.profile_cache,
            times=self.times, update_seconds_per_byte=update_rate, memory_note=note)
        if profiled and opts.profile_cache and _C.get_rank() == 0:
            self.owner.profile_cache.save(opts.profile_cache)
        return deployment

    # ---- running ------------------------------------------------------------------------
    def agree(self, args, kwargs, what: str, flag: bool = False) -> _Call:
        """This call's arguments, agreed by every rank in one all-gather: all ranks are in
        `what` (a training or an eval call, [Note: named collectives]), with local batches of
        the same rows, arguments of the same shapes (checked on every call: a rank with
        other sizes would desynchronise the transfers) and the same parameters requiring
        grad, so that all raise together or deploy new shapes together; and whether any
        rank raised `flag`."""
        flat = self.graph._flat_args(args, kwargs)
        local = dict(zip(self.input_ids, flat))
        call = _Call(flat, local, self._local_rows(local), self._shapes(local), self._trainable(),
                     flag)
        if not handshake.active():
            return call
        scalars = self._scalar_arguments(local)
        small = self._small_shared_arguments(local)  # [Note: shared arguments agree]
        mine = torch.tensor([call.rows, zlib.crc32(repr(call.shapes).encode()),
                             zlib.crc32(bytes(call.trainable or ())), flag,
                             zlib.crc32(repr(scalars).encode()),
                             _content_crc([t for _, t in small])], dtype=torch.float64)
        everyone = handshake.exchange(what, mine).long()
        sizes, signatures, flags, raised, values, contents = (everyone[:, i].tolist()
                                                              for i in range(6))
        call.flagged = any(raised)
        if len(set(signatures)) > 1:
            raise _shapes_differ(signatures, self.graph._trace.inputs, call.shapes)
        if len(set(values)) > 1:
            raise _scalars_differ(values, scalars)
        if len(set(contents)) > 1:
            raise _shared_arguments_differ(contents, small, self.graph.batch_size)
        if len(set(flags)) > 1:
            raise failure.agreed(
                f"the ranks' models differ in which parameters require grad "
                f"({sum(call.trainable)} on rank {_C.get_rank()}): freeze or unfreeze "
                "parameters on every rank alike")
        if len(set(sizes)) > 1:
            raise failure.agreed(f"local batches must have the same size on every rank in "
                                 f"each call; got {dict(enumerate(sizes))} (rank: rows)"
                                 f"{failure.UNEQUAL_CURE}")
        return call

    def run(self, call: _Call, args, kwargs):
        """Runs one agreed call on variant()."""
        return self.variant(call, args, kwargs)._run(call.local, call.flat, call.rows)

    def variant(self, call: _Call, args, kwargs, new_programs: bool = True) -> "Deployed":
        """The deployment that runs `call`: this one, or the one of this mode for the call's
        input shapes, deployed first if they are new ([Note: new input shapes]): this
        plan's, or another program's where the model is another program at them ([Note:
        programs at other shapes] in module.py; unless not `new_programs`)."""
        shapes, trainable = call.shapes, call.trainable
        key = (shapes, trainable)
        target = self.variants.get(key)
        if target is None:
            if key in self.unrunnable:  # the same error without tracing again
                raise failure.agreed(self.unrunnable[key])
            what = (f"new input shapes {self.describe_shapes(shapes)} (planned at "
                    f"{self.describe_shapes()})" if shapes != self.shapes
                    else f"{sum(trainable)} of {len(trainable)} parameters now require grad "
                         f"({sum(self.trainable)} when planned)")
            try:
                target = self.variants[key] = self.owner._deploy_shapes(self, args, kwargs,
                                                                         new_programs)
            except Exception as e:
                if getattr(e, "on_every_rank", False) and not getattr(e, "depends_on_batch", False):
                    self.unrunnable[key] = str(e)  # a rule of the plan or the trace
                else:  # say which step failed: the whole model runs to trace it again
                    e.add_note(f"rannc: while tracing the model again for {what}")
                raise
            if _C.get_rank() == 0 and target not in self.shape_programs:  # (planned: said)
                plan = target.planned_by
                made = ("made at the first call" if plan is self else
                        f"made at {plan.describe_shapes()}, where the model is the same program")
                _C.log_info(
                    f"{what}: traced again in "
                    f"{target.times.tracing:.2f} s, running plan {plan.deployment.hash} {made} "
                    f"({len(self.variants)} variants so far)"
                    f"{target._micro_batch_note()}")
                target._warn_over_memory(shapes == self.shapes)
        if trainable is not None:
            self.last_trained = target
        return target

    # [Note: modules' modes] A trace bakes in each module's training flag (dropout on or off,
    # batch norm's batch or running statistics). Putting submodules in eval() after the first
    # call (dropout switched off for fine-tuning, batch norm's statistics frozen) or one in
    # train() during evaluation (Monte Carlo dropout) was ignored without a word; such a call
    # is another program (module.py), traced and planned on its own as a call of other
    # arguments is ([Note: other arguments] in module.py): its ops differ (a batch norm in
    # eval mode writes no statistics), so the first plan cannot run it. (Ranks whose modes
    # differ are in differently named programs: the handshake names them.)
    def _attributes_changed(self, values: tuple) -> str:
        changed = [f"{attribute} of {name} ({then!r} -> {now!r})"
                   for (name, _, attribute, then), now in zip(self.attributes, values) if now != then]
        return (f"the attribute{'s' if len(changed) > 1 else ''} {failure.some_of(changed)} "
                "changed since the model was traced (a number that changes every step is "
                "better kept in a buffer: [Note: attributes read] in _trace.py)")

    def _modes_changed(self, modes: tuple) -> str:
        names = [name or "the model" for (name, _), now, then
                 in zip(self.owner.module.named_modules(), modes, self.modes) if now != then]
        evals = sum(1 for now, then in zip(modes, self.modes) if now != then and not now)
        now = "eval()" if evals == len(names) else "train()" if not evals else "other modes"
        return (f"{failure.some_of(names)} put in {now} since the model was traced ([Note: "
                "modules' modes] in deployed.py)")

    def _trainable(self) -> tuple | None:
        """[Note: frozen parameters] Which parameters require grad now, in a training mode
        (None in eval). A trace bakes in which values carry gradients (the transfers between
        stages, the gradient buckets, what a stage updates), so unfreezing a layer between
        steps, as fine-tuning schedules do, or freezing one, traces again under the same
        plan, as new input shapes do; before, the change was ignored without a word."""
        if not self.owner.module.training:
            return None
        return tuple(p.requires_grad for p in self.params)

    def _run(self, local: dict, flat: list, rows: int):
        # Outputs go where the user's inputs are (the stage's device without tensor inputs).
        self.out_device = next((t.device for t in flat if isinstance(t, torch.Tensor)),
                               self.owner.device)
        self._use_batch(rows)
        training = torch.is_grad_enabled() and self.owner.module.training
        # [Note: input gradients] in csrc/runtime/engine.h
        grad_inputs = {vid: t for vid, t in local.items() if training and
                       isinstance(t, torch.Tensor) and t.requires_grad}
        self.grad_input_ids = sorted(grad_inputs)
        self.grad_inputs = [grad_inputs[vid] for vid in self.grad_input_ids]
        self.engine.set_input_grads(set(self.grad_input_ids))
        if training:  # read when the step's backwards run ([Note: unsynced steps])
            self.call_sync = self.owner._grad_sync
            self.engine.set_grad_sync(self.call_sync)
        if training and self.fill_drain:
            self.drop_forwards()
            with _hooks_held(self.own_params):  # [Note: parameter hooks]
                produced, batch_outputs = self.engine.forward_for_backward(local)
            return self._outputs(produced, batch_outputs, "fill_drain")
        train = training and self.engine.loss_vid is not None
        if train:
            self.loss_scale = forward_loss_scale(self.owner)  # [Note: scaled seeds] in amp.py
            with _hooks_held(self.own_params):
                produced, batch_outputs = self.engine.step(local, True, self.loss_scale)
        else:
            produced, batch_outputs = self.engine.step(local, False)
        return self._outputs(produced, batch_outputs, "1f1b" if train else None)

    # ---- batch sizes ([Note: batch sizes] in csrc/runtime/engine.h) -----------------------
    def _local_rows(self, local: dict) -> int:
        """This call's local batch: the rows of the arguments that carry the batch."""
        rows = {}
        for vid, t in local.items():
            v = self.engine.value(vid)
            if v.batch_dim >= 0 and isinstance(t, torch.Tensor):
                rows[v.name or vid] = t.shape[v.batch_dim] // v.batch_multiple
        if len(set(rows.values())) > 1:
            raise _C.Error(f"the arguments that carry the batch disagree on its size: {rows}")
        return next(iter(rows.values()), self.graph.batch_size)

    def _scalar_arguments(self, local: dict) -> tuple:
        """(path, value) of each 0-dim tensor argument: not rows of the batch, so every
        stage must see one value (a count passed in, as transformers' num_items_in_batch)."""
        example = self.graph._trace.inputs
        tensors = [t for t in local.values() if isinstance(t, torch.Tensor)]
        return tuple((example.paths[slot], t.item()) for slot, t in zip(example.tensor_slots, tensors)
                     if t.dim() == 0)

    def _small_shared_arguments(self, local: dict) -> list[tuple[str, torch.Tensor]]:
        """(path, tensor) of each tensor argument of a dimension or more that holds no rows
        of the batch and at most _SHARED_COMPARED values (per-set labels beside a set's
        rows, a small mask): compared at every call, as 0-dim ones are."""
        example = self.graph._trace.inputs
        tensors = [(vid, t) for vid, t in local.items() if isinstance(t, torch.Tensor)]
        return [(example.paths[slot], t) for slot, (vid, t) in zip(example.tensor_slots, tensors)
                if vid in self.rowless_inputs and t.dim() >= 1 and t.numel() <= _SHARED_COMPARED]

    def _shapes(self, local: dict) -> tuple:
        """[Note: new input shapes] The arguments' dtypes and shapes but the batch dimension
        (-1 there). A trace holds what the model computed from the shapes (a loop over the
        sequence, a mask's length), the plan's transfers are sized from them, and a stage
        takes a size from another as traced: so each new shape is traced again, on every
        rank together, and runs the plan made at the first shapes when the trace is the same
        program (partition::rebindDeployment), else it is another program ([Note: programs
        at other shapes] in module.py)."""
        return _shapes_but_batch((t, self.engine.value(vid).batch_dim) for vid, t in local.items())

    def describe_shapes(self, shapes: tuple | None = None) -> str:
        """"kwargs['input_ids'] int64 [*, 16], ..." for `shapes` (default: this deployment's
        traced ones; * is the batch)."""
        return _describe_shapes(self.graph._trace.inputs, shapes or self.shapes)

    def _use_batch(self, rows: int):
        try:
            changed = self.engine.use_batch(rows)
        except _C.CommError:
            raise  # a peer failed: nothing to agree on
        except _C.Error as e:  # too few rows: every rank has the agreed rows, and says so
            raise failure.agreed(str(e)) from None
        if changed and _C.get_rank() == 0:
            _C.log_info(f"local batch of {rows} rows (planned with {self.planned_rows}): "
                        f"the plan's stages and replicas re-split the rows"
                        f"{self._micro_batch_note()}")
            self._warn_over_memory()

    def _micro_batch_note(self) -> str:
        """Why the current batch runs another micro-batch count than the plan's: too few
        rows for it, or more than it kept within memory ([Note: memory at other batches]
        in csrc/runtime/batch_memory.h)."""
        now, planned = self.engine.layout.micro_batches, self.deployment.micro_batches
        fit = self.engine.memory_fit
        if now > planned:
            why = ("to stay within" if fit.fits else "the lowest predicted peak, though above")
            return (f"; {now} micro-batches instead of the plan's {planned}, {why} the "
                    f"{format_bytes(self.deployment.memory_limit)} per device the plan was made "
                    f"for (predicted peak {format_bytes(fit.peak_bytes)}, stage {fit.stage})")
        if now < planned:
            return f"; {now} micro-batch(es) instead of the plan's {planned} (each replica needs a row of each)"
        return ""

    def _warn_over_memory(self, thawed: bool = False):
        """Rank 0's warning where this variant's predicted peak is over the plan's limit:
        at larger input sizes, or (`thawed`) with parameters unfrozen since the plan, which
        now hold gradients and optimizer state ([Note: frozen parameters' memory] in
        csrc/partition/cost/cost_model.h)."""
        fit = self.engine.memory_fit
        if fit.fits or not self.deployment.feasible:  # a plan over its limit said so when made
            return
        where, cure = (("with the parameters unfrozen since the plan (their gradients and "
                        "optimizer state)", "Wrap the model with every parameter it will train "
                        "unfrozen (the plan counts what requires grad when it is made)")
                       if thawed else
                       ("at these input sizes", "Make the first call the largest batch and "
                        "shapes (its plan fits them)"))
        _C.log_warn(
            f"{where} stage {fit.stage} is predicted to need "
            f"{format_bytes(fit.peak_bytes)} per device, above the {format_bytes(self.deployment.memory_limit)} "
            f"the plan was made for, even in {fit.micro_batches} micro-batches (the fewest "
            f"bytes any count gives): it may run out of memory. {cure}, or use more devices")

    def drop_forwards(self):
        """Frees the stashes of the fill-drain forwards whose outputs autograd freed."""
        while self.unreferenced_forwards:
            self.engine.drop_forward(self.unreferenced_forwards.popleft())

    def backward_from_outputs(self, grads, awaiting: _AwaitingForward, retain: bool = False,
                              to_parameters: bool = True):
        """Backward of the fill-drain forward `awaiting`: `grads` are the user's gradients of
        its float outputs (None where unused). As with DistributedDataParallel, the parameter
        gradients are averaged over the ranks: a loss that is a mean over each rank's rows
        gives the gradient of the mean over the global batch. `retain`: the forward's
        stashes stay for another backward (backward(retain_graph=True)); without
        `to_parameters` (torch.autograd.grad) only the input gradients are computed, the
        parameters' .grad stays ([Note: gradients without .grad])."""
        # [Note: named collectives] in handshake.py: a rank that skipped this backward (a
        # check of its own loss) is in its next call instead, and the transfers waited for
        # each other until comm_timeout, on every later call too; now every rank raises,
        # naming where each is
        handshake.enter("a fill-drain backward")
        engine = self.engine
        engine.resume_forward(awaiting.id)  # its batch size, shapes and argument gradients
        layout = engine.layout
        comm = _C.Communicator.world_cpu()
        world = float(comm.size)
        by_vid = {}
        for vid, g in zip(awaiting.float_outputs, grads):  # an output returned twice: add
            if g is not None and by_vid.get(vid) is not None:
                g = by_vid[vid] + g
            by_vid[vid] = g if g is not None else by_vid.get(vid)
        batch_ids = set(engine.batch_output_ids)
        batch = {vid: (g / world if g is not None else None) for vid, g in by_vid.items()
                 if vid in batch_ids}
        seeds = engine.scatter_output_grads(batch)
        # Scalars and other whole outputs: every rank's gradient, averaged over the ranks.
        whole = [vid for vid in dict.fromkeys(awaiting.float_outputs)
                 if vid not in batch_ids and engine.producer_of(vid) >= 0]
        sums = {}
        for vid in whole:
            g = by_vid[vid]
            t = (g.detach().to("cpu", torch.float64, copy=True) if g is not None
                 else torch.zeros(engine.value(vid).shape, dtype=torch.float64))
            comm.all_reduce(t).wait()
            sums[vid] = (t / world).to(engine.device)
        mine = set(engine.stages)  # one per chunk under an interleaved schedule
        for m in range(layout.micro_batches):
            for vid in whole:
                if engine.producer_of(vid) not in mine:
                    continue
                dtype = engine.output_dtype(m, vid)
                if vid in self.combined:  # [Note: outputs without rows]
                    # the output is the row-weighted mean of the shares, or their sum
                    seeds.setdefault(m, {})[vid] = (sums[vid] * engine.share_weight(vid, m)).to(dtype)
                elif m == 0 and engine.copy == 0 and engine.replica == 0:
                    # returned from micro-batch 0 of the first replica: its gradient goes there
                    seeds.setdefault(m, {})[vid] = sums[vid].to(dtype)
        with _hooks_held(self.own_params):  # [Note: parameter hooks]
            engine.backward_from(seeds, retain)
        step_grads = engine.take_step_grads()
        if to_parameters:
            self.apply_grads(1.0, step_grads, awaiting.call_sync)

    def apply_grads(self, scale, step_grads, call_sync: bool):
        """.grad += scale * `step_grads` (a training call's gradients, taken from the engine
        after its backward), for this rank's parameters (in C++, with one foreach call each);
        `call_sync`: whether that call summed them over the ranks ([Note: unsynced steps])."""
        # loss.backward() seeds 1: nothing to multiply (read only where reading is free; on
        # a GPU the fused multiply is cheaper than a synchronisation)
        unit = not isinstance(scale, torch.Tensor) or scale.device.type == "cpu"
        unit = unit and float(scale) == 1.0
        if not unit and isinstance(scale, torch.Tensor) and scale.device.type != "cpu":
            scale = scale.to(self.owner.device)  # the loss may be on another GPU than the stage
        # [Note: unsynced steps] in csrc/runtime/engine.h: what calls under no_sync() left
        # in .grad is each rank's own share until a summed step comes
        if call_sync and self.owner._held_unsynced:
            # (they are the first training program's: no other runs under no_sync())
            self.owner._deployed[True].last_trained.engine.sync_held_grads()
        self.owner._held_unsynced = not call_sync
        named = named_backward.NAMED.get()  # [Note: backward of named parameters]
        if named is not None:
            if self.routing_key is not None:
                raise _C.Error(
                    "backward(inputs=...) naming parameters of the model after a training call "
                    "with other arguments than the first ([Note: other training arguments] in "
                    "module.py): call backward() and set the .grad of the others to None")
            step_grads = step_grads.without([i for i, p in enumerate(self.own_params)
                                             if id(p) not in named])
        if self.routing_key is not None:  # [Note: other training arguments] in module.py
            self._route_grads(step_grads, None if unit else scale)
            return
        hooked = _hooked(self.own_params)  # [Note: parameter hooks]
        if hooked and len(step_grads):
            rest = step_grads.without(hooked)
            self.engine.apply_step_grads(rest, None if unit else scale)
            for i in hooked:
                if step_grads[i] is not None:  # None: no gradient reached it
                    _accumulate_with_hooks(self.own_params[i], step_grads[i] if unit
                                           else step_grads[i] * scale)
        else:
            self.engine.apply_step_grads(step_grads, None if unit else scale)

    def _route_grads(self, step_grads, scale):
        """[Note: other training arguments] in module.py: adds `scale` (None: 1) times this
        training program's gradients to .grad on the ranks that train each parameter: here
        where this rank trains what its stages ran, from the first rank running it
        elsewhere. Every rank agrees first on which gradients exist (a parameter off the
        loss's path has none, and its .grad stays as it is, as in PyTorch)."""
        placement, rank = self.owner.placement, _C.get_rank()
        if self._routes is None:
            self._routes = placement.gradient_routes(self.routing_key)
            self._positions = {vid: i for i, vid in enumerate(self.state_ids)}
        position = self._positions
        mine = {}  # state position -> this program's gradient of it on this rank
        for j, vid in enumerate(self.own):
            g = step_grads[j] if len(step_grads) else None
            if g is not None:
                mine[position[vid]] = g if scale is None else g * scale
        # which gradients exist, as their senders see them (one all-reduce of flags)
        exists = torch.tensor([float(rank == sender and i in mine)
                               for i, sender, _ in self._routes], dtype=torch.float64)
        comm = _C.Communicator.world_cpu()
        if comm.size > 1 and len(exists):
            comm.all_reduce(exists).wait()
        tensors = placement.tensors()
        received, copies = {}, []
        for (i, sender, receivers), there in zip(self._routes, exists.tolist()):
            if not there or not receivers:
                continue
            if rank in receivers:
                t = tensors[i]
                received[i] = torch.empty(placement.full_shape(i, t), dtype=t.dtype,
                                          device=self.owner.device)
                copies.append((sender, receivers, received[i]))
            else:
                copies.append((sender, receivers, mine.get(i)))
        placement.transfer(copies)
        trained = placement.trained_here()
        for i, g in list(mine.items()) + list(received.items()):
            param = tensors[i]
            if id(param) in trained:
                _accumulate_with_hooks(param, g.to(param.dtype))

    def _outputs(self, produced, batch_outputs, schedule):
        """The user's outputs from what the stages produced; `schedule` says how training
        went (None: no training, "1f1b": seeded by the loss, "fill_drain": gradients of the
        outputs come from outside)."""
        train = schedule == "1f1b"
        step_grads = self.engine.take_step_grads() if train else None  # once: a loss returned twice
        comm = _C.Communicator.world_cpu()
        ir, layout, engine = self.graph.ir, self.engine.layout, self.engine
        tensors = []
        for vid in ir.outputs:
            v = engine.value(vid)
            if vid in batch_outputs:
                tensors.append(batch_outputs[vid].to(self.out_device))
            elif vid in self.combined:  # [Note: outputs without rows]
                # a mean over the rows of each micro-batch share: weight by rows (a sum:
                # add up); summed where the stage computed it, then one copy to the host (a
                # GPU would stall once per micro-batch on a .cpu() each)
                wide = torch.complex128 if v.dtype.startswith("Complex") else torch.float64
                parts = [outs[vid].detach().to(wide) * engine.share_weight(vid, m)
                         for m, outs in produced.items() if vid in outs]
                total = (torch.stack(parts).sum(0) if parts
                         else torch.zeros(list(v.shape), dtype=wide))
                if comm.size > 1:  # one rank: no copy, so no wait for the GPU's step to end
                    total = total.cpu()
                    comm.all_reduce(total).wait()
                value = total.to(self.out_device, _dtype(v)).reshape(v.shape)  # () or [1]
                if train and vid == engine.loss_vid:
                    value = _ApplyStepGrads.apply(self.owner._anchor, value, self, step_grads,
                                                  *self.grad_inputs)
                tensors.append(value)
            else:
                if comm.size == 1:  # no trip through the host
                    tensors.append(produced[0][vid].detach().to(self.out_device, copy=True))
                    continue
                producer = engine.producer_of(vid)
                root = layout.rank_of(producer, 0, 0) if producer >= 0 else 0
                buf = (produced[0][vid].detach().to("cpu", copy=True) if _C.get_rank() == root
                       else engine.empty(vid))
                comm.broadcast(buf, root).wait()
                tensors.append(buf.to(self.out_device))
        # a tensor of rannc's that requires grad links the outputs to the step's gradients
        # (a parameter of the user's would see its hooks called with None, [Note: parameter hooks])
        anchor = self.owner._anchor
        if schedule == "fill_drain":
            floats = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]
            self._float_outputs = [ir.outputs[i] for i in floats]
            carried = _FillDrainOutputs.apply(anchor, self, len(floats),
                                              *[tensors[i] for i in floats], *self.grad_inputs)
            for i, t in zip(floats, carried):
                tensors[i] = t
        if train:  # other float outputs: a clear error if the user backpropagates through them
            for i, (vid, t) in enumerate(zip(ir.outputs, tensors)):
                if vid != engine.loss_vid and (t.is_floating_point() or t.is_complex()):
                    tensors[i] = _NoGradientPath.apply(
                        anchor, t, _NoGradientPath.of_training(f"#{i} ({engine.value(vid).name or vid})"))
        elif (schedule is None and torch.is_grad_enabled() and not self.owner.module.training
              and any(p.requires_grad for p in self.params)):
            # an eval call outside no_grad: its outputs require grad, as in PyTorch, and a
            # backward through them says why it cannot train
            for i, (vid, t) in enumerate(zip(ir.outputs, tensors)):
                if t.is_floating_point() or t.is_complex():
                    tensors[i] = _NoGradientPath.apply(
                        anchor, t, _NoGradientPath.of_eval(f"#{i} ({engine.value(vid).name or vid})"))
        return self.graph._rebuild_output(tensors)


# [Note: parameter hooks] A hook on a parameter (p.register_hook(fn), which the trace
# error for a module's backward hooks suggests instead, or register_post_accumulate_grad_hook,
# with which an optimizer steps inside the backward) runs in PyTorch once per backward, on
# the parameter's whole gradient of it. The stages' backwards reach a parameter once per
# micro-batch with its share, before the sum over the replicas (and under 1F1B inside the
# forward call): a hook clamping the gradient clamped each share, one stepping an optimizer
# stepped on a share, and a hook on a stage's first weight was called with None. So while
# the engine runs, the hooks of this rank's parameters are held back, and they run where
# the call's gradient reaches .grad (apply_grads), on the whole of it, once. A replicated
# parameter's hooks run on each rank that holds it, as under DDP.
def _hooked(params) -> list[int]:
    """The positions of `params` that carry hooks of the user's ([Note: parameter hooks])."""
    return [i for i, p in enumerate(params)
            if p._backward_hooks or p._post_accumulate_grad_hooks]


@contextlib.contextmanager
def _hooks_held(params):
    """[Note: parameter hooks] Holds back the hooks of `params` while the engine runs."""
    held = []
    for p in params:
        for hooks in (p._backward_hooks, p._post_accumulate_grad_hooks):
            if hooks:
                held.append((hooks, dict(hooks)))
                hooks.clear()  # torch calls what the dict holds when a gradient comes
    try:
        yield
    finally:
        for hooks, saved in held:
            hooks.update(saved)


def _accumulate_with_hooks(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, as autograd's accumulation does it: through the parameter's
    hooks first, its post-accumulate hooks after ([Note: parameter hooks])."""
    for hook in list((param._backward_hooks or {}).values()):
        changed = hook(grad)
        if changed is not None:
            grad = changed
    if param.grad is None:
        param.grad = grad
    else:
        param.grad += grad
    for hook in list((param._post_accumulate_grad_hooks or {}).values()):
        hook(param)


def _summed(ir, vid: int, loss_reduction: str) -> bool:
    """Whether output `vid` combines over micro-batches, replicas and ranks as a sum
    (a scalar's by option loss_reduction; auto, and any other output without rows: where the
    graph shows a sum over the batch, csrc/ir/reduction.h) rather than a mean weighted by
    rows ([Note: outputs without rows])."""
    if not _combined_over_shares(ir, vid):
        return False
    if not _scalar_over_batch(ir, vid):
        return ir.output_reduction(vid) == "sum"
    return loss_reduction == "sum" or (loss_reduction == "auto" and ir.output_reduction(vid) == "sum")


def _scalar_over_batch(ir, vid: int) -> bool:
    """A one-element tensor computed from the batch (a loss, a metric)."""
    return _one_value_over_batch(ir.value(vid))


def _task_signatures(graph) -> list:
    """Per task, in the trace's order: (its op, its outputs' shapes, their batch dimensions,
    the task described), to find where the ranks' graphs part ([Note: named collectives])."""
    ir, traced = graph.ir, graph._trace.traced
    return [(t.op, [tuple(ir.value(o).shape) for o in t.outputs],
             [ir.value(o).batch_dim for o in t.outputs], traced.describe_task(t.id))
            for t in ir.tasks()]


def _first_difference(signatures: list) -> tuple[str, str] | None:
    """Where the ranks' task lists first differ: (what differs, "op", "shape" or "batch")."""
    mine = signatures[0]
    for rank, theirs in enumerate(signatures[1:], start=1):
        for (op, shapes, dims, said), (op2, shapes2, dims2, said2) in zip(mine, theirs):
            if op != op2:
                if said == said2:  # ops glued into one task that part inside it
                    ops, ops2 = op.split("+"), op2.split("+")
                    k = next((i for i, (a, b) in enumerate(zip(ops, ops2)) if a != b),
                             min(len(ops), len(ops2)))
                    said = f"{said}, whose op {k + 1} is {ops[k] if k < len(ops) else 'none'}"
                    said2 = f"{ops2[k] if k < len(ops2) else 'none'} there"
                hint = (" (pad_packed_sequence pads to each rank's longest sequence: pass "
                        "total_length=)" if "aten::_pad_packed_sequence" in op + op2 else "")
                return f"rank 0 runs {said} where rank {rank} runs {said2}{hint}", "op"
            if shapes != shapes2:
                return (f"{said} makes {_shapes_text(shapes)} on rank 0 and "
                        f"{_shapes_text(shapes2)} on rank {rank}", "shape")
            if dims != dims2:
                return (f"{said} makes a value whose batch dimension is {dims} on rank 0 and "
                        f"{dims2} on rank {rank} (-1: none)", "batch")
        if len(mine) != len(theirs):
            return f"rank 0 traced {len(mine)} tasks and rank {rank} {len(theirs)}", "op"
    return None


def _shapes_text(shapes: list) -> str:
    return ", ".join(str(list(s)) for s in shapes)


def module_modes(module: torch.nn.Module) -> tuple:
    """Every module's training flag, in named_modules() order ([Note: modules' modes])."""
    return tuple(m.training for m in module.modules())


def _one_value_over_batch(v) -> bool:
    """A tensor of one element (0-dim, or [1]: DataParallel's habit loss.view(1)) computed
    from the batch: each share's value is combined (weighted by rows, or added). Before, a
    [1] loss was no loss: the call ran fill-drain and returned micro-batch 0's value."""
    return (v.batch_dependent and v.kind == "Tensor" and v.batch_dim < 0
            and all(n == 1 for n in v.shape))


# [Note: outputs without rows] An output computed from the batch that holds no dimension of
# its rows and does not grow with them (a multi-task model's `torch.stack([mse, ce])`, a
# feature mean `h.mean(0)`, a confusion count) is combined over the micro-batches and
# replicas as a scalar is, element by element: added where the graph shows a sum over the
# batch, else weighted by the shares' rows. It came back as micro-batch 0's of the first
# replica on every rank, neither the global value nor the rank's own, and a backward
# through it (`out.sum().backward()`) trained on that micro-batch's gradient alone
# (parameters 0.067 off after 3 steps), without a word. An integer one that is no sum
# over the rows (the rows' largest label) still is micro-batch 0's: rank 0 says so.
def _combined_over_shares(ir, vid: int) -> bool:
    v = ir.value(vid)
    if not (v.batch_dependent and v.kind == "Tensor" and v.batch_dim < 0):
        return False
    if all(n == 1 for n in v.shape) or v.dtype.startswith(("Float", "BFloat", "Complex")):
        return True
    return ir.output_reduction(vid) == "sum"  # an integer count over the rows


def _shapes_but_batch(tensors_and_batch_dims) -> tuple:
    """[Note: new input shapes] The dtype and shape of each tensor argument, -1 in its batch
    dimension, from (argument, batch_dim) pairs."""
    return tuple((str(t.dtype).replace("torch.", ""),
                  tuple(-1 if k == dim else n for k, n in enumerate(t.shape)))
                 for t, dim in tensors_and_batch_dims if isinstance(t, torch.Tensor))


def _sizes_of_one(planned: "Deployed", shapes) -> str:
    """A hint where a dimension is 1 in the planned shapes or in `shapes` and not in the
    other: a dimension of size 1 (a generation loop's first token) makes ops such as view
    and reshape trace otherwise than at longer lengths (nn.MultiheadAttention's
    projections), so the two are different programs."""
    paths = [planned.graph._trace.inputs.paths[slot]
             for slot, (_, then), (_, now) in zip(planned.graph._trace.inputs.tensor_slots,
                                                  planned.shapes, shapes)
             if len(then) == len(now) and any(a != b and 1 in (a, b) for a, b in zip(then, now))]
    if not paths:
        return ""
    return (f". {failure.some_of(paths)} has a dimension of size 1 in one of the two calls "
            "and not in the other: ops such as view and reshape trace a size of 1 otherwise "
            "than longer ones, so keep such a dimension above 1 in every call (a generation "
            "loop: start from a prompt of two tokens or more)")


def traced_shapes(graph: TracedGraph) -> tuple:
    """The traced arguments' shapes but the batch ([Note: new input shapes])."""
    ir = graph.ir
    n_state = len(graph._trace.state.names)
    return _shapes_but_batch(zip(graph._trace.inputs.tensors,
                                 (ir.value(v).batch_dim for v in ir.inputs[n_state:])))


def _describe_shapes(example, shapes) -> str:
    """"kwargs['input_ids'] int64 [*, 16], ..." (* is the batch); `example`: the traced
    arguments (their paths)."""
    return ", ".join(
        f"{example.paths[slot]} {dtype} [{', '.join('*' if n < 0 else str(n) for n in shape)}]"
        for slot, (dtype, shape) in zip(example.tensor_slots, shapes))


def _differing_ranks(signatures) -> list[int]:
    """The ranks whose signature differs from rank 0's."""
    return [r for r, sig in enumerate(signatures) if sig != signatures[0]]


def _shapes_differ(signatures, example, shapes) -> Exception:
    """The agreed error for ranks whose arguments differ in shape (`signatures`: one crc per
    rank; `shapes`: this rank's)."""
    differ = _differing_ranks(signatures)
    return failure.agreed(
        f"the ranks' arguments differ in dtype or in shape besides the batch dimension (ranks "
        f"{differ} differ from rank 0; this rank passed {_describe_shapes(example, shapes)}): "
        "every rank must pass the same dtypes and shapes in a call, since the ranks' batches "
        "are rows of one global batch. Where a dtype differs, convert it in the collator; "
        "where lengths differ, pad every rank's batch to the longest of the call: in the module "
        "(option pad_values, for transformers' models pad_values=\"transformers\"), after "
        "the collator (rannc.pad_to_same_length) or to a fixed length (transformers "
        "tokenizers: padding=\"max_length\")")


# [Note: shared arguments agree] A tensor argument that is not rows of the batch (a mask
# shared by all rows, a table) goes to every stage that reads it as it is, so every rank
# must pass the same. The batch is dimension 0 of the tensor arguments whose size there
# matches the first tensor argument's ([Note: batch dimensions] in _trace.py), so a first
# argument that is not the batch (forward(table, x, y)) made the rows x and y shared
# tensors, each rank's own, and training went wrong without a word (loss 2.32 for 2.07).
# Their contents are compared at each deployment (the first call of a program or shape;
# 0-dim ones and ones of at most _SHARED_COMPARED values at every call: per-set labels
# beside the sets' rows were compared at the first call alone, and where they happened to
# agree there, later calls trained on rank 0's labels without a word, parameters 0.048
# off): where they differ, an error on every rank names them.
_SHARED_COMPARED = 4096
def _content_crc(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        data = t.detach().reshape(-1).cpu().contiguous()
        crc = zlib.crc32(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"", crc)
    return crc


# [Note: rows alike on every rank] A shared tensor whose first size happens to equal the
# local batch (a MoCo queue of 4 entries at 4 rows per rank) reads as rows of the batch: it
# was cut into micro-batches and replicas' shares, and its "global" rows were every rank's
# copy of it (loss 0.090 for 0.047, without a word). Such an argument has the same values
# on every rank where the batch's other tensors differ: rank 0 warns, naming it (its first
# and last rows are compared at each deployment, for the first _ROWS_COMPARED such
# arguments; one whose first and last rows are the same, an attention mask of ones, is
# left out).
_ROWS_COMPARED = 8


def _end_rows_crc(t: torch.Tensor, dim: int) -> int:
    """A crc of `t`'s first and last rows along `dim`, 0 where they are the same (an
    attention mask of ones, position ids repeated for every row: alike on every rank, and
    rows all the same) or hold fewer than 4 values (class labels, alike by chance)."""
    if t.shape[dim] < 2 or t.select(dim, 0).numel() < 4:  # (labels: alike by chance)
        return 0
    first, last = _content_crc([t.select(dim, 0)]), _content_crc([t.select(dim, t.shape[dim] - 1)])
    return 0 if first == last else first ^ (last << 1)


def _say_rows_alike(paths: list[str], batch: int) -> None:
    _C.log_warn(f"{failure.some_of(paths)} {'have' if len(paths) > 1 else 'has'} the same values on "
                "every rank, unlike the other rows of the batch: rannc takes "
                f"{'them' if len(paths) > 1 else 'it'} as rows of the batch (a first size equal "
                f"to the local batch's {batch} rows), cut into micro-batches and across the "
                "ranks. If it is not rows of the batch (a queue, a table), keep it in a buffer "
                "or give it another first size ([Note: rows alike on every rank] in deployed.py)")


def _shared_arguments_differ(contents, shared, batch: int) -> Exception:
    differ = _differing_ranks(contents)
    paths = failure.some_of([f"{path} [{', '.join(map(str, t.shape))}]" for path, t in shared])
    return failure.agreed(
        f"the ranks pass different values of {paths} (ranks {differ} differ from rank 0), which "
        f"are not rows of the batch ({batch} rows here: the batch is dimension 0 of the tensor "
        "arguments whose size there matches the first tensor argument's), so the stages that "
        "read them must all see one value. Pass the batch's tensors first, and the same "
        "shared tensors on every rank; a rank's own data sized otherwise than its rows (a label "
        "per set or graph of rows) must be rows itself: pad the sets to [sets, largest set, "
        "...] with a mask ([Note: shared arguments agree] in deployed.py)")


def _scalars_differ(signatures, scalars) -> Exception:
    """The agreed error for ranks that pass different values of a 0-dim tensor argument
    (`signatures`: one crc per rank; `scalars`: this rank's (path, value) pairs)."""
    differ = _differing_ranks(signatures)
    passed = ", ".join(f"{path} = {value}" for path, value in scalars)
    hint = ""
    if any("num_items_in_batch" in path for path, _ in scalars):
        hint = (" (transformers' Trainer counts the global batch's items on every rank with "
                "TrainingArguments(average_tokens_across_devices=True), its default)")
    return failure.agreed(
        f"the ranks pass different values of the 0-dim tensor arguments (ranks {differ} differ "
        f"from rank 0; this rank passed {passed}): such an argument is not rows of the batch, "
        f"so the stages that read it must all see one value; pass the same on every rank{hint}")


def _dtype(value):
    from .pipeline import DTYPES
    return DTYPES[value.dtype]


def reads_every_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` reads every gradient of the model in its step (LBFGS or a class
    built on it, or a step that requires a closure or comes in SAM's two halves): [Note:
    optimizers that read every gradient]."""
    if isinstance(optimizer, torch.optim.LBFGS):
        return True
    if callable(getattr(optimizer, "first_step", None)) and \
            callable(getattr(optimizer, "second_step", None)):
        return True  # SAM's two halves, called by the loop (davda54/sam and its copies)
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # a builtin step: no signature to read
        return False
    return closure is not None and closure.default is inspect.Parameter.empty
