"""EP groups of backend "cuda": :func:`initialize` creates the library-owned, peer-mapped GPU memory of a mesh
axis, :func:`finalize` releases it. Nothing is allocated or synchronized while a computation runs.

A :class:`Group` serves one mesh axis (found by its name at trace time); several groups, for different axes
or meshes, can live in one process. Everything that changes from call to call (call numbers, flags, the
abort word) lives in the group's device memory, and the timeout in the group's fixed kernel arguments, not
in the traced program, so the calls can be captured in XLA command buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import re
import socket
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import call_sites
from ._validate import check_positive_int

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NCCL reads it once, at the process's first NCCL call (maybe XLA's)

try:
    from . import _jax_ep_cuda as _extension
except ImportError as _error:  # built without CUDA, or its libraries are missing
    _extension = None
    _import_error: ImportError | None = _error
else:
    _import_error = None

TRANSPORTS = ("auto", "nccl")
_SETUP_TIMEOUT_S = 300.0  # least time initialize/finalize wait for other processes
_ids = itertools.count(1)  # group ids, local to this process
_generations: dict[str, int] = {}  # initialize calls so far for each mesh axis (its key-value store namespace)


def available() -> bool:
    """Whether the CUDA extension was built and loads here; it loads without a GPU too (see :func:`cuda_available`)."""
    return _extension is not None


def cuda_available() -> bool:
    """Whether backend "cuda" can run here (``jax_ep.cuda_available``): the extension loads and jax sees a CUDA GPU.

    Asking jax for its CUDA devices initializes its backends, as ``jax.devices()`` does.
    """
    if not available():
        return False
    try:
        return len(jax.local_devices(backend="cuda")) > 0
    except RuntimeError:  # no CUDA backend: jax without its CUDA plugin, no GPU, or JAX_PLATFORMS without cuda
        return False


def unavailable_reason() -> str:
    """Why :func:`available` is False ("" when it is True)."""
    return "" if _import_error is None else why_not_loaded(_import_error, Path(__file__).parents[1])


def why_not_loaded(error: ImportError, package: Path) -> str:
    """What a failed import of the extension (``jax_ep/ep/_jax_ep_cuda``) means, and what to do, for the jax_ep
    package at ``package``."""
    root = package.parent
    built = any((package / "ep").glob("_jax_ep_cuda*"))
    if not built and (root / "pyproject.toml").is_file() and (root / "ffi").is_dir():
        return (
            f"the jax_ep CUDA extension did not load: this jax_ep is the source tree {package}, which holds no "
            f"built extension (Python found it first because it started in {root}). Run from another directory "
            "to use the installed jax_ep, or build in place with `python -m pip install -e .` "
            f"(BUILD.md). The import said: {error}"
        )
    return (
        f"the jax_ep CUDA extension did not load ({error}): jax_ep was built without CUDA, or the CUDA runtime or "
        "NCCL libraries it needs were not found; BUILD.md says how to build and run it"
    )


def extension() -> Any:
    """The loaded extension, with its FFI targets registered with jax."""
    _register()
    return _extension


@functools.cache
def limits() -> dict[str, int]:
    """The kernels' limits (ffi/kernels/launch.h): ``max_topk`` (a token's rows are held in shared memory) and
    ``max_experts`` (so are the receivers' row tables). Needs the extension: raises :func:`extension`'s error."""
    return dict(extension().limits())


def over_limits(*, topk: int, num_experts: int) -> str:
    """Why backend "cuda" cannot take these sizes (:func:`limits`), or ""."""
    limit = limits()
    if topk > limit["max_topk"]:
        return f"topk must be at most {limit['max_topk']} for backend 'cuda', got {topk}"
    if num_experts > limit["max_experts"]:
        return f"num_experts must be at most {limit['max_experts']} for backend 'cuda', got {num_experts}"
    return ""


def nccl_version() -> int:
    """Version code of the libnccl.so.2 the extension resolved (e.g. 22809 for 2.28.9)."""
    return extension().nccl_version()


def cuda_versions() -> tuple[int, int]:
    """CUDA runtime and driver version codes the extension sees (e.g. 13000 for 13.0)."""
    return tuple(extension().cuda_versions())


_registered = False


def _register() -> None:
    global _registered
    if _extension is None:
        raise RuntimeError(f"jax_ep: backend 'cuda' is not available: {unavailable_reason()}")
    if not _registered:
        for name, registration in _extension.type_registrations().items():
            jax.ffi.register_ffi_type(name, registration, platform="CUDA")
        for name, target in _extension.registrations().items():
            jax.ffi.register_ffi_target(name, target, platform="CUDA")
        _registered = True


def buffer_size_hint(
    *,
    num_ranks: int,
    num_tokens: int,
    hidden: int,
    topk: int,
    num_experts: int,
    dtype: Any = jnp.float32,
    nccl: bool = False,
) -> int:
    """Bytes of GPU memory that :func:`initialize` allocates on each GPU of a group for these shapes.

    ``dtype`` is the widest dtype that travels: ``x``, the expert outputs and
    their cotangents, and combine's partial sums (float32 with
    ``partial_dtype=jnp.float32``). The bytes are:

    * the staging, two halves, so that a call never overwrites what a peer may
      still read of the call before:
      ``2 * R * (16 + 16 * ceil((L + 1) / 4) + ceil16(T * K * 12) + T * ceil16(H * itemsize))``;
    * with ``nccl`` (the GPU reaches some rank through NCCL): an outbox and an
      inbox of one staging half each, as much again;
    * the routing kernel's scratch (int32 counts of ``T``, ``K``, ``E``, ``R``)
      and the group's signals and peer table (about 10 KB).

    The CUDA extension computes it (``ffi/kernels/launch.h``, ``DeviceBytes``), as the kernels check it; without
    the extension this raises the RuntimeError of backend "cuda" being unavailable.
    """
    return extension().device_bytes(num_ranks, num_tokens, _row_bytes(hidden, dtype), topk, num_experts, bool(nccl))


def _row_bytes(hidden: int, dtype: Any) -> int:
    return hidden * jnp.dtype(dtype).itemsize


@dataclasses.dataclass(eq=False)
class Group:
    """The GPU memory of one EP axis, made by :func:`initialize`; pass it nowhere, find it by ``axis_name``.

    * ``axis_name``, ``num_ranks``: the mesh axis and its size ``R``.
    * ``num_sms``: the SMs each kernel may occupy (the fewest over this process's GPUs).
    * ``sizes``: the largest per-rank ``num_tokens``, ``hidden``, ``topk``, ``num_experts`` and ``dtype``.
    """

    id: int
    namespace: str  # of its keys in jax.distributed's key-value store, the same in every process
    axis_name: Hashable
    num_ranks: int
    num_sms: int
    sizes: dict[str, Any]
    processes: list[int]
    setup_timeout_ms: int
    nccl: dict[Any, tuple[int, ...]]
    devices: frozenset = frozenset()  # this process's GPUs in the group
    released: bool = False

    def uses_nccl(self) -> bool:
        """Whether a GPU of this process reaches some rank through NCCL: its calls then run outside command buffers
        (XLA must not capture NCCL calls that other processes capture on their own)."""
        return any(self.nccl.values())

    def nccl_ranks(self) -> dict[Any, tuple[int, ...]]:
        """For each of this process's GPUs in the group: the ranks it reaches through NCCL, not by peer stores."""
        return dict(self.nccl)

    def check(self) -> None:
        """Raise the error a kernel of this group recorded on any of this process's GPUs (RuntimeError), if any.

        Calls captured in an XLA command buffer cannot fail on their own: a failed call leaves NaN in its
        float outputs and -1 in its counts, and the error is raised here or by the next call XLA launches.
        The message ends with where in this process's code the call sites it names were traced.
        """
        if self.released:
            raise RuntimeError(f"jax_ep: the group of axis {self.axis_name!r} was finalized")
        message = extension().group_error(self.id)
        if message:
            sites = sorted({int(site) for site in re.findall(r"call site (\d+)", message)})
            where = [f"call site {site}: {call_sites.describe(site)}" for site in sites]
            raise RuntimeError("\n".join([message, *where]))

    def host_launches(self) -> int:
        """How often XLA launched this group's calls from the host, over all of this process's GPUs.

        Under XLA command buffers (CUDA graphs) the calls are recorded once and replayed, so this stays
        below the number of calls that ran.
        """
        return int(extension().group_launches(self.id))

    def finalize(self) -> None:
        """Release the group's memory (collective across processes); compiled computations must not run again.

        It first waits for every computation whose results are still alive on the group's GPUs, so that steps
        issued before it, and not waited for, finish as they would have (one that failed raises on its own results,
        not here). The memory goes once every kernel already
        launched has finished, and in several processes, once every process has stopped reading its peers' memory.
        Then it clears JAX's caches (``jax.clear_caches()``): a jitted function called afterwards is traced again,
        for the group ``initialize`` makes next, since a computation compiled for this group, replayed from an XLA
        command buffer, would run its kernels on the freed memory without reaching a handler that could refuse.
        Computations compiled ahead of time (``.lower(...).compile()``) before it must not run again.

        Over several processes, a process frees its memory only once every process has said (at a barrier) that it
        no longer maps it: CUDA leaves freeing memory another process still maps undefined. If the barrier fails,
        the group is stopped and its error raised, and this process's memory stays allocated until it exits.
        """
        if self.released:
            return
        self.released = True
        if _groups.get(self.axis_name) is self:
            del _groups[self.axis_name]
        unmapped_everywhere = len(self.processes) == 1
        try:
            _wait_for_results(self.devices)
            if not unmapped_everywhere:
                _extension.close_peer_mappings(self.id)
                _barrier(self.namespace, "released", self.processes, self.setup_timeout_ms)
                unmapped_everywhere = True
        finally:
            if unmapped_everywhere:
                _extension.release(self.id)
            else:  # stopped (no handler launches), its peers' memory unmapped, its own kept
                _extension.close_peer_mappings(self.id)
            jax.clear_caches()


def _wait_for_results(devices: frozenset) -> None:
    """Waits for every computation whose results are alive on ``devices``. A failed one (a jax_ep call that gave up,
    say) raises on its own results, not here: finalize goes on to its barrier, so that no other process waits there
    in vain, and the extension synchronizes the GPUs before it frees anything."""
    for array in [a for a in jax.live_arrays() if a.devices() & devices]:
        with contextlib.suppress(Exception):
            array.block_until_ready()


_groups: dict[Hashable, Group] = {}


def group_for(axis_name: Hashable) -> Group | None:
    """The live group of a mesh axis, or None."""
    return _groups.get(axis_name)


def group_by_id(group_id: int) -> Group:
    """The live group with id ``group_id``; a RuntimeError when it was finalized since a trace found it."""
    for group in _groups.values():
        if group.id == group_id:
            return group
    raise RuntimeError(
        f"jax_ep: the group (id {group_id}) that this computation was traced for was finalized; call "
        "jax_ep.initialize again and trace the computation again"
    )


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
) -> Group:
    """Create the GPU memory of backend "cuda" for every EP group along ``axis_name`` of ``mesh``.

    Each EP group is the GPUs along ``axis_name`` (the other mesh axes index
    the groups). GPUs of this process reach each other by peer access; with a
    mesh over several processes (after ``jax.distributed.initialize``), every
    process calls ``initialize`` with the same arguments and the processes
    swap CUDA IPC handles of their buffers through ``jax.distributed``'s
    key-value store.

    How rows travel between two GPUs of a group: with ``transport="auto"``,
    by stores over NVLink/P2P into each other's buffers when both are on one
    host and reach each other by P2P both ways, and through NCCL otherwise
    (other hosts, no P2P in either direction, or ``NCCL_P2P_DISABLE=1`` in
    the environment). P2P is checked with ``cudaDeviceCanAccessPeer`` between
    GPUs of one process, and between processes of one host by opening the
    other GPU's CUDA IPC handles. Every process decides from the same facts,
    swapped through the key-value store, so both GPUs of a pair always pick
    the same transport. ``transport="nccl"`` sends every pair of distinct
    GPUs through NCCL.

    Sizes are per rank, as seen inside ``shard_map``: ``num_tokens`` T,
    ``hidden`` H, ``topk`` K and ``num_experts`` E (at most the kernels'
    ``jax_ep.ep.group.limits()``), and the widest ``dtype`` that travels
    (see :func:`buffer_size_hint`). A later call with larger shapes fails
    with a clear error. A rank that waits longer than
    ``timeout_s`` for a peer gives up and tells every peer: that call's
    outputs hold NaN, and every later call of the group fails with an error
    naming the rank that never came, until ``initialize`` is called again.
    The group's first call waits at least 300 s (or ``timeout_s``, if
    longer) in the first call of each compiled jax_ep call (each call in
    each executable), since processes may finish compiling it minutes
    apart; so does the watchdog of the swaps through NCCL.
    ``num_sms`` caps the SMs each kernel occupies (one block of 1024 threads
    per SM), leaving the rest of the GPU to compute and collectives that run
    beside the exchange; ``None``: all but 32 SMs (at least half) in a group
    of several GPUs, every SM in a group of one.

    Calling it again for the same ``axis_name`` replaces that group.
    Returns the :class:`Group`; :func:`finalize` (or ``Group.finalize``)
    releases it.
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
    processes = sorted({device.process_index for device in mesh.devices.flat})
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
    reason = over_limits(topk=sizes["topk"], num_experts=sizes["num_experts"])
    if reason:
        raise ValueError(f"jax_ep.initialize: {reason}")
    namespace = _namespace(mesh, axis_name)  # first: every process counts this call, whatever raises below
    if axis_name in _groups:
        _groups[axis_name].finalize()
    groups = np.moveaxis(mesh.devices, axis, -1).reshape(-1, num_ranks).tolist()
    local_experts = sizes["num_experts"] // num_ranks
    row_bytes = _row_bytes(sizes["hidden"], dtype)
    staging = _extension.staging_bytes(num_ranks, sizes["num_tokens"], row_bytes, sizes["topk"], local_experts)
    scratch = _extension.routing_scratch_ints(num_ranks, sizes["num_tokens"], sizes["topk"], sizes["num_experts"])
    group_id = next(_ids)
    setup_ms = _setup_ms(timeout_s)
    _extension.begin(group_id)
    try:
        sms, nccl = _connect(
            group_id, namespace, groups, staging, scratch, num_sms or 0, processes, timeout_s, transport
        )
    except BaseException:
        _extension.close_peer_mappings(group_id)
        _extension.release(group_id)
        raise
    sizes = {**sizes, "dtype": jnp.dtype(dtype)}
    group = Group(group_id, namespace, axis_name, num_ranks, sms, sizes, processes, setup_ms, nccl, frozenset(nccl))
    _groups[axis_name] = group
    return group


def finalize(axis_name: Hashable | None = None) -> None:
    """Release the group of ``axis_name``, or every group when None; collective across processes."""
    for group in [g for name, g in _groups.items() if axis_name is None or name == axis_name]:
        group.finalize()


def nccl_ranks(axis_name: Hashable | None = None) -> dict[Any, tuple[int, ...]]:
    """For each of this process's GPUs in a group (of ``axis_name``, or any): the ranks it reaches through NCCL."""
    out = {}
    for name, group in _groups.items():
        if axis_name is None or name == axis_name:
            out.update(group.nccl_ranks())
    return out


def _namespace(mesh: jax.sharding.Mesh, axis_name: Hashable) -> str:
    """The key-value store namespace of an initialize call: the mesh axis and how often this process has initialized
    it, which every process agrees on (they call initialize alike), whatever else each initialized before."""
    axis = repr((axis_name, mesh.axis_names, mesh.devices.shape, [d.id for d in mesh.devices.flat]))
    digest = hashlib.sha256(axis.encode()).hexdigest()[:16]
    _generations[digest] = _generations.get(digest, 0) + 1
    return f"{digest}/{_generations[digest]}"


def _connect(
    group_id: int,
    namespace: str,
    groups: list[list[Any]],
    staging: int,
    scratch: int,
    num_sms: int,
    processes: list[int],
    timeout_s: float,
    transport: str,
) -> tuple[int, dict[Any, tuple[int, ...]]]:
    """Allocates this process's GPUs of every EP group, swaps IPC handles and NCCL ids with the other processes,
    connects. Returns the SMs the kernels may use and each local GPU's NCCL ranks."""
    me = jax.process_index()
    local = [(g, r, d) for g, group in enumerate(groups) for r, d in enumerate(group) if d.process_index == me]
    for _, rank, device in local:
        _extension.allocate(
            group_id,
            device.local_hardware_id,
            rank,
            len(groups[0]),
            staging,
            scratch,
            num_sms,
            timeout_s,
            _setup_ms(timeout_s) / 1000,  # the first call: processes may finish compiling minutes apart
        )
    client = _key_value_client() if len(processes) > 1 else None
    handles: dict[tuple[int, int], bytes] = {}  # (g, rank) of other processes' GPUs
    if client is not None:  # before the transport decision: the other processes of this host probe them
        for g, rank, device in local:
            client.key_value_set_bytes(
                _key(namespace, "handles", g, rank), _extension.export_handles(group_id, device.local_hardware_id)
            )
    by_nccl = _nccl_pairs(group_id, namespace, groups, local, transport, client, timeout_s, handles)
    if client is not None:
        for g in sorted({g for g, _, _ in local}):
            for rank, device in enumerate(groups[g]):
                peer_stores = any(not by_nccl[g][mine][rank] for h, mine, _ in local if h == g)
                if device.process_index != me and peer_stores and (g, rank) not in handles:
                    handles[g, rank] = _fetch(client, _key(namespace, "handles", g, rank), timeout_s, device, rank)
    for g, rank, device in local:
        ordinals = [d.local_hardware_id if d.process_index == me else -1 for d in groups[g]]
        peer_handles = [handles.get((g, r), b"") for r in range(len(groups[g]))]
        _extension.connect(group_id, device.local_hardware_id, ordinals, peer_handles, by_nccl[g][rank])
    nccl_groups = sorted({g for g, _, _ in local if any(any(row) for row in by_nccl[g])})
    if nccl_groups:
        ids = {g: _nccl_unique_id(namespace, groups[g], g, client, timeout_s) for g in nccl_groups}
        members = [(g, d) for g, _, d in local if g in ids]
        _extension.connect_nccl(
            group_id,
            [d.local_hardware_id for _, d in members],
            [ids[g] for g, _ in members],
            int(timeout_s * 1000),
            _setup_ms(timeout_s),
        )
    sms = _extension.commit(group_id)
    if client is not None:
        _barrier(namespace, "connected", processes, _setup_ms(timeout_s))
    reached = {d: tuple(r for r, nccl in enumerate(by_nccl[g][rank]) if nccl) for g, rank, d in local}
    return sms, reached


def _nccl_pairs(
    group_id: int,
    namespace: str,
    groups: list[list[Any]],
    local: list[tuple[int, int, Any]],
    transport: str,
    client: Any,
    timeout_s: float,
    handles: dict[tuple[int, int], bytes] | None = None,
) -> list[list[list[bool]]]:
    """``[g][a][b]``: whether ranks a and b of group g swap rows through NCCL; the same in every process.

    The processes swap facts in two rounds: first each one's host, whether it sends every pair through NCCL,
    and the pairs of its own GPUs without P2P (``can_access_peer``); then, when some processes share a host,
    the pairs whose other GPU is in another process of this host and whose IPC handles (published before
    this) a GPU of this process failed to open (``can_open_handles``). ``handles`` receives the handles
    fetched for those probes, keyed by ``(g, rank)``.
    """
    me = jax.process_index()
    force = transport == "nccl" or os.environ.get("NCCL_P2P_DISABLE", "0") not in ("", "0")
    no_p2p = [
        [g, a, b]
        for g, a, d in local
        for h, b, e in local
        if not force and h == g and a != b and not _extension.can_access_peer(d.local_hardware_id, e.local_hardware_id)
    ]
    facts = {me: {"host": socket.gethostname(), "force": force, "no_p2p": no_p2p}}
    processes = sorted({d.process_index for group in groups for d in group})
    if client is not None:
        facts = _swap(client, namespace, "facts", facts[me], processes, timeout_s, "call jax_ep.initialize")
    if len({fact["force"] for fact in facts.values()}) > 1:
        raise ValueError(
            "jax_ep.initialize: the processes disagree on sending every pair through NCCL: pass the same "
            "transport everywhere and set NCCL_P2P_DISABLE alike in every process"
        )
    host = {process: fact["host"] for process, fact in facts.items()}
    if not force and len(set(host.values())) < len(host):  # some processes share a host: probe their pairs
        handles = {} if handles is None else handles
        failed = []
        for g, a, d in local:
            for b, e in enumerate(groups[g]):
                if e.process_index == me or host[e.process_index] != host[me]:
                    continue
                if (g, b) not in handles:
                    handles[g, b] = _fetch(client, _key(namespace, "handles", g, b), timeout_s, e, b)
                if not _extension.can_open_handles(group_id, d.local_hardware_id, handles[g, b]):
                    failed.append([g, a, b])
        what = "finish probing P2P with the other processes of its host"
        for process, pairs in _swap(client, namespace, "probes", failed, processes, timeout_s, what).items():
            facts[process] = {**facts[process], "no_p2p": facts[process]["no_p2p"] + pairs}
    return decide_transports(groups, facts, force)


def decide_transports(groups: list[list[Any]], facts: dict[int, dict[str, Any]], force: bool) -> list[list[list[bool]]]:
    """``[g][a][b]``: whether ranks a and b of group g (devices with a ``process_index``) swap rows through NCCL.

    ``facts[process]`` holds the process's ``host`` and ``no_p2p``, the ``[g, a, b]`` it found without P2P
    from a GPU of its own. Every process computes this from the same facts, so all agree. A pair goes
    through NCCL when ``force``, when its GPUs are on different hosts, or when any process reported it
    without P2P in either direction, so the answer is the same for (a, b) and (b, a).
    """
    missing = {(g, a, b) for fact in facts.values() for g, a, b in fact["no_p2p"]}
    missing |= {(g, b, a) for g, a, b in missing}
    host = {process: fact["host"] for process, fact in facts.items()}
    routes = [
        [
            [
                a != b and (force or host[d.process_index] != host[e.process_index] or (g, a, b) in missing)
                for b, e in enumerate(group)
            ]
            for a, d in enumerate(group)
        ]
        for g, group in enumerate(groups)
    ]
    for group in routes:
        assert all(row[b] == group[b][a] for a, row in enumerate(group) for b in range(len(group))), "asymmetric"
    return routes


def _swap(
    client: Any, namespace: str, name: str, mine: Any, processes: list[int], timeout_s: float, what: str
) -> dict[int, Any]:
    """Publishes this process's ``mine`` (JSON) under ``name``; returns every process's, waiting for each."""
    me = jax.process_index()
    client.key_value_set(_key(namespace, name, me), json.dumps(mine))
    values = {me: mine}
    for process in processes:
        if process == me:
            continue
        try:
            value = client.blocking_key_value_get(_key(namespace, name, process), _setup_ms(timeout_s))
        except Exception as error:  # the client raises its own error types
            raise RuntimeError(
                f"jax_ep.initialize: process {process} did not {what} within {_setup_ms(timeout_s) // 1000} s ({error})"
            ) from error
        values[process] = json.loads(value)
    return values


def _nccl_unique_id(namespace: str, group: list[Any], g: int, client: Any, timeout_s: float) -> bytes:
    """The NCCL id of group g: made by the process of its rank 0 and passed through the key-value store."""
    if client is None:
        return _extension.nccl_unique_id()
    if group[0].process_index == jax.process_index():
        unique_id = _extension.nccl_unique_id()
        client.key_value_set_bytes(_key(namespace, "nccl_id", g), unique_id)
        return unique_id
    return _fetch(client, _key(namespace, "nccl_id", g), timeout_s, group[0], 0, what="NCCL unique id")


def _barrier(namespace: str, name: str, processes: list[int], timeout_ms: int) -> None:
    _key_value_client().wait_at_barrier(_key(namespace, name), timeout_ms, process_ids=processes)


def _key(namespace: str, *parts: Any) -> str:
    """A key of one initialize call in jax.distributed's key-value store."""
    return "/".join(["jax_ep", namespace, *map(str, parts)])


def _setup_ms(timeout_s: float) -> int:
    """How long initialize/finalize wait for the other processes: they may start many seconds apart."""
    return int(max(timeout_s, _SETUP_TIMEOUT_S) * 1000)


def _fetch(client: Any, key: str, timeout_s: float, device: Any, rank: int, what: str = "buffers") -> bytes:
    try:
        return client.blocking_key_value_get_bytes(key, _setup_ms(timeout_s))
    except Exception as error:  # the client raises its own error types
        raise RuntimeError(
            f"jax_ep.initialize: rank {rank} ({device}, process {device.process_index}) did not publish its "
            f"{what} within {_setup_ms(timeout_s) // 1000} s; every process must call jax_ep.initialize "
            f"with the same mesh ({error})"
        ) from error


def _key_value_client() -> Any:
    """jax.distributed's key-value store client, or None before jax.distributed.initialize (no public API yet)."""
    from jax._src import distributed

    return distributed.global_state.client
