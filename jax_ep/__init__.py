"""jax_ep: expert-parallel dispatch and combine for JAX MoE layers."""

from ._api import combine, default_capacity, dispatch
from ._group import Group, buffer_size_hint, finalize, initialize, nccl_ranks
from ._group import available as cuda_available
from ._grouped_matmul import grouped_matmul
from ._types import Dispatched, Handle

__all__ = [
    "Dispatched",
    "Group",
    "Handle",
    "buffer_size_hint",
    "combine",
    "cuda_available",
    "default_capacity",
    "dispatch",
    "finalize",
    "grouped_matmul",
    "initialize",
    "nccl_ranks",
]
__version__ = "0.2.0"
