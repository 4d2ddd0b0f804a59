"""Trains a zoo model with RaNNCModule on every rank and compares, step by step, with
plain PyTorch on the concatenated global batch: loss, this rank's gradients and
parameters after each Adam step, batch-shaped outputs (this rank's rows), and at the end
eval()/no_grad outputs. Exits non-zero on the first mismatch (on every rank).

    train_check.py MODEL --stages S --micro M [--steps N] [--mode plain|accum|scale2]
                   [--eval] [--rows R1,R2,..] [--input-grad] [--opt key=value ...]

    accum: gradients accumulated over two forward/backward calls before each step
    scale2: (2 * loss).backward()
    outside: the loss is computed outside the model from its outputs (fill-drain with
             gradients from outside; the reference is the same loss on the global batch)
    outside_accum: both
    accum_no_sync, outside_accum_no_sync: the first call of each step inside
             wrapped.no_sync() (DDP's gradient accumulation idiom): its gradients stay each
             rank's own share (checked where a stage has replicas), and the second call sums
             them with its own
    --rows: the local batch of each step (cycled; default 4), e.g. 4,4,2 for the short last
            batch of an epoch
    --lengths: the sequence length of each step (cycled), e.g. 8,5,12 for dynamic padding
    --input-grad: the floating arguments require grad; their gradients equal the
            reference's (this rank's rows times the ranks, as DDP's for a mean loss over the
            rank's rows, [Note: input gradients] in csrc/runtime/engine.h; or the whole
            gradient of a tensor without a batch)
    --amp bf16|fp16: both run under torch.autocast(device, dtype) (fp16 with loss scaling:
            rannc.GradScaler, the reference torch's), compared within that precision
    --clip NORM: clip_grad_norm(NORM, scaler=...) against PyTorch's unscale_ + clip_grad_norm_
    --scaler torch: fp16 on rannc's side with torch.amp.GradScaler, not rannc.GradScaler
            (`import rannc` makes torch's agree across the ranks, [Note: agreed steps])
    --clip-by torch|torch_subset: clip with torch.nn.utils.clip_grad_norm_ on rannc's side
    --clip-by total_norm: with torch.nn.utils.get_total_norm and clip_grads_with_norm_
    --clip-by filtered: fairseq's clip_grad_norm_([p for p in params if p.grad is not None])
        and each top-level child's norm logged with get_total_norm over the gradients it has
        here: a freed parameter has none, so each rank's lists differ ([Note: the
        parameters meant] in clipping.py)
    --clip-by groups: two param groups, the first one parameter of the first stage (the
        others' share of it is empty), each clipped by its own norm with clip_grad_norm_
            too (after unscale_ with a scaler), over model.parameters() or over every other
            parameter by name (a subset that spans the stages); the norm is the model's
    --show-stages: rank 0 prints the ops of each stage ("stage 0 ops: aten::linear,...")
    --inject-inf STEP: at STEP the gradient of the model's last parameter (on the last
            stage only) overflows: every rank skips that step and halves its scale
"""
import argparse
import contextlib
import copy
import sys

import torch
import torch.utils._pytree as pytree

import rannc
import zoo

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--stages", type=int, default=0)
ap.add_argument("--micro", type=int, default=0)
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--mode", default="plain", choices=["plain", "accum", "scale2", "outside", "outside_accum", "accum_no_sync", "outside_accum_no_sync"])
ap.add_argument("--eval", action="store_true")
ap.add_argument("--opt", nargs="*", default=[])
ap.add_argument("--rows", default="4", help="local batch per step, cycled")
ap.add_argument("--lengths", default="", help="sequence length per step, cycled (default the model's)")
ap.add_argument("--input-grad", action="store_true")
ap.add_argument("--amp", default="", choices=["", "bf16", "fp16"])
ap.add_argument("--inject-inf", type=int, default=-1)
ap.add_argument("--clip", type=float, default=0.0, help="clip the gradients' global norm")
ap.add_argument("--scaler", default="rannc", choices=["rannc", "torch"])
ap.add_argument("--clip-by", default="rannc", choices=["rannc", "torch", "torch_subset", "total_norm", "groups",
                                                  "filtered"])
ap.add_argument("--show-stages", action="store_true", help="rank 0 prints each stage's ops")
a = ap.parse_args()
options = dict(o.split("=", 1) for o in a.opt)
rank, world = rannc.get_rank(), rannc.get_world_size()
torch.set_num_threads(1)
zoo.full_fp32()  # GPU stages compute in full float32 (no TF32), like the reference

local_batch = 4
global_batch = local_batch * world
model, _, _ = zoo.make(a.model, batch=global_batch, seed=0)
zoo.no_dropout(model)  # dropout masks cannot match a single process
reference = copy.deepcopy(model)
if a.amp:  # Adam would turn bf16/fp16 rounding noise in near-zero gradients into full steps
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
elif a.clip_by == "groups":  # [Note: clipping a param group]
    def two_groups(m):
        named = list(m.named_parameters())
        return [{"params": [named[1][1]]}, {"params": [p for _, p in named[:1] + named[2:]]}]
    ref_opt = torch.optim.Adam(two_groups(reference), lr=1e-2, eps=1e-5)
    opt = torch.optim.Adam(two_groups(model), lr=1e-2, eps=1e-5)
else:
    # eps well above float noise: some gradients are exactly zero in exact arithmetic (the
    # key bias of attention), and Adam would turn their rounding noise into full-size steps.
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-5)
wrapped = rannc.RaNNCModule(model, opt, num_stages=a.stages, num_microbatches=a.micro, **options)
batches = zoo.Batches(a.model, world, rank)
step_rows = [int(r) for r in a.rows.split(",")]
step_lengths = [int(n) for n in a.lengths.split(",")] if a.lengths else []
loss_of = zoo.loss_of


def local(x):
    """This rank's rows of a batch-shaped output of the reference."""
    return batches.rows(x)


# Low precision: the same ops in the same dtype, but each micro-batch's matmul rounds on
# its own, where the reference rounds the whole batch once: a few elements differ by an
# ulp of bf16/fp16. Tensors are compared by their relative error in norm there.
# That the stages compute in that dtype at all is checked on the deployed graph.
REL = {"bf16": 5e-2, "fp16": 1e-2}.get(a.amp)
AMP_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)
# With option device=cuda (tests/gpu) rannc's stages compute on the GPU, under the user's
# autocast for cuda, and so does the reference: plain PyTorch on the same GPU, with the same
# kernels (cuDNN, attention) and CUDA's autocast op lists (a CPU reference, as before,
# compared other kernels and CPU autocast's lists).
STAGE_DEVICE = "cuda" if options.get("device", "cpu").startswith("cuda") else "cpu"
REF_DEVICE = STAGE_DEVICE
reference.to(REF_DEVICE)  # its optimizer holds the same Parameter objects, moved in place
SCALER = rannc.GradScaler if a.scaler == "rannc" else torch.amp.GradScaler
scaler = SCALER(STAGE_DEVICE, init_scale=2.0 ** 10) if a.amp == "fp16" else None
ref_scaler = torch.amp.GradScaler(REF_DEVICE, init_scale=2.0 ** 10) if a.amp == "fp16" else None


def on_ref(tree):
    """The reference's arguments on its device (the CPU: unchanged); a leaf that requires
    grad stays a leaf, whose .grad the input-gradient check reads."""
    if REF_DEVICE == "cpu":
        return tree

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.is_leaf and t.requires_grad:
            return t.detach().to(REF_DEVICE).requires_grad_()
        return t.to(REF_DEVICE)
    return pytree.tree_map(move, tree)


def autocast(device_type=REF_DEVICE):
    return (torch.autocast(device_type, dtype=AMP_DTYPE) if AMP_DTYPE is not None
            else torch.autocast(device_type, enabled=False))


def autocast_for_rannc():
    """With the option precision, rannc's calls run without autocast (the option does it)."""
    return contextlib.nullcontext() if "precision" in options else autocast(STAGE_DEVICE)


def backward(loss, s):
    (s.scale(loss) if s is not None else loss).backward()


def optimizer_step(o, s):
    if s is None:
        o.step()
    else:
        s.step(o)
        s.update()


def close(x, y, what):
    # on the host: with option device=cuda (tests/gpu) the stages run on the GPU and the
    # reference on the CPU
    x, y = x.detach().cpu().double(), y.detach().cpu().double()
    if REL is None:
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, check_dtype=False,
                                   msg=lambda m: f"rank {rank}: {what}: {m}")
        return
    assert x.shape == y.shape, f"rank {rank}: {what}: shapes {x.shape} vs {y.shape}"
    err = ((x - y).norm() / y.norm().clamp_min(1e-6)).item()
    assert err <= REL, f"rank {rank}: {what}: relative error {err:.2e} above {REL:.0e}"


def same_output(out, ref_out, what):
    """The loss (a scalar) or this rank's rows of a batch output equal the reference's."""
    out, ref_out = loss_of(out).detach(), loss_of(ref_out).detach()
    close(out, local(ref_out) if out.dim() > 0 else ref_out, what)


def batch_rows(out):
    """The batch-shaped outputs besides the loss, by name: multi_io's hidden and aux rows,
    a transformers model's logits."""
    if hasattr(out, "logits"):
        return {"logits": out.logits}
    if isinstance(out, dict):
        return {"hidden": out["hidden"], "aux": out["aux"][0]}
    return {}


def labels(seed, rows, n):
    return torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(seed))[rows]


def outside_loss(out, y):
    """A loss made outside the model: on each rank from its own rows, a mean over them."""
    if isinstance(out, dict):
        return out["score"] + out["hidden"].pow(2).mean()
    return torch.nn.functional.cross_entropy(out, y)


def check_input_grads(mine, ref, step):
    """Each floating argument's gradient equals the reference's: this rank's rows of it
    times the ranks, or all of it for a tensor without a batch dimension."""
    checked = 0
    for t, r, is_batch in zip(pytree.tree_leaves(mine), pytree.tree_leaves(ref), batches.batch_leaves):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            assert t.grad is not None, f"rank {rank}: an input's .grad is None at step {step}"
            close(t.grad, world * local(r.grad) if is_batch else r.grad,
                  f"input gradient at step {step}")
            checked += 1
    assert checked, "no argument requires grad"


def unsynced_share(o):
    """After a call under no_sync(), a stage with replicas holds its own share of the
    gradients, not the sum (the reference's)."""
    groups = wrapped._deployed[True].engine.grad_groups()
    if not any(rank in ranks and len(ranks) > 1 for ranks, _ in groups):
        return
    own = [p for g in o.param_groups for p in g["params"] if p.grad is not None]
    assert any(not torch.allclose(p.grad, ref_params[names[id(p)]].grad, rtol=1e-4, atol=1e-5)
               for p in own), f"rank {rank}: the gradients were summed under no_sync()"


def inputs_of_later_stages():
    """Whether a later stage than the first takes an argument of the model directly."""
    engine = wrapped._deployed[True].engine
    inputs = set(wrapped._deployed[True].input_ids)
    return any(inputs & set(piece.inputs) for piece in engine.pieces[1:])


names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}  # frozen: nobody updates them
ref_params = dict(reference.named_parameters())
scale = 2.0 if a.mode == "scale2" else 1.0
calls = 2 if "accum" in a.mode else 1
no_sync = a.mode.endswith("no_sync")
outside = a.mode.startswith("outside")
for step in range(a.steps):
    opt.zero_grad()
    ref_opt.zero_grad()
    n = step_rows[step % len(step_rows)]
    length = step_lengths[step % len(step_lengths)] if step_lengths else None
    for call in range(calls):
        (g_args, g_kwargs), (l_args, l_kwargs) = batches(100 + 10 * step + call, n, a.input_grad, length)
        g_args, g_kwargs = on_ref((g_args, g_kwargs))
        unsynced = no_sync and call < calls - 1
        with autocast_for_rannc(), wrapped.no_sync() if unsynced else contextlib.nullcontext():
            out = wrapped(*l_args, **l_kwargs)
        with autocast():
            ref_out = reference(*g_args, **g_kwargs)
        if unsynced:
            check_unsynced = lambda: unsynced_share(opt)  # noqa: E731 (after the backwards)
        if outside:
            seed = 100 + 10 * step + call
            mine = slice(rank * n, (rank + 1) * n)
            outside_loss(out, labels(seed, mine, n * world)).backward()
            outside_loss(ref_out, labels(seed, slice(None), n * world).to(REF_DEVICE)).backward()
            if unsynced:
                check_unsynced()
            if not isinstance(out, dict):
                same_output(out, ref_out, f"output rows at step {step}")
                continue
        else:
            backward(scale * loss_of(out), scaler)
            backward(scale * loss_of(ref_out), ref_scaler)
            if unsynced:
                check_unsynced()
        close(loss_of(out).detach(), loss_of(ref_out).detach(), f"loss at step {step}")
        if a.show_stages and step == 0 and call == 0 and rank == 0:
            deployed = wrapped._deployed[True]
            for i, st in enumerate(deployed.deployment.stages):
                print(f"stage {i} ops: " + ",".join(deployed.graph.ir.task(t).op for t in st.tasks), flush=True)
        if a.amp and step == 0:  # the deployed program computes in the autocast dtype
            dtypes = {v.dtype for v in wrapped._deployed[True].graph.ir.values()}
            assert {"bf16": "BFloat16", "fp16": "Float16"}[a.amp] in dtypes, dtypes
        rows_out = batch_rows(out)
        if rows_out and not outside:  # batch-shaped outputs: this rank's own rows
            ref_rows = batch_rows(ref_out)
            for what, mine in rows_out.items():
                close(mine, local(ref_rows[what]), f"{what} rows")
            try:  # no gradient path through outputs other than the loss: a clear error
                next(iter(rows_out.values())).sum().backward()
                raise AssertionError("backward through a non-loss output did not fail")
            except rannc.Error as e:  # 1F1B: the loss seeded the step's backward
                assert "has no gradient path" in str(e), e
            except RuntimeError as e:  # fill-drain: the loss's backward used this forward
                assert "a second time" in str(e), e
    if a.clip:
        clipped = sorted(n for n, _ in reference.named_parameters())
        clipped = set(clipped[::2] if a.clip_by == "torch_subset" else clipped)
        if a.clip_by == "rannc":
            norm = wrapped.clip_grad_norm(a.clip, scaler=scaler)
        elif a.clip_by == "groups":  # each group by its own norm: one check per group
            for g, ref_g in zip(opt.param_groups, ref_opt.param_groups):
                close(torch.nn.utils.clip_grad_norm_(g["params"], a.clip),
                      torch.nn.utils.clip_grad_norm_(ref_g["params"], a.clip),
                      f"gradient norm of a group at step {step}")
            norm = ref_norm = torch.zeros(())
        elif a.clip_by == "filtered":  # [Note: the parameters meant] in clipping.py
            for (name, child), ref_child in zip(wrapped.module.named_children(), reference.children()):
                close(torch.nn.utils.get_total_norm(
                          [p.grad for p in child.parameters() if p.grad is not None]),
                      torch.nn.utils.get_total_norm([p.grad for p in ref_child.parameters()]),
                      f"gradient norm of {name} at step {step}")
            norm = torch.nn.utils.clip_grad_norm_(
                [p for p in wrapped.parameters() if p.grad is not None], a.clip)
        elif a.clip_by == "total_norm":  # torch >= 2.6's two halves ([Note: torch's get_total_norm])
            params = list(wrapped.parameters())
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
            torch.nn.utils.clip_grads_with_norm_(params, a.clip, norm)
        else:  # what training loops write ([Note: torch's clip_grad_norm_])
            if scaler is not None:
                scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(
                wrapped.parameters() if a.clip_by == "torch" else
                [p for n, p in wrapped.module.named_parameters() if n in clipped], a.clip)
        if ref_scaler is not None:
            ref_scaler.unscale_(ref_opt)
        if a.clip_by != "groups":
            ref_norm = torch.nn.utils.clip_grad_norm_(
                [p for n, p in reference.named_parameters() if n in clipped], a.clip)
        close(norm, ref_norm, f"gradient norm at step {step}")
    if a.input_grad:
        check_input_grads((l_args, l_kwargs), (g_args, g_kwargs), step)
        if step == 0 and rank == 0 and inputs_of_later_stages():
            print("a later stage takes an argument directly", flush=True)
    own = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]  # frozen: kept
    for p in own:
        close(p.grad, ref_params[names[id(p)]].grad, f"gradient of {names[id(p)]} at step {step}")
    if step == a.inject_inf:  # one stage's gradient overflows (its ranks only)
        last = list(ref_params)[-1]
        ref_params[last].grad.view(-1)[0] = float("inf")
        for p in own:
            if names[id(p)] == last:
                p.grad.view(-1)[0] = float("inf")
                print(f"rank {rank}: inf in the gradient of {last}", flush=True)
        before = [p.detach().clone() for p in own]
        scale_before = scaler.get_scale()
    optimizer_step(opt, scaler)
    optimizer_step(ref_opt, ref_scaler)
    if scaler is not None:
        assert scaler.get_scale() == ref_scaler.get_scale(), \
            f"rank {rank}: scale {scaler.get_scale()} vs reference {ref_scaler.get_scale()}"
    if step == a.inject_inf:
        assert scaler.get_scale() == scale_before / 2, f"rank {rank}: scale not halved"
        for p, b in zip(own, before):
            assert torch.equal(p.detach(), b), f"rank {rank}: stepped though a stage overflowed"
        print(f"rank {rank}: skipped step {step}, scale {scaler.get_scale()}", flush=True)
    for p in own:
        close(p.detach(), ref_params[names[id(p)]].detach(), f"{names[id(p)]} after step {step}")
    if rank == 0 and loss_of(out).dim() == 0:
        print(f"step {step}: loss {loss_of(out).item():.6f} "
              f"(reference {loss_of(ref_out).item():.6f})", flush=True)

# every parameter is updated by some rank (a stage may have none: an elementwise tail)
counts = torch.zeros(len(names), dtype=torch.int64)
index = {n: i for i, n in enumerate(names.values())}
for p in own:
    counts[index[names[id(p)]]] = 1
rannc._C.Communicator.world_cpu().all_reduce(counts).wait()
assert counts.min().item() >= 1, "some parameter is updated by no rank"

if a.eval:
    (g_args, g_kwargs), (l_args, l_kwargs) = batches(999)
    g_args, g_kwargs = on_ref((g_args, g_kwargs))
    wrapped.eval()
    reference.eval()
    with torch.no_grad():
        with autocast_for_rannc():
            out = wrapped(*l_args, **l_kwargs)
        with autocast():
            ref_out = reference(*g_args, **g_kwargs)
    same_output(out, ref_out, "eval loss")
    ref_rows = batch_rows(ref_out)
    for what, mine in batch_rows(out).items():
        close(mine, local(ref_rows[what]), f"eval {what} rows")
    wrapped.train()
    reference.train()
    # training goes on after eval, on the parameters both modes share
    (g_args, g_kwargs), (l_args, l_kwargs) = batches(1000)
    g_args, g_kwargs = on_ref((g_args, g_kwargs))
    opt.zero_grad()
    with autocast_for_rannc():
        out = wrapped(*l_args, **l_kwargs)
    with autocast():
        same_output(out, reference(*g_args, **g_kwargs), "loss after eval")
print(f"OK rank {rank}", flush=True)
