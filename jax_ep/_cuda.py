"""The "cuda" backend: ``jax.ffi`` wrappers around the CUDA extension, and its resources.

The exchange stores rows straight into peer GPUs' library-owned receive buffers
over NVLink and synchronizes through flags in device memory. Those buffers are
created by :func:`initialize` before any computation runs, never during one.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._layout import LocalLayout
from ._types import Config, Handle
from ._validate import check_positive_int

try:
    from . import _jax_ep_cuda as _extension
except ImportError as _error:  # built without CUDA, or its libraries are missing
    _extension = None
    _import_error: ImportError | None = _error
else:
    _import_error = None

# What the fused combine kernel takes; other combines go through the exchange.
COMBINE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_FUSED_TOPK = 64
_CYCLES_PER_SECOND = 2_000_000_000  # SM clock upper bound; timeouts are approximate
_SETUP_TIMEOUT_S = 300.0  # least time initialize/finalize wait for other processes
_state: dict[str, Any] = {}  # what initialize() set up: axis_name, num_ranks, timeout_cycles, ...
_generation = 0  # initialize() calls so far: names this call's keys in jax.distributed's key-value store


def available() -> bool:
    """Whether the CUDA extension was built and loads here (``jax_ep.cuda_available``)."""
    return _extension is not None


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return "" if _import_error is None else f"the jax_ep CUDA extension did not load ({_import_error})"


def not_ready_reason(axis_name: Hashable, num_ranks: int) -> str:
    """Why backend 'cuda' cannot run a dispatch over this axis now ("" when it can)."""
    if not available():
        return unavailable_reason()
    if not _state:
        return "call jax_ep.initialize(mesh, axis_name, ...) first to create the peer-mapped buffers"
    if (_state["axis_name"], _state["num_ranks"]) != (axis_name, num_ranks):
        return (
            f"jax_ep.initialize was called for axis {_state['axis_name']!r} of size {_state['num_ranks']}, "
            f"but this dispatch runs over axis {axis_name!r} of size {num_ranks}"
        )
    return ""


def nccl_version() -> int:
    """Version code of the libnccl.so.2 the extension resolved (e.g. 22809 for 2.28.9)."""
    _register()
    return _extension.nccl_version()


def cuda_versions() -> tuple[int, int]:
    """CUDA runtime and driver version codes the extension sees (e.g. 13000 for 13.0)."""
    _register()
    return tuple(_extension.cuda_versions())


@functools.cache
def _register() -> None:
    if _extension is None:
        raise RuntimeError(f"jax_ep: backend 'cuda' is not available: {unavailable_reason()}")
    for name, registration in _extension.type_registrations().items():
        jax.ffi.register_ffi_type(name, registration, platform="CUDA")
    for name, target in _extension.registrations().items():
        jax.ffi.register_ffi_target(name, target, platform="CUDA")


def buffer_size_hint(
    *, num_ranks: int, num_tokens: int, hidden: int, topk: int, num_experts: int, dtype: Any = jnp.float32
) -> int:
    """Bytes of receive buffer per GPU that dispatch and combine of these shapes need.

    ``dtype`` is the widest dtype that is dispatched (``x`` and the combine
    cotangent); combine sends float32 partial sums, so rows are at least
    ``4 * hidden`` bytes.
    """
    itemsize = max(jnp.dtype(dtype).itemsize, 4)
    row_bytes = max(hidden * itemsize, 2 * topk * 4)
    return num_ranks * max(num_tokens * row_bytes, num_experts * 4)


def initialize(
    mesh: jax.sharding.Mesh,
    axis_name: Hashable,
    *,
    num_tokens: int,
    hidden: int,
    topk: int,
    num_experts: int,
    dtype: Any = jnp.float32,
    timeout_s: float = 60.0,
    num_sms: int | None = None,
) -> int:
    """Create the peer-mapped buffers of backend "cuda" for every EP group of ``mesh``.

    Each group is the GPUs along ``axis_name`` (the other mesh axes index the
    groups). GPUs of this process reach each other by peer access; with a mesh
    over several processes (after ``jax.distributed.initialize``, one or more
    GPUs each), every process calls ``initialize`` with the same arguments and
    the processes swap CUDA IPC handles of their buffers through
    ``jax.distributed``'s key-value store. Either way the GPUs of a group must
    reach each other by NVLink/P2P. Sizes are per rank, as
    seen inside ``shard_map``: ``num_tokens`` T, ``hidden`` H, ``topk`` K,
    ``num_experts`` E, and the widest ``dtype`` that is dispatched. A later call
    with larger shapes fails with a clear error. A rank waiting longer than
    ``timeout_s`` for its peers gives up instead of hanging: that call's outputs
    are invalid, and the next call on that GPU fails with an error naming the
    rank that never came, until ``initialize`` is called again. Calling again
    replaces the buffers; :func:`finalize` releases them.

    ``num_sms`` caps the SMs each transfer kernel occupies (one block of 1024
    threads per SM); the rest of the GPU stays free for compute that overlaps
    the exchange. ``None`` lets the kernels use every SM. Returns the number of
    SMs the kernels may use (the fewest over this process's GPUs).
    """
    sizes = dict(num_tokens=num_tokens, hidden=hidden, topk=topk, num_experts=num_experts)
    sizes = {name: check_positive_int(name, value) for name, value in sizes.items()}
    if not timeout_s > 0:
        raise ValueError(f"jax_ep.initialize: timeout_s must be positive, got {timeout_s}")
    if num_sms is not None:
        num_sms = check_positive_int("num_sms", num_sms)
    if axis_name not in mesh.axis_names:
        raise ValueError(f"jax_ep.initialize: axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    platforms = sorted({device.platform for device in mesh.devices.flat})
    if platforms != ["gpu"]:
        raise ValueError(f"jax_ep.initialize: backend 'cuda' needs a mesh of GPUs, got devices of {platforms}")
    processes = {device.process_index for device in mesh.devices.flat}
    if len(processes) > 1 and _key_value_client() is None:
        raise ValueError(
            f"jax_ep.initialize: the mesh spans {len(processes)} processes; call jax.distributed.initialize() "
            "first, so that they can swap their GPUs' buffer handles"
        )
    axis = mesh.axis_names.index(axis_name)
    num_ranks = mesh.devices.shape[axis]
    if sizes["num_experts"] % num_ranks:
        raise ValueError(
            f"jax_ep.initialize: num_experts must be a multiple of the size of axis {axis_name!r}; "
            f"expected a multiple of {num_ranks}, got {num_experts}"
        )
    _register()
    groups = np.moveaxis(mesh.devices, axis, -1).reshape(-1, num_ranks).tolist()
    capacity = buffer_size_hint(num_ranks=num_ranks, dtype=dtype, **sizes)
    _release()
    global _generation
    _generation += 1
    _extension.begin()
    try:
        sms = _connect_groups(groups, capacity, num_sms or 0, sorted(processes), timeout_s)
    except BaseException:
        _extension.close_peer_mappings()
        _extension.finalize()
        raise
    _state.update(
        axis_name=axis_name,
        num_ranks=num_ranks,
        timeout_cycles=int(timeout_s * _CYCLES_PER_SECOND),
        processes=sorted(processes),
        setup_timeout_ms=_setup_timeout_ms(timeout_s),
    )
    return sms


def _setup_timeout_ms(timeout_s: float) -> int:
    """How long initialize/finalize wait for the other processes: they may start many seconds apart."""
    return int(max(timeout_s, _SETUP_TIMEOUT_S) * 1000)


def _connect_groups(
    groups: list[list[Any]], capacity: int, num_sms: int, processes: list[int], timeout_s: float
) -> int:
    """Allocates this process's GPUs of every group, swaps IPC handles with the other processes, connects."""
    me = jax.process_index()
    local = [(g, r, d) for g, group in enumerate(groups) for r, d in enumerate(group) if d.process_index == me]
    for _, rank, device in local:
        _extension.allocate(device.local_hardware_id, rank, len(groups[0]), capacity, num_sms)
    handles = {}
    if len(processes) > 1:
        client = _key_value_client()
        for g, rank, device in local:
            client.key_value_set_bytes(_handles_key(g, rank), _extension.export_handles(device.local_hardware_id))
        for g in sorted({g for g, _, _ in local}):
            for rank, device in enumerate(groups[g]):
                if device.process_index != me:
                    handles[g, rank] = _fetch(client, _handles_key(g, rank), timeout_s, device, rank)
    for g, _, device in local:
        ordinals = [d.local_hardware_id if d.process_index == me else -1 for d in groups[g]]
        peer_handles = [handles.get((g, rank), b"") for rank in range(len(groups[g]))]
        _extension.connect(device.local_hardware_id, ordinals, peer_handles)
    sms = _extension.commit()
    if len(processes) > 1:
        _barrier("connected", processes, _setup_timeout_ms(timeout_s))
    return sms


def _barrier(name: str, processes: list[int], timeout_ms: int) -> None:
    _key_value_client().wait_at_barrier(f"jax_ep/{_generation}/{name}", timeout_ms, process_ids=processes)


def _handles_key(group: int, rank: int) -> str:
    return f"jax_ep/{_generation}/handles/{group}/{rank}"


def _fetch(client: Any, key: str, timeout_s: float, device: Any, rank: int) -> bytes:
    try:
        return client.blocking_key_value_get_bytes(key, _setup_timeout_ms(timeout_s))
    except Exception as error:  # the client raises its own error types
        raise RuntimeError(
            f"jax_ep.initialize: rank {rank} ({device}, process {device.process_index}) did not publish its "
            f"buffers within {_setup_timeout_ms(timeout_s) // 1000} s; every process must call jax_ep.initialize "
            f"with the same mesh ({error})"
        ) from error


def _key_value_client() -> Any:
    """jax.distributed's key-value store client, or None before jax.distributed.initialize (no public API yet)."""
    from jax._src import distributed

    return distributed.global_state.client


def _release() -> None:
    """Frees the buffers; across processes, every process first unmaps its peers' buffers, then all free."""
    if _extension is None:
        return
    try:
        if len(_state.get("processes", ())) > 1:
            _extension.close_peer_mappings()
            _barrier("released", _state["processes"], _state["setup_timeout_ms"])
    finally:
        _extension.finalize()
        _state.clear()


def finalize() -> None:
    """Release the buffers made by :func:`initialize`; computations compiled before must not run again.

    With a mesh over several processes, every process must call it.
    """
    _release()


def _result(like: jax.Array, shape: tuple[int, ...], dtype: Any) -> Any:
    """Result type that varies over the same mesh axes as ``like`` (inside ``shard_map``)."""
    return jax.typeof(like).update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)


def local_layout(topk_idx: jax.Array, num_experts: int, num_ranks: int) -> LocalLayout:
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


def _timeout_cycles() -> np.int64:
    _register()
    if not _state:
        raise ValueError("jax_ep: backend='cuda' needs jax_ep.initialize(mesh, axis_name, ...) first")
    return np.int64(_state["timeout_cycles"])


def exchange(buffer: jax.Array, counts: jax.Array, config: Config) -> tuple[jax.Array, jax.Array]:
    """Rows ``[:counts[d]]`` of ``buffer[d]`` to rank ``d`` by NVLink peer stores; see ``_ops._exchange``."""
    results = (_result(buffer, buffer.shape, buffer.dtype), _result(counts, counts.shape, jnp.int32))
    call = jax.ffi.ffi_call("jax_ep_exchange", results)
    return call(buffer, counts.astype(jnp.int32), timeout_cycles=_timeout_cycles())


def tokens_to_rows(x: jax.Array, self_token: jax.Array, handle: Handle) -> jax.Array:
    """Dispatch's data movement in one FFI call: layout rows ``[N, H]``; see ``_ops.to_experts``.

    ``self_token [T]`` lists the tokens this rank sends to itself, in order.
    """
    out = _result(x, (handle.row_slot.shape[0], x.shape[1]), x.dtype)
    call = jax.ffi.ffi_call("jax_ep_tokens_to_rows", out)
    args = (x, handle.token_dest_pos, self_token, handle.recv_rows, handle.recv_counts, handle.row_slot)
    return call(*args, timeout_cycles=_timeout_cycles())


def rows_to_tokens(y: jax.Array, weights: jax.Array, handle: Handle) -> jax.Array:
    """Combine's data movement and sums in one FFI call: ``[T, H]`` in ``y.dtype``; see ``_ops.to_tokens``.

    ``y [N, H]`` are layout rows and ``weights [N]`` float32 their weights.
    """
    out = _result(y, (handle.config.num_tokens, y.shape[1]), y.dtype)
    call = jax.ffi.ffi_call("jax_ep_rows_to_tokens", out)
    args = (y, weights, handle.recv_rows, handle.recv_counts, handle.token_dest_pos)
    return call(*args, timeout_cycles=_timeout_cycles())
