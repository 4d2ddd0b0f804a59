"""Sharded checkpoints (python/rannc/checkpoint.py, safetensors_io.py): the file format
without MPI, then resume, resharding, foreign formats, damage, crashes and memory under
real mpirun."""
import json
import os
import struct
import subprocess
import sys

import pytest
import torch

from mpirun import HERE, ROOT, mpirun
from rannc import safetensors_io as sio

sys.path[:0] = [HERE, os.path.join(ROOT, "examples")]
import zoo  # noqa: E402

ENV = {"RANNC_COMM_TIMEOUT": "60"}
EXACT = ["--opt", "cost_model=analytic"]  # a plan that is the same in every run


def ok(res, ranks):
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(ranks):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]


# ---- the file format -----------------------------------------------------------------------
def test_streamed_safetensors_files_read_back_with_the_safetensors_library(tmp_path):
    from safetensors.torch import load_file
    tensors = [("w", torch.randn(3, 5)), ("half", torch.randn(4).to(torch.bfloat16)),
               ("mask", torch.rand(2, 2) > 0.5), ("step", torch.tensor(7.0)),
               ("empty", torch.zeros(0, 3)), ("cols", torch.randn(5, 3).t())]  # not contiguous
    path = str(tmp_path / "x.safetensors")
    checksums = sio.write_file(path, tensors, {"format": "pt"})
    loaded = load_file(path)
    assert set(loaded) == {n for n, _ in tensors}
    for name, t in tensors:
        assert torch.equal(loaded[name], t), name
    with sio.Reader(path) as reader:
        assert reader.metadata == {"format": "pt"}
        for name, t in tensors:
            got, digest = reader.read_into(name)
            assert torch.equal(got, t) and digest == checksums[name], name
        # into a tensor of another dtype, and into a non-contiguous one: copied and cast
        dest = torch.zeros(3, 5, dtype=torch.float64)
        reader.read_into("w", dest)
        assert torch.equal(dest, tensors[0][1].double())
        dest = torch.zeros(3, 5).t().contiguous().t()
        reader.read_into("w", dest)
        assert torch.equal(dest, tensors[0][1])


def test_a_truncated_safetensors_file_is_named(tmp_path):
    path = str(tmp_path / "x.safetensors")
    sio.write_file(path, [("w", torch.randn(64))])
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 10)
    with pytest.raises(ValueError, match="x.safetensors is truncated"):
        sio.Reader(path)


# ---- resume, exact and resharded -------------------------------------------------------------
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of gpt after 3 steps on 4 ranks (2 stages x 2 replicas), and the
    losses and state of the same run going on to 5 steps without a stop."""
    d = tmp_path_factory.mktemp("saved")
    straight = mpirun("sharded_checkpoint_check.py", 4, "straight", "--out", d / "straight.pt",
                      *EXACT, timeout=300, env=ENV)
    ok(straight, 4)
    save = mpirun("sharded_checkpoint_check.py", 4, "save", "--dir", d / "ckpt", *EXACT,
                  timeout=300, env=ENV)
    ok(save, 4)
    return d


def test_a_resumed_run_equals_the_run_without_a_stop_bit_for_bit(saved):
    res = mpirun("sharded_checkpoint_check.py", 4, "resume", "--dir", saved / "ckpt", "--exact",
                 saved / "straight.pt", *EXACT, f"load_plan={saved / 'ckpt' / 'plan-train.rannc'}",
                 timeout=300, env=ENV)
    ok(res, 4)


@pytest.mark.parametrize("ranks,stages,first,extra", [
    (2, 2, "none", []), (1, 1, "none", []), (2, 2, "eval", []), (4, 2, "train", []),
    (2, 4, "none", ["--opt", "schedule=interleaved"]),  # each rank holds 2 stages
], ids=["2ranks", "1rank", "2ranks-after-eval", "4ranks-after-a-train-call", "2ranks-interleaved"])
def test_a_checkpoint_loads_into_other_layouts_and_training_goes_on_as_in_pytorch(
        saved, ranks, stages, first, extra):
    res = mpirun("sharded_checkpoint_check.py", ranks, "resume", "--dir", saved / "ckpt",
                 "--stages", stages, "--micro", min(2, stages), "--deploy-first", first, *extra,
                 timeout=300, env=ENV)
    ok(res, ranks)


def test_consolidate_writes_a_state_dict_and_optimizer_state_plain_pytorch_loads(saved, tmp_path):
    out, opt_out = tmp_path / "model.pt", tmp_path / "opt.pt"
    res = subprocess.run([sys.executable, "-m", "rannc.checkpoint", "consolidate",
                          str(saved / "ckpt"), str(out), "--optimizer", str(opt_out)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")})
    assert res.returncode == 0, res.stderr
    assert "Warning" not in res.stderr, res.stderr
    model, _, _ = zoo.make("gpt", batch=8, seed=3)
    model.load_state_dict(torch.load(out))  # strict: tied names included
    straight = torch.load(saved / "straight.pt")
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    opt.load_state_dict(torch.load(opt_out))
    assert opt.param_groups[0]["lr"] == 1e-2
    assert all(int(s["step"]) == 3 for s in opt.state.values()) and len(opt.state) == len(
        list(model.parameters()))
    # the state after 3 steps: plain PyTorch's, on the same global batches
    assert set(torch.load(out)) == set(straight["state"])
    reference = zoo.no_dropout(zoo.make("gpt", batch=8, seed=0)[0])
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2, eps=1e-5)
    batches = zoo.Batches("gpt", 4, 0)
    for seed in (10, 11, 12):
        args, kwargs = batches(seed, local_batch=2)[0]
        ref_opt.zero_grad()
        zoo.loss_of(reference(*args, **kwargs)).backward()
        ref_opt.step()
    for k, v in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-4, atol=1e-5)
    res = subprocess.run([sys.executable, "-m", "rannc.checkpoint", "consolidate",
                          str(tmp_path / "nothing"), str(out)], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")})
    assert res.returncode == 1 and "no checkpoint at" in res.stderr, res.stderr


# ---- other formats in, transformers out ------------------------------------------------------
def test_transformers_reads_a_sharded_checkpoint_with_from_pretrained(tmp_path):
    res = mpirun("sharded_checkpoint_check.py", 2, "save", "--dir", tmp_path / "ckpt",
                 "--model", "hf_gpt2", timeout=300, env=ENV)
    ok(res, 2)
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt")
    index = json.load(open(tmp_path / "ckpt" / "model.safetensors.index.json"))
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: once
    state = loaded.state_dict()
    for name, fname in index["weight_map"].items():
        with safe_open(str(tmp_path / "ckpt" / fname), "pt") as f:
            assert torch.equal(state[name], f.get_tensor(name)), name
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()


@pytest.mark.parametrize("kind", ["hf_dir", "state_dict_file"])
def test_a_hugging_face_directory_or_a_state_dict_file_loads_into_a_rannc_module(tmp_path, kind):
    if kind == "hf_dir":
        model, _, _ = zoo.make("hf_gpt2", batch=8, seed=0)
        model.save_pretrained(tmp_path / "src")
        args = ["--model", "hf_gpt2", "--dir", tmp_path / "src"]
    else:
        model, _, _ = zoo.make("gpt", batch=8, seed=0)
        torch.save(model.state_dict(), tmp_path / "src.pt")
        args = ["--dir", tmp_path / "src.pt"]
    ok(mpirun("sharded_checkpoint_check.py", 2, "weights", *args, timeout=300, env=ENV), 2)


# ---- damage, failures, crashes ---------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 2-rank checkpoint of the MLP after one step; a failed second save left it alone."""
    d = tmp_path_factory.mktemp("small")
    res = mpirun("checkpoint_safety_check.py", 2, "fail", "--dir", d / "ckpt", "--rank", 1,
                 timeout=300, env=ENV)
    ok(res, 2)
    assert "rank 1: OSError: [Errno 28] No space left on device" in res.stdout
    return d / "ckpt"


def test_a_save_that_fails_on_one_rank_fails_on_all_and_keeps_the_previous_checkpoint(small):
    ok(mpirun("checkpoint_safety_check.py", 2, "load", "--dir", small, "--step", 1,
              timeout=300, env=ENV), 2)


def test_a_rank_that_dies_mid_save_leaves_the_previous_checkpoint(tmp_path):
    res = mpirun("checkpoint_safety_check.py", 2, "die", "--dir", tmp_path / "ckpt", "--rank", 1,
                 timeout=300, env=ENV)
    assert res.returncode != 0 and "rank 1 dies while saving" in res.stdout, res.stdout[-3000:]
    ok(mpirun("checkpoint_safety_check.py", 2, "load", "--dir", tmp_path / "ckpt", "--step", 1,
              timeout=300, env=ENV), 2)


def _damage(src, dst, how):
    import shutil
    shutil.copytree(src, dst)
    shard = dst / "model-00002-of-00002.safetensors"
    if how == "missing":
        os.remove(shard)
    elif how == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) - 4)
    else:  # a flipped byte in the last tensor: same size, other bytes
        raw = bytearray(shard.read_bytes())
        raw[-3] ^= 0xFF
        shard.write_bytes(bytes(raw))


@pytest.mark.parametrize("how,error", [
    ("missing", "model-00002-of-00002.safetensors is missing"),
    ("truncated", "model-00002-of-00002.safetensors has"),
    ("corrupt", "do not match their CRC-32")])
def test_a_damaged_checkpoint_fails_to_load_on_every_rank_naming_the_damage(small, tmp_path,
                                                                            how, error):
    _damage(small, tmp_path / "ckpt", how)
    ok(mpirun("checkpoint_safety_check.py", 2, "load", "--dir", tmp_path / "ckpt", "--error",
              error, timeout=300, env=ENV), 2)


def test_saving_and_loading_hold_no_more_than_one_tensor_above_the_ranks_own_state(tmp_path):
    res = mpirun("checkpoint_safety_check.py", 4, "memory", "--dir", tmp_path / "ckpt",
                 timeout=300, env=ENV)
    ok(res, 4)
    print(res.stdout)


def test_a_checkpoint_resumes_an_optimizer_built_after_wrapping():
    """DDP's order (wrap, build AdamW over the wrapper's parameters, load_checkpoint before
    the first step): the optimizer's state and hyperparameters are read, and the resumed
    steps equal PyTorch's uninterrupted run ([Note: checkpoints of optimizers made after
    wrapping] in checkpoint.py; Adam's step count restarted at 1, a probe's finding)."""
    res = mpirun("loop_probes.py", 2, "resume_late_optimizer", timeout=300,
                 env={"RANNC_COMM_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-4000:]
    for r in range(2):
        assert f"OK rank {r}" in res.stdout, res.stdout[-4000:]
