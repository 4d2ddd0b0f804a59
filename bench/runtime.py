"""Runtime benchmark: RaNNCModule against plain PyTorch on one rank, and a 2-stage
pipeline on 2 CPU ranks against the plan's prediction and against one rank.

    python bench/runtime.py [--repeats 20]
    python bench/runtime.py --device cuda [--out DIR]   # one rank on the GPU only
    python bench/runtime.py --bert-large [--device cpu|cuda] [--small] [--out DIR]

--device cuda also runs the speed issue's BERT-large-like comparison (transformers
BertForMaskedLM, 24 layers, hidden 1024, batch 16 x 128 tokens, Adam) in fp32 and under
bf16 autocast: plain PyTorch, RaNNCModule on one rank, their ratio, rannc's prediction,
and a torch.profiler summary of where rannc's extra time goes (the ops whose time grew
most against eager), written to runtime_cuda_profile.txt. --bert-large runs only that
part; with --small a 2-layer config (a smoke run of the same code on the CPU).


Both parts alternate the measured variants in one run (the machine is shared and noisy:
read the ratios). The pipeline runs over Open MPI's single-copy shared memory (CMA) where
the machine allows it, and over copy in/out as well (see single_copy_works). Writes
bench/results/runtime.json.
"""
import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "python"), os.path.join(ROOT, "examples")]
import rannc  # noqa: E402
from models import GPT, TransformerConfig  # noqa: E402

CFG = dict(vocab=1000, hidden=256, heads=8, layers=8, max_len=64, dropout=0.0)
BATCH = 8
# On a GPU, a model large enough that the step is not dominated by kernel launches.
CUDA_CFG = dict(vocab=32000, hidden=1024, heads=16, layers=12, max_len=512, dropout=0.0)
CUDA_BATCH = 8


def data(rows, seed, cfg=CFG, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg["vocab"], (rows, cfg["max_len"]), generator=g).to(device),
            torch.randint(0, cfg["vocab"], (rows, cfg["max_len"]), generator=g).to(device))


def step(fn, opt, batch):
    sync = torch.cuda.synchronize if batch[0].is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    loss = fn(*batch)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sync()
    return time.perf_counter() - start


def one_rank(repeats, device="cpu"):
    """The same model and batch trained by plain PyTorch and by RaNNCModule (one stage)
    on `device`, steps alternating."""
    cfg, rows = (CUDA_CFG, CUDA_BATCH) if device == "cuda" else (CFG, BATCH)
    torch.manual_seed(0)
    plain = GPT(TransformerConfig(**cfg))
    ours = copy.deepcopy(plain)
    plain.to(device)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=1e-4)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=1e-4)
    # RaNNCModule moves `ours` to the device itself (option device)
    wrapped = rannc.RaNNCModule(ours, opt_ours, log_level="warn", device=device)
    batch = data(rows, 0, cfg, device)
    for _ in range(3):  # warm-up (and the first call's trace and plan)
        step(plain, opt_plain, batch)
        step(wrapped, opt_ours, batch)
    t_plain, t_ours = [], []
    for _ in range(repeats):
        t_plain.append(step(plain, opt_plain, batch))
        t_ours.append(step(wrapped, opt_ours, batch))
    p, o = statistics.median(t_plain), statistics.median(t_ours)
    return dict(device=device, model=cfg, batch=rows, plain_step_s=p, rannc_step_s=o,
                ratio=o / p)


BERT_LARGE = dict(num_hidden_layers=24, hidden_size=1024, intermediate_size=4096, num_attention_heads=16)
BERT_SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2)
BERT_BATCH, BERT_SEQ = 16, 128


def bert_step(fn, opt, kwargs, precision):
    """One training step of a transformers model (its output's .loss) under `precision`."""
    device = kwargs["input_ids"].device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = fn(**kwargs).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    sync()
    return time.perf_counter() - start


def _self_times(prof, device):
    """op name -> self time in ms over the profiled steps (device time on a GPU)."""
    out = {}
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
              if device == "cuda" else e.self_cpu_time_total)
        out[e.key] = out.get(e.key, 0.0) + us / 1e3
    return out


def bert_large(device, precision, repeats, small=False, profile_steps=2):
    """The BERT-large-like step, plain PyTorch against RaNNCModule (one stage), alternating,
    and a torch.profiler comparison of the two. Returns (row, profile text)."""
    import transformers as tf
    from torch.profiler import ProfilerActivity, profile
    tf.logging.set_verbosity_error()
    cfg = tf.BertConfig(**(BERT_SMALL if small else BERT_LARGE), hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    plain = tf.BertForMaskedLM(cfg)
    ours = copy.deepcopy(plain)
    plain.to(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BERT_BATCH, BERT_SEQ), generator=g).to(device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=1e-5)
    opt_ours = torch.optim.Adam(ours.parameters(), lr=1e-5)
    wrapped = rannc.RaNNCModule(ours, opt_ours, log_level="warn", device=device)
    start = time.perf_counter()
    bert_step(wrapped, opt_ours, kwargs, precision)
    first = time.perf_counter() - start
    for _ in range(3):
        bert_step(plain, opt_plain, kwargs, precision)
        bert_step(wrapped, opt_ours, kwargs, precision)
    t_plain, t_ours = [], []
    for _ in range(repeats):
        t_plain.append(bert_step(plain, opt_plain, kwargs, precision))
        t_ours.append(bert_step(wrapped, opt_ours, kwargs, precision))
    p, o = statistics.median(t_plain), statistics.median(t_ours)
    predicted = wrapped.deployments["train"].iteration_time
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    times = {}
    for name, fn, opt in (("plain", plain, opt_plain), ("rannc", wrapped, opt_ours)):
        with profile(activities=acts) as prof:
            for _ in range(profile_steps):
                bert_step(fn, opt, kwargs, precision)
        times[name] = _self_times(prof, device)
    grew = sorted(((times["rannc"].get(k, 0.0) - times["plain"].get(k, 0.0), k)
                   for k in set(times["plain"]) | set(times["rannc"])), reverse=True)
    clock = "device" if device == "cuda" else "CPU"
    lines = [f"BERT-large-like ({'small' if small else '24 layers'}), {precision}, {device}: plain "
             f"{p * 1e3:.1f} ms, rannc {o * 1e3:.1f} ms, ratio {o / p:.3f}, predicted {predicted * 1e3:.1f} ms",
             f"self {clock} time over {profile_steps} steps: the ops that grew most under rannc (ms)",
             f"{'op':<48} {'plain':>10} {'rannc':>10} {'extra':>10}"]
    for extra, k in grew[:15]:
        lines.append(f"{k[:48]:<48} {times['plain'].get(k, 0.0):>10.2f} {times['rannc'].get(k, 0.0):>10.2f} "
                     f"{extra:>10.2f}")
    total = {n: sum(t.values()) for n, t in times.items()}
    lines.append(f"{'all ops':<48} {total['plain']:>10.2f} {total['rannc']:>10.2f} "
                 f"{total['rannc'] - total['plain']:>10.2f}")
    row = dict(model="bert_large_small" if small else "bert_large", precision=precision, device=device,
               batch=BERT_BATCH, seq=BERT_SEQ, plain_step_s=p, rannc_step_s=o, ratio=o / p,
               predicted_s=predicted, first_step_s=first)
    return row, "\n".join(lines)


def bert_large_report(device, repeats, small, out_dir):
    """Both precisions; writes runtime_<device>_bert_large.json and the profile text."""
    rows, texts, failed = [], [], []
    for precision in ("fp32", "bf16"):
        try:  # one precision failing still measures the other (a GPU session has one call)
            row, text = bert_large(device, precision, repeats, small)
        except Exception as e:  # noqa: BLE001 (recorded, and the run exits non-zero)
            text = f"BERT-large-like, {precision}, {device}: FAILED: {type(e).__name__}: {e}"
            row = dict(model="bert_large_small" if small else "bert_large", precision=precision,
                       device=device, error=f"{type(e).__name__}: {e}")
            failed.append(precision)
        print(text, flush=True)
        rows.append(row)
        texts.append(text)
    tag = f"{device}_bert_large" + ("_small" if small else "")
    ratios = [r["ratio"] for r in rows if "ratio" in r]
    with open(os.path.join(out_dir, f"runtime_{tag}.json"), "w") as f:
        json.dump({"rows": rows, "ratio": max(ratios) if ratios else None}, f, indent=2)
    with open(os.path.join(out_dir, f"runtime_{tag}_profile.txt"), "w") as f:
        f.write("\n\n".join(texts) + "\n")
    if failed:
        raise SystemExit(f"BERT-large-like failed in {', '.join(failed)}")
    return rows


def warmed_up_pipeline(stages):
    """Under mpirun: the GPT wrapped by RaNNCModule over `stages` stages, its optimizer and
    this rank's batch, after three steps (the first traces, plans and deploys)."""
    torch.manual_seed(0)
    model = GPT(TransformerConfig(**CFG))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    wrapped = rannc.RaNNCModule(model, opt, num_stages=stages, log_level="warn")
    batch = data(BATCH, rannc.get_rank())
    for _ in range(3):
        step(wrapped, opt, batch)
    return wrapped, opt, batch


def mpirun_command(ranks, single_copy, script_args):
    """mpirun over shared memory: CMA with `single_copy`, else copy in/out (see
    single_copy_works), running `script_args` with this Python."""
    transport = [] if single_copy else ["--mca", "btl_vader_single_copy_mechanism", "none"]
    return (["mpirun", "--oversubscribe", "-np", str(ranks), "--mca", "btl", "self,vader"]
            + transport + [sys.executable] + list(script_args))


def mpirun_env(**extra):
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMP_NUM_THREADS="1", **extra)


def worker(repeats, stages):
    """Runs under mpirun: times RaNNCModule steps; rank 0 prints one JSON line."""
    wrapped, opt, batch = warmed_up_pipeline(stages)
    times = []
    for _ in range(repeats):
        rannc.barrier(60)
        times.append(step(wrapped, opt, batch))
    if rannc.get_rank() == 0:
        d = wrapped.deployments["train"]
        print("RESULT " + json.dumps(dict(
            ranks=rannc.get_world_size(), stages=d.num_stages, micro_batches=d.micro_batches,
            measured_step_s=statistics.median(times), predicted_iteration_s=d.iteration_time)),
            flush=True)


def single_copy_works() -> bool:
    """Whether Open MPI's shared-memory transport can copy straight between processes
    (CMA, its default; containers without ptrace rights refuse it). Without it, a large
    send goes through shared-memory fragments that only move when the sender calls into
    MPI, so an activation sent before a compute waits for that compute to end."""
    code = ("import sys, torch; sys.path.insert(0, %r); import rannc; from rannc import _C; "
            "c = _C.Communicator.world_cpu(); r = rannc.get_rank(); t = torch.ones(1 << 18); "
            "b = torch.empty_like(t); w = c.send(t, 1 - r, 0); c.recv(b, 1 - r, 0).wait(); "
            "w.wait(); assert bool((b == 1).all()); print('SINGLE COPY OK')") % os.path.join(ROOT, "python")
    try:
        out = subprocess.run(mpirun_command(2, True, ["-c", code]), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=mpirun_env(), timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0 and out.stdout.count("SINGLE COPY OK") == 2


def launch(ranks, stages, repeats, single_copy=False, **extra_env):
    out = subprocess.run(
        mpirun_command(ranks, single_copy, [__file__, "--worker", str(stages), "--repeats", str(repeats)]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=mpirun_env(**extra_env),
        timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]),
                        transport="single copy (CMA)" if single_copy else "copy in/out")
    raise RuntimeError(out.stdout[-3000:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: only the one-rank comparison, on the GPU (goal: within 3%%)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="folder of the json")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--bert-large", action="store_true", help="only the BERT-large-like comparison")
    ap.add_argument("--small", action="store_true", help="a 2-layer BERT (a smoke run)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.worker:
        return worker(a.repeats, a.worker)
    if a.bert_large:
        bert_large_report(a.device, a.repeats, a.small, a.out)
        return
    if a.device == "cuda":
        single = one_rank(a.repeats, "cuda")
        print(f"one rank on {torch.cuda.get_device_name()}: PyTorch "
              f"{single['plain_step_s'] * 1e3:.2f} ms, RaNNCModule {single['rannc_step_s'] * 1e3:.2f} ms "
              f"per step, ratio {single['ratio']:.3f} (goal <= 1.03)")
        out = os.path.join(a.out, "runtime_cuda.json")
        with open(out, "w") as f:
            json.dump(dict(single, gpu=torch.cuda.get_device_name()), f, indent=2)
        print(f"wrote {out}")
        bert_large_report("cuda", min(a.repeats, 10), False, a.out)
        return
    single = one_rank(a.repeats)
    print(f"one rank: PyTorch {single['plain_step_s'] * 1e3:.1f} ms, RaNNCModule "
          f"{single['rannc_step_s'] * 1e3:.1f} ms per step, ratio {single['ratio']:.3f} (goal <= 1.05)")
    # one rank as the baseline of the pipeline: the same local batch per rank
    base = launch(1, 1, a.repeats)
    cma = single_copy_works()
    pipe = launch(2, 2, a.repeats, single_copy=cma)
    # the same over copy in/out (containers without ptrace rights), for comparison
    copy_io = launch(2, 2, a.repeats) if cma else pipe
    for name, r in (("", pipe), ("  over copy in/out: ", copy_io)):
        err = r["measured_step_s"] / r["predicted_iteration_s"] - 1
        print(f"{name or '2 ranks, 2 stages: '}{r['micro_batches']} micro-batches, {r['transport']}: "
              f"measured {r['measured_step_s'] * 1e3:.1f} ms, predicted "
              f"{r['predicted_iteration_s'] * 1e3:.1f} ms ({err:+.0%}; goal within 10%)")
        if r is copy_io is pipe:
            print("  (single copy is refused here; only copy in/out was measured)")
            break
    print(f"one rank on its local batch: {base['measured_step_s'] * 1e3:.1f} ms")
    out = os.path.join(a.out, "runtime.json")
    with open(out, "w") as f:
        json.dump(dict(model=CFG, local_batch=BATCH, one_rank=single, pipeline_1rank=base,
                       pipeline_2ranks=pipe, pipeline_2ranks_copy_in_out=copy_io),
                  f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
