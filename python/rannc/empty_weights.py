"""Building a model without its weights: `with rannc.empty_weights(): model = Build()` puts
every parameter on the meta device (shape and dtype, no storage) and leaves buffers real,
so no rank ever holds the whole model ([Note: models built on the meta device] in
placement.py)."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def empty_weights():
    """Within it, every parameter a module registers moves to the meta device as it is
    registered (one parameter's storage at a time, never initialised); buffers, which hold
    data such as position ids, are built as usual. Wrap the model in RaNNCModule and load
    its weights with load_checkpoint before the first call: each rank allocates and reads
    only its stages' parameters."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        param = module._parameters[name]
        if param is not None and not param.is_meta:  # a subclass keeps its attributes
            module._parameters[name] = type(param)(param.data.to("meta"),
                                                   requires_grad=param.requires_grad,
                                                   **param.__dict__)

    torch.nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
