"""jax_ep: expert-parallel dispatch and combine for JAX MoE layers."""

from ._api import combine, default_capacity, dispatch
from ._types import Dispatched, Handle

__all__ = ["Dispatched", "Handle", "combine", "default_capacity", "dispatch"]
__version__ = "0.1.0"
