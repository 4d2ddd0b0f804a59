"""One options table for RaNNCModule and rannc.plan: converted once, checked once (by the
planner in C++ where it is the planner's), under the names the user writes."""
import os
from dataclasses import fields

import pytest

import rannc
import zoo
from rannc.options import MODULE, PLAN, Options

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "options.md")


def test_every_option_is_documented():
    text = open(DOCS).read()
    missing = [f.name for f in fields(Options) if f"`{f.name}`" not in text]
    assert not missing, f"docs/options.md does not name {missing}"


@pytest.mark.parametrize("name,value,message", [
    ("num_blocks", 0, "option num_blocks is 0; expected at least 1"),
    ("plan_tolerance", 1.5, "option plan_tolerance is 1.5"),
    ("memory_margin", -0.1, "option memory_margin is -0.1"),
    ("num_microbatches", -2, "option num_microbatches is -2"),
    ("replicas", "2,1", "option replicas is 2,1; expected one count per stage: set num_stages to 2"),
    ("replicas", "2,x", "option replicas is '2,x'"),
    ("recompute", "sometimes", "option recompute is 'sometimes'; expected auto, always or never"),
    ("schedule", "gpipe", "option schedule is 'gpipe'; expected auto, 1f1b, zb_h1, interleaved or fill_drain"),
    ("profile_cpu_clock", "sundial", "option profile_cpu_clock is 'sundial'"),
    ("cost_model", "guess", "option cost_model is 'guess'; expected profile, analytic"),
    ("precision", "fp8", "option precision is 'fp8'"),
    ("num_stages", "two", "option num_stages is 'two'"),
    ("pad_values", "tokens", "option pad_values is 'tokens': expected \"transformers\" or a dict"),
    ("pad_values", {"input_ids": "pad"}, "option pad_values is {'input_ids': 'pad'}: expected"),
    ("pad_multiple_of", 0, "option pad_multiple_of is 0: expected at least 1"),
])
def test_a_bad_value_names_the_option_before_anything_runs(name, value, message):
    with pytest.raises(rannc.Error) as info:
        Options.resolve({name: value}, environ={})
    assert message in str(info.value)


def test_each_entry_point_refuses_the_others_options():
    with pytest.raises(rannc.Error, match="option.s. training belong to rannc.plan, not RaNNCModule"):
        Options.resolve({"training": False}, environ={}, entry=MODULE)
    with pytest.raises(rannc.Error, match="option.s. load_plan belong to RaNNCModule, not rannc.plan"):
        Options.resolve({"load_plan": "x"}, environ={}, entry=PLAN)
    # an environment variable of the other entry point's option is not read
    assert Options.resolve({}, environ={"RANNC_TRAINING": "0"}).training is True
    assert Options.resolve({}, environ={"RANNC_MAX_MICROBATCHES": "8"}).max_microbatches == 8
    # a dict option from the environment: its JSON
    assert Options.resolve({}, environ={"RANNC_PAD_VALUES": '{"input_ids": 0, "labels": -100}'}
                           ).pad_values == {"input_ids": 0, "labels": -100}


def test_the_planner_gets_the_users_names_and_values():
    o = Options.resolve({"num_stages": "3", "replicas": [2, 1, 1], "num_microbatches": 5,
                         "recompute": "always", "max_microbatches": 16}, environ={})
    p = o.planner_options(world_size=8)
    assert (p.num_stages, p.replicas, p.num_microbatches, p.recompute, p.max_microbatches) == \
        (3, [2, 1, 1], 5, "always", 16)
    # the world-dependent check waits for the world: 2+1+1 devices do not divide 6
    p = o.planner_options(world_size=6)
    model, args, kwargs = zoo.make("mlp", batch=4)
    g = rannc.trace(model, args, kwargs)
    device = rannc._C.DeviceSpec()
    with pytest.raises(rannc.Error, match="option replicas is 2,1,1; expected counts whose sum "
                       "divides the world size 6"):
        rannc._C.plan_analytic(g.ir, device, p)


def test_recompute_always_is_planned_so_the_plan_says_and_costs_it():
    model, args, kwargs = zoo.make("gpt", batch=4)
    opts = dict(world_size=2, device_memory="16GiB", cost_model="analytic", num_stages=2)
    auto = rannc.plan(model, args, kwargs, **opts)
    always = rannc.plan(model, args, kwargs, recompute="always", **opts)
    assert not any(s.recompute for s in auto.stages())
    assert all(s.recompute for s in always.stages())
    assert always.iteration_time > auto.iteration_time
