"""The "cuda" backend's ``jax.ffi`` wrappers around the CUDA extension."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from ._layout import LocalLayout

try:
    from . import _jax_ep_cuda as _extension
except ImportError as _error:  # built without CUDA, or its libraries are missing
    _extension = None
    _import_error: ImportError | None = _error
else:
    _import_error = None


def available() -> bool:
    """Whether the CUDA extension was built and loads here."""
    return _extension is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return "" if _import_error is None else f"the jax_ep CUDA extension did not load ({_import_error})"


def nccl_version() -> int:
    """Version code of the libnccl.so.2 the extension resolved (e.g. 22703 for 2.27.3)."""
    _register()
    return _extension.nccl_version()


@functools.cache
def _register() -> None:
    if _extension is None:
        raise RuntimeError(f"jax_ep: backend 'cuda' is not available: {unavailable_reason()}")
    for name, capsule in _extension.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")


def _result(like: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> Any:
    """Result type that varies over the same mesh axes as ``like`` (inside ``shard_map``)."""
    return jax.typeof(like).update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)


def routing_layout(topk_idx: jax.Array, num_experts: int, num_ranks: int) -> LocalLayout:
    """:func:`jax_ep._layout.local_layout` computed by the CUDA kernel, bit for bit."""
    _register()
    num_tokens, topk = topk_idx.shape
    results = (
        _result(topk_idx, (num_tokens, num_ranks), jnp.int32),
        _result(topk_idx, (num_ranks,), jnp.int32),
        _result(topk_idx, (num_experts,), jnp.int32),
        _result(topk_idx, (num_tokens, topk), jnp.int32),
        _result(topk_idx, (), jnp.int32),
    )
    call = jax.ffi.ffi_call("jax_ep_routing_layout", results)
    return LocalLayout(*call(topk_idx, num_experts=num_experts, num_ranks=num_ranks))
