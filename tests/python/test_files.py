"""Plan and profile-cache files that make no sense are refused naming the file and the
field, however valid their checksum: each test writes a good file, changes one field,
recomputes the checksum (so only the readers' sense checks stand in the way) and loads it."""
import math
import struct

import pytest
import torch

import rannc
from rannc import _C
import zoo

MAGIC = b"RANNC\0"


def fnv1a(data: bytes) -> int:
    """csrc/common/hash.h's FNV-1a 64, the frame's checksum."""
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def unframe(data: bytes):
    """(kind, version, payload) of a framed rannc file (csrc/ir/serialize.h)."""
    assert data[:6] == MAGIC
    pos = 6
    (n,) = struct.unpack_from("<Q", data, pos)
    kind = data[pos + 8:pos + 8 + n].decode()
    pos += 8 + n
    version, n = struct.unpack_from("<IQ", data, pos)
    pos += 12
    payload = data[pos:pos + n]
    assert struct.unpack_from("<Q", data, pos + n)[0] == fnv1a(payload)
    return kind, version, payload


def frame(kind: str, version: int, payload: bytes) -> bytes:
    k = kind.encode()
    return (MAGIC + struct.pack("<Q", len(k)) + k + struct.pack("<IQ", version, len(payload))
            + payload + struct.pack("<Q", fnv1a(payload)))


class Fields:
    """Offsets of the named fields of a payload, found by walking it with the layout its
    writer uses; set(name, fmt, value) rewrites one in place."""

    def __init__(self, payload: bytes):
        self.data, self.pos, self.at = bytearray(payload), 0, {}

    def read(self, name, fmt):
        self.at[name] = (self.pos, fmt)
        (v,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def list(self, name, fmt):
        n = self.read(name, "Q")
        self.pos += n * struct.calcsize(fmt)
        return n

    def set(self, name, value):
        pos, fmt = self.at[name]
        struct.pack_into("<" + fmt, self.data, pos, value)


def deployment_fields(payload: bytes) -> Fields:
    f = Fields(payload)
    f.read("graph_hash", "Q")
    f.list("planner", "c")
    for name, fmt in [("world_size", "i"), ("batch_size", "q"), ("pipelines", "i"),
                      ("micro_batches", "i"), ("schedule", "B"), ("chunks", "i"), ("optimizer", "B"),
                      ("memory_limit", "q"), ("iteration_time", "d"), ("feasible", "B")]:
        f.read(name, fmt)
    for s in range(f.read("stages", "Q")):
        p = f"stages[{s}]."
        f.list(p + "tasks", "i")
        f.list(p + "ranks", "i")
        for name, fmt in [("first_block", "i"), ("last_block", "i"), ("recompute", "B"),
                          ("micro_batch_rows", "q")]:
            f.read(p + name, fmt)
        for name in ["forward_time", "backward_time", "weight_time", "send_forward_time", "send_backward_time",
                     "allreduce_time", "update_time", "busy_time", "bubble_time"]:
            f.read(p + name, "d")
        for name in ["param_bytes", "memory_bytes", "static_bytes", "stash_bytes", "working_bytes"]:
            f.read(p + name, "q")
    for c in range(f.read("schedule_candidates", "Q")):
        p = f"schedule_candidates[{c}]."
        for name, fmt in [("schedule", "B"), ("iteration_time", "d"), ("bubble", "d"), ("feasible", "B")]:
            f.read(p + name, fmt)
    assert f.pos == len(f.data)
    return f


def profile_fields(payload: bytes) -> Fields:
    f = Fields(payload)
    for e in range(f.read("entries", "Q")):
        p = f"entries[{e}]."
        f.read(p + "content_hash", "Q")
        f.read(p + "rows", "q")
        f.list(p + "dtype", "c")
        f.list(p + "device", "c")
        for name, fmt in [("recompute", "B"), ("forward_time", "d"), ("backward_time", "d"),
                          ("activation_bytes", "q"), ("peak_bytes", "q"), ("out_of_memory", "B"),
                          ("weight_time", "d")]:
            f.read(p + name, fmt)
    assert f.pos == len(f.data)
    return f


def corrupted(data: bytes, walk, field, value) -> bytes:
    kind, version, payload = unframe(data)
    f = walk(payload)
    f.set(field, value)
    return frame(kind, version, bytes(f.data))


@pytest.fixture(scope="module")
def planned():
    """A 2-stage analytic plan of the MLP for 2 ranks, its graph and its bytes."""
    model, args, kwargs = zoo.make("mlp", batch=4)
    plan = rannc.plan(model, args, kwargs, world_size=2, device_memory="64MiB",
                      cost_model="analytic", num_stages=2, schedule="auto")
    assert plan.num_stages == 2 and len(plan.deployment.schedule_candidates) == 2
    return plan, plan.deployment.to_bytes()


PLAN_CASES = [
    # field, value written, what the message says besides the field
    ("stages[0].tasks", 1 << 62, "count 4611686018427387904"),  # count x 4 wraps to 0
    ("stages", 1 << 40, "count 1099511627776"),
    ("stages[1].forward_time", math.nan, "nan"),
    ("stages[0].backward_time", -0.25, "-0.25"),
    ("iteration_time", math.inf, "inf"),
    ("stages[1].memory_bytes", -4096, "-4096"),
    ("micro_batches", 0, "not between 1"),
    ("world_size", -3, "-3"),
    ("schedule_candidates[1].bubble", 1.5, "not a fraction"),
    ("schedule_candidates[0].schedule", 9, "not a known schedule"),
    ("chunks", 2, "2 chunk(s) per device group under schedule"),
]


@pytest.mark.parametrize("field,value,says", PLAN_CASES, ids=[c[0] for c in PLAN_CASES])
def test_a_plan_file_with_a_senseless_field_is_refused_naming_file_and_field(
        planned, tmp_path, field, value, says):
    plan, data = planned
    path = str(tmp_path / "plan.rannc")
    open(path, "wb").write(corrupted(data, deployment_fields, field, value))
    with pytest.raises(rannc.SerializationError) as info:
        _C.load_deployment(path, plan.graph.ir)
    msg = str(info.value)
    assert msg.startswith(path + ": ") and field in msg and says in msg, msg


def test_a_plan_for_a_batch_of_2_to_the_40_is_refused(planned, tmp_path):
    plan, data = planned
    path = str(tmp_path / "plan.rannc")
    open(path, "wb").write(corrupted(data, deployment_fields, "batch_size", 1 << 40))
    # Alone, the stages' rows give it away; against the model's batch, the batch itself.
    with pytest.raises(rannc.SerializationError, match=r"micro_batch_rows.*batch_size 1099511627776"):
        _C.load_deployment(path, plan.graph.ir)
    with pytest.raises(rannc.SerializationError) as info:
        _C.load_deployment(path, plan.graph.ir, batch_size=plan.graph.batch_size * 2, world_size=2)
    msg = str(info.value)
    assert msg.startswith(path + ": ") and "batch_size" in msg and "1099511627776" in msg, msg
    # The good file loads, and is the same plan.
    open(path, "wb").write(data)
    assert _C.load_deployment(path, plan.graph.ir, batch_size=8, world_size=2).to_bytes() == data


def test_a_plan_from_rank_0_is_checked_like_a_file(planned):
    plan, data = planned
    bad = corrupted(data, deployment_fields, "stages[0].update_time", math.nan)
    with pytest.raises(rannc.SerializationError, match=r"^the plan from rank 0: .*stages\[0\]\.update_time"):
        _C.deployment_from_bytes(bad, plan.graph.ir, "the plan from rank 0")


def test_load_plan_refuses_a_plan_for_another_batch_naming_it(tmp_path):
    # RaNNCModule's load_plan: the plan must be for this model's batch (local rows x ranks).
    model, args, kwargs = zoo.make("mlp", batch=4)
    model = zoo.no_dropout(model)
    plan = rannc.plan(model, args, kwargs, world_size=1, device_memory="64MiB", cost_model="analytic")
    path = str(tmp_path / "plan.rannc")
    open(path, "wb").write(corrupted(plan.deployment.to_bytes(), deployment_fields, "batch_size", 1 << 40))
    wrapped = rannc.RaNNCModule(model, torch.optim.SGD(model.parameters(), lr=0.1), load_plan=path,
                                cost_model="analytic")
    with pytest.raises(rannc.SerializationError) as info:
        wrapped(*args, **kwargs)
    msg = str(info.value)
    assert msg.startswith(path + ": ") and "batch_size" in msg and "model's batch is 4" in msg, msg


@pytest.fixture(scope="module")
def profiles():
    """A profile cache filled by a deterministic (fake-timer) plan, as bytes."""
    model, args, kwargs = zoo.make("mlp", batch=4)
    cache = rannc.ProfileCache()
    rannc.plan(model, args, kwargs, world_size=2, device_memory="64MiB", profile_cache=cache,
               profile_fake_timer=True, profile_warmup=0, profile_repetitions=1,
               probe_bandwidth=False, update_seconds_per_byte=1e-9)
    assert len(cache) > 0
    return cache.to_bytes()


CACHE_CASES = [
    ("entries", 1 << 62, "count 4611686018427387904"),
    ("entries[0].dtype", 1 << 61, "count 2305843009213693952"),
    ("entries[0].forward_time", math.nan, "nan"),
    ("entries[1].backward_time", -1e-3, "-0.001"),
    ("entries[0].activation_bytes", -8, "-8"),
    ("entries[0].peak_bytes", -1, "negative"),
    ("entries[0].rows", 0, "rows"),
    ("entries[0].weight_time", -0.5, "neither -1"),
]


@pytest.mark.parametrize("field,value,says", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_a_profile_cache_with_a_senseless_field_is_refused_naming_file_and_field(
        profiles, tmp_path, field, value, says):
    path = str(tmp_path / "profiles.bin")
    open(path, "wb").write(corrupted(profiles, profile_fields, field, value))
    with pytest.raises(rannc.SerializationError) as info:
        rannc.ProfileCache().load(path)
    msg = str(info.value)
    assert msg.startswith(path + ": ") and field in msg and says in msg, msg


def test_a_profile_cache_file_is_checked_before_planning_and_left_unmerged(profiles, tmp_path):
    path = str(tmp_path / "profiles.bin")
    open(path, "wb").write(corrupted(profiles, profile_fields, "entries[2].forward_time", -1.0))
    model, args, kwargs = zoo.make("mlp", batch=4)
    with pytest.raises(rannc.SerializationError, match=r"entries\[2\]\.forward_time"):
        rannc.plan(model, args, kwargs, world_size=2, device_memory="64MiB", profile_cache=path,
                   profile_fake_timer=True)
    cache = rannc.ProfileCache()
    with pytest.raises(rannc.SerializationError):
        cache.load(path)
    assert len(cache) == 0  # nothing of a refused file is taken
    # A piece that ran out of memory keeps its infinite times.
    open(path, "wb").write(corrupted(
        corrupted(profiles, profile_fields, "entries[0].out_of_memory", 1),
        profile_fields, "entries[0].forward_time", math.inf))
    assert cache.load(path) and len(cache) > 0


def test_profile_cache_entries_can_be_read_and_put_back_but_not_nonsense(profiles):
    cache = rannc.ProfileCache()
    cache.merge_bytes(profiles)
    entries = cache.entries()
    assert len(entries) == len(cache) and entries == sorted(
        entries, key=lambda e: (e["content_hash"], e["rows"], e["dtype"], e["device"], e["recompute"]))
    e = dict(entries[0])
    e["forward_time"] *= 2
    cache.put(**e)
    assert cache.entries()[0]["forward_time"] == e["forward_time"]
    with pytest.raises(rannc.Error, match=r"ProfileCache.put: forward_time: nan"):
        cache.put(**dict(e, forward_time=math.nan))
    with pytest.raises(rannc.Error, match=r"ProfileCache.put: peak_bytes: -1 bytes is negative"):
        cache.put(**dict(e, peak_bytes=-1))
