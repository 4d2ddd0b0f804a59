"""What real training loops do, under mpirun (2 ranks). Each probe asserts its exact
behaviour and prints "OK rank r", or fails the way the test expects.

    loop_probes.py rank0_weights       each rank seeds otherwise before building the model
                                       (timm's habit), or loads weights on rank 0 alone: the
                                       stages train from rank 0's values, as DDP broadcasts
                                       them; 2 stages and 1 replicated stage equal PyTorch
    loop_probes.py ndim_groups         AdamW built after the first call with nanoGPT's groups
                                       (weight decay where p.dim() >= 2): the groups, the
                                       steps and optimizer_state_dict() equal PyTorch's
    loop_probes.py draws_in_forward    label dropout and timesteps drawn in forward from rand,
                                       returned: equal to PyTorch given every rank's draws
    loop_probes.py caught_trace_error  a TraceError every rank raises is caught; a new module
                                       then trains equal to PyTorch
    loop_probes.py caught_bad_batch    a batch the model itself fails on (int32 labels on one
                                       rank at the first call, a wrong feature size at a new
                                       shape on every rank, an empty batch) is an error on
                                       every rank; the loop catches it, skips the batch and
                                       trains on equal to PyTorch
    loop_probes.py lazy_cache          a position table the forward builds at its first call
                                       and rebuilds for a longer sequence (rotary and ALiBi
                                       caches), and an auxiliary loss left in an attribute:
                                       trained over three lengths equal to PyTorch, the
                                       attribute named and the module left as it was
    loop_probes.py optional_tensors    an optional argument traced as a tensor and passed as
                                       None later, a 0-dim tensor then a float, and weights
                                       under parametrize.cached() (around the call and in
                                       forward): equal to PyTorch
    loop_probes.py first_token         greedy decoding through nn.MultiheadAttention from
                                       one token: length 2 is another program than length 1,
                                       planned on its own, and lengths 3, 4 run its plan;
                                       training at lengths 1, 3, 1, 2 alike; equal to
                                       PyTorch; under no_sync() such a call is an error
    loop_probes.py aliased_module      one embedding under two names (and tied to the head),
                                       trained at a new length: equal to PyTorch
    loop_probes.py adagrad_after_eval  Adagrad (state made in __init__) built after an eval call
                                       freed parameters: trains equal to PyTorch
    loop_probes.py resume_late_optimizer  an optimizer built after wrapping, a checkpoint loaded
                                       before the first step: its state and hyperparameters
                                       are read, the resume equals PyTorch's six steps
    loop_probes.py stand_in_traces     a new length and an eval call after training (traced
                                       with stand-ins for the parameters) of a model with
                                       nn.MultiheadAttention: equal to PyTorch
    loop_probes.py mixed_dtypes        bf16 and fp32 parameters on a replicated stage: each
                                       gradient in its parameter's dtype, AdamW equal to PyTorch
    loop_probes.py two_scalers         a second GradScaler for another model: the module's
                                       backward is seeded by its own scaler's scale
    loop_probes.py user_error STAGES   rank 1 raises in the user's loop after step 2: every
                                       rank ends in seconds, rank 0 naming rank 1's error
    loop_probes.py shared_later        per-set labels (no rows) alike at the first call and a
                                       rank's own later: an error on each such call
    loop_probes.py mismatched_rows     ranks pass different batch sizes: a clear error on
                                       every such call, and training goes on after
    loop_probes.py data_branch         control flow on data that differs between ranks
    loop_probes.py different_models    the ranks build different models
    loop_probes.py padded_lengths      each rank's batch has its own length (a per-rank
                                       collator); rannc.pad_to_same_length pads them to the
                                       longest of the global batch: equal to PyTorch on the
                                       padded global batch; unpadded, an error naming the cause;
                                       the option pad_values="transformers" pads each call in
                                       the module (positional input_ids too), equal to PyTorch;
                                       without the attention mask, an error naming it
    loop_probes.py eval_after_new_length  training at a new length between evaluations: the
                                       eval stages get the weights the training updated
    loop_probes.py shared_module       two RaNNCModules over models sharing an encoder: the
                                       second's first call is an error on every rank naming
                                       the shared parameters, and the first trains on
    loop_probes.py table_first         a table that is not rows of the batch passed first
                                       (forward(table, x, y)): the rows after it read as
                                       shared tensors, which differ by rank: an error on every
                                       rank naming them; the batch passed first trains
    loop_probes.py embeds_outside      inputs_embeds made outside from the model's own
                                       embedding (FreeLB) and a penalty on it: each step
                                       (and clip_grad_norm_) averages its gradient over the
                                       ranks, as DDP; the norms and training equal PyTorch
    loop_probes.py skipped_backward    one rank skips the backward of a fill-drain call (a
                                       check of its own loss): an error on every rank naming
                                       where each is, at once, and the next calls run
    loop_probes.py queue_alike         a queue passed as an argument whose size equals the
                                       local batch reads as rows: rank 0 warns naming it (the
                                       test counts the warning); of another size it is shared
                                       and trains equal to PyTorch
    loop_probes.py length_branch       the model takes another path for short sequences: a
                                       new length that the plan cannot run is another
                                       program, planned on its own; training at both
                                       lengths equals PyTorch
    loop_probes.py num_items_in_batch  transformers GPT-2 given num_items_in_batch (the global
                                       count of labels that are not -100, as Trainer passes
                                       it): its loss is a sum over that count, which adds up
                                       over the micro-batches and ranks; equal to PyTorch
    loop_probes.py uneven_selection    the first batch selects as many tokens from every row
                                       (x[keep], no padding yet), later ones do not: the
                                       selected tokens stay in one task ([Note: data-sized
                                       values]) and every step equals PyTorch
    loop_probes.py rank0_only          DDP's habits `if rank == 0: torch.save(model.state_dict())`
                                       and an evaluation on rank 0 alone: every rank raises an
                                       error naming what each rank called ([Note: named
                                       collectives]), and training goes on
    loop_probes.py process_group       rannc.init_process_group(): torch.distributed over the
                                       MPI ranks (DistributedSampler shards, all_reduce sums),
                                       beside a RaNNCModule trained equal to PyTorch
    loop_probes.py late_optimizer      DDP's habit: RaNNCModule(model) first, then AdamW over
                                       its parameters; its first step makes it the module's
                                       ([Note: optimizers made after wrapping]): training and
                                       optimizer_state_dict() equal PyTorch's, its groups hold
                                       this rank's share; its state is in the plan, and one
                                       built after the first call draws a warning
    loop_probes.py compiled            nanoGPT's habit: torch.compile(model) before wrapping
                                       (a block compiled with Module.compile() inside, the
                                       wrapper compiled too): traced eagerly, trained equal
                                       to PyTorch, state_dict() names as the compiled model's
    loop_probes.py sync_batch_norm     DDP's habit: convert_sync_batchnorm, with
                                       torch.distributed initialised: each SyncBatchNorm runs
                                       as BatchNorm over its share; with one share of the
                                       global batch per stage, equal to PyTorch's BatchNorm
    loop_probes.py module_state_dict   DDP's habits model.module.state_dict() on rank 0,
                                       model.module.load_state_dict(sd) and model.module(x):
                                       an error naming what this rank lacks ([Note: the
                                       module's own state_dict]); with one stage replicated,
                                       each works on the whole current model, as under DDP
    loop_probes.py forward_hook        a forward hook that scales a block's output: traced
                                       into the graph, equal to PyTorch with the same hook;
                                       rank 0 warns that its side effects happen at tracing
    loop_probes.py unfreeze            fine-tuning's schedule: a block frozen when wrapped is
                                       unfrozen after 2 steps, another frozen after 4; every
                                       step, the weights and AdamW's state equal PyTorch's
                                       ([Note: frozen parameters])
    loop_probes.py averaged_model      AveragedModel of a RaNNCModule (an EMA, made before
                                       the first call) and a frozen deepcopy: their calls
                                       (eval, train mode), state_dict(), load_state_dict() and
                                       a checkpoint of the average equal PyTorch's copies of
                                       the plain model, with layers
                                       evaluated on other ranks than they train on ([Note:
                                       copies of a wrapped model])
    loop_probes.py retained_graph      backward(retain_graph=True) and another backward through
                                       the same outputs: 1F1B's loss three times, and a
                                       multi-task loop's two heads under fill-drain (with
                                       and without recomputation): each adds its gradients,
                                       as in PyTorch
    loop_probes.py adversarial         FGSM adversarial training: the input's gradient by
                                       torch.autograd.grad (or backward(inputs=[x])) leaves
                                       the parameters' .grad alone, under 1F1B and fill-drain;
                                       a gradient penalty (create_graph=True) is an error
    loop_probes.py other_arguments     training calls with other arguments than the first
                                       (a batch without its image features, another task's
                                       head chosen by a string), each its own program placed
                                       on its own: AdamW steps, torch's clip_grad_norm_,
                                       batch norm's statistics, optimizer_state_dict() and
                                       eval calls equal PyTorch's ([Note: other training
                                       arguments] in module.py); 2 ranks with batch norm,
                                       3 ranks (replicas) with layer norm and fill-drain
    loop_probes.py several_optimizers  one optimizer for the blocks' matrices (as Muon), AdamW
                                       for the rest: both
                                       passed to RaNNCModule, or AdamW built after wrapping
                                       (added at its first step): steps equal PyTorch's, each
                                       optimizer's state_dict() on rank 0 alone is its whole
                                       state, a resume from those files or from a checkpoint
                                       trains on equal to PyTorch ([Note: several optimizers])
    loop_probes.py add_param_group     gradual unfreezing: a frozen block joins the optimizer
                                       with add_param_group after 2 steps; its group is cut
                                       to the rank's share, and steps and the optimizer's
                                       state_dict() equal PyTorch's
    loop_probes.py outside_parameter   CLIP's learnt temperature outside the wrapped model, in
                                       the same optimizer (its gradient averaged by the script,
                                       as under DDP): it trains (it was cut out of the
                                       optimizer), state_dict() holds its state, and
                                       save_checkpoint works, warning that it is not saved
    loop_probes.py eval_memory         an eval call after training is planned within what
                                       training's state leaves of each device ([Note: memory
                                       the programs before hold] in deployed.py); where no
                                       plan fits there, every rank raises an error naming the
                                       memory held, and training goes on
    loop_probes.py no_grad_forward     torch.no_grad() inside forward: a teacher evaluated
                                       under it gets no gradient and AdamW leaves it alone,
                                       and a buffer updated under it (DINO's center) holds
                                       no autograd history; equal to PyTorch on 2 stages
                                       ([Note: no_grad in forward] in _trace.py)
    loop_probes.py module_modes        batch norm put in eval() after the first training call
                                       (its statistics frozen for fine-tuning): the next calls
                                       trace again and train equal to PyTorch ([Note: modules'
                                       modes] in deployed.py; the change was ignored)
    loop_probes.py optimizer_anew      a second phase with a fresh AdamW, then SGD, over the
                                       same parameters: each replaces the one before, so its
                                       state_dict() is its own state ([Note: optimizers made
                                       anew] in optimizer_share.py; it gave the first's)
    loop_probes.py loss_view1          a loss returned as loss.view(1) (DataParallel's habit):
                                       the 1F1B loss of the global batch, as a 0-dim loss is
                                       (it ran fill-drain and returned micro-batch 0's value)
    loop_probes.py buffer_replicas     a ResNet as one stage on both ranks (replicas): after
                                       each training call the ranks hold the same batch norm
                                       statistics, the state_dict()'s, and evaluate alike
                                       ([Note: buffers of replicas] in placement.py)
    loop_probes.py pairs_rows          an in-batch contrastive loss (CLIP's) inside forward:
                                       planned with one micro-batch, each replica of its
                                       stage pairing the rows it holds (equal to DDP's ranks
                                       on one stage, to one process on two); computed
                                       outside the module from the embeddings and the
                                       temperature (or the raw parameter, [Note: outputs
                                       that are inputs]) forward returns, the towers pipeline
                                       4 micro-batches ([Note: rows paired]; it was cut into
                                       micro-batches without a word)
    loop_probes.py recompute_buffers   batch norm on stages that recompute: its statistics
                                       and counter move once per forward, equal to PyTorch
                                       ([Note: buffers a recompute writes]; they moved twice)
    loop_probes.py lbfgs               LBFGS with a closure: planned as one stage (it reads
                                       every gradient), equal to PyTorch; num_stages=2 is an
                                       error on every rank naming it ([Note: optimizers that
                                       read every gradient]; each rank stepped by its stages)
    loop_probes.py attributes          a temperature and a flag of the model set between
                                       steps: each set of values is traced again, equal to
                                       PyTorch; a count forward keeps draws a warning
                                       ([Note: attributes read]; they were ignored)
    loop_probes.py cumulative_bn       swa_utils.update_bn on the wrapped model after training
                                       (batch norm's momentum=None, a cumulative average):
                                       the statistics equal PyTorch's ([Note: cumulative
                                       batch norm]; the traced factor was fixed)
    loop_probes.py count_output        a count of the labels next to the loss, scaling with
                                       the batch on one rank's shard only: trains, the count
                                       the global batch's ([Note: integers of sizes]; every
                                       rank failed naming control flow on data)
    loop_probes.py graphs_part         an LSTM over packed sequences whose lengths add up
                                       differently on the ranks: every rank's error names the
                                       op and the sizes on each rank (it named none)
    loop_probes.py qat_resume          per-channel fake quantization after a plain call, saved
                                       and resumed into a model never called: equal to PyTorch
    loop_probes.py edits_after_load    load_checkpoint into a fresh module, then a new head
                                       and a new lr before the first call: both kept, equal
                                       to PyTorch ([Note: edits after a load]; the first call
                                       read the checkpoint over them)
    loop_probes.py save_pretrained     transformers' model.save_pretrained(dir) on the wrapper,
                                       on every rank and on rank 0 alone: config.json and the
                                       whole trained weights, which from_pretrained loads
                                       equal to PyTorch's, tied as the model ties them;
                                       model.module.save_pretrained is an error naming it
    loop_probes.py sparse_embedding    a recommender's nn.Embedding(sparse=True) with
                                       SparseAdam, Adam for the rest, on one stage of two
                                       replicas: equal to PyTorch ([Note: sparse gradients]
                                       in runtime/grad_buckets.cpp; "reshape is not
                                       implemented for sparse tensors" on every rank)
    loop_probes.py ema_state_dict      timm's ModelEmaV2 over copy.deepcopy of the wrapper,
                                       updated in place through the copy's state_dict()
                                       values, on two stages: the average and its eval
                                       equal PyTorch's ([Note: writes into a copy's
                                       state_dict] in copies.py; it never moved)
"""
import copy
import os
import sys
import time

import torch
import torch.nn as nn

import rannc
import zoo

rank = rannc.get_rank()
torch.set_num_threads(1)
zoo.full_fp32()  # tests/gpu runs some probes with stages on the GPU, against the CPU
probe = sys.argv[1]


class Regression(nn.Module):
    """Two layers with the loss inside: the probes' small model."""

    def __init__(self, hidden=16):
        super().__init__()
        self.a, self.b = nn.Linear(4, hidden), nn.Linear(hidden, 1)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def expect_error(call, *fragments, kinds=(rannc.Error,)):
    """The call raises one of `kinds` on this rank, whose message or notes say each of
    `fragments`; returns the error."""
    try:
        call()
    except kinds as e:
        said = "; ".join([str(e), *getattr(e, "__notes__", [])])
        for f in fragments:
            assert f in said, f"rank {rank}: {f!r} not in: {said}"
        return e
    raise AssertionError(f"rank {rank}: no error")


def expect_freed_graph_error(out, what):
    """A backward through `out`, whose forward's backward ran, is PyTorch's error for a
    freed graph."""
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "a second time" in str(e), e
        return
    raise AssertionError(f"rank {rank}: {what} did not fail")


def step_both(loss, ref_loss, opt, ref_opt):
    """rannc's and the reference's backward, optimizer step and zero_grad."""
    loss.backward()
    ref_loss.backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()


def sgd_pair(model, **options):
    """(its plain copy, SGD over the model, SGD over the copy, the model wrapped with
    `options`)."""
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    return reference, opt, ref_opt, rannc.RaNNCModule(model, opt, **options)


def global_batch(name, rows=4, seed=1):
    """Zoo model `name`'s arguments for 2 ranks of `rows` rows each: (the whole, this
    rank's share)."""
    _, whole, _ = zoo.make(name, batch=2 * rows, seed=seed)
    return whole, tuple(t[rows * rank:rows * (rank + 1)] for t in whole)


def same_stage_parameters(model, reference, rtol, atol=1e-5, wrapped=None):
    """The parameters of this rank's stages equal the reference's (with `wrapped`, the
    RaNNCModule, those whose current value it holds: a program that runs a layer on a rank
    that does not train it gets the weights before its next call). The default atol is for
    Adam at lr 1e-2: an element whose gradient is near zero takes a step of m / sqrt(v) that
    turns summation-order differences (micro-batches, another CPU's vector width) into about
    2e-6 after a few steps (CI, the unfreeze probe); a lost or doubled gradient moves a
    parameter by about lr."""
    ref = dict(reference.named_parameters())
    stale = set(wrapped.placement.not_current_here()) if wrapped is not None else set()
    for n, p in model.named_parameters():
        if p.numel() and n not in stale:  # the others are freed (or stale) on this rank
            torch.testing.assert_close(p.detach().cpu(), ref[n].detach(), rtol=rtol, atol=atol,
                                       msg=lambda m: f"{n}: {m}")


def steps_like_pytorch(wrapped, reference, opt, ref_opt, what, steps=3, seed=0):
    """`steps` SGD steps of `wrapped` on this rank's half of an [8, 8] -> [8, 1] batch and of
    `reference` on the whole, the losses compared at each."""
    for step in range(steps):
        g = torch.Generator().manual_seed(seed + step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
        mine = slice(4 * rank, 4 * (rank + 1))
        loss, ref_loss = wrapped(x[mine], y[mine]), reference(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {what} step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)


def same_state(wrapped, reference, what, rtol=1e-5, atol=1e-6):
    """The gathered state_dict() of `wrapped` equals `reference`'s."""
    state = wrapped.state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k].float(), v.float(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{what} {k}: {m}")


def train(wrapped, opt, args):
    loss = wrapped(*args)
    loss.backward()
    opt.step()
    opt.zero_grad()


class FrozenFirst(nn.Module):
    """Frozen layers first: training (no backward there) puts trainable layer 8 on the
    first stage, evaluation on the second, so eval's rank needs training's weights."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(512, 512) for _ in range(12)])
        for layer in self.layers[:8]:
            layer.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def frozen_first_pair():
    """FrozenFirst and its plain copy, each with SGD over its trainable parameters; the
    first wrapped in 2 stages."""
    torch.manual_seed(0)
    model = FrozenFirst()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_opt = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    # plans from shapes alone (no clocks): the probes assume where the stages are cut
    return model, reference, opt, ref_opt, rannc.RaNNCModule(
        model, opt, num_stages=2, profile_fake_timer=True, probe_bandwidth=False)


def first_stage_tasks(wrapped, mode: str) -> int:
    return len(wrapped.deployments[mode].stages[0].tasks)


if probe == "user_error":
    model, args, _ = zoo.make("gpt", batch=4, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=int(sys.argv[2]), num_microbatches=2)
    for step in range(6):
        train(wrapped, opt, args)
        if step == 2 and rank == 1:
            print(f"RAISING AT {time.time():.3f}", flush=True)
            raise ValueError("user code failed after step 2")
    print(f"rank {rank} finished though rank 1 failed", flush=True)

elif probe == "new_length_fails":
    class ShortOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            if x.size(1) > 6:
                raise ValueError("sequences longer than 6 are not supported")
            return self.b(torch.tanh(self.a(x))).pow(2).mean()

    model = ShortOnly()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    train(wrapped, opt, (torch.randn(4, 4, 8),))
    train(wrapped, opt, (torch.randn(4, 8, 8),))  # traced again at the new length: fails
    print(f"rank {rank} finished though tracing failed", flush=True)

elif probe == "shared_later":  # [Note: shared arguments agree] in deployed.py
    class PerSet(nn.Module):  # DeepSets: a label per set beside the sets' rows
        def __init__(self):
            super().__init__()
            self.phi, self.rho = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x, sets, y):
            pooled = torch.zeros(y.size(0), 8).index_add_(0, sets, torch.relu(self.phi(x)))
            return nn.functional.cross_entropy(self.rho(pooled), y)

    torch.manual_seed(0)
    model = PerSet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt)
    x, sets = torch.randn(8, 6), torch.tensor([0] * 5 + [1] * 3)
    train(wrapped, opt, (x, sets, torch.tensor([0, 1])))  # alike on every rank: compared
    for _ in range(2):  # later labels of a rank's own were rank 0's, without a word
        expect_error(lambda: wrapped(x, sets, torch.tensor([rank, 1])),
                     "the ranks pass different values of args[2] [2]", "pad the sets")
    train(wrapped, opt, (x, sets, torch.tensor([2, 1])))  # alike again: trains on
    print(f"OK rank {rank}", flush=True)
elif probe == "pairs_in_forward":  # [Note: rows that agree by chance] in convert.cpp
    class Reward(nn.Module):  # a reward model that scores chosen and rejected in one pass
        def __init__(self):
            super().__init__()
            self.emb, self.v = nn.Embedding(32, 16), nn.Linear(16, 1)

        def forward(self, ids_c, mask_c, ids_r, mask_r):
            ids, mask = torch.cat([ids_c, ids_r]), torch.cat([mask_c, mask_r])
            h = torch.tanh(self.emb(ids))
            r = self.v(h[torch.arange(ids.size(0)), mask.sum(-1) - 1]).squeeze(-1)
            n = ids_c.size(0)
            return -nn.functional.logsigmoid(r[:n] - r[n:]).mean()

    def masks(lengths):
        return (torch.arange(8)[None, :] < torch.tensor(lengths)[:, None]).long()

    # rank 0's lengths agree on the rows two observations share, rank 1's do not: the
    # ranks traced different graphs, blamed on control flow
    lengths = [([4, 7, 8, 7, 8, 8, 4, 4], [8, 7, 5, 6, 3, 8, 5, 7]),
               ([5, 6, 7, 8, 8, 8, 4, 4], [8, 8, 8, 8, 3, 8, 5, 7])]
    for stages in (1, 2):
        torch.manual_seed(0)
        model = Reward()
        reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=stages)
        for step, (lc, lr) in enumerate(lengths):
            ids = torch.randint(1, 32, (16, 8), generator=torch.Generator().manual_seed(step))
            args = (ids[:8], masks(lc), ids[8:], masks(lr))
            mine = slice(4 * rank, 4 * (rank + 1))
            loss = wrapped(*(a[mine] for a in args))
            ref_loss = reference(*args)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {stages} stages, step {step}: {m}")
            step_both(loss, ref_loss, opt, ref_opt)
        same_state(wrapped, reference, f"{stages} stages")
    print(f"OK rank {rank}", flush=True)
elif probe == "task_tensor":  # [Note: tensors that choose the program] in _trace.py
    class MultiTask(nn.Module):  # the task id comes from the collate function, a 0-dim tensor
        def __init__(self, by_if):
            super().__init__()
            self.by_if = by_if
            self.trunk = nn.Linear(16, 32)
            self.heads = nn.ModuleList([nn.Linear(32, 5), nn.Linear(32, 5)])

        def forward(self, x, y, task):
            h = torch.relu(self.trunk(x))
            if self.by_if:
                out = self.heads[0](h) if task == 0 else self.heads[1](h)
            else:
                out = self.heads[int(task)](h)
            return nn.functional.cross_entropy(out, y)

    for by_if, stages in ((False, 1), (True, 2)):
        torch.manual_seed(0)
        model = MultiTask(by_if)
        reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=stages)
        for step, task in enumerate((0, 1, 1, 0)):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 5, (8,), generator=gen)
            mine = slice(4 * rank, 4 * (rank + 1))
            loss = wrapped(x[mine], y[mine], torch.tensor(task))
            ref_loss = reference(x, y, torch.tensor(task))
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: if={by_if}, step {step}: {m}")
            step_both(loss, ref_loss, opt, ref_opt)
        same_state(wrapped, reference, f"if={by_if}")
    print(f"OK rank {rank}", flush=True)
elif probe == "failed_load":  # [Note: a load that fails changes nothing] in full_state.py
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2)
    wrapped(torch.randn(4, 16)).sum().backward()
    opt.step()
    before = wrapped.state_dict()
    bad = {k: torch.full_like(v, 7.0) for k, v in before.items()}
    for key in ("0.weight", "4.bias"):  # one on each stage
        wrong = dict(bad, **{key: torch.zeros(3, 3)})
        expect_error(lambda: wrapped.load_state_dict(wrong), f"size mismatch for {key}",
                     kinds=(RuntimeError,))
        after = wrapped.state_dict()
        for k in before:  # nothing loaded, on any rank (a stage's keys were before)
            assert torch.equal(after[k], before[k]), (key, k)
    wrapped.load_state_dict(bad)
    assert all(torch.equal(v, torch.full_like(v, 7.0)) for v in wrapped.state_dict().values())
    print(f"OK rank {rank}", flush=True)
elif probe == "after_training":  # what users do with a model once it trained
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(4 * 6 * 6, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=1)  # 2 replicas: rank 0 says of BN
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 3, (4,))
    nn.functional.cross_entropy(wrapped(x), y).backward()
    opt.step()
    # conversions to what the model already is change nothing (they were refused)
    assert wrapped.float() is wrapped and wrapped.to(torch.float32) is wrapped
    expect_error(lambda: wrapped.half(), "after a RaNNCModule's first call")
    expect_error(lambda: wrapped.to(torch.float64), "after a RaNNCModule's first call")
    # a copy trained as a second model: rank 0 says it runs forward only (torch's error was all)
    copied = copy.deepcopy(wrapped)
    loss = nn.functional.cross_entropy(copied(x), y)
    assert not loss.requires_grad
    print(f"OK rank {rank}", flush=True)
elif probe == "mismatched_rows":
    model, args, _ = zoo.make("mlp", batch=4, seed=rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    train(wrapped, opt, args)
    short = tuple(a[:3] for a in args)
    for _ in range(2):  # the error comes on every such call, not only the first
        expect_error(lambda: wrapped(*(short if rank == 1 else args)),
                     "local batches must have the same size on every rank in each call",
                     "{0: 4, 1: 3}")
    train(wrapped, opt, args)

    # at a module's first call too, where one rank's trace alone would fail (one row taking
    # a path of its own): the agreed error on every rank, and the job goes on (_agree_on_rows)
    class NoSingleRow(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] == 1:
                raise ValueError("one row")
            return self.a(x).pow(2).mean()

    single = NoSingleRow()
    fresh = rannc.RaNNCModule(single, torch.optim.SGD(single.parameters(), lr=0.1))
    x = torch.randn(2, 4)
    expect_error(lambda: fresh(x[:1] if rank == 1 else x),
                 "local batches must have the same size on every rank", "{0: 2, 1: 1}")
    fresh(x).backward()
    train(wrapped, opt, short)  # the same smaller size everywhere is fine
    print(f"OK rank {rank}", flush=True)

elif probe in ("data_branch", "different_models"):
    class Branchy(nn.Module):
        def __init__(self, extra=False):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.extra = nn.Linear(8, 8) if extra else None

        def forward(self, x):
            h = self.a(x)
            if x.abs().mean() > 1.0:  # rank 0's data is large, rank 1's small
                h = torch.tanh(h) * 2
            if self.extra is not None:
                h = self.extra(h)
            return h.pow(2).mean()

    model = Branchy(extra=probe == "different_models" and rank == 1)
    x = torch.randn(4, 8) * (5.0 if rank == 0 else 0.1)
    wrapped = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if probe == "data_branch":
        expect_error(lambda: wrapped(x), "the ranks traced different graphs from the same model",
                     "control flow depends on its input data")
    else:
        expect_error(lambda: wrapped(x), "the ranks built different models")
    print(f"OK rank {rank}", flush=True)
elif probe == "length_branch":
    class LengthBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            if x.size(1) > 6:  # long sequences go through tanh
                h = torch.tanh(h)
            return self.b(h).pow(2).mean()

    torch.manual_seed(0)
    model = LengthBranch()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    g = torch.Generator().manual_seed(0)
    mine = slice(4 * rank, 4 * (rank + 1))
    # length 4 is another program ([Note: programs at other shapes] in module.py), 10 the first's
    for step, length in enumerate((8, 4, 8, 4, 10, 5)):
        x = torch.randn(8, length, 8, generator=g)
        loss, ref_loss = wrapped(x[mine]), reference(x)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-5, wrapped=wrapped)
    state = wrapped.state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    assert len(wrapped._deployed_by_arguments) == 1, wrapped._deployed_by_arguments.keys()
    print(f"OK rank {rank}", flush=True)
elif probe == "padded_lengths":
    import copy

    import torch.nn.functional as F

    import hf_zoo
    world = rannc.get_world_size()
    model, _, _ = hf_zoo.make("hf_bert", batch=4)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    # Two micro-batches: the loss is a mean over the labels that are not -100 (padding),
    # whose count differs between them ([Note: token-mean losses]).
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    PAD = {"input_ids": 0, "attention_mask": 0, "labels": -100}

    def rank_batch(r, step):
        """Rank r's batch at `step`, padded to its own longest sequence (as a collator does)."""
        _, _, kwargs = hf_zoo.make("hf_bert", batch=4, seed=100 * step + r, length=9 + 3 * r + step)
        return kwargs

    for step in range(3):
        mine = rank_batch(rank, step)
        if step == 0:
            expect_error(lambda: wrapped(**mine), "the ranks' arguments differ in dtype or in "
                         "shape besides the batch dimension", f"this rank passed kwargs['input_ids'] int64 [*, {9 + 3 * rank}]")
        padded = rannc.pad_to_same_length(mine, PAD, multiple_of=4)
        # the reference: every rank's batch padded by hand to the longest, rounded up to 4
        batches = [rank_batch(r, step) for r in range(world)]
        target = -(-max(b["input_ids"].shape[1] for b in batches) // 4) * 4
        assert padded["input_ids"].shape[1] == target, (padded["input_ids"].shape, target)
        glob = {k: torch.cat([F.pad(b[k], (0, target - b[k].shape[1]), value=v) for b in batches])
                for k, v in PAD.items()}
        loss = wrapped(**padded).loss
        ref_loss = reference(**glob).loss
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-4)

    # The module pads each call itself (option pad_values, [Note: padding calls]): the
    # ranks' own lengths, positional input_ids, padded to the longest rounded up to 8; the
    # same loss and steps as PyTorch on the global batch padded to the longest (the padding
    # is masked and its labels ignored). One length on every rank pads nothing.
    model, _, _ = hf_zoo.make("hf_bert", batch=4)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2,
                                pad_values="transformers")
    for step in range(4):
        mine = rank_batch(rank, step)
        batches = [rank_batch(r, step) for r in range(world)]
        if step == 3:  # one length everywhere
            mine, batches = rank_batch(0, step), [rank_batch(0, step)] * world
        longest = max(b["input_ids"].shape[1] for b in batches)
        glob = {k: torch.cat([F.pad(b[k], (0, longest - b[k].shape[1]), value=v) for b in batches])
                for k, v in PAD.items()}
        ids = mine.pop("input_ids")
        out = wrapped(ids, **mine)
        ref = reference(**glob)
        torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=1e-4, atol=1e-6)
        padded = longest if step == 3 else -(-longest // 8) * 8
        assert out.logits.shape[1] == padded, (out.logits.shape, padded)
        step_both(out.loss, ref.loss, opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-4)
    # transformers' padding attends to padded tokens without the attention mask: refused
    mine = rank_batch(rank, 0)
    del mine["attention_mask"]
    expect_error(lambda: wrapped(**mine), "would pad input_ids to 16 tokens",
                 "the call has no attention_mask")
    print(f"OK rank {rank}", flush=True)
elif probe == "num_items_in_batch":
    import copy

    import hf_zoo
    world = rannc.get_world_size()
    model, _, _ = hf_zoo.make("hf_gpt2", batch=4)
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))
    for step in range(3):
        ids = torch.randint(0, 96, (4 * world, 16), generator=g)
        labels = ids.masked_fill(torch.rand(ids.shape, generator=g) < 0.4, -100)
        labels[::3] = -100  # rows without a label
        items = (labels[:, 1:] != -100).sum()  # the shifted labels the loss counts
        out = wrapped(input_ids=ids[mine], labels=labels[mine], num_items_in_batch=items)
        ref = reference(input_ids=ids, labels=labels, num_items_in_batch=items)
        torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
        step_both(out.loss, ref.loss, opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    # a count of this rank's own items (Trainer's average_tokens_across_devices=False):
    # the stages would divide by different counts
    own = (labels[mine, 1:] != -100).sum() + rank
    expect_error(lambda: wrapped(input_ids=ids[mine], labels=labels[mine],
                                 num_items_in_batch=own),
                 "the ranks pass different values of the 0-dim tensor arguments (ranks [1]",
                 f"kwargs['num_items_in_batch'] = {own.item()}",
                 "average_tokens_across_devices=True")
    out = wrapped(input_ids=ids[mine], labels=labels[mine], num_items_in_batch=items)
    ref = reference(input_ids=ids, labels=labels, num_items_in_batch=items)
    torch.testing.assert_close(out.loss.detach(), ref.loss.detach(), rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
elif probe == "save_pretrained":
    import os
    import tempfile

    import hf_zoo
    import transformers as tf
    model, _, kwargs = hf_zoo.make("hf_gpt2", batch=8)
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2)
    mine = slice(4 * rank, 4 * (rank + 1))
    step_both(wrapped(input_ids=kwargs["input_ids"][mine], labels=kwargs["labels"][mine]).loss,
              reference(**kwargs).loss, opt, ref_opt)
    for who in ("every rank", "rank 0"):
        directory = os.path.join(tempfile.gettempdir(),
                                 f"save_pretrained_{os.getppid()}_{who.replace(' ', '_')}")
        if who == "every rank" or rank == 0:
            wrapped.save_pretrained(directory)  # rank 0 writes; the others serve it alone
        wrapped(input_ids=kwargs["input_ids"][mine], labels=kwargs["labels"][mine])  # agreed
        assert os.path.exists(os.path.join(directory, "config.json")), who
        loaded = tf.AutoModelForCausalLM.from_pretrained(directory)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(loaded.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{who}, {name}: {m}")
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    # DDP's habit saves model.module: refused on a rank that lacks some weights (the plan
    # may give one stage every layer but the embeddings, whose rank then lacks nothing);
    # with two stages some rank always lacks some (each rank knows where all are current)
    assert any(len(current) < rannc.get_world_size()
               for _, current in wrapped.placement.sources()), "every rank holds everything"
    if wrapped.placement.not_current_here():
        expect_error(lambda: model.save_pretrained(directory + "_module"),
                     "Call the RaNNCModule's state_dict(), save_pretrained(dir) or "
                     "save_checkpoint")

    class SavesItsOwnState(zoo.MLP):
        """diffusers' ModelMixin.save_pretrained: no state_dict argument (its **kwargs
        swallows one), it saves self.state_dict()"""

        def save_pretrained(self, save_directory, is_main_process=True, **kwargs):
            if is_main_process:
                os.makedirs(save_directory, exist_ok=True)
                torch.save(self.state_dict(), os.path.join(save_directory, "weights.pt"))

    torch.manual_seed(0)
    model = SavesItsOwnState(dropout=0.0)
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    whole, mine = global_batch("mlp")
    step_both(wrapped(*mine), reference(*whole), opt, ref_opt)
    directory = os.path.join(tempfile.gettempdir(), f"save_pretrained_{os.getppid()}_own_state")
    wrapped.save_pretrained(directory)
    rannc.barrier()
    saved = torch.load(os.path.join(directory, "weights.pt"))
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(saved[name], value, msg=lambda m: f"own state, {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "eval_after_new_length":
    import copy

    world = rannc.get_world_size()
    model, reference, opt, ref_opt, wrapped = frozen_first_pair()
    rows = slice(32 * rank, 32 * (rank + 1))
    # evaluated at the first length: eval deploys no new shape (which would gather weights)
    x_eval = torch.randn(32 * world, 2, 512, generator=torch.Generator().manual_seed(99))
    for step, length in enumerate((2, 3, 3)):
        x = torch.randn(32 * world, length, 512, generator=torch.Generator().manual_seed(step))
        model.train()
        loss, ref_loss = wrapped(x[rows]), reference(x)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-4, atol=1e-6)
        for o, l in ((opt, loss), (ref_opt, ref_loss)):
            l.backward()
            o.step()
            o.zero_grad()
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(wrapped(x_eval[rows]), reference(x_eval), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: eval after step {step}: {m}")
        # every weight this rank holds is current (eval's ranks got training's updates)
        for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
            if p.numel():
                torch.testing.assert_close(p.detach(), ref_p.detach(), rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: {name} after step {step}: {m}")
    # the case this probe is for (profiled plans: checked, not assumed)
    assert first_stage_tasks(wrapped, "train") > first_stage_tasks(wrapped, "eval")
    print(f"OK rank {rank}", flush=True)
elif probe == "uneven_selection":
    class Packed(nn.Module):
        """Layers over the tokens a mask keeps, scattered back (as unpadded attention does)."""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c, self.d = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x, keep):
            h = torch.tanh(self.a(x))
            packed = torch.tanh(self.c(torch.tanh(self.b(h[keep]))))
            return self.d(torch.zeros_like(h).index_put((keep,), packed)).pow(2).mean()

    torch.manual_seed(0)
    model = Packed().double()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    rows = slice(4 * rank, 4 * rank + 4)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8, 6, 4, generator=g, dtype=torch.float64)
        keep = torch.rand(8, 6, generator=g) < 0.5
        if step == 0:  # two tokens from every row
            keep = torch.zeros(8, 6, dtype=torch.bool)
            keep[:, :2] = True
        loss, ref_loss = wrapped(x[rows], keep[rows]), reference(x, keep)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12,
                                   msg=lambda m: f"rank {rank}: loss at step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-10)
    print(f"OK rank {rank}", flush=True)
elif probe == "rank0_only":
    import os
    import tempfile

    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # a state per parameter
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    step_both(wrapped(*args), reference(*args), opt, ref_opt)
    # DDP's habit: rank 0 alone saves the model and the optimizer, the others train on and
    # serve both gathers from their next call ([Note: gathers asked by some ranks])
    path = os.path.join(tempfile.gettempdir(), f"rank0_only_{os.getppid()}.pt")
    if rank == 0:
        torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict()}, path)
    saved_ref = copy.deepcopy({"model": reference.state_dict(), "optimizer": ref_opt.state_dict()})
    step_both(wrapped(*args), reference(*args), opt, ref_opt)
    saved = torch.load(path)  # written: rank 0 saved before this call of every rank
    # the same with a barrier after the save, which serves the gathers (was MPI_ERR_TRUNCATE)
    if rank == 0:
        torch.save({"model": wrapped.state_dict()}, path + ".2")
    rannc.barrier()
    for k, v in torch.load(path + ".2")["model"].items():
        torch.testing.assert_close(v, reference.state_dict()[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {k} saved before a barrier: {m}")
    rannc.barrier()
    if rank == 0:
        os.remove(path + ".2")
    for k, v in saved_ref["model"].items():
        torch.testing.assert_close(saved["model"][k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{k}: {m}")
    assert saved["optimizer"]["param_groups"] == saved_ref["optimizer"]["param_groups"]
    assert saved["optimizer"]["state"].keys() == saved_ref["optimizer"]["state"].keys()
    for i, state in saved_ref["optimizer"]["state"].items():
        torch.testing.assert_close(saved["optimizer"]["state"][i]["momentum_buffer"],
                                   state["momentum_buffer"], rtol=1e-5, atol=1e-6)
    # every rank resumes from rank 0's file, the reference from its own state then
    wrapped.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])  # the whole optimizer's: this rank takes its share
    reference.load_state_dict(saved_ref["model"])
    ref_opt.load_state_dict(saved_ref["optimizer"])
    for _ in range(2):
        step_both(wrapped(*args), reference(*args), opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    # two ranks gathering different things, an eval beside a training call: named errors
    said = ("state_dict() on rank 0; optimizer_state_dict() on rank 1",
            "must gather the same one of the same model")
    if rank == 0:
        expect_error(lambda: wrapped.state_dict(), *said)
    else:
        expect_error(lambda: opt.state_dict(), *said)
    # a checkpoint is written by every rank: not served
    said = ("save_checkpoint() on rank 0; a training call on rank 1", "call it on every rank",
            "not under `if rank == 0:`")
    if rank == 0:
        expect_error(lambda: wrapped.save_checkpoint(tempfile.mkdtemp()), *said)
    else:
        expect_error(lambda: wrapped(*args), *said)
    # rank 1 saving in its `finally` after an error of its own: not the DDP habit
    said = ("a training call on rank 0; save_checkpoint() on rank 1", "after its own error")
    if rank == 1:
        expect_error(lambda: wrapped.save_checkpoint(tempfile.mkdtemp()), *said)
    else:
        expect_error(lambda: wrapped(*args), *said)
    said = ("rannc.barrier() on rank 0; a training call on rank 1", "the same calls")
    if rank == 0:
        expect_error(rannc.barrier, *said)
    else:
        expect_error(lambda: wrapped(*args), *said)
    said = ("an eval call on rank 0; a training call on rank 1", "evaluate on every rank")
    if rank == 0:
        wrapped.eval()
        with torch.no_grad():
            expect_error(lambda: wrapped(*args), *said)
        wrapped.train()
    else:
        expect_error(lambda: wrapped(*args), *said)
    step_both(wrapped(*args), reference(*args), opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    if rank == 0:
        os.remove(path)
        # the last word: rank 0 saves after the others ended their script, which serves it
        state = wrapped.state_dict()
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
elif probe == "process_group":
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.utils.data import DistributedSampler

    rannc.init_process_group()
    assert (dist.get_rank(), dist.get_world_size()) == (rank, rannc.get_world_size())
    # torchrun's variables, which DDP scripts and accelerate read
    # ([Note: a DDP script's environment on GPUs])
    assert [os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")] \
        == [str(rank), "2", str(rank), "2"], dict(os.environ)
    assert dist.get_backend() == "gloo", dist.get_backend()  # no GPU, or one for two ranks
    cuda = torch.cuda.is_available()
    if cuda:  # tests/gpu: the current device is the stages', which a CUDA tensor reduces on
        assert torch.cuda.current_device() == rank % torch.cuda.device_count()
        on_gpu = torch.tensor([rank + 1.0], device="cuda")
        dist.all_reduce(on_gpu)
        assert on_gpu.item() == 3.0, on_gpu
    shard = list(DistributedSampler(range(16), shuffle=False))
    assert shard == list(range(rank, 16, 2)), shard
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    assert total.item() == 3.0, total

    torch.manual_seed(0)
    model = Regression(hidden=8)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    # a DDP script's habit: the stages go to each rank's GPU at the first call, and the whole
    # model does not ([Note: moving a wrapped model])
    assert (wrapped.cuda() if cuda else wrapped.to("cpu")) is wrapped
    assert all(p.device.type == "cpu" for p in model.parameters())
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    order = list(range(0, 16, 2)) + list(range(1, 16, 2))  # rank 0's rows, then rank 1's
    for step in range(3):
        loss, ref_loss = wrapped(x[shard], y[shard]), reference(x[order], y[order])
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # a metric averaged as DDP scripts do
        torch.testing.assert_close(mean / 2, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-5)
    # rank 0 saves alone while rank 1 waits in torch's barrier, which serves the gather
    # first ([Note: torch.distributed agrees with rannc]); Trainer's end of training
    if rank == 0:
        state = wrapped.state_dict()
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6)
    dist.barrier()
    # a torch collective beside a RaNNCModule call: a named error, not a hang
    said = ("a training call on rank 0; torch.distributed.all_reduce on rank 1",)
    if rank == 0:
        expect_error(lambda: wrapped(x[shard], y[shard]), *said)
    else:
        expect_error(lambda: dist.all_reduce(torch.ones(1)), *said)
    dist.barrier()
    dist.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
elif probe == "two_calls":  # [Note: calls awaiting their backward] in csrc/runtime/engine.h
    import torch.nn.functional as F
    from rannc.transport import all_gather_objects

    def global_mean(value):  # the ranks' losses over their own rows: the global batch's
        return sum(all_gather_objects(float(value))) / rannc.get_world_size()

    # 1F1B: one backward of a loss over two calls (two views, R-Drop) applies each call's
    # gradients (it applied the second call's twice)
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    B, world = 4, rannc.get_world_size()
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x1, y1, x2, y2 = (torch.randn(B * world, k, generator=g) for k in (4, 1, 4, 1))
        loss = wrapped(x1[mine], y1[mine]) + 0.5 * wrapped(x2[mine], y2[mine])
        ref_loss = reference(x1, y1) + 0.5 * reference(x2, y2)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-5)
    # the loss returned twice: one backward through both applies the call's gradients twice
    class Twice(Regression):
        def forward(self, x, y):
            loss = super().forward(x, y)
            return loss, {"again": loss}

    torch.manual_seed(0)
    model = Twice()
    reference = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, num_stages=2, num_microbatches=2)
    out, ref_out = wrapped(x1[mine], y1[mine]), reference(x1, y1)
    (out[0] + 0.5 * out[1]["again"]).backward()
    (ref_out[0] + 0.5 * ref_out[1]["again"]).backward()
    ref_grads = dict(reference.named_parameters())
    for n, p in model.named_parameters():
        if p.numel():
            torch.testing.assert_close(p.grad, ref_grads[n].grad, rtol=1e-5, atol=1e-7)
    # fill-drain: a GAN. The discriminator's two calls (real and fake rows) await one
    # backward; the generator's output reaches it through the discriminator's input
    # gradients ([Note: input gradients]: its generator trained at half its gradient on 2 ranks)
    torch.manual_seed(1)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 16), nn.LeakyReLU(0.2),
                         nn.Linear(16, 1))
    ref_gen, ref_disc = copy.deepcopy(gen), copy.deepcopy(disc)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (gen, disc, ref_gen, ref_disc)]
    G = rannc.RaNNCModule(gen, opts[0], num_stages=2, num_microbatches=2)
    D = rannc.RaNNCModule(disc, opts[1], num_stages=2, num_microbatches=2)
    bce = F.binary_cross_entropy_with_logits
    for step in range(3):
        g = torch.Generator().manual_seed(10 + step)
        real, z = torch.randn(B * world, 8, generator=g), torch.randn(B * world, 4, generator=g)
        ones, zeros = torch.ones(B * world, 1), torch.zeros(B * world, 1)
        fake, ref_fake = G(z[mine]), ref_gen(z)
        d_loss = bce(D(real[mine]), ones[mine]) + bce(D(fake.detach()), zeros[mine])
        ref_d_loss = bce(ref_disc(real), ones) + bce(ref_disc(ref_fake.detach()), zeros)
        for o in opts:
            o.zero_grad()
        d_loss.backward()
        ref_d_loss.backward()
        opts[1].step()
        opts[3].step()
        g_loss, ref_g_loss = bce(D(fake), ones[mine]), bce(ref_disc(ref_fake), ones)
        opts[0].zero_grad()
        opts[2].zero_grad()
        g_loss.backward()
        ref_g_loss.backward()
        opts[0].step()
        opts[2].step()
        for mine_loss, ref in ((d_loss, ref_d_loss), (g_loss, ref_g_loss)):
            torch.testing.assert_close(global_mean(mine_loss), ref.item(), rtol=1e-5, atol=1e-6)
        same_stage_parameters(gen, ref_gen, rtol=1e-4)
        same_stage_parameters(disc, ref_disc, rtol=1e-4)
    # a forward whose outputs are dropped without a backward frees its stashes at the next
    # call; a second backward through the same outputs is PyTorch's error
    stashed = lambda: D._deployed[True].engine.executor().stashed  # noqa: E731
    out = D(real[mine])
    assert stashed() > 0
    del out
    kept = D(real[mine])
    left = stashed()
    kept.sum().backward()
    assert stashed() == 0 and left > 0, (left, stashed())
    expect_freed_graph_error(kept, "a second backward")
    print(f"OK rank {rank}", flush=True)
elif probe == "retained_graph":  # [Note: retained graphs] in csrc/runtime/engine.h
    B, world = 4, rannc.get_world_size()
    mine = slice(rank * B, (rank + 1) * B)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B * world, 4, generator=g), torch.randn(B * world, 1, generator=g)

    def same_grads(model, reference, what):
        ref = dict(reference.named_parameters())
        for n, p in model.named_parameters():
            if p.numel():
                torch.testing.assert_close(p.grad, ref[n].grad, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{what}, {n}: {m}")

    # 1F1B: the loss's backward three times adds the call's gradients three times (the
    # first addition aliased them into .grad, and the third added 4 of them)
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, num_stages=2, num_microbatches=2)
    loss, ref_loss = wrapped(x[mine], y[mine]), reference(x, y)
    for k in range(3):
        loss.backward(retain_graph=k < 2)
        ref_loss.backward(retain_graph=k < 2)
        same_grads(model, reference, f"1f1b, backward {k}")
    # a backward after one without retain_graph: PyTorch's error (it added them again)
    expect_freed_graph_error(loss, "1f1b, a backward after the graph was freed")
    same_grads(model, reference, "1f1b, after the refused backward")
    # fill-drain: a multi-task loop's l1.backward(retain_graph=True), l2.backward() through
    # one forward's outputs (was an error), with and without recomputation, an input
    # that takes a gradient, SGD steps between
    for recompute in ("never", "always"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                              nn.Linear(16, 1))
        reference = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2,
                                    schedule="fill_drain", recompute=recompute)
        stashed = lambda: wrapped._deployed[True].engine.executor().stashed  # noqa: E731
        for step in range(2):
            xs, ref_x = x[mine].clone().requires_grad_(), x.clone().requires_grad_()
            out, ref_out = wrapped(xs), reference(ref_x)
            heads = [lambda o, t: (o - t).pow(2).mean(), lambda o, t: (o - t).abs().mean()]
            held = stashed()
            heads[0](out, y[mine]).backward(retain_graph=True)
            heads[0](ref_out, y).backward(retain_graph=True)
            assert stashed() == held > 0, (held, stashed())
            same_grads(model, reference, f"{recompute}, step {step}, first head")
            heads[1](out, y[mine]).backward()
            heads[1](ref_out, y).backward()
            assert stashed() == 0, stashed()
            same_grads(model, reference, f"{recompute}, step {step}, both heads")
            # [Note: input gradients]: a batch argument's is world times its rows of the global one
            torch.testing.assert_close(xs.grad, world * ref_x.grad[mine], rtol=1e-5, atol=1e-7)
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            same_stage_parameters(model, reference, rtol=1e-5)
        expect_freed_graph_error(out, "a backward after the last")
    print(f"OK rank {rank}", flush=True)
elif probe == "adversarial":  # [Note: gradients without .grad] in deployed.py
    B, world, eps = 4, rannc.get_world_size(), 0.1
    mine = slice(rank * B, (rank + 1) * B)
    for schedule in ("1f1b", "fill_drain"):
        # FGSM adversarial training: the input's gradient by torch.autograd.grad leaves .grad
        # alone; the step trains on the perturbed batch only (the clean batch's gradients
        # were added too)
        torch.manual_seed(0)
        if schedule == "1f1b":  # the loss inside the module
            model = Regression()
            loss_of = lambda m, x, y: m(x, y)  # noqa: E731
        else:
            model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
            loss_of = lambda m, x, y: (m(x) - y).pow(2).mean()  # noqa: E731
        reference = copy.deepcopy(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2,
                                    schedule=schedule)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(B * world, 4, generator=g), torch.randn(B * world, 1, generator=g)
            xs, ref_x = x[mine].clone().requires_grad_(), x.clone().requires_grad_()
            if step == 2:  # backward(inputs=[x]) as well
                loss_of(wrapped, xs, y[mine]).backward(inputs=[xs])
                loss_of(reference, ref_x, y).backward(inputs=[ref_x])
                gx, ref_gx = xs.grad, ref_x.grad
            else:
                gx, = torch.autograd.grad(loss_of(wrapped, xs, y[mine]), xs)
                ref_gx, = torch.autograd.grad(loss_of(reference, ref_x, y), ref_x)
            # [Note: input gradients]: a batch argument's is world times its rows of the global one
            torch.testing.assert_close(gx, world * ref_gx[mine], rtol=1e-5, atol=1e-7)
            assert all(p.grad is None for p in model.parameters()), schedule
            adv, ref_adv = (xs + eps * gx.sign()).detach(), (ref_x + eps * ref_gx.sign()).detach()
            step_both(loss_of(wrapped, adv, y[mine]), loss_of(reference, ref_adv, y), opt, ref_opt)
            same_stage_parameters(model, reference, rtol=1e-5)
        # a gradient penalty (create_graph=True) is refused on every rank, naming it
        xs = x[mine].clone().requires_grad_()
        expect_error(lambda: torch.autograd.grad(loss_of(wrapped, xs, y[mine]), xs,
                                                 create_graph=True),
                     "a gradient of a gradient through a RaNNCModule", "create_graph=True")
        # and training goes on
        step_both(loss_of(wrapped, x[mine], y[mine]), loss_of(reference, x, y), opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "param_hooks":  # [Note: parameter hooks] in deployed.py
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    seen = {"rannc": [], "reference": []}
    for m, who in ((model, "rannc"), (reference, "reference")):
        # clamping is not linear: per micro-batch share it clamped each share
        m.a.weight.register_hook(lambda g: g.clamp(-0.01, 0.01))
        m.b.weight.register_post_accumulate_grad_hook(
            lambda p, who=who: seen[who].append(p.grad.detach().clone()))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, replicas="2,1")
    B, world = 4, rannc.get_world_size()
    mine = slice(rank * B, (rank + 1) * B)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(B * world, 4, generator=g), torch.randn(B * world, 1, generator=g)
        step_both(wrapped(x[mine], y[mine]), reference(x, y), opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-5)
    # the post-accumulate hook ran once per backward where b.weight is trained, on its
    # whole gradient
    if model.b.weight.numel():
        assert len(seen["rannc"]) == 3, len(seen["rannc"])
        for mine_grad, ref_grad in zip(seen["rannc"], seen["reference"]):
            torch.testing.assert_close(mine_grad, ref_grad, rtol=1e-5, atol=1e-6)
    else:
        assert not seen["rannc"], len(seen["rannc"])
    print(f"OK rank {rank}", flush=True)
elif probe == "late_optimizer":
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, num_stages=2, num_microbatches=2)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    everything = len(opt.param_groups[0]["params"])
    for step in range(3):
        loss, ref_loss = wrapped(*args), reference(*args)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-4)
    assert wrapped.optimizer is opt, f"rank {rank}: not adopted"
    mine = len(opt.param_groups[0]["params"])
    assert 0 < mine < everything, f"rank {rank}: {mine} of {everything} parameters in the group"
    gathered, ref_state = wrapped.optimizer_state_dict(), ref_opt.state_dict()
    assert gathered["state"].keys() == ref_state["state"].keys()
    for i, s in ref_state["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(gathered["state"][i][k], s[k], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: state {i} {k}: {m}")
    # built before the first call, as Trainer builds its AdamW: the plan counted its state
    assert wrapped._planned_optimizer_kind == "adam", wrapped._planned_optimizer_kind
    # built after the first call: adopted at its first step, and rank 0 warns
    import tempfile
    from rannc.transport import all_gather_objects
    plan = all_gather_objects(os.path.join(tempfile.mkdtemp(), "plan.rannc") if rank == 0
                              else None)[0]
    late_model = copy.deepcopy(reference)
    late = rannc.RaNNCModule(late_model, num_stages=2, num_microbatches=2, save_plan=plan)
    late(*args)
    late_opt = torch.optim.AdamW(late.parameters(), lr=1e-2)
    late(*args).backward()
    late_opt.step()
    assert late.optimizer is late_opt and late._planned_optimizer_kind == "sgd"
    # a plan from a file counted what it counted: no warning ([Note: optimizers made after
    # wrapping]; it warned, as if the plan had counted no state)
    loaded = rannc.RaNNCModule(copy.deepcopy(reference), load_plan=plan)
    loaded(*args)
    loaded_opt = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    loaded(*args).backward()
    loaded_opt.step()
    assert loaded.optimizer is loaded_opt and loaded._planned_optimizer_kind is None
    print(f"OK rank {rank}", flush=True)
elif probe == "compiled":  # [Note: compiled models] in _trace.py
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    model.blocks[1].compile()
    compiled = torch.compile(model)
    names = list(compiled.state_dict())
    assert names[0].startswith("_orig_mod."), names[0]
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    module = rannc.RaNNCModule(compiled, opt, num_stages=2, num_microbatches=2)
    wrapped = torch.compile(module)  # its state_dict() adds torch's "_orig_mod." in front
    for step in range(3):
        loss, ref_loss = wrapped(*args), reference(*args)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-4)
    gathered = module.state_dict()
    assert list(gathered) == names, f"rank {rank}: {list(gathered)[:3]} against {names[:3]}"
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(gathered["_orig_mod." + name], t, rtol=1e-4, atol=1e-6)
    assert model.blocks[1]._compiled_call_impl is not None, "the user's compiled block was changed"
    print(f"OK rank {rank}", flush=True)
elif probe == "sync_batch_norm":  # [Note: SyncBatchNorm] in _trace.py
    model, _, _ = zoo.make("resnet", batch=4, seed=0)
    reference = copy.deepcopy(model)  # BatchNorm2d, on the global batch
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    rannc.init_process_group()  # SyncBatchNorm would all-gather over it
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=1)
    for step in range(3):
        shares = [zoo.make("resnet", batch=4, seed=10 * step + r)[1] for r in range(2)]
        mine = shares[rank]
        everyone = tuple(torch.cat([s[i] for s in shares]) for i in range(len(mine)))
        loss, ref_loss = wrapped(*mine), reference(*everyone)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    gathered = wrapped.state_dict()  # the running statistics too
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(gathered[name], t, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    assert "forward" not in vars(model.stem[1]), "the SyncBatchNorm was left changed"
    torch.distributed.destroy_process_group()
    print(f"OK rank {rank}", flush=True)
elif probe == "module_state_dict":  # [Note: the module's own state_dict] in placement.py
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    full = copy.deepcopy(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # plans from shapes alone with micro-batches to pipeline, so each rank lacks some
    # tensors (a profiled plan of one micro-batch under load put all but three tasks on
    # rank 1: with nothing to overlap, the cut goes where the fewest bytes cross)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=4,
                                profile_fake_timer=True, probe_bandwidth=False)
    wrapped(*args).backward()
    opt.step()
    opt.zero_grad()
    expect_error(lambda: wrapped.module.state_dict(), f"GPT.state_dict() of the model inside a "
                 f"RaNNCModule on rank {rank}: this rank keeps only its stages'",
                 "Call the RaNNCModule's state_dict() or save_checkpoint(dir) on every rank")
    expect_error(lambda: wrapped.module.load_state_dict(full), "GPT.load_state_dict() of the model",
                 "has no storage for", "load_state_dict(state) or load_checkpoint(path)")
    expect_error(lambda: wrapped.module(*args), f"GPT called directly on rank {rank} (as "
                 "model.module(...) or transformers' generate)", "Call the RaNNCModule itself")
    # a submodule called directly (sampling code's model.module.net(x)): refused where this
    # rank lacks its tensors (it failed inside torch on a size of 0), run where it holds them
    parts = {"pos": lambda: wrapped.module.pos(torch.arange(4)),  # first stage
             "ln": lambda: wrapped.module.ln(torch.randn(2, model.ln.weight.shape[0]))}  # last
    lacked = 0
    for name, call in parts.items():
        if getattr(model, name).weight.numel() == 0:
            lacked += 1
            expect_error(call, f"'{name}' of the model inside a RaNNCModule called directly on "
                         f"rank {rank} (as model.module.{name}(...)", "Call the RaNNCModule itself")
        else:
            with torch.no_grad():
                call()
    assert lacked == 1, f"rank {rank}: the plan's stages hold both or neither of pos, ln"
    wrapped.load_state_dict(full)  # the wrapper's own calls still work
    gathered = wrapped.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(gathered[name], t, msg=lambda m: f"rank {rank}: {name}: {m}")
    # one stage on both ranks (replicas): every rank holds everything, current, as under DDP
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=1)
    step_both(wrapped(*args), reference(*args), opt, ref_opt)
    own = wrapped.module.state_dict()
    for name, t in reference.state_dict().items():
        torch.testing.assert_close(own[name], t, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    wrapped.module.load_state_dict(own)
    with torch.no_grad():  # a local forward, as DDP's model.module(x)
        torch.testing.assert_close(wrapped.module(*args), reference(*args), rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
elif probe == "forward_hook":  # [Note: hooks] in _trace.py
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.blocks[1].register_forward_hook(lambda mod, inputs, out: out * 0.5)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    for step in range(3):
        loss, ref_loss = wrapped(*args), reference(*args)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-4)
    # registered after the trace: never run, and rank 0 says so once ([Note: hooks
    # registered later] in module.py)
    seen = []
    model.blocks[0].register_forward_hook(lambda mod, inputs, out: seen.append(1))
    model.blocks[0].register_full_backward_hook(lambda mod, grad_in, grad_out: seen.append(2))
    for step in range(2):
        train(wrapped, opt, args)
    assert not seen, seen
    print(f"OK rank {rank}", flush=True)
elif probe == "no_grad_forward":  # [Note: no_grad in forward] in _trace.py
    import torch.nn.functional as F
    class Distilled(nn.Module):
        def __init__(self):
            super().__init__()
            self.student = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.teacher = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.register_buffer("center", torch.zeros(8))

        def forward(self, x):
            with torch.no_grad():
                target = self.teacher(x)
            h = self.student(x)
            if self.training:
                with torch.no_grad():
                    self.center.mul_(0.9).add_(h.mean(0), alpha=0.1)
            return F.mse_loss(h - self.center, target)

    torch.manual_seed(0)
    model = Distilled()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # one micro-batch: the center's update sees the whole batch, as in PyTorch
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=1)
    for step in range(4):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        loss, ref_loss = wrapped(x[4 * rank:4 * rank + 4]), reference(x)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        for p in model.teacher.parameters():
            assert p.grad is None, f"rank {rank}: the teacher got a gradient"
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for name, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "module_modes":  # [Note: modules' modes] in deployed.py
    model, args, _ = zoo.make("resnet", batch=4, seed=0)
    # one micro-batch per stage: batch norm's statistics see the whole batch, as in PyTorch
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=1)
    whole, mine = global_batch("resnet")
    for step in range(3):
        if step == 1:  # freeze batch norm's statistics
            for m in (model, reference):
                for bn in m.modules():
                    if isinstance(bn, nn.BatchNorm2d):
                        bn.eval()
        loss, ref_loss = wrapped(*mine), reference(*whole)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    for name, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    # training with the whole module in eval mode (PyTorch allows it): eval calls are
    # forward only, and a backward through their outputs says what to do instead
    wrapped.eval()
    out = wrapped(*mine)
    assert out.requires_grad  # outside no_grad, as PyTorch's
    expect_error(out.backward, "comes from an eval call", "put its dropout modules in eval()")
    print(f"OK rank {rank}", flush=True)
elif probe == "optimizer_anew":  # [Note: optimizers made anew] in optimizer_share.py
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2)
    for step in range(5):
        if step == 3:  # phase 2: a fresh optimizer
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3, eps=1e-5)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, eps=1e-5)
        step_both(wrapped(*args), reference(*args), opt, ref_opt)
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    assert state["param_groups"] == ref_state["param_groups"], state["param_groups"]
    assert state["state"].keys() == ref_state["state"].keys()
    for i, s in ref_state["state"].items():
        assert float(state["state"][i]["step"]) == float(s["step"]) == 2.0, (i, state["state"][i])
        torch.testing.assert_close(state["state"][i]["exp_avg"], s["exp_avg"], rtol=1e-4,
                                   atol=1e-5, msg=lambda m: f"rank {rank}: state {i}: {m}")
    assert wrapped.optimizers == [opt], wrapped.optimizers
    # phase 3: SGD with momentum
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step_both(wrapped(*args), reference(*args), opt, ref_opt)
    state, ref_state = opt.state_dict(), ref_opt.state_dict()
    assert {k for s in state["state"].values() for k in s} == {"momentum_buffer"}, state["state"][0]
    for name, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "loss_view1":  # _one_value_over_batch in deployed.py
    class ViewedLoss(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args).view(1)

    inner, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(inner)
    model = ViewedLoss(inner)
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    whole, mine = global_batch("gpt")
    for step in range(3):
        loss, ref_loss = wrapped(*mine), reference(*whole)
        assert loss.shape == (1,), loss.shape
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    assert wrapped.deployments["train"].schedule != "fill_drain"
    for name, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "buffer_replicas":  # [Note: buffers of replicas] in placement.py
    from rannc.transport import all_gather_objects
    model, _, _ = zoo.make("resnet", batch=4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=1)
    for step in range(2):
        _, mine = global_batch("resnet", seed=step)
        loss = wrapped(*mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = {n: b.clone() for n, b in model.named_buffers() if "running" in n}
        everyone = all_gather_objects(stats)
        for n, b in stats.items():
            torch.testing.assert_close(b, everyone[0][n], rtol=0, atol=0,
                                       msg=lambda m: f"rank {rank}: step {step}: {n}: {m}")
    assert len(wrapped.deployments["train"].stages[0].ranks) == 2  # replicas
    state = wrapped.state_dict()
    for n, b in stats.items():
        torch.testing.assert_close(state[n], b, rtol=0, atol=0)
    wrapped.eval()
    with torch.no_grad():
        _, whole, _ = zoo.make("resnet", batch=8, seed=5)
        loss = wrapped(*whole[:1], whole[1])
    print(f"OK rank {rank}", flush=True)
elif probe == "eval_memory":  # [Note: memory the programs before hold] in deployed.py
    from rannc.transport import all_gather_objects
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    limit = 64 << 20
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, device_memory=limit)
    loss, ref_loss = wrapped(*args), reference(*args)
    step_both(loss, ref_loss, opt, ref_opt)
    # this rank's stage: its weights and AdamW's two moments (the gradients were set to
    # None), its step counters and the buffers
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    held = wrapped.held_bytes()
    extra = sum(b.numel() * b.element_size() for b in model.buffers()) + 64 * len(opt.state)
    assert 3 * own <= held <= 3 * own + extra, f"rank {rank}: held {held}, weights {own}"
    most = max(all_gather_objects(held))
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(*args), reference(*args), rtol=1e-5, atol=1e-6)
    limits = {m: d.memory_limit for m, d in wrapped.deployments.items()}
    assert limits["train"] == int(limit * 0.9), limits
    assert abs(limits["eval"] - int((limit - most) * 0.9)) <= 1, (limits, most)
    assert all(s.memory_bytes <= limits["eval"] for s in wrapped.deployments["eval"].stages)
    # a rank that holds nearly the whole device: no eval plan fits, every rank says why
    model2, _, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model2)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2, eps=1e-5)
    wrapped2 = rannc.RaNNCModule(model2, opt2, num_stages=2, device_memory=limit)
    train(wrapped2, opt2, args)
    if rank == 1:
        wrapped2.held_bytes = lambda: limit - 4096
    wrapped2.eval()
    try:
        with torch.no_grad():
            wrapped2(*args)
        raise AssertionError(f"rank {rank}: an eval plan fit in 4 KiB")
    except rannc.InfeasiblePlanError as e:
        assert "programs deployed before, training calls, hold up to 64.0 MiB" in str(e), \
            f"rank {rank}: {e}"
        assert e.bytes_needed > 0, f"rank {rank}: {e.bytes_needed}"
    # training goes on, equal to PyTorch
    wrapped2.train()
    train(wrapped2, opt2, args)
    wrapped.train()
    reference.train()
    for step in range(2):
        loss, ref_loss = wrapped(*args), reference(*args)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    # (a rank's copy of a weight that only its eval stage uses is stale until the next eval)
    for name, value in wrapped.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "unfreeze":  # [Note: frozen parameters] in deployed.py
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    model.blocks[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=1e-5)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    for step in range(6):
        if step == 2:
            for m in (model, reference):
                m.blocks[0].requires_grad_(True)
        if step == 4:
            for m in (model, reference):
                m.blocks[1].requires_grad_(False)
        loss, ref_loss = wrapped(*args), reference(*args)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-4)
    gathered, ref_state = wrapped.optimizer_state_dict(), ref_opt.state_dict()
    assert gathered["state"].keys() == ref_state["state"].keys(), \
        f"rank {rank}: {sorted(gathered['state'])} against {sorted(ref_state['state'])}"
    for i, s in ref_state["state"].items():
        torch.testing.assert_close(gathered["state"][i]["exp_avg"], s["exp_avg"], rtol=1e-4,
                                   atol=1e-6, msg=lambda m: f"rank {rank}: state {i}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "averaged_model":  # [Note: copies of a wrapped model] in copies.py
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    world = rannc.get_world_size()
    model, reference, opt, ref_opt, wrapped = frozen_first_pair()
    # made before the first call, as training scripts make their EMA
    ema = AveragedModel(wrapped, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    rows = slice(32 * rank, 32 * (rank + 1))
    x_eval = torch.randn(32 * world, 2, 512, generator=torch.Generator().manual_seed(99))

    def same_eval(mine, theirs, what):
        mine.eval()
        theirs.eval()
        with torch.no_grad():
            torch.testing.assert_close(mine(x_eval[rows]), theirs(x_eval), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {what}: {m}")

    for step in range(4):
        x = torch.randn(32 * world, 2, 512, generator=torch.Generator().manual_seed(step))
        for m in (wrapped, reference, ema, ref_ema):
            m.train()
        step_both(wrapped(x[rows]), reference(x), opt, ref_opt)
        ema.update_parameters(wrapped)
        ref_ema.update_parameters(reference)
        if step == 0:  # a frozen copy (a reference model, a teacher)
            frozen, ref_frozen = copy.deepcopy(wrapped), copy.deepcopy(reference)
        if step == 1:  # the copy in train mode, forward only; the first eval is the copy's
            with torch.no_grad():
                torch.testing.assert_close(ema(x[rows]), ref_ema(x), rtol=1e-4, atol=1e-6)
        if step >= 1:
            same_eval(ema, ref_ema, f"the average after step {step}")
            # each value of the average this rank holds is current after an eval call
            # (those of the ranks that only evaluate a tensor came from its owner)
            same_stage_parameters(ema.module.module, ref_ema.module, rtol=1e-5)
            same_eval(wrapped, reference, f"the model after step {step}")  # its own weights
    same_eval(frozen, ref_frozen, "the copy made after step 0")
    assert first_stage_tasks(wrapped, "train") > first_stage_tasks(wrapped, "eval")
    state, ref_state = ema.state_dict(), ref_ema.state_dict()
    assert state.keys() == ref_state.keys(), (sorted(state), sorted(ref_state))
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")
    resumed = AveragedModel(wrapped, multi_avg_fn=get_ema_multi_avg_fn(0.8))
    resumed.load_state_dict(ref_state)  # every rank passes the whole state
    same_eval(resumed, ref_ema, "an average loaded from a state_dict")
    # the average as a sharded checkpoint of the model, each rank reading its share back
    import shutil
    import tempfile

    from rannc.transport import all_gather_objects
    directory = all_gather_objects(tempfile.mkdtemp() if rank == 0 else None)[0]
    ema.module.save_checkpoint(directory)
    loaded = copy.deepcopy(wrapped)
    loaded.load_checkpoint(directory)
    same_eval(loaded, ref_ema.module, "an average saved and loaded as a checkpoint")
    same_stage_parameters(loaded.module, ref_ema.module, rtol=1e-6, atol=1e-6)
    if rank == 0:
        shutil.rmtree(directory)
    print(f"OK rank {rank}", flush=True)
elif probe == "other_arguments":  # [Note: other training arguments] in module.py
    import torch.nn.functional as F
    world = rannc.get_world_size()
    # batch norm equals PyTorch's where each stage sees the global batch as one share
    # (2 ranks, 2 stages, one micro-batch); with replicas, layer norm
    norm = nn.BatchNorm1d if world == 2 else nn.LayerNorm

    class MultiTask(nn.Module):
        """Text features with optional image features, and a head per task."""

        def __init__(self):
            super().__init__()
            self.text = nn.Linear(8, 32)
            self.image = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 32))
            # (a norm right after a bias would leave it a gradient of rounding errors only,
            # which Adam's steps amplify)
            self.body = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                      norm(32), nn.Linear(32, 32), nn.Tanh())
            self.heads = nn.ModuleDict({"regress": nn.Linear(32, 1),
                                        "classify": nn.Linear(32, 3)})

        def forward(self, x, y, image=None, task="regress"):
            h = self.text(x)
            if image is not None:
                h = h + self.image(image)
            out = self.heads[task](self.body(h))
            return F.mse_loss(out, y) if task == "regress" else F.cross_entropy(out, y)

    torch.manual_seed(0)
    model = MultiTask()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    # 3 ranks: gradients from the backward of the outputs (fill-drain)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=1,
                                cost_model="analytic",
                                schedule="fill_drain" if world == 3 else "1f1b")
    B = 4
    mine = slice(rank * B, (rank + 1) * B)

    def losses(wrapped, step, with_image, task):
        """This rank's loss and the reference's on the global batch of `step`."""
        g = torch.Generator().manual_seed(step)
        x, image = torch.randn(B * world, 8, generator=g), torch.randn(B * world, 12, generator=g)
        y = (torch.randn(B * world, 1, generator=g) if task == "regress"
             else torch.randint(0, 3, (B * world,), generator=g))
        extra, ref_extra = ({"image": image[mine]}, {"image": image}) if with_image else ({}, {})
        if task != "regress":
            extra["task"] = ref_extra["task"] = task
        loss, ref_loss = wrapped(x[mine], y[mine], **extra), reference(x, y, **ref_extra)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        return loss, ref_loss

    def same_trained_parameters(wrapped, model, what):
        """The parameters this rank trains equal the reference's (a rank running one in some
        program only holds a copy that the next call of that program brings up to date)."""
        trained, ref = wrapped.placement.trained_here(), dict(reference.named_parameters())
        for n, p in model.named_parameters():
            if id(p) in trained:
                torch.testing.assert_close(p.detach().cpu(), ref[n].detach(), rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"rank {rank}: {what}: {n}: {m}")

    # text first, then with images, another task, both, and back
    calls = [(False, "regress"), (True, "regress"), (False, "classify"), (True, "classify"),
             (False, "regress"), (True, "regress"), (False, "classify")]
    for step, (with_image, task) in enumerate(calls):
        loss, ref_loss = losses(wrapped, step, with_image, task)
        loss.backward()
        ref_loss.backward()
        norms = (torch.nn.utils.clip_grad_norm_(wrapped.parameters(), 0.5).cpu(),
                 torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5))
        torch.testing.assert_close(*norms, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: the norm: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        same_trained_parameters(wrapped, model, f"step {step}")
    # the programs place some parameters on other ranks: gradients moved between them
    placement = wrapped.placement
    keys = [k for k in placement._users if isinstance(k, tuple) and k[0] is True]
    assert len(keys) == 3, keys
    assert any(receivers for k in keys for _, _, receivers in placement.gradient_routes(k)), \
        "no program placed a parameter elsewhere than its trainers: the routes went untested"
    gathered, ref_state = wrapped.state_dict(), reference.state_dict()  # batch norm's too
    for name, t in ref_state.items():
        torch.testing.assert_close(gathered[name].cpu(), t, rtol=1e-4, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    state, ref_opt_state = wrapped.optimizer_state_dict(), ref_opt.state_dict()
    assert state["state"].keys() == ref_opt_state["state"].keys(), \
        (sorted(state["state"]), sorted(ref_opt_state["state"]))
    for i, s in ref_opt_state["state"].items():
        torch.testing.assert_close(state["state"][i]["exp_avg_sq"].cpu(), s["exp_avg_sq"],
                                   rtol=1e-4, atol=1e-8,
                                   msg=lambda m: f"rank {rank}: state {i}: {m}")
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        for with_image in (False, True):
            losses(wrapped, 0, with_image, "classify")
    wrapped.train()
    reference.train()
    with wrapped.no_sync():  # its gradients are routed once summed: an error on every rank
        expect_error(lambda: losses(wrapped, 0, False, "classify"), "under no_sync()")
    # accumulation: the first program under no_sync(), then another one summed with it
    with wrapped.no_sync():
        for loss in losses(wrapped, 20, False, "regress"):
            loss.backward()
    for loss in losses(wrapped, 21, True, "classify"):
        loss.backward()
    for o in (opt, ref_opt):
        o.step()
        o.zero_grad()
    same_trained_parameters(wrapped, model, "accumulated")
    # ranks passing different constants: an error on every rank, and training goes on
    expect_error(lambda: losses(wrapped, 22, False, "classify" if rank else "regress"),
                 "every rank must pass arguments of the same structure")

    class Scaled(Regression):
        def forward(self, x, y, scale=1.0):
            return super().forward(x * scale, y)

    # a Python number that changes every call would make a program per value: an error
    scaled = rannc.RaNNCModule(Scaled(), num_stages=2, cost_model="analytic")
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, 4, generator=g), torch.randn(B, 1, generator=g)
    for step in range(1 + wrapped._MAX_PROGRAMS):
        scaled(x, y, scale=1.0 + step).backward()
    expect_error(lambda: scaled(x, y, scale=100.0), "different sets of arguments",
                 "kwargs['scale'] was 1.0 when traced and is 100.0 now", "as a tensor")
    scaled(x, y, scale=3.0).backward()  # a program it has
    # resumed from a checkpoint by a module whose first call runs neither the images nor
    # the classifier: AdamW's state of those is kept until a program trains them
    import shutil
    import tempfile

    from rannc.transport import all_gather_objects
    directory = all_gather_objects(tempfile.mkdtemp() if rank == 0 else None)[0]
    wrapped.save_checkpoint(directory)
    torch.manual_seed(1)
    resumed = MultiTask()
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    wrapped = rannc.RaNNCModule(resumed, resumed_opt, num_stages=2, num_microbatches=1,
                                cost_model="analytic",
                                schedule="fill_drain" if world == 3 else "1f1b")
    wrapped.load_checkpoint(directory)
    for step, (with_image, task) in enumerate([(False, "regress"), (False, "classify"),
                                               (True, "regress")], start=len(calls)):
        loss, ref_loss = losses(wrapped, step, with_image, task)
        step_both(loss, ref_loss, resumed_opt, ref_opt)
        same_trained_parameters(wrapped, resumed, f"resumed, step {step}")
    if rank == 0:
        shutil.rmtree(directory)
    print(f"OK rank {rank}", flush=True)
elif probe == "several_optimizers":  # [Note: several optimizers] in optimizer_share.py
    import shutil
    import tempfile

    from rannc.transport import all_gather_objects
    world = rannc.get_world_size()

    def optimizers(m, wrapped=None):
        """Muon's split: one optimizer for the blocks' matrices, AdamW for the rest (of
        `wrapped` when given, as a script that builds its optimizers after wrapping). The
        matrices' is SGD with Nesterov momentum here: Muon orthogonalises in bf16, whose
        roundings differ with the order the gradients were summed in."""
        named = list((wrapped or m).named_parameters())
        matrices = [p for n, p in named if p.ndim == 2 and "blocks." in n]
        rest = [p for n, p in named if not any(p is q for q in matrices)]
        return (torch.optim.SGD(matrices, lr=0.05, momentum=0.9, nesterov=True),
                torch.optim.AdamW(rest, lr=1e-2, eps=1e-5))

    def same_state(mine, theirs, what):
        assert mine["state"].keys() == theirs["state"].keys(), \
            f"rank {rank}: {what}: {sorted(mine['state'])} against {sorted(theirs['state'])}"
        for i, s in theirs["state"].items():
            for key, v in s.items():
                torch.testing.assert_close(torch.as_tensor(mine["state"][i][key]).cpu(),
                                           torch.as_tensor(v), rtol=1e-4, atol=1e-7,
                                           msg=lambda m: f"rank {rank}: {what}: {i}.{key}: {m}")
        assert [g["params"] for g in mine["param_groups"]] == \
            [g["params"] for g in theirs["param_groups"]], what

    def train_steps(wrapped, model, opts, reference, ref_opts, steps):
        for step in steps:
            x, y = zoo.make("gpt", batch=4 * world, seed=100 + step)[1]
            mine = slice(4 * rank, 4 * (rank + 1))
            loss, ref_loss = wrapped(x[mine], y[mine]), reference(x, y)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: step {step}: {m}")
            loss.backward()
            ref_loss.backward()
            for o in (*opts, *ref_opts):
                o.step()
                o.zero_grad()
            # (the attention's key bias has a gradient of rounding errors only, which
            # AdamW's steps amplify)
            same_stage_parameters(model, reference, rtol=1e-3)

    for late in (False, True):
        model, _, _ = zoo.make("gpt", batch=4, seed=0)
        zoo.no_dropout(model)
        reference = copy.deepcopy(model)
        ref_opts = optimizers(reference)
        if late:  # DDP's order: wrap, then build the optimizers over the wrapper's parameters
            wrapped = rannc.RaNNCModule(model, num_stages=2, num_microbatches=2)
            opts = optimizers(model, wrapped)
        else:
            opts = optimizers(model)
            wrapped = rannc.RaNNCModule(model, list(opts), num_stages=2, num_microbatches=2)
        train_steps(wrapped, model, opts, reference, ref_opts, range(3))
        assert [type(o) for o in wrapped.optimizers] == [torch.optim.SGD, torch.optim.AdamW], \
            wrapped.optimizers
        held = sum(len(g["params"]) for o in opts for g in o.param_groups)
        assert held < sum(1 for _ in model.parameters()), "the optimizers were not cut"
        # DDP's habit: each optimizer's state saved on rank 0 alone
        directory = all_gather_objects(tempfile.mkdtemp() if rank == 0 else None)[0]
        if rank == 0:
            states = [o.state_dict() for o in opts]
            for mine, o, name in zip(states, ref_opts, ("SGD", "AdamW")):
                same_state(mine, o.state_dict(), f"{name}'s state_dict() on rank 0")
            torch.save({"model": wrapped.state_dict(), "opts": states},
                       os.path.join(directory, "ddp.pt"))
        # every rank: the other ranks served the gathers
        wrapped.save_checkpoint(os.path.join(directory, "checkpoint"))
        # resumed from the DDP file and from the checkpoint: two more steps as PyTorch's
        for how in ("torch.load", "load_checkpoint"):
            torch.manual_seed(5)
            resumed, _, _ = zoo.make("gpt", batch=4, seed=1)
            zoo.no_dropout(resumed)
            resumed_opts = optimizers(resumed)
            again = rannc.RaNNCModule(resumed, list(resumed_opts), num_stages=2,
                                      num_microbatches=2)
            if how == "torch.load":
                saved = torch.load(os.path.join(directory, "ddp.pt"))
                again.load_state_dict(saved["model"])
                for o, sd in zip(resumed_opts, saved["opts"]):
                    o.load_state_dict(sd)
            else:
                again.load_checkpoint(os.path.join(directory, "checkpoint"))
            ref_copy = copy.deepcopy(reference)
            ref_copy_opts = optimizers(ref_copy)
            for o, ref_o in zip(ref_copy_opts, ref_opts):  # (torch's load keeps the tensors)
                o.load_state_dict(copy.deepcopy(ref_o.state_dict()))
            train_steps(again, resumed, resumed_opts, ref_copy, ref_copy_opts, range(3, 5))
            for mine, o, name in zip(resumed_opts, ref_copy_opts, ("SGD", "AdamW")):
                same_state(mine.state_dict(), o.state_dict(), f"{name} resumed by {how}")
        all_gather_objects(None)
        if rank == 0:
            shutil.rmtree(directory)
    print(f"OK rank {rank}", flush=True)
elif probe == "add_param_group":  # a group added to a cut optimizer (optimizer_share.py)
    model, args, _ = zoo.make("gpt", batch=4, seed=0)
    zoo.no_dropout(model)
    model.blocks[0].requires_grad_(False)
    reference = copy.deepcopy(model)

    def unfrozen(m):
        return [p for n, p in m.named_parameters() if not n.startswith("blocks.0.")]

    opt = torch.optim.AdamW(unfrozen(model), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(unfrozen(reference), lr=1e-2, eps=1e-5)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2)
    for step in range(5):
        if step == 2:  # gradual unfreezing: the block joins with a rate of its own
            for m, o in ((model, opt), (reference, ref_opt)):
                m.blocks[0].requires_grad_(True)
                o.add_param_group({"params": list(m.blocks[0].parameters()), "lr": 1e-3})
        loss, ref_loss = wrapped(*args), reference(*args)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-3)
    held = [p for p in opt.param_groups[-1]["params"]]
    assert all(p.numel() for p in held), f"rank {rank}: the added group holds freed parameters"
    theirs, mine = ref_opt.state_dict(), opt.state_dict()  # the whole state, gathered
    assert [g["params"] for g in mine["param_groups"]] == \
        [g["params"] for g in theirs["param_groups"]], mine["param_groups"]
    assert mine["param_groups"][-1]["lr"] == 1e-3
    assert mine["state"].keys() == theirs["state"].keys(), (sorted(mine["state"]),
                                                           sorted(theirs["state"]))
    for i, s in theirs["state"].items():
        torch.testing.assert_close(mine["state"][i]["exp_avg"].cpu(), s["exp_avg"], rtol=1e-3,
                                   atol=1e-7, msg=lambda m: f"rank {rank}: state {i}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "outside_parameter":  # optimizer_share.py: parameters outside the module
    import shutil
    import tempfile

    import torch.nn.functional as F

    from rannc.transport import all_gather_objects
    world = rannc.get_world_size()
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))
    reference = copy.deepcopy(body)
    scale, ref_scale = nn.Parameter(torch.tensor(1.0)), nn.Parameter(torch.tensor(1.0))
    opt = torch.optim.AdamW(list(body.parameters()) + [scale], lr=1e-2)
    ref_opt = torch.optim.AdamW(list(reference.parameters()) + [ref_scale], lr=1e-2)
    wrapped = rannc.RaNNCModule(body, opt, num_stages=2, cost_model="analytic")
    B = 4
    mine = slice(rank * B, (rank + 1) * B)
    comm = rannc._C.Communicator.world_cpu()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(B * world, 8, generator=g), torch.randint(0, 4, (B * world,), generator=g)
        F.cross_entropy(wrapped(x[mine]) * scale, y[mine]).backward()
        F.cross_entropy(reference(x) * ref_scale, y).backward()
        comm.all_reduce(scale.grad).wait()  # the script's own averaging, as under DDP
        scale.grad /= world
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(scale.detach(), ref_scale.detach(), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"rank {rank}: step {step}: the scale: {m}")
        same_stage_parameters(body, reference, rtol=1e-4)
    assert any(p is scale for g in opt.param_groups for p in g["params"]), "cut out"
    mine_state, theirs = opt.state_dict(), ref_opt.state_dict()
    last = len(list(reference.parameters()))  # the scale's index
    torch.testing.assert_close(mine_state["state"][last]["exp_avg"], theirs["state"][last]["exp_avg"])
    directory = all_gather_objects(tempfile.mkdtemp() if rank == 0 else None)[0]
    wrapped.save_checkpoint(os.path.join(directory, "checkpoint"))
    before = {k: v.clone() for k, v in opt.state[scale].items()}
    wrapped.load_checkpoint(os.path.join(directory, "checkpoint"))
    wrapped(x[mine])  # reads what the load left to read
    for k, v in before.items():  # the scale's state stays as it was
        torch.testing.assert_close(opt.state[scale][k], v)
    all_gather_objects(None)
    if rank == 0:
        shutil.rmtree(directory)
    print(f"OK rank {rank}", flush=True)
elif probe == "pairs_rows":  # [Note: rows paired] in csrc/frontend/traced_model.h
    class Contrastive(nn.Module):
        """Two towers and CLIP's loss over the batch; with `returns` ("temperature" or
        "parameter"), the loss is left to the caller, and forward returns the embeddings and
        the temperature (as open_clip's models do) or the parameter it is made from."""

        def __init__(self, returns=None):
            super().__init__()
            self.returns = returns
            self.a = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
            self.b = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8))
            self.scale = nn.Parameter(torch.tensor(2.0))

        def forward(self, x, y):
            za, zb = self.a(x), self.b(y)
            if self.returns == "parameter":  # [Note: outputs that are inputs] in _trace.py
                return za, zb, self.scale
            if self.returns == "temperature":
                return za, zb, self.scale.exp()
            return clip_loss(za, zb, self.scale.exp())

    def clip_loss(za, zb, temperature):
        logits = (nn.functional.normalize(za, dim=-1) @ nn.functional.normalize(zb, dim=-1).T
                  * temperature)
        labels = torch.arange(za.shape[0], device=za.device)
        return (nn.functional.cross_entropy(logits, labels)
                + nn.functional.cross_entropy(logits.T, labels)) / 2

    def loss_of(outputs, returns):
        """The loss of a model's call, computed outside where the model leaves it."""
        if returns is None:
            return outputs
        za, zb, t = outputs
        return clip_loss(za, zb, t.exp() if returns == "parameter" else t)

    def shares_loss(model, x, y, shares, returns=None):
        """The mean of the loss over `shares` equal shares of the rows: the loss of DDP's
        ranks, each pairing its own rows."""
        return sum(loss_of(model(xs, ys), returns)
                   for xs, ys in zip(x.chunk(shares), y.chunk(shares))) / shares

    # (what forward returns, layout, the shares whose rows the loss pairs, micro-batches):
    # the loss inside, on one stage on both ranks (the layout given: rank 0 warns), pairs
    # each rank's rows; on two stages of one rank each, the global batch's, as one process;
    # left to the planner, the stage of the loss has one replica ([Note: rows kept
    # together] in csrc/partition/stage/stage_cost.h): one process's; all with one
    # micro-batch. The
    # loss outside: the towers pipeline four micro-batches on two stages, and each rank's
    # loss pairs its own rows, as under DDP.
    cases = ((None, {"num_stages": 1}, 2, 1), (None, {"num_stages": 2, "cost_model": "analytic"}, 1, 1),
             (None, {"cost_model": "analytic"}, 1, 1),
             ("temperature", {"num_stages": 2, "num_microbatches": 4}, 2, 4),
             ("parameter", {"num_stages": 2, "num_microbatches": 4}, 2, 4))
    for returns, layout, shares, micro_batches in cases:
        torch.manual_seed(0)
        reference, opt, ref_opt, wrapped = sgd_pair(Contrastive(returns), **layout)
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 6, generator=gen)
            mine = slice(8 * rank, 8 * (rank + 1))
            loss = loss_of(wrapped(x[mine], y[mine]), returns)
            ref_loss = shares_loss(reference, x, y, shares, returns)
            expected = (ref_loss if returns is None
                        else loss_of(reference(x[mine], y[mine]), returns))  # this rank's
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=lambda m: (
                f"rank {rank}: {returns} {layout} step {step}: {m}"))
            step_both(loss, ref_loss, opt, ref_opt)
        assert wrapped.deployments["train"].micro_batches == micro_batches, (returns, layout)
        same_stage_parameters(wrapped.module, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "recompute_buffers":  # [Note: buffers a recompute writes] in runtime/stage.cpp
    # A ResNet on 2 stages recomputing every stage, one micro-batch: the stages see the
    # global batch as one process does, so batch norm's statistics and counters equal
    # PyTorch's (each recompute wrote them again: twice the moves and the counts).
    model, _, _ = zoo.make("resnet", batch=4, seed=0)
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=1,
                                                recompute="always", cost_model="analytic")
    for step in range(3):
        whole, mine = global_batch("resnet", seed=step)
        loss, ref_loss = wrapped(*mine), reference(*whole)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    assert all(s.recompute for s in wrapped.deployments["train"].stages)
    state, ref_state = wrapped.state_dict(), reference.state_dict()
    assert any("num_batches_tracked" in n for n in state)
    for name, value in state.items():
        torch.testing.assert_close(value, ref_state[name], rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "lbfgs":  # [Note: optimizers that read every gradient] in deployed.py
    def lbfgs(model):
        return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)

    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opt, ref_opt = lbfgs(model), lbfgs(reference)
    wrapped = rannc.RaNNCModule(model, opt, num_microbatches=2, cost_model="analytic")
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
        mine = slice(8 * rank, 8 * (rank + 1))

        def closure():
            opt.zero_grad()
            loss = wrapped(x[mine], y[mine])
            loss.backward()
            return loss

        def ref_closure():
            ref_opt.zero_grad()
            loss = reference(x, y)
            loss.backward()
            return loss

        loss, ref_loss = opt.step(closure), ref_opt.step(ref_closure)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
    assert wrapped.deployments["train"].num_stages == 1
    same_stage_parameters(model, reference, rtol=1e-4, atol=1e-4)  # LBFGS amplifies rounding
    # cut into stages on purpose: an error on every rank, naming the optimizer
    model = Regression()
    staged = rannc.RaNNCModule(model, lbfgs(model), num_stages=2, cost_model="analytic")
    expect_error(lambda: staged(x[mine], y[mine]), "LBFGS reads every gradient", "num_stages=2")

    class MyLBFGS(torch.optim.LBFGS):  # a class built on it reads every gradient too
        pass
    model = Regression()
    staged = rannc.RaNNCModule(model, MyLBFGS(model.parameters()), num_stages=2,
                               cost_model="analytic")
    expect_error(lambda: staged(x[mine], y[mine]), "MyLBFGS reads every gradient", "num_stages=2")
    # built after the first training call planned two stages: refused at its first step
    model = Regression()
    staged = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               num_stages=2, cost_model="analytic")
    staged(x[mine], y[mine]).backward()
    late = lbfgs(model)
    expect_error(lambda: late.step(lambda: staged(x[mine], y[mine])),
                 "LBFGS was built after RaNNCModule's first training call", "2 stages")

    class SAM(torch.optim.Optimizer):
        """Sharpness-aware minimisation as its users write it: a step to the worst point
        within rho along the gradient, whose norm is over every gradient, then the base
        optimizer's step with the gradient there (the closure computes it)."""

        def __init__(self, params, rho=0.05, **kwargs):
            super().__init__(params, dict(rho=rho, **kwargs))
            self.base = torch.optim.SGD(self.param_groups, **kwargs)
            self.param_groups = self.base.param_groups

        @torch.no_grad()
        def step(self, closure):
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            norm = torch.stack([g.norm() for g in grads]).norm()
            for g in self.param_groups:
                for p in g["params"]:
                    if p.grad is not None:
                        self.state[p]["e"] = p.grad * (g["rho"] / (norm + 1e-12))
                        p.add_(self.state[p]["e"])
            with torch.enable_grad():
                self.zero_grad()
                closure()
            for g in self.param_groups:
                for p in g["params"]:
                    if "e" in self.state[p]:
                        p.sub_(self.state[p]["e"])
            self.base.step()

    # SAM's step requires a closure: planned as one stage (its norm is every gradient's)
    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opt, ref_opt = SAM(model.parameters(), lr=0.1), SAM(reference.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_microbatches=2, cost_model="analytic")
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
        wrapped(x[mine], y[mine]).backward()
        opt.step(lambda: wrapped(x[mine], y[mine]).backward())
        opt.zero_grad()
        reference(x, y).backward()
        ref_opt.step(lambda: reference(x, y).backward())
        ref_opt.zero_grad()
    assert wrapped.deployments["train"].num_stages == 1
    same_stage_parameters(model, reference, rtol=1e-5)
    model = Regression()
    staged = rannc.RaNNCModule(model, SAM(model.parameters(), lr=0.1), num_stages=2,
                               cost_model="analytic")
    expect_error(lambda: staged(x[mine], y[mine]), "SAM reads every gradient", "num_stages=2")

    class TwoHalves(torch.optim.SGD):  # SAM's other form: the loop calls both halves
        def first_step(self):
            pass

        def second_step(self):
            pass
    model = Regression()
    staged = rannc.RaNNCModule(model, TwoHalves(model.parameters(), lr=0.1), num_stages=2,
                               cost_model="analytic")
    expect_error(lambda: staged(x[mine], y[mine]), "TwoHalves reads every gradient")
    print(f"OK rank {rank}", flush=True)
elif probe == "attributes":  # [Note: attributes read] in _trace.py
    class Annealed(nn.Module):
        """A temperature and a flag the loop sets between steps, and a count forward keeps."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)
            self.temperature, self.use_extra, self.calls = 1.0, False, 0

        def forward(self, x, y):
            self.calls += 1  # changed by forward: not watched, rank 0 warns
            h = torch.tanh(self.a(x))
            logits = self.b(h) / self.temperature
            if self.use_extra:
                logits = logits + h[:, :3]
            return nn.functional.cross_entropy(logits, y)

    torch.manual_seed(0)
    reference, opt, ref_opt, wrapped = sgd_pair(Annealed(), num_stages=2, num_microbatches=2,
                                                cost_model="analytic")
    for step, (temperature, extra) in enumerate(((1.0, False), (0.5, False), (0.5, True),
                                                 (0.25, True), (0.5, True))):
        for m in (wrapped.module, reference):
            m.temperature, m.use_extra = temperature, extra
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 4, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        mine = slice(8 * rank, 8 * (rank + 1))
        loss, ref_loss = wrapped(x[mine], y[mine]), reference(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    same_stage_parameters(wrapped.module, reference, rtol=1e-5)
    assert len(wrapped._deployed_by_arguments) == 3  # (0.5, F), (0.5, T), (0.25, T)
    print(f"OK rank {rank}", flush=True)
elif probe == "cumulative_bn":  # [Note: cumulative batch norm] in _trace.py
    # Two stages of one rank each, one micro-batch: each stage sees the global batch, as one
    # process. Trained with momentum 0.1, then the statistics recomputed by swa_utils's
    # update_bn (momentum=None: a cumulative average), as SWA does: equal to PyTorch's.
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(),
                                      nn.Linear(16, 8), nn.BatchNorm1d(8), nn.ReLU())
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.body(x))

    torch.manual_seed(0)
    reference, opt, ref_opt, wrapped = sgd_pair(Classifier(), num_stages=2, num_microbatches=1,
                                                cost_model="analytic")
    batches = [torch.randn(16, 4, generator=torch.Generator().manual_seed(s)) * (s + 1)
               for s in range(3)]
    mine = slice(8 * rank, 8 * (rank + 1))
    y = torch.arange(16) % 3
    for step, x in enumerate(batches):
        # the loss outside: each rank's over its rows, their gradients averaged, as DDP's
        loss = nn.functional.cross_entropy(wrapped(x[mine]), y[mine])
        ref_logits = reference(x)
        ref_loss = nn.functional.cross_entropy(ref_logits, y)
        torch.testing.assert_close(loss, nn.functional.cross_entropy(ref_logits[mine], y[mine]),
                                   rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    torch.optim.swa_utils.update_bn([x[mine] for x in batches], wrapped)
    torch.optim.swa_utils.update_bn(batches, reference)
    state, ref_state = wrapped.state_dict(), reference.state_dict()
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    assert wrapped.module.body[1].momentum == 0.1  # update_bn put it back
    # and training goes on with momentum 0.1 (the first program again)
    loss = nn.functional.cross_entropy(wrapped(batches[0][mine]), y[mine])
    ref_loss = nn.functional.cross_entropy(reference(batches[0])[mine], y[mine])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
elif probe == "count_output":  # [Note: integers of sizes] in csrc/frontend/convert.cpp
    # A count of the data next to the loss: with these labels it scales with the batch on
    # one rank's shard and not on the other's, whose graphs then differed ("the model's
    # control flow depends on its input data" on every rank).
    class Counts(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, y):
            return nn.functional.cross_entropy(self.lin(x), y), (y == 0).sum()

    torch.manual_seed(0)
    reference, opt, ref_opt, wrapped = sgd_pair(Counts(), num_stages=2, num_microbatches=2,
                                                cost_model="analytic")
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 3, 3, 0, 1, 0, 0, 1])
    mine = slice(4 * rank, 4 * (rank + 1))
    for step in range(2):
        (loss, count), (ref_loss, _) = wrapped(x[mine], y[mine]), reference(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert int(count) == int((y == 0).sum()), (rank, count)  # added over the ranks
        step_both(loss, ref_loss, opt, ref_opt)
    print(f"OK rank {rank}", flush=True)
elif probe == "graphs_part":  # _first_difference in deployed.py
    # An LSTM over packed sequences whose lengths add up differently on the ranks: the
    # error names the op whose value's size the data decides (it named none).
    from torch.nn.utils.rnn import pack_padded_sequence

    class Packed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lstm = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, ids, lengths, y):
            packed = pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                          enforce_sorted=False)
            _, (h, _) = self.lstm(packed)
            return nn.functional.cross_entropy(self.head(h[-1]), y)

    model = Packed()
    wrapped = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                cost_model="analytic")
    lengths = torch.tensor([[3, 6, 2, 6], [6, 6, 5, 6]][rank])
    expect_error(lambda: wrapped(torch.randint(0, 20, (4, 6)), lengths, torch.arange(4) % 3),
                 "the ranks traced different graphs from the same model: op ",
                 "makes [17, 8]", "on rank 0 and [23, 8]", "pad_packed_sequence(..., total_length=T)")
    print(f"OK rank {rank}", flush=True)
elif probe == "edits_after_load":  # [Note: edits after a load] in checkpoint.py
    # Fine-tuning from a checkpoint: load it into a fresh module, then a new head and a new
    # lr before the first call; the first call read the checkpoint over both.
    import shutil
    import tempfile

    def adamw(model):
        return torch.optim.AdamW(model.parameters(), lr=1e-2)

    def new_head(model):
        with torch.no_grad():
            model.b.weight.copy_(torch.linspace(-0.5, 0.5, model.b.weight.numel()).view_as(model.b.weight))
            model.b.bias.data.zero_()  # `.data`: no version counter moves

    torch.manual_seed(0)
    model = Regression()
    reference = copy.deepcopy(model)
    opt, ref_opt = adamw(model), adamw(reference)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, cost_model="analytic")
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))
    mine = slice(4 * rank, 4 * (rank + 1))
    for step in range(2):
        step_both(wrapped(x[mine], y[mine]), reference(x, y), opt, ref_opt)
    from rannc.transport import all_gather_objects
    directory = all_gather_objects(tempfile.mkdtemp() if rank == 0 else None)[0]
    wrapped.save_checkpoint(directory)
    fresh = Regression()
    opt2 = adamw(fresh)
    wrapped2 = rannc.RaNNCModule(fresh, opt2, num_stages=2, num_microbatches=2, cost_model="analytic")
    wrapped2.load_checkpoint(directory)
    new_head(fresh)
    new_head(reference)
    for o in (opt2, ref_opt):
        for group in o.param_groups:
            group["lr"] = 2e-3
    for step in range(2):
        loss, ref_loss = wrapped2(x[mine], y[mine]), reference(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt2, ref_opt)
    assert opt2.param_groups[0]["lr"] == 2e-3
    same_stage_parameters(fresh, reference, rtol=1e-5)
    rannc.barrier()
    if rank == 0:
        shutil.rmtree(directory)
    print(f"OK rank {rank}", flush=True)
elif probe == "sparse_embedding":  # [Note: sparse gradients] in runtime/grad_buckets.cpp
    class Recommender(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = nn.Embedding(50, 8, sparse=True)
            self.mlp = nn.Sequential(nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, items, y):
            scores = self.mlp(self.items(items).flatten(1)).squeeze(-1)
            return nn.functional.binary_cross_entropy_with_logits(scores, y)

    def optimizers(m):
        return [torch.optim.SparseAdam(list(m.items.parameters()), lr=1e-2),
                torch.optim.Adam(m.mlp.parameters(), lr=1e-2)]

    # planned: one stage, two replicas; then two stages from profiles, whose update cost
    # SparseAdam's step over dense scratch gradients cannot time (the plan failed with
    # "SparseAdam does not support dense gradients": update_cost.py times its kind's)
    for stages in (0, 2):
        torch.manual_seed(0)
        model = Recommender()
        reference = copy.deepcopy(model)
        opts, ref_opts = optimizers(model), optimizers(reference)
        wrapped = rannc.RaNNCModule(model, opts, num_stages=stages,
                                    cost_model="profile" if stages else "analytic")
        for step in range(3):
            gen = torch.Generator().manual_seed(step)
            items = torch.randint(0, 50, (8, 3), generator=gen)
            y = (torch.rand(8, generator=gen) > 0.5).float()
            mine = slice(4 * rank, 4 * (rank + 1))
            loss, ref_loss = wrapped(items[mine], y[mine]), reference(items, y)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: step {step}: {m}")
            loss.backward()
            ref_loss.backward()
            grad = model.items.weight.grad
            assert grad is None if model.items.weight.numel() == 0 else grad.is_sparse
            for o in opts + ref_opts:
                o.step()
                o.zero_grad()
        assert wrapped.deployments["train"].num_stages == (stages or 1)
        same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "ema_state_dict":  # [Note: writes into a copy's state_dict] in copies.py
    class ModelEmaV2(nn.Module):  # timm.utils.model_ema.ModelEmaV2's update
        def __init__(self, model, decay=0.9):
            super().__init__()
            self.module, self.decay = copy.deepcopy(model), decay
            self.module.eval()

        def update(self, model):
            with torch.no_grad():
                for ema_v, model_v in zip(self.module.state_dict().values(),
                                          model.state_dict().values()):
                    ema_v.copy_(self.decay * ema_v + (1.0 - self.decay) * model_v)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, cost_model="analytic")
    ema, ref_ema = ModelEmaV2(wrapped), ModelEmaV2(reference)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    mine = slice(4 * rank, 4 * (rank + 1))
    for step in range(3):
        loss = nn.functional.mse_loss(wrapped(x[mine]), y[mine])
        step_both(loss, nn.functional.mse_loss(reference(x), y), opt, ref_opt)
        ema.update(wrapped)
        ref_ema.update(reference)
    got, expected = ema.module.state_dict(), ref_ema.module.state_dict()
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: EMA {key}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(ema.module(x[mine]), ref_ema.module(x)[mine], rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
elif probe == "mixed_dtypes":  # [Note: buckets of one dtype] in runtime/grad_buckets.cpp
    class PartlyBf16(nn.Module):  # the user cast the body to bf16 and kept the head in fp32
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 3)

        def forward(self, x, y):
            h = torch.relu(self.b(torch.relu(self.a(x.to(torch.bfloat16)))))
            return nn.functional.cross_entropy(self.head(h.float()), y)
    torch.manual_seed(0)
    model = PartlyBf16()
    model.a.to(torch.bfloat16)
    model.b.to(torch.bfloat16)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=1, num_microbatches=2, replicas="2",
                                cost_model="analytic")  # one stage, two replicas: all-reduced
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
        mine = slice(8 * rank, 8 * (rank + 1))
        wrapped(x[mine], y[mine]).backward()
        reference(x, y).backward()
        for name, p in model.named_parameters():
            assert p.grad.dtype == p.dtype, f"rank {rank}: {name} {p.dtype} has a {p.grad.dtype} gradient"
        opt.step()  # AdamW failed on a bf16 parameter with an fp32 gradient
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    same_stage_parameters(model, reference, rtol=2e-2, atol=2e-2)  # bf16 sums in another order
    print(f"OK rank {rank}", flush=True)
elif probe == "two_scalers":  # [Note: scaled seeds] in amp.py
    # the module's GradScaler and a later one of an auxiliary plain model: the module's
    # backward is seeded with its own scaler's scale, not the newest's (which overflowed
    # its fp16 gradients: every step skipped)
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.ln = nn.Linear(32, 64), nn.LayerNorm(64)
            self.l2, self.l3, self.l4 = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10)

        def forward(self, x, y):
            h = torch.relu(self.ln(self.l1(x)))
            h = torch.tanh(self.l3(torch.relu(self.l2(h))))
            return nn.functional.cross_entropy(self.l4(h), y)
    first = 2.0 ** 19  # this model's fp16 gradients overflow at 2^19 once, not at 2^18
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=first)
    scaler = torch.amp.GradScaler("cpu", init_scale=first)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2,
                                cost_model="analytic")
    aux = nn.Linear(8, 1)
    aux_opt = torch.optim.SGD(aux.parameters(), lr=0.01)
    aux_scaler = torch.amp.GradScaler("cpu", init_scale=first)  # fp32 model: never overflows
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = wrapped(x.chunk(2)[rank], y.chunk(2)[rank])
            ref_loss = reference(x, y)
        scaler.scale(loss).backward()
        ref_scaler.scale(ref_loss).backward()
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        opt.zero_grad()
        ref_opt.zero_grad()
        aux_scaler.scale(nn.functional.mse_loss(aux(torch.randn(4, 8)), torch.zeros(4, 1))).backward()
        aux_scaler.step(aux_opt)
        aux_scaler.update()
        aux_opt.zero_grad()
        assert scaler.get_scale() == ref_scaler.get_scale(), \
            f"rank {rank}: step {step}: scale {scaler.get_scale()}, PyTorch's {ref_scaler.get_scale()}"
    same_stage_parameters(model, reference, rtol=1e-2, atol=1e-3)  # fp16
    print(f"OK rank {rank}", flush=True)
elif probe == "stand_in_traces":  # [Note: stand-in parameters] in _trace.py
    # traces after the first (a new length, an eval call after training) stand in for the
    # parameters; they must read the model as the first trace did
    class Factorised(nn.Module):  # ALBERT's factorised embedding before attention
        def __init__(self):
            super().__init__()
            self.emb, self.proj = nn.Embedding(32, 8), nn.Linear(8, 16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.dec = nn.Linear(16, 32)

        def forward(self, ids, labels):
            h = self.proj(self.emb(ids))
            a, _ = self.attn(h, h, h, need_weights=False)
            return nn.functional.cross_entropy(self.dec(h + a).view(-1, 32), labels.view(-1))
    torch.manual_seed(0)
    model = Factorised()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=1, cost_model="analytic")
    mine = slice(4 * rank, 4 * (rank + 1))
    for step, length in enumerate((6, 5, 6)):
        gen = torch.Generator().manual_seed(step)
        ids, labels = torch.randint(0, 32, (8, length), generator=gen), torch.randint(0, 32, (8, length), generator=gen)
        loss, ref_loss = wrapped(ids[mine], labels[mine]), reference(ids, labels)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}, length {length}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids[mine], labels[mine]), reference(ids, labels),
                                   rtol=1e-5, atol=1e-6)
    print(f"OK rank {rank}", flush=True)
elif probe == "resume_late_optimizer":  # [Note: checkpoints of optimizers made after wrapping]
    import tempfile
    directory = os.path.join(tempfile.gettempdir(), f"rannc_resume_late_{os.getppid()}")

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                             nn.Linear(16, 1))

    def train(model, opt, steps, shard):
        for step in steps:
            gen = torch.Generator().manual_seed(step)
            x, y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)
            if shard:
                x, y = x[8 * rank:8 * (rank + 1)], y[8 * rank:8 * (rank + 1)]
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    # DDP's order: wrap, then build the optimizer over the wrapper's parameters
    first = rannc.RaNNCModule(make(), num_stages=2, cost_model="analytic")
    first_opt = torch.optim.AdamW(first.parameters(), lr=1e-2)
    train(first, first_opt, range(3), True)
    first.save_checkpoint(directory)
    resumed = rannc.RaNNCModule(make(), num_stages=2, cost_model="analytic")
    opt = torch.optim.AdamW(resumed.parameters(), lr=5e-2)  # the checkpoint's lr wins
    resumed.load_checkpoint(directory)
    train(resumed, opt, range(3, 6), True)
    reference = make()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, ref_opt, range(6), False)
    same_stage_parameters(resumed.module, reference, rtol=1e-5)
    steps = [float(s["step"]) for s in opt.state_dict()["state"].values()]
    assert steps and all(s == 6 for s in steps), f"rank {rank}: Adam's steps {steps}"
    print(f"OK rank {rank}", flush=True)
elif probe == "aliased_module":  # [Note: modules under several names] in _trace.py
    class Aliased(nn.Module):  # transformers 4's T5: one embedding under two names
        def __init__(self, tied):
            super().__init__()
            self.shared = nn.Embedding(32, 16)
            self.embed_tokens = self.shared
            self.body = nn.Linear(16, 16)
            self.head = nn.Linear(16, 32, bias=False)
            if tied:
                self.head.weight = self.shared.weight

        def forward(self, ids, labels):
            h = torch.tanh(self.body(self.embed_tokens(ids))) * 0.5
            return nn.functional.cross_entropy(self.head(h).view(-1, 32), labels.view(-1))
    for tied in (False, True):
        torch.manual_seed(0)
        model = Aliased(tied)
        reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, cost_model="analytic")
        for step, length in enumerate((6, 5, 6)):  # a new length: traced with stand-ins
            gen = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 32, (8, length), generator=gen)
            labels = torch.randint(0, 32, (8, length), generator=gen)
            mine = slice(4 * rank, 4 * (rank + 1))
            loss, ref_loss = wrapped(ids[mine], labels[mine]), reference(ids, labels)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: tied {tied}, step {step}: {m}")
            step_both(loss, ref_loss, opt, ref_opt)
        assert isinstance(model.shared.weight, nn.Parameter)
    print(f"OK rank {rank}", flush=True)
elif probe == "adagrad_after_eval":  # [Note: state made on freed parameters] in optimizer_share.py
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    reference = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, num_stages=2, cost_model="analytic")
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    mine = slice(8 * rank, 8 * (rank + 1))
    wrapped.eval()  # Trainer's evaluate() before train(): parameters freed where eval keeps none
    with torch.no_grad():
        wrapped(x[mine])
    wrapped.train()
    opt = torch.optim.Adagrad(wrapped.parameters(), lr=1e-2)  # its state is made here
    ref_opt = torch.optim.Adagrad(reference.parameters(), lr=1e-2)
    for step in range(3):
        step_both(nn.functional.mse_loss(wrapped(x[mine]), y[mine]),
                  nn.functional.mse_loss(reference(x), y), opt, ref_opt)
    # a rank keeps the eval stage's copies too, stale until the next eval call: compare the
    # gathered state
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(wrapped.state_dict()[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {name}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "caught_trace_error":  # [Note: trace errors agreed] in module.py
    class Untraceable(nn.Module):  # rows picked by an argument that is no batch
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, rows):
            return self.a(x)[rows].sum()
    bad = rannc.RaNNCModule(Untraceable())
    expect_error(lambda: bad(torch.randn(4, 4), torch.tensor([3, 2, 1, 0, 3])))
    # the script goes on with another model, which trains as PyTorch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, cost_model="analytic")
    x = torch.randn(8, 4)
    for step in range(2):
        step_both(wrapped(x[4 * rank:4 * (rank + 1)]).pow(2).mean(), reference(x).pow(2).mean(),
                  opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "shared_module":  # [Note: modules wrapped twice] in module.py
    class Task(nn.Module):
        def __init__(self, encoder, outputs):
            super().__init__()
            self.encoder, self.head = encoder, nn.Linear(16, outputs)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.head(self.encoder(x)), y)

    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
    first, second = Task(encoder, 1), Task(encoder, 2)
    reference = copy.deepcopy(first)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (first, reference))
    wrapped_first = rannc.RaNNCModule(first, opt, num_stages=2)
    wrapped_second = rannc.RaNNCModule(second, num_stages=2)
    g = torch.Generator().manual_seed(1)
    mine = slice(4 * rank, 4 * (rank + 1))
    for step in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        loss, ref_loss = wrapped_first(x[mine], y[mine]), reference(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
        if step == 0:
            expect_error(lambda: wrapped_second(x[mine], torch.zeros(4, 2)),
                         "shares 4 parameter(s) (encoder.0.weight, encoder.0.bias, "
                         "encoder.2.weight and 1 more)", "Wrap one module that holds both")
    same_stage_parameters(first, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "table_first":  # [Note: shared arguments agree] in deployed.py
    class Lookup(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = nn.Linear(8, 6), nn.Linear(6, 1)

        def forward(self, table, x, y):
            h = torch.tanh(self.enc(x))
            return nn.functional.mse_loss(self.head(h + torch.softmax(h @ table.t(), 1) @ table), y)

    class BatchFirst(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y, table):
            return self.inner(table, x, y)

    torch.manual_seed(0)
    table = torch.randn(5, 6, generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)
    mine = slice(4 * rank, 4 * (rank + 1))
    model = Lookup()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2)
    for _ in range(2):  # the same error each time
        expect_error(lambda: wrapped(table, x[mine], y[mine]),
                     "the ranks pass different values of args[1] [4, 8], args[2] [4, 1]",
                     "which are not rows of the batch (5 rows here", "Pass the batch's tensors first")
    reference, opt, ref_opt, wrapped = sgd_pair(BatchFirst(model), num_stages=2)
    for step in range(2):
        loss, ref_loss = wrapped(x[mine], y[mine], table), reference(x, y, table)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    print(f"OK rank {rank}", flush=True)
elif probe == "call_layouts":  # [Note: call layouts] in call_layout.py
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 4)

        def forward(self, x, y, scale=None, **extra):
            out = self.b(torch.tanh(self.a(x)))
            out = out if scale is None else out * scale
            for value in extra.values():  # the order of **extra matters: kept as passed
                out = out * 2 + value
            return nn.functional.mse_loss(out, y)

    torch.manual_seed(0)
    reference, opt, ref_opt, wrapped = sgd_pair(Scaled(), num_stages=2, num_microbatches=2)
    styles = [lambda x, y, s: ((x, y), {}), lambda x, y, s: ((), {"x": x, "y": y}),
              lambda x, y, s: ((), {"y": y, "x": x}), lambda x, y, s: ((x,), {"y": y}),
              lambda x, y, s: ((), {"scale": s, "y": y, "x": x}),
              lambda x, y, s: ((x, y, s), {})]
    for step, style in enumerate(styles):
        g = torch.Generator().manual_seed(step)
        x, y, s = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g), torch.rand(8, 1, generator=g)
        mine = slice(4 * rank, 4 * (rank + 1))
        args, kwargs = style(x[mine], y[mine], s[mine])
        loss = wrapped(*args, **kwargs)
        ref_args, ref_kwargs = style(x, y, s)
        ref_loss = reference(*ref_args, **ref_kwargs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    # one program for the calls without scale, one for those with it
    programs = list(wrapped._deployed_by_arguments)
    assert len(programs) == 1, programs
    same_stage_parameters(wrapped.module, reference, rtol=1e-5, wrapped=wrapped)
    # names only **extra takes keep their order: another order is another program
    g = torch.Generator().manual_seed(9)
    x, y, u, v = (torch.randn(8, 4, generator=g) for _ in range(4))
    mine = slice(4 * rank, 4 * (rank + 1))
    for order in (("u", "v"), ("v", "u")):
        extra = {"u": u, "v": v}
        loss = wrapped(x[mine], y[mine], **{k: extra[k][mine] for k in order})
        ref_loss = reference(x, y, **{k: extra[k] for k in order})
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: extra {order}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    assert len(wrapped._deployed_by_arguments) == 3, list(wrapped._deployed_by_arguments)
    print(f"PROGRAMS OF OTHER STRUCTURES {rank}", flush=True)  # no hint of a number up to here
    for scale in (0.5, 0.25):  # a number that changes: the fourth program draws the hint
        loss, ref_loss = wrapped(x[mine], y[mine], scale), reference(x, y, scale)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    print(f"OK rank {rank}", flush=True)
elif probe == "complex_values":  # an FFT layer: complex weights, gradients and boundaries
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.lift, self.head = nn.Linear(8, 8), nn.Linear(10, 1)
            self.w1 = nn.Parameter(torch.randn(5, 5, dtype=torch.cfloat) * 0.3)
            self.w2 = nn.Parameter(torch.randn(5, 5, dtype=torch.cfloat) * 0.3)

        def forward(self, x, y):
            z = torch.tanh(torch.fft.rfft(self.lift(x)) @ self.w1)  # [B, 5] complex
            z = z @ self.w2
            return nn.functional.mse_loss(self.head(torch.view_as_real(z).flatten(1)), y)

    for options in (dict(num_stages=2, num_microbatches=2), dict(num_stages=1)):
        torch.manual_seed(0)
        reference, opt, ref_opt, wrapped = sgd_pair(Spectral(), **options)
        steps_like_pytorch(wrapped, reference, opt, ref_opt, options)
        same_stage_parameters(wrapped.module, reference, rtol=1e-4, wrapped=wrapped)
        same_state(wrapped, reference, options, rtol=1e-4, atol=1e-5)  # complex tensors move
    print(f"OK rank {rank}", flush=True)
elif probe == "preempted":  # a preemption handler's sys.exit inside a call
    import signal
    import threading

    def preempted(signum, frame):
        raise SystemExit("preempted")

    if rank == 0:
        signal.signal(signal.SIGTERM, preempted)
    model, args, _ = zoo.make("mlp", batch=4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, comm_timeout=60)
    train(wrapped, opt, args)
    began = time.time()
    try:
        if rank == 1:
            time.sleep(6)  # rank 0 waits for this rank inside its call when the signal comes
        else:
            threading.Timer(1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        train(wrapped, opt, args)
        raise AssertionError("the call went through")
    except SystemExit as e:  # raised while waiting ([Note: signals while waiting])
        assert rank == 0 and str(e) == "preempted", (rank, e)
        assert time.time() - began < 4, time.time() - began
        print(f"OK rank {rank}", flush=True)
        time.sleep(8)  # until rank 1 learnt of it (this rank's exit ends the job)
        sys.exit(0)
    except rannc.CommError as e:  # told at once, not after comm_timeout
        assert rank == 1 and "rank 0 stopped by a signal in " in str(e) and \
            "SystemExit: preempted" in str(e), e
        assert time.time() - began < 30, time.time() - began
    print(f"OK rank {rank}", flush=True)
elif probe == "state_before_step":  # [Note: a step is a collective] in optimizer_share.py
    torch.manual_seed(0)
    model = zoo.MLP(dropout=0.0)
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    for step in range(3):
        (whole, mine) = global_batch("mlp", seed=step)
        loss, ref_loss = wrapped(*mine), reference(*whole)
        loss.backward()
        ref_loss.backward()
        if rank == 0:  # a log or a checkpoint of the state before the update, on rank 0 alone
            state = wrapped.state_dict()
            for k, v in reference.state_dict().items():
                torch.testing.assert_close(state[k], v, msg=lambda m: f"step {step}: {k}: {m}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "eval_before_step":  # eval between backward and step, on another rank's layers
    torch.manual_seed(0)
    model = FrozenFirst()
    model.layers[4:8].requires_grad_(True)  # training's first stage ends at layer 7, eval's at 5
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)
                    for m in (model, reference))
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, profile_fake_timer=True,
                                probe_bandwidth=False)
    rows = slice(16 * rank, 16 * (rank + 1))
    x_eval = torch.randn(32, 2, 512, generator=torch.Generator().manual_seed(99))

    def same_eval(what):
        for m in (wrapped, reference):
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(wrapped(x_eval[rows]), reference(x_eval), rtol=1e-4,
                                       atol=1e-6, msg=lambda m: f"rank {rank}: {what}: {m}")
        for m in (wrapped, reference):
            m.train()

    for step in range(3):
        x = torch.randn(32, 2, 512, generator=torch.Generator().manual_seed(step))
        loss, ref_loss = wrapped(x[rows]), reference(x)
        loss.backward()
        ref_loss.backward()
        same_eval(f"before step {step}")  # evaluation under gradient accumulation
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        same_eval(f"after step {step}")  # it ran on the weights before the step
        same_state(wrapped, reference, f"state_dict() after step {step}")
    trained_first = [i for i, users in enumerate(wrapped.placement._users[True]) if 0 in users]
    evaluated_first = [i for i, users in enumerate(wrapped.placement._users[False]) if 0 in users]
    assert set(trained_first) > set(evaluated_first), (trained_first, evaluated_first)
    print(f"OK rank {rank}", flush=True)
elif probe == "assigned_after_call":  # [Note: tensors assigned after the first call] in placement.py
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
            self.register_buffer("scale", torch.ones(()))

        def forward(self, x, y):
            h = torch.tanh(self.b(torch.tanh(self.a(x)))) * self.scale
            return nn.functional.mse_loss(self.head(h), y)

    torch.manual_seed(0)
    model = Scaled()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    steps_like_pytorch(wrapped, reference, opt, ref_opt, "before", steps=1)
    held = (model.scale, model.head.bias, model.head)
    attempts = [
        (lambda: setattr(model, "scale", torch.tensor(3.0)), "buffer 'scale'", "assigned a new buffer"),
        (lambda: setattr(model.head, "bias", nn.Parameter(torch.zeros(1))),
         "parameter 'head.bias'", "model.module.head.bias.copy_(value)"),
        (lambda: setattr(model, "head", nn.Linear(16, 1)), "submodule 'head'", "reset_parameters()"),
        (lambda: model.b.register_buffer("mask", torch.ones(16)), "buffer 'b.mask'",
         "registered as a new buffer", "register it before wrapping")]
    for attempt, *said in attempts:
        expect_error(attempt, *said, "after the RaNNCModule's first call")
    assert (model.scale, model.head.bias, model.head) == held and "mask" not in model.b._buffers
    for m in (model, reference):  # the cure: in place
        with torch.no_grad():
            m.scale.fill_(3.0)
            m.head.reset_parameters() if m is reference else None
    with torch.no_grad():  # the same re-initialised head on both
        for p, q in zip(model.head.parameters(), reference.head.parameters()):
            if p.numel():
                p.copy_(q)
    same_state(wrapped, reference, "after the writes in place")
    steps_like_pytorch(wrapped, reference, opt, ref_opt, "after", steps=2, seed=1)
    same_state(wrapped, reference, "after training on")
    print(f"OK rank {rank}", flush=True)
elif probe == "named_backward":  # [Note: backward of named parameters] in named_backward.py
    torch.manual_seed(0)
    model = zoo.MLP(dropout=0.0)
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    first, last = list(model.parameters())[0], list(model.parameters())[-1]
    ref_first, ref_last = list(reference.parameters())[0], list(reference.parameters())[-1]
    for step in range(3):
        (whole, mine) = global_batch("mlp", seed=step)
        x, ref_x = mine[0].clone().requires_grad_(), whole[0].clone().requires_grad_()
        loss, ref_loss = wrapped(x, *mine[1:]), reference(ref_x, *whole[1:])
        # one part trained at a time, and the input's gradient beside it
        named = [first, last, x] if step % 2 == 0 else [last]
        loss.backward(inputs=named)
        ref_loss.backward(inputs=[ref_first, ref_last, ref_x] if step % 2 == 0 else [ref_last])
        for p, q in zip(model.parameters(), reference.parameters()):
            if p.numel():
                assert (p.grad is None) == (q.grad is None), f"rank {rank} step {step}"
        if step % 2 == 0:
            # [Note: input gradients]: world times its rows of the global one
            torch.testing.assert_close(x.grad, 2 * ref_x.grad[4 * rank:4 * (rank + 1)])
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    same_stage_parameters(model, reference, rtol=1e-5)
    same_state(wrapped, reference, "after steps of named parameters")
    print(f"OK rank {rank}", flush=True)
elif probe == "outputs_without_rows":  # [Note: outputs without rows] in deployed.py
    class MultiTask(nn.Module):
        def __init__(self, only_tasks):
            super().__init__()
            self.only_tasks = only_tasks
            self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 16)
            self.a, self.b = nn.Linear(16, 1), nn.Linear(16, 3)

        def forward(self, x, y, c):
            h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
            logits = self.b(h)
            tasks = torch.stack([nn.functional.mse_loss(self.a(h).squeeze(1), y),
                                 nn.functional.cross_entropy(logits, c)])
            if self.only_tasks:  # the caller sums them: a fill-drain backward through it
                return tasks
            confusion = nn.functional.one_hot(c, 3).float().t() @ nn.functional.one_hot(
                logits.argmax(-1), 3).float()
            return {"loss": tasks.sum(), "tasks": tasks, "feature_mean": h.mean(0),
                    "confusion": confusion}

    for only_tasks in (False, True):
        torch.manual_seed(0)
        model = MultiTask(only_tasks)
        reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y, c = torch.randn(8, 8, generator=g), torch.randn(8, generator=g), torch.randint(0, 3, (8,), generator=g)
            mine = slice(4 * rank, 4 * (rank + 1))
            out, ref_out = wrapped(x[mine], y[mine], c[mine]), reference(x, y, c)
            if only_tasks:
                torch.testing.assert_close(out, ref_out, msg=lambda m: f"rank {rank} step {step}: {m}")
                step_both(out.sum(), ref_out.sum(), opt, ref_opt)
                continue
            for k in ("tasks", "feature_mean", "confusion"):  # the whole batch's, on every rank
                torch.testing.assert_close(out[k], ref_out[k], msg=lambda m: f"rank {rank} {k}: {m}")
            step_both(out["loss"], ref_out["loss"], opt, ref_opt)
        same_state(wrapped, reference, f"only_tasks={only_tasks}")
    print(f"OK rank {rank}", flush=True)
elif probe == "grad_in_place":  # .grad takes what PyTorch's takes
    torch.manual_seed(0)
    model = zoo.MLP(dropout=0.0)
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=1, num_microbatches=2)
    for step in range(3):
        (whole, mine) = global_batch("mlp", seed=step)
        loss, ref_loss = wrapped(*mine), reference(*whole)
        loss.backward()
        ref_loss.backward()
        for m in (model, reference):
            for p in m.parameters():
                if p.grad is None:
                    continue
                if step == 0:  # weight decay by hand, outside no_grad: .grad gets history
                    p.grad.add_(p, alpha=0.01)
                else:  # zero_grad as apex and torch before 1.7 wrote it
                    p.grad.detach_()
                    p.grad.mul_(0.5)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "stashed_buffer":  # [Note: buffers a stashed backward reads] in runtime/stage.cpp
    class WeightScaled(nn.Module):
        """A buffer written in place in forward, then read by a differentiable op (which
        saves it for backward): a scale kept from the first layer's weight."""

        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
            self.register_buffer("scale", torch.ones(()))

        def forward(self, x, y):
            with torch.no_grad():
                self.scale.copy_(self.a.weight.abs().max())
            h = torch.relu(self.a(x)) / self.scale
            return nn.functional.mse_loss(self.c(torch.tanh(self.b(h))), y)

    for schedule in ("1f1b", "fill_drain"):
        torch.manual_seed(0)
        reference, opt, ref_opt, wrapped = sgd_pair(WeightScaled(), num_stages=2,
                                                    num_microbatches=2, schedule=schedule)
        steps_like_pytorch(wrapped, reference, opt, ref_opt, schedule)
        same_state(wrapped, reference, schedule)
    print(f"OK rank {rank}", flush=True)
elif probe == "fused_fake_quant":  # quantization-aware training's fused observers
    import torch.ao.quantization as quantization

    class Quantized(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
            self.qa = quantization.FusedMovingAvgObsFakeQuantize()
            self.qb = quantization.FusedMovingAvgObsFakeQuantize()

        def forward(self, x, y):
            h = self.qb(torch.relu(self.b(self.qa(torch.relu(self.a(x))))))
            return nn.functional.mse_loss(self.c(h), y)

    class Tutorial(nn.Module):  # eager-mode QAT as PyTorch's tutorial prepares it
        def __init__(self):
            super().__init__()
            self.quant, self.dequant = quantization.QuantStub(), quantization.DeQuantStub()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

        def forward(self, x, y):
            h = torch.relu(self.b(torch.relu(self.a(self.quant(x)))))
            return nn.functional.mse_loss(self.dequant(self.c(h)), y)

    def prepared(first_call=True):
        model = Tutorial()
        model.qconfig = quantization.get_default_qat_qconfig("fbgemm")
        model = quantization.prepare_qat(model.train())
        if first_call:  # its per-channel observers size their ranges at their first call
            model(torch.randn(4, 8, generator=torch.Generator().manual_seed(7)), torch.zeros(4, 1))
        return model

    # traced before that first call, the size they decide on is fixed for every step
    expect_error(lambda: rannc.RaNNCModule(prepared(first_call=False), num_stages=2)(
        torch.randn(4, 8), torch.randn(4, 1)), "reads the size of", "per-channel observer",
        kinds=(rannc.TraceError,))

    # whether rows read as coupled depended on each rank's data; the tutorial's per-channel
    # weight observers size their buffers at their first call (state_dict() then failed)
    for seed, make in ((0, Quantized), (1, Quantized), (2, Quantized), (3, prepared)):
        torch.manual_seed(seed)
        reference, opt, ref_opt, wrapped = sgd_pair(make(), num_stages=2, num_microbatches=1)
        steps_like_pytorch(wrapped, reference, opt, ref_opt, f"seed {seed}", seed=10 * seed)
        same_state(wrapped, reference, f"seed {seed}", rtol=1e-4, atol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "qat_resume":  # [Note: modules that resize their state at a load]
    import shutil
    import tempfile

    import torch.ao.quantization as quantization
    from rannc.transport import all_gather_objects

    class PerChannel(nn.Module):  # FakeQuantize over a per-channel moving-average observer
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)
            self.q = quantization.FakeQuantize(
                observer=quantization.MovingAveragePerChannelMinMaxObserver, quant_min=0,
                quant_max=255, ch_axis=1)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.b(self.q(torch.relu(self.a(x)))), y)

    def first_called(model):  # its observer sizes its range at its first call
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(7)), torch.zeros(4, 1))
        return model

    # its resize_ of the range to the size it has was a constant in the trace: a TraceError
    # at every first call ([Note: resizes to the same size] in _trace.py)
    torch.manual_seed(0)
    reference, opt, ref_opt, wrapped = sgd_pair(first_called(PerChannel()), num_stages=2,
                                                num_microbatches=1)
    steps_like_pytorch(wrapped, reference, opt, ref_opt, "per-channel QAT")
    same_state(wrapped, reference, "per-channel QAT", rtol=1e-4, atol=1e-5)
    directory = all_gather_objects(tempfile.mkdtemp() if rank == 0 else None)[0]
    wrapped.save_checkpoint(directory)
    # resumed into a model never called: its scale [1] and empty range take the checkpoint's
    # sizes, as its own _load_from_state_dict does ("size mismatch" before)
    torch.manual_seed(1)
    fresh = PerChannel()
    assert fresh.q.activation_post_process.min_val.numel() == 0
    resumed_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    resumed = rannc.RaNNCModule(fresh, resumed_opt, num_stages=2, num_microbatches=1)
    resumed.load_checkpoint(directory)
    steps_like_pytorch(resumed, reference, resumed_opt, ref_opt, "resumed QAT", seed=5)
    same_state(resumed, reference, "resumed QAT", rtol=1e-4, atol=1e-5)
    if rank == 0:
        shutil.rmtree(directory)
    print(f"OK rank {rank}", flush=True)
elif probe == "embeds_outside":  # [Note: gradients made outside] in optimizer_share.py
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.a, self.b = nn.Embedding(12, 8), nn.Linear(8, 16), nn.Linear(16, 3)

        def forward(self, embeds, y):
            return nn.functional.cross_entropy(self.b(torch.tanh(self.a(embeds))).mean(1), y)

    torch.manual_seed(0)
    reference, opt, ref_opt, wrapped = sgd_pair(Classifier(), num_stages=2, num_microbatches=2)
    mine = slice(4 * rank, 4 * (rank + 1))
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids, y = torch.randint(0, 12, (8, 4), generator=g), torch.randint(0, 3, (8,), generator=g)
        embeds = wrapped.module.emb(ids[mine])
        loss, ref_loss = wrapped(embeds, y[mine]), reference(reference.emb(ids), y)
        # a penalty every rank computes alike on the same weight: whole on each rank
        loss, ref_loss = (l + 0.01 * m.emb.weight.pow(2).sum()
                          for l, m in ((loss, wrapped.module), (ref_loss, reference)))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        loss.backward()
        ref_loss.backward()
        # clipping counts and scales the embedding's gradient, averaged first
        norms = [torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                 for m in (wrapped.module, reference)]
        torch.testing.assert_close(norms[0], norms[1], rtol=1e-5, atol=1e-6)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        same_stage_parameters(wrapped.module, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "skipped_backward":  # [Note: named collectives] in handshake.py
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=2, num_microbatches=2, comm_timeout=60)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    def step():
        nn.functional.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad()

    step()
    said = ("a fill-drain backward on rank 0; a training call on rank 1",)
    out = wrapped(x)
    start = time.time()
    if rank == 0:
        expect_error(lambda: nn.functional.mse_loss(out, y).backward(), *said)
    else:  # skips that backward: its next call meets rank 0's backward
        expect_error(lambda: wrapped(x), *said)
    assert time.time() - start < 30, time.time() - start  # not comm_timeout
    del out
    opt.zero_grad()
    step()
    print(f"OK rank {rank}", flush=True)
elif probe == "queue_alike":  # [Note: rows alike on every rank] in deployed.py
    class Queue(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(8, 6)

        def forward(self, x, queue):
            q = nn.functional.normalize(torch.tanh(self.enc(x)), dim=1)
            logits = torch.cat([q.sum(1, keepdim=True), q @ queue.t()], 1)
            return nn.functional.cross_entropy(logits, torch.zeros(x.shape[0], dtype=torch.long))

    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 8, generator=g)
    mine = slice(4 * rank, 4 * (rank + 1))
    for size in (4, 5):  # 4: the local batch's rows (warned); 5: shared
        torch.manual_seed(0)
        queue = torch.randn(size, 6, generator=torch.Generator().manual_seed(5))
        reference, opt, ref_opt, wrapped = sgd_pair(Queue(), num_stages=2)
        loss, ref_loss = wrapped(x[mine], queue), reference(x, queue)
        if size == 5:
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        step_both(loss, ref_loss, opt, ref_opt)
    print(f"OK rank {rank}", flush=True)
elif probe == "ndim_groups":  # [Note: freed tensors keep their dimensions] in placement.py
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.norm, self.b = nn.Linear(4, 16), nn.LayerNorm(16), nn.Linear(16, 16)
            self.c = nn.Linear(16, 1)

        def forward(self, x, y):
            h = torch.tanh(self.b(self.norm(torch.tanh(self.a(x)))))
            return nn.functional.mse_loss(self.c(h), y)

    def groups(model):  # nanoGPT's configure_optimizers
        params = [p for p in model.parameters() if p.requires_grad]
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    wrapped = rannc.RaNNCModule(model, num_stages=2)
    g = torch.Generator().manual_seed(3)
    mine = slice(4 * rank, 4 * (rank + 1))
    opt = ref_opt = None
    for step in range(4):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        loss, ref_loss = wrapped(x[mine], y[mine]), reference(x, y)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        loss.backward()
        ref_loss.backward()
        if opt is None:  # after the first call: this rank's stages hold their tensors only
            opt = torch.optim.AdamW(groups(model), lr=1e-2, eps=1e-5)
            ref_opt = torch.optim.AdamW(groups(reference), lr=1e-2, eps=1e-5)
            assert [len(g["params"]) for g in opt.param_groups] == \
                [len(g["params"]) for g in ref_opt.param_groups], opt.param_groups
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        same_stage_parameters(model, reference, rtol=1e-5)
    gathered, ref_state = wrapped.optimizer_state_dict(), ref_opt.state_dict()
    assert [g["params"] for g in gathered["param_groups"]] == \
        [g["params"] for g in ref_state["param_groups"]], gathered["param_groups"]
    assert gathered["state"].keys() == ref_state["state"].keys()
    for i, s in ref_state["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(gathered["state"][i][k], s[k], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: state {i} {k}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "rank0_weights":  # [Note: rank 0's weights] in placement.py
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 16)
            self.norm, self.c = nn.LayerNorm(16), nn.Linear(16, 1)

        def forward(self, x, y):
            h = torch.tanh(self.b(torch.tanh(self.a(x))))
            return nn.functional.mse_loss(self.c(self.norm(h)), y)

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
    mine = slice(8 * rank, 8 * (rank + 1))
    for layout, loaded in (({"num_stages": 2}, False), ({"num_stages": 1}, False),
                           ({"num_stages": 2}, True)):
        torch.manual_seed(0)
        reference = Net()  # rank 0's model
        # each rank its own seed before building, as timm's scripts do (seed 0 on rank 0)
        torch.manual_seed(100 * loaded + rank)
        model = Net()
        if loaded and rank == 0:  # pretrained weights read on rank 0 alone
            model.load_state_dict(reference.state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        wrapped = rannc.RaNNCModule(model, opt, **layout)
        for step in range(3):
            loss, ref_loss = wrapped(x[mine], y[mine]), reference(x, y)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {layout} step {step}: {m}")
            step_both(loss, ref_loss, opt, ref_opt)
        state = wrapped.state_dict()
        for k, v in reference.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: {layout} {k}: {m}")
    print(f"OK rank {rank}", flush=True)
elif probe == "first_token":  # [Note: programs at other shapes] in module.py
    import torch.nn.functional as F

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 16)
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.out = nn.Linear(16, 11)

        def forward(self, tokens, targets=None):
            h = self.embed(tokens)
            causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
            logits = self.out(h + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0])
            return logits if targets is None else F.cross_entropy(logits.flatten(0, 1),
                                                                  targets.flatten())

    torch.manual_seed(0)
    model = Decoder().eval()
    prompt = torch.randint(0, 11, (8, 5), generator=torch.Generator().manual_seed(2))
    mine = slice(4 * rank, 4 * (rank + 1))
    from_one = rannc.RaNNCModule(copy.deepcopy(model), num_stages=2, cost_model="analytic").eval()
    with torch.no_grad():
        # length 1 traces nn.MultiheadAttention's projections otherwise: length 2 is another
        # program, planned on its own; 3 and 4 run its plan
        for length in (1, 2, 3, 4):
            torch.testing.assert_close(from_one(prompt[mine, :length]),
                                       model(prompt[:, :length])[mine], rtol=1e-5, atol=1e-6)
    programs = [key for key in from_one._deployed_by_arguments if key[1][1] == "input shapes"]
    assert len(programs) == 1, from_one._deployed_by_arguments.keys()
    # training at lengths of both programs: each step's gradients reach the parameters'
    # trainers, and the weights each program runs are current
    # (SGD: the key projection's bias has a gradient of 0 up to rounding, which Adam turns
    # into steps of lr)
    reference, opt, ref_opt, wrapped = sgd_pair(model.train(), num_stages=2, num_microbatches=2)
    for step, length in enumerate((1, 3, 1, 2)):
        tokens, targets = prompt[:, :length], prompt[:, 1:length + 1]
        loss, ref_loss = wrapped(tokens[mine], targets[mine]), reference(tokens, targets)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
        same_stage_parameters(model, reference, rtol=1e-5, wrapped=wrapped)
    with torch.no_grad():
        wrapped.eval()
        reference.eval()
        torch.testing.assert_close(wrapped(prompt[mine, :4]), reference(prompt[:, :4])[mine],
                                   rtol=1e-5, atol=1e-5)
        wrapped.train()
    state = wrapped.state_dict()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-5)
    with wrapped.no_sync():  # its gradients are routed only once summed
        expect_error(lambda: wrapped(prompt[mine, :3], prompt[mine, 1:4]), "under no_sync()")
    print(f"OK rank {rank}", flush=True)
elif probe == "optional_tensors":
    import torch.nn.utils.parametrize as parametrize

    class Optional(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.e = nn.Linear(8, 16), nn.Linear(16, 3), nn.Linear(4, 16)
            torch.nn.utils.parametrizations.orthogonal(self.a)

        def forward(self, x, y, extra=None, temperature=1.0):
            with parametrize.cached():  # [Note: cached parametrizations] in _trace.py
                h = torch.tanh(self.a(x) + self.a(x).flip(-1))
            if extra is not None:
                h = h + self.e(extra)
            return nn.functional.cross_entropy(self.b(h) / temperature, y)

    torch.manual_seed(0)
    model = Optional()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2,
                                                cost_model="analytic")
    mine = slice(4 * rank, 4 * (rank + 1))
    gen = torch.Generator().manual_seed(1)
    # an optional tensor, then None (was taken for the traced program at new shapes: "the
    # model is another program than the one planned"); a 0-dim tensor, then a number
    for extra, temperature in ((True, 1.0), (False, 1.0), (True, torch.tensor(2.0)),
                               (True, 2.0), (False, 1.0)):
        x, e = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
        y = torch.randint(0, 3, (8,), generator=gen)
        with parametrize.cached():  # as torch documents it, around the call
            loss = wrapped(x[mine], y[mine], e[mine] if extra else None, temperature)
        ref_loss = reference(x, y, e if extra else None, temperature)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "lazy_cache":  # [Note: tracing changes no attribute] in _trace.py
    class Positions(nn.Module):
        def __init__(self):
            super().__init__()
            self.table, self.cached = None, 0

        def forward(self, x):  # x: (batch, tokens, 8)
            tokens = x.shape[1]
            if self.table is None or self.cached < tokens:
                self.table = torch.sin(torch.arange(tokens)[:, None] / (1 + torch.arange(8)))
                self.cached = tokens
            return x + self.table[:tokens]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos, self.a, self.b = Positions(), nn.Linear(8, 16), nn.Linear(16, 8)
            self.aux = None

        def forward(self, x):
            h = torch.tanh(self.a(self.pos(x)))
            self.aux = h.pow(2).mean()  # left for the loop; rannc's steps set no attribute
            return nn.functional.mse_loss(self.b(h), x)

    torch.manual_seed(0)
    model = Net()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2,
                                                cost_model="analytic")
    mine = slice(4 * rank, 4 * (rank + 1))
    for step, tokens in enumerate((4, 4, 6, 4, 6)):
        x = torch.randn(8, tokens, 8, generator=torch.Generator().manual_seed(step))
        loss, ref_loss = wrapped(x[mine]), reference(x)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    # tracing left the module as the call found it: the steps set no attribute
    assert model.pos.table is None and model.pos.cached == 0 and model.aux is None, \
        (model.pos.cached, model.aux)
    print(f"OK rank {rank}", flush=True)
elif probe == "caught_bad_batch":  # [Note: trace errors agreed] in module.py
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 16), nn.Linear(16, 3)

        def forward(self, x, y):  # x: (batch, tokens, 4)
            return nn.functional.cross_entropy(self.b(torch.tanh(self.a(x)).mean(1)), y)

    def skipped(call, *fragments):
        """The call fails on this rank, as the loop expects of a bad batch: torch's own
        errors (the model's) or rannc.Error."""
        return expect_error(call, *fragments, kinds=(RuntimeError, IndexError))

    torch.manual_seed(0)
    model = Classifier()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2,
                                                cost_model="analytic")
    mine = slice(4 * rank, 4 * (rank + 1))
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 2, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
    # the first call: rank 1's labels are int32, which cross_entropy refuses (in PyTorch too)
    labels = y[mine].int() if rank == 1 else y[mine]
    skipped(lambda: wrapped(x[mine], labels),
            *(["expected target dtype"] if rank == 1 else ["tracing the model failed on rank 1"]))
    for step in range(6):
        tokens = 3 if step == 2 else 2
        x, y = torch.randn(8, tokens, 4, generator=gen), torch.randint(0, 3, (8,), generator=gen)
        if step == 1:  # a malformed batch at a new shape, traced again: fails on every rank
            skipped(lambda: wrapped(torch.randn(4, 2, 5), y[mine]), "cannot be multiplied",
                    "while tracing the model again for new input shapes")
        if step == 2:  # a new length whose first batch fails by its values (rank 1's label
            # out of range): the next batch of that length traces and trains
            bad = y[mine].clone()
            bad[0] = 7 if rank == 1 else bad[0]
            skipped(lambda: wrapped(x[mine], bad),
                    "out of bounds" if rank == 1 else "tracing the model failed on rank 1")
        if step == 4:  # an empty batch: too few rows for the plan, on every rank
            skipped(lambda: wrapped(x[:0], y[:0]), "is too small for this plan")
        step_both(wrapped(x[mine], y[mine]), reference(x, y), opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
elif probe == "draws_in_forward":  # [Note: random values] in csrc/frontend/convert.cpp
    import torch.distributed as dist

    class Guided(nn.Module):
        """Classifier-free guidance's label dropout and a timestep drawn in forward, both
        returned; the reference is given the draws of every rank."""

        def __init__(self):
            super().__init__()
            self.emb, self.a, self.b = nn.Embedding(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y, drop=None, t=None):
            n = x.shape[0]
            drop = torch.rand(n) < 0.3 if drop is None else drop
            y = torch.where(drop, torch.full_like(y, 5), y)
            t = (torch.rand(n) * 100).long() if t is None else t
            h = self.b(torch.tanh(self.a(x * (t[:, None].float() / 100)) + self.emb(y)))
            return nn.functional.mse_loss(h, x), drop, t

    rannc.init_process_group()
    torch.manual_seed(0)
    model = Guided()
    reference, opt, ref_opt, wrapped = sgd_pair(model, num_stages=2, num_microbatches=2)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 5, (8,), generator=gen)
        mine = slice(4 * rank, 4 * (rank + 1))
        torch.manual_seed(100 * step + rank)  # each rank its own draws, as the docs advise
        loss, drop, t = wrapped(x[mine], y[mine])
        assert drop.shape == (4,) and t.shape == (4,), (drop.shape, t.shape)
        drops, ts = [torch.empty_like(drop) for _ in range(2)], [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(drops, drop)
        dist.all_gather(ts, t)
        ref_loss, _, _ = reference(x, y, torch.cat(drops), torch.cat(ts))
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"rank {rank}: step {step}: {m}")
        step_both(loss, ref_loss, opt, ref_opt)
    same_stage_parameters(model, reference, rtol=1e-5)
    print(f"OK rank {rank}", flush=True)
else:
    raise SystemExit(f"unknown probe {probe}")
