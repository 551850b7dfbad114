"""jax_ep: expert-parallel dispatch and combine for JAX MoE layers."""

from .ep.group import Group, buffer_size_hint, cuda_available, finalize, initialize, nccl_ranks
from .ep.ops import combine, combine_finish, combine_start, default_capacity, dispatch, dispatch_finish, dispatch_start
from .ep.types import Dispatched, Handle, PendingCombine, PendingDispatch
from .gmm.grouped_matmul import grouped_matmul

__all__ = [
    "Dispatched",
    "Group",
    "Handle",
    "PendingCombine",
    "PendingDispatch",
    "buffer_size_hint",
    "combine",
    "combine_finish",
    "combine_start",
    "cuda_available",
    "default_capacity",
    "dispatch",
    "dispatch_finish",
    "dispatch_start",
    "finalize",
    "grouped_matmul",
    "initialize",
    "nccl_ranks",
]
__version__ = "0.1.0"  # the one place: pyproject.toml reads it, CHANGELOG.md names it
