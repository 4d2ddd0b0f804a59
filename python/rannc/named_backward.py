"""Backward of the parameters named in `inputs`, for RaNNCModule parameters.

[Note: backward of named parameters] `loss.backward(inputs=[...])` accumulates into the
tensors named only (a GAN's `loss_d.backward(inputs=list(D.parameters()))`, one part of a
model trained at a time). A RaNNCModule's parameters are in no graph that autograd sees
(its stages hold their own), so autograd ran nothing for them: .grad stayed None and they
never trained, without a word. `import rannc` therefore replaces torch.autograd.backward
(which Tensor.backward calls) with one that, where `inputs` names parameters of a
trained RaNNCModule, asks autograd for the module's anchor instead of them (the leaf of
every call's outputs, [Note: gradients without .grad] in deployed.py) and adds the call's
step gradients to the parameters named only. Any other backward is torch's own.
"""
from __future__ import annotations

import contextvars

import torch

from . import registry

# ids of the RaNNCModule parameters the running backward names, or None (all of them)
NAMED = contextvars.ContextVar("rannc_named_parameters", default=None)

_torch_backward = torch.autograd.backward


def _backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
              grad_variables=None, inputs=None):
    if inputs is None:
        return _torch_backward(tensors, grad_tensors, retain_graph, create_graph,
                               grad_variables, inputs=inputs)
    named = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
    trained = [m for m in registry.modules() if m._deployed.get(True) is not None]
    owner = {id(p): m for m in trained for p in m.module.parameters()}
    modules = {id(owner[id(t)]): owner[id(t)] for t in named
               if isinstance(t, torch.Tensor) and id(t) in owner}
    if not modules:
        return _torch_backward(tensors, grad_tensors, retain_graph, create_graph,
                               grad_variables, inputs=inputs)
    rest = [t for t in named if not (isinstance(t, torch.Tensor) and id(t) in owner)]
    anchors = [m._anchor for m in modules.values()]
    token = NAMED.set({id(t) for t in named if isinstance(t, torch.Tensor) and id(t) in owner})
    try:
        return _torch_backward(tensors, grad_tensors, retain_graph, create_graph,
                               grad_variables, inputs=rest + anchors)
    finally:
        NAMED.reset(token)


def install() -> None:
    torch.autograd.backward = _backward
