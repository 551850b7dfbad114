"""The "cuda" backend: ``jax.ffi`` wrappers around the CUDA extension, and its resources.

The exchange stores rows straight into peer GPUs' library-owned receive buffers
over NVLink and synchronizes through flags in device memory. Those buffers are
created by :func:`initialize` before any computation runs, never during one.
"""

from __future__ import annotations

import functools
import json
import os
import socket
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
TRANSPORTS = ("auto", "nccl")
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
    transport: str = "auto",
) -> int:
    """Create the peer-mapped buffers of backend "cuda" for every EP group of ``mesh``.

    Each group is the GPUs along ``axis_name`` (the other mesh axes index the
    groups). GPUs of this process reach each other by peer access; with a mesh
    over several processes (after ``jax.distributed.initialize``, one or more
    GPUs each), every process calls ``initialize`` with the same arguments and
    the processes swap CUDA IPC handles of their buffers through
    ``jax.distributed``'s key-value store.

    How rows travel between two GPUs of a group: with ``transport="auto"``,
    by stores over NVLink/P2P into each other's buffers when both are on one
    host and can reach each other by P2P, and through NCCL otherwise (other
    hosts, no P2P, or ``NCCL_P2P_DISABLE=1`` in the environment).
    ``transport="nccl"`` sends every pair of distinct GPUs through NCCL.
    NCCL moves fixed-size regions of ``T`` rows per rank pair, so the counts
    never leave the GPU. Sizes are per rank, as
    seen inside ``shard_map``: ``num_tokens`` T, ``hidden`` H, ``topk`` K,
    ``num_experts`` E, and the widest ``dtype`` that is dispatched. A later call
    with larger shapes fails with a clear error. A rank waiting longer than
    ``timeout_s`` for its peers gives up instead of hanging: that call's outputs
    are invalid, and the next call on that GPU fails with an error naming the
    rank that never came, until ``initialize`` is called again (an NCCL
    transfer that does not finish within ``timeout_s`` aborts the group's
    communicator, with the same effect). Calling again
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
    if transport not in TRANSPORTS:
        raise ValueError(f"jax_ep.initialize: transport must be one of {TRANSPORTS}, got {transport!r}")
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
        sms, nccl_ranks = _connect_groups(groups, capacity, num_sms or 0, sorted(processes), timeout_s, transport)
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
        nccl_ranks=nccl_ranks,
    )
    return sms


def nccl_ranks() -> dict[Any, tuple[int, ...]]:
    """For each of this process's GPUs in an EP group: the ranks it reaches through NCCL, not by peer stores."""
    return dict(_state.get("nccl_ranks", {}))


def _setup_timeout_ms(timeout_s: float) -> int:
    """How long initialize/finalize wait for the other processes: they may start many seconds apart."""
    return int(max(timeout_s, _SETUP_TIMEOUT_S) * 1000)


def _connect_groups(
    groups: list[list[Any]], capacity: int, num_sms: int, processes: list[int], timeout_s: float, transport: str
) -> tuple[int, dict[Any, tuple[int, ...]]]:
    """Allocates this process's GPUs of every group, swaps IPC handles and NCCL ids with the other processes,
    connects. Returns the SMs the kernels may use and each local GPU's NCCL ranks."""
    me = jax.process_index()
    local = [(g, r, d) for g, group in enumerate(groups) for r, d in enumerate(group) if d.process_index == me]
    for _, rank, device in local:
        _extension.allocate(device.local_hardware_id, rank, len(groups[0]), capacity, num_sms)
    client = _key_value_client() if len(processes) > 1 else None
    by_nccl = _nccl_pairs(groups, local, transport, client, timeout_s)
    handles = {}
    if client is not None:
        for g, rank, device in local:
            client.key_value_set_bytes(_key("handles", g, rank), _extension.export_handles(device.local_hardware_id))
        for g in sorted({g for g, _, _ in local}):
            for rank, device in enumerate(groups[g]):
                peer_stores = any(not by_nccl[g][mine][rank] for h, mine, _ in local if h == g)
                if device.process_index != me and peer_stores:
                    handles[g, rank] = _fetch(client, _key("handles", g, rank), timeout_s, device, rank)
    for g, rank, device in local:
        ordinals = [d.local_hardware_id if d.process_index == me else -1 for d in groups[g]]
        peer_handles = [handles.get((g, r), b"") for r in range(len(groups[g]))]
        _extension.connect(device.local_hardware_id, ordinals, peer_handles, by_nccl[g][rank])
    nccl_groups = sorted({g for g, _, _ in local if any(any(row) for row in by_nccl[g])})
    if nccl_groups:
        ids = {g: _nccl_unique_id(groups[g], g, client, timeout_s) for g in nccl_groups}
        members = [(g, d) for g, _, d in local if g in ids]
        _extension.connect_nccl(
            [d.local_hardware_id for _, d in members], [ids[g] for g, _ in members], int(timeout_s * 1000)
        )
    sms = _extension.commit()
    if client is not None:
        _barrier("connected", processes, _setup_timeout_ms(timeout_s))
    reached = {d: tuple(r for r, nccl in enumerate(by_nccl[g][rank]) if nccl) for g, rank, d in local}
    return sms, reached


def _nccl_pairs(
    groups: list[list[Any]], local: list[tuple[int, int, Any]], transport: str, client: Any, timeout_s: float
) -> list[list[list[bool]]]:
    """``[g][a][b]``: whether ranks a and b of group g swap rows through NCCL; the same in every process."""
    force = transport == "nccl" or os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
    no_p2p = [
        [g, a, b]
        for g, a, d in local
        for h, b, e in local
        if h == g and a != b and not _extension.can_access_peer(d.local_hardware_id, e.local_hardware_id)
    ]
    facts = {jax.process_index(): {"host": socket.gethostname(), "force": force, "no_p2p": no_p2p}}
    if client is not None:
        client.key_value_set(_key("facts", jax.process_index()), json.dumps(facts[jax.process_index()]))
        for process in {d.process_index for group in groups for d in group} - set(facts):
            key = _key("facts", process)
            try:
                facts[process] = json.loads(client.blocking_key_value_get(key, _setup_timeout_ms(timeout_s)))
            except Exception as error:  # the client raises its own error types
                raise RuntimeError(
                    f"jax_ep.initialize: process {process} did not call jax_ep.initialize within "
                    f"{_setup_timeout_ms(timeout_s) // 1000} s ({error})"
                ) from error
    if len({fact["force"] for fact in facts.values()}) > 1:
        raise ValueError(
            "jax_ep.initialize: the processes disagree on sending every pair through NCCL: pass the same "
            "transport everywhere and set NCCL_P2P_DISABLE alike in every process"
        )
    missing = {tuple(pair) for fact in facts.values() for pair in fact["no_p2p"]}
    host = {process: fact["host"] for process, fact in facts.items()}
    return [
        [
            [
                a != b and (force or host[d.process_index] != host[e.process_index] or (g, a, b) in missing)
                for b, e in enumerate(group)
            ]
            for a, d in enumerate(group)
        ]
        for g, group in enumerate(groups)
    ]


def _nccl_unique_id(group: list[Any], g: int, client: Any, timeout_s: float) -> bytes:
    """The NCCL id of group g: made by the process of its rank 0 and passed through the key-value store."""
    if client is None:
        return _extension.nccl_unique_id()
    if group[0].process_index == jax.process_index():
        unique_id = _extension.nccl_unique_id()
        client.key_value_set_bytes(_key("nccl_id", g), unique_id)
        return unique_id
    return _fetch(client, _key("nccl_id", g), timeout_s, group[0], 0, what="NCCL unique id")


def _barrier(name: str, processes: list[int], timeout_ms: int) -> None:
    _key_value_client().wait_at_barrier(_key(name), timeout_ms, process_ids=processes)


def _key(*parts: Any) -> str:
    """A key of this initialize call in jax.distributed's key-value store."""
    return "/".join(["jax_ep", str(_generation), *map(str, parts)])


def _fetch(client: Any, key: str, timeout_s: float, device: Any, rank: int, what: str = "buffers") -> bytes:
    try:
        return client.blocking_key_value_get_bytes(key, _setup_timeout_ms(timeout_s))
    except Exception as error:  # the client raises its own error types
        raise RuntimeError(
            f"jax_ep.initialize: rank {rank} ({device}, process {device.process_index}) did not publish its "
            f"{what} within {_setup_timeout_ms(timeout_s) // 1000} s; every process must call jax_ep.initialize "
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
