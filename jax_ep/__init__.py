"""jax_ep: expert-parallel dispatch and combine for JAX MoE layers."""

from ._api import combine, default_capacity, dispatch
from ._cuda import available as cuda_available
from ._cuda import buffer_size_hint, finalize, initialize, nccl_ranks
from ._types import Dispatched, Handle

__all__ = [
    "Dispatched",
    "Handle",
    "buffer_size_hint",
    "combine",
    "cuda_available",
    "default_capacity",
    "dispatch",
    "finalize",
    "initialize",
    "nccl_ranks",
]
__version__ = "0.1.0"
