"""rannc: automatic hybrid (pipeline + data) parallelism for ordinary PyTorch models."""
import torch  # noqa: F401  (loads libtorch before the extension)

from ._C import (  # noqa: F401
    CommError,
    CommTimeoutError,
    Error,
    InfeasiblePlanError,
    InternalError,
    InvalidGraphError,
    SerializationError,
    TraceError,
    get_local_rank,
    get_rank,
    get_world_size,
    set_log_level,
)
from . import amp, clipping, failure, named_backward, optimizer_share
from .amp import GradScaler  # noqa: F401
from .empty_weights import empty_weights  # noqa: F401
from .handshake import barrier  # noqa: F401
from .graph import SplitGraph, TracedGraph, load_ir, trace  # noqa: F401
from .module import RaNNCModule  # noqa: F401
from .options import Options, option_docs  # noqa: F401
from .padding import pad_to_same_length  # noqa: F401
from .process_group import init_process_group  # noqa: F401
from .planning import Plan, ProfileCache, plan  # noqa: F401

failure.install()  # [Note: failure notices]
clipping.install()  # [Note: torch's clip_grad_norm_]
amp.install()  # [Note: agreed steps]
optimizer_share.install()  # [Note: optimizers made after wrapping]
named_backward.install()  # [Note: backward of named parameters]

__all__ = [
    "RaNNCModule", "Options", "option_docs", "GradScaler", "empty_weights", "pad_to_same_length", "init_process_group", "trace", "plan", "Plan", "ProfileCache", "load_ir", "TracedGraph", "SplitGraph", "set_log_level",
    "Error", "TraceError", "InvalidGraphError", "SerializationError", "InfeasiblePlanError",
    "InternalError", "CommError", "CommTimeoutError",
    "get_rank", "get_world_size", "get_local_rank", "barrier",
]
