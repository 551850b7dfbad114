"""One process of the multi-process GPU tests (tests/test_cuda_multiprocess.py); one GPU per process.

    python -m tools.multiprocess_worker PORT PROCESS_ID MODE [PROCESSES]

MODE is one of compare, compare_shared, peer_hangs, late_shared, skew_shared, skew_later_shared, branch_shared,
wrong_rank_shared, scan_shared, dies_shared; PROCESSES (default 2) is R, one rank per process.

compare:   backend "cuda" against "xla" over a mesh of both processes' GPUs: dispatch bit for bit, combine
           within float32 rounding, gradients; random routings. Prints the ranks it reaches through NCCL
           (all with NCCL_P2P_DISABLE=1), and "OK" at the end.
compare_shared: the same cases with both processes on GPU 0, each one rank, storing into the other's buffer
           through CUDA IPC, so the kernels' peer paths run on a machine of one GPU (the GPU time-slices the
           two processes: only results count here, not speed). NCCL refuses two ranks on one GPU, so "cuda"
           is checked against the NumPy reference of tests/reference.py instead of "xla".
peer_hangs: process 1 stays alive but never enters a transfer; process 0's first dispatch gives up after
           timeout_s and its next one fails naming rank 1. Prints "OK" at the end. (A process that dies is
           reported by jax.distributed itself, which stops the others.)
skew_later_shared: both on GPU 0; after the group's first calls, process 1 reaches the first call of another
           compiled function timeout_s + 2 s late (as after compiling an eval step for longer): the first call of
           every compiled call waits the set-up timeout, so both get the reference.
branch_shared: both on GPU 0; a lax.cond on lax.axis_index runs an extra dispatch on rank 0 alone, from another
           call site, before the dispatch both run: the calls meet at the same position, and both fail with an
           error naming the two call sites, never pairing their data.
late_shared: both on GPU 0; process 1 stalls on the host past timeout_s before its dispatch. Process 0 gives
           up (NaN outputs, an error naming rank 1); process 1 then arrives late and fails the same way, never
           reading stale data; after jax_ep.initialize again both match the reference.
wrong_rank_shared: both on GPU 0; the group is made for a mesh in process order, the call runs over the
           reversed mesh, so lax.axis_index differs from the kernels' rank: both fail with that error.
scan_shared: both on GPU 0, XLA command buffers on (the test sets XLA_FLAGS): tools/command_buffer_scan.py's
           200-step training scan, each rank against the NumPy reference.
"""

import os
import sys
import time
import traceback

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import distributed  # noqa: E402  (its key-value client; jax has no public one)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

R = 2  # processes, one rank each (main sets it)


def global_array(mesh, data):
    return jax.make_array_from_callback(data.shape, NamedSharding(mesh, P("ep")), lambda index: data[index])


def rank_of(mesh) -> int:
    """This process's rank: its device's place in the mesh."""
    return list(mesh.devices.flat).index(mesh.local_devices[0])


def local(array) -> np.ndarray:
    return np.asarray(array.addressable_shards[0].data.astype(jnp.float32))


def host_inputs(tokens, hidden, topk, experts, dtype, seed, messy):
    """Every rank's x (rounded to dtype), topk_idx and topk_weights as NumPy arrays, the same in both processes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R * tokens, hidden)).astype(dtype)
    idx = np.stack([rng.permutation(experts)[:topk] for _ in range(R * tokens)]).astype(np.int32)
    if messy:
        idx[rng.random(idx.shape) < 0.1] = -1
        idx[rng.random(idx.shape) < 0.05] = experts + 3
        idx[:, -1] = idx[:, 0]
    w = (rng.random((R * tokens, topk)) + 0.1).astype(np.float32)
    return x, idx, w


def inputs(mesh, tokens, hidden, topk, experts, dtype, seed, messy):
    return tuple(global_array(mesh, a) for a in host_inputs(tokens, hidden, topk, experts, dtype, seed, messy))


def run(mesh, backend, x, idx, w, **kw):
    import jax_ep

    def forward(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, axis_name="ep", backend=backend, **kw)
        out = jax_ep.combine(d.x * 2 + 1, d.handle, weights=d.weights, partial_dtype=jnp.float32)
        # The ragged tail past sum(group_sizes) is unspecified: compare only the rows the contract specifies.
        held = jnp.arange(d.x.shape[0])[:, None] < jnp.sum(d.group_sizes) if kw.get("layout") == "ragged" else True
        return jnp.where(held, d.x, 0)[None], d.weights[None], d.group_sizes[None], out

    def loss_grads(x, w, idx):  # idx is an argument: a jitted function cannot close over another process's shards
        def body(x, idx, w):
            d = jax_ep.dispatch(x, idx, w, axis_name="ep", backend=backend, **kw)
            y = jnp.tanh(d.x.astype(jnp.float32)).astype(x.dtype)
            return jax_ep.combine(y, d.handle, weights=d.weights).astype(jnp.float32)

        # Gradients of sum(out**2), pulled back without summing over ranks (no collective, which NCCL would
        # refuse for two processes on one GPU).
        out, pullback = jax.vjp(lambda x, w: jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w), x, w)
        return pullback(2 * out)

    with jax.set_mesh(mesh):
        outs = jax.jit(jax.shard_map(forward, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)
        grads = jax.jit(loss_grads)(x, w, idx)
    return [local(a) for a in (*outs, *grads)]


CASES = [
    # tokens, hidden, topk, experts, dtype, messy, layout, capacity
    (256, 2048, 8, 64, jnp.bfloat16, False, "ragged", None),
    (200, 1024, 6, 16, jnp.float32, True, "ragged", None),
    (128, 512, 4, 16, jnp.float32, True, "expert", 40),
]


def reference_run(mesh, host, dtype, *, num_experts, layout, capacity):
    """What ``run`` returns on this process's rank, from tests/reference.py (float64 sums) over ``host_inputs``."""
    from tests import reference

    xs, ids, ws = (a.reshape(R, a.shape[0] // R, -1) for a in (host[0].astype(np.float32), *host[1:]))
    ref = reference.dispatch(xs, ids, ws, num_experts=num_experts, layout=layout, capacity=capacity)
    held = np.zeros(ref.weights.shape, bool)
    for d, row in ref.rows.values():
        held.reshape(R, -1)[d, row] = True
    out = reference.combine(ref, np.where(held[..., None], ref.x * 2 + 1, 0), ref.weights)
    y = np.asarray(jnp.tanh(ref.x).astype(dtype).astype(jnp.float32))  # the loss's tanh, rounded like its cast
    g = 2 * reference.combine(ref, y, ref.weights)
    dy, dweights = reference.combine_vjp(ref, y, ref.weights, g)
    dx, dw = reference.dispatch_vjp(ref, dy * (1 - np.tanh(ref.x.astype(np.float64)) ** 2), dweights)
    rank = rank_of(mesh)
    return [ref.x[rank][None], ref.weights[rank][None], ref.group_sizes[rank][None], out[rank], dx[rank], dw[rank]]


def compare(mesh, against):
    """backend "cuda" against ``against``: "xla", or "reference" (tests/reference.py)."""
    rank = rank_of(mesh)
    for seed, (tokens, hidden, topk, experts, dtype, messy, layout, capacity) in enumerate(CASES):
        host = host_inputs(tokens, hidden, topk, experts, dtype, seed, messy)
        x, idx, w = (global_array(mesh, a) for a in host)
        kw = dict(num_experts=experts, layout=layout, capacity=capacity)
        cuda = run(mesh, "cuda", x, idx, w, **kw)
        want = run(mesh, "xla", x, idx, w, **kw) if against == "xla" else reference_run(mesh, host, dtype, **kw)
        for name, got, expected in zip(["x", "weights", "group_sizes"], cuda[:3], want[:3], strict=True):
            np.testing.assert_array_equal(got, expected, err_msg=name)
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        np.testing.assert_allclose(cuda[3], want[3], rtol=tol, atol=tol, err_msg="combine")
        for name, got, expected in zip(["dx", "dw"], cuda[4:], want[4:], strict=True):
            atol = (1e-5 if dtype == jnp.float32 else 2e-2) * np.max(np.abs(expected))
            np.testing.assert_allclose(got, expected, rtol=0, atol=atol, err_msg=name)
        # Every rank receives rows; with a capacity the first source ranks fill it, so that a later rank's tokens
        # may all be dropped (their combine is 0), but rank 0's never are.
        assert np.abs(want[0]).sum() > 0 and (rank != 0 or np.abs(want[3]).sum() > 0)
        print(f"case {seed} ({layout}, {jnp.dtype(dtype).name}, T={tokens}): cuda == {against}", flush=True)


def peer_hangs(mesh, process_id):
    import jax_ep

    client = distributed.global_state.client
    x, idx, w = inputs(mesh, 64, 256, 4, 16, jnp.float32, seed=7, messy=False)

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=16, axis_name="ep", backend="cuda").x

    step = jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))
    with jax.set_mesh(mesh):  # both compile: XLA shares autotuning results between the processes
        step = step.lower(x, idx, w).compile()
    print(f"process {process_id} compiled", flush=True)
    with jax.set_mesh(mesh):  # the group's first call, which may wait the set-up timeout, together
        jax.block_until_ready(step(x, idx, w))
    if process_id == 1:  # alive (it keeps sending heartbeats) but never enters the transfer
        client.blocking_key_value_get("peer_hangs/done", 120_000)
        return
    with jax.set_mesh(mesh):
        jax.block_until_ready(step(x, idx, w))  # gives up after timeout_s
        try:
            jax.block_until_ready(step(x, idx, w))
        except Exception as error:  # noqa: BLE001
            assert "gave up waiting for rank 1" in str(error), error
            print(f"second call failed as expected: {str(error)[:300]}", flush=True)
        else:
            raise AssertionError("the call after a timeout did not fail")
    client.key_value_set("peer_hangs/done", "1")


def later_calls_fail(call, want, after):
    """After a failed call: Group.check() and the next call both raise an error that says ``want``."""
    for attempt in ("check", "next call"):
        try:
            if attempt == "check":
                GROUP[0].check()
            else:
                jax.block_until_ready(call())
        except Exception as error:  # noqa: BLE001
            assert want in str(error), error
            print(f"{attempt} failed as expected: {str(error)[:300]}", flush=True)
        else:
            raise AssertionError(f"the {attempt} after {after} did not fail")


def _compiled_weights_step(mesh, name):
    """A jitted dispatch of messy float32 inputs that returns the rows' weights, compiled by every process before a
    barrier (XLA shares autotuning results between them). Returns (host inputs, dispatch keywords, the shard_map
    body, the compiled step, its global inputs)."""
    import jax_ep

    kw = dict(num_experts=16, layout="ragged", capacity=None)
    host = host_inputs(64, 256, 4, 16, np.float32, seed=7, messy=True)
    inputs = tuple(global_array(mesh, a) for a in host)

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, axis_name="ep", backend="cuda", **kw).weights[None]

    with jax.set_mesh(mesh):
        step = jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))).lower(*inputs).compile()
    distributed.global_state.client.wait_at_barrier(f"{name}/compiled", 60_000)
    return host, kw, body, step, inputs


def late_shared(mesh, process_id, timeout_s):
    """Process 1 comes late: both calls fail (NaN, named errors); after initialize again both are right."""
    import jax_ep

    client = distributed.global_state.client
    host, kw, body, step, (x, idx, w) = _compiled_weights_step(mesh, "late")
    assert not np.any(np.isnan(local(step(x, idx, w))))  # the first call, which may wait the set-up timeout
    client.wait_at_barrier("late/first", 60_000)
    if process_id == 1:
        time.sleep(timeout_s + 2)  # a host stall past the group's timeout
    out = local(step(x, idx, w))
    assert np.all(np.isnan(out)), f"process {process_id} read data of a call its peer gave up on: {out[:4]}"
    print(f"process {process_id}: outputs are NaN", flush=True)
    want = "gave up waiting for rank 1" if process_id == 0 else "gave up waiting for rank 1 (this GPU)"
    later_calls_fail(lambda: step(x, idx, w), want, "the timeout")
    client.wait_at_barrier("late/failed", 60_000)
    GROUP[0] = jax_ep.initialize(mesh, "ep", num_tokens=256, hidden=2048, topk=8, num_experts=64, timeout_s=timeout_s)
    with jax.set_mesh(mesh):
        again = local(jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w))
    want_weights = reference_run(mesh, host, np.float32, **kw)[1]
    np.testing.assert_array_equal(again, want_weights)
    print("after initialize again: cuda == reference", flush=True)


def skew_later_shared(mesh, process_id, timeout_s):
    """After the group's first calls, process 1 reaches the first call of a newly compiled function timeout_s + 2 s
    late: that call waits the first-call timeout, so both get the reference, and no call gives up."""
    import jax_ep

    client = distributed.global_state.client
    host, kw, body, step, (x, idx, w) = _compiled_weights_step(mesh, "later")
    want = reference_run(mesh, host, np.float32, **kw)[1]
    np.testing.assert_array_equal(local(step(x, idx, w)), want)  # the group's first calls, and this step's
    np.testing.assert_array_equal(local(step(x, idx, w)), want)

    def eval_body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, axis_name="ep", backend="cuda", **kw).weights[None] * 1

    with jax.set_mesh(mesh):
        eval_step = jax.jit(jax.shard_map(eval_body, in_specs=P("ep"), out_specs=P("ep"))).lower(x, idx, w).compile()
    client.wait_at_barrier("later/compiled", 60_000)
    if process_id == 1:
        time.sleep(timeout_s + 2)  # a longer compile of the eval step
    np.testing.assert_array_equal(local(eval_step(x, idx, w)), want)
    GROUP[0].check()
    print("the first call of a later compiled function after a skew: cuda == reference", flush=True)


def branch_shared(mesh, process_id):
    """Rank 0 alone takes a lax.cond branch that holds an extra dispatch (another call site): the ranks' calls at
    the same position come from different call sites, and both fail naming them, with NaN outputs."""
    import jax_ep

    client = distributed.global_state.client
    kw = dict(num_experts=16, axis_name="ep", backend="cuda")
    x, idx, w = inputs(mesh, 64, 256, 4, 16, jnp.float32, seed=11, messy=False)

    def body(x, idx, w):
        def extra(x):
            return x + jnp.sum(jax_ep.dispatch(x, idx, w, **kw).weights)  # rank 0's call at the shared position

        x = jax.lax.cond(jax.lax.axis_index("ep") == 0, extra, lambda x: x, x)
        return jax_ep.dispatch(x, idx, w, **kw).weights[None]

    with jax.set_mesh(mesh):
        step = jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))).lower(x, idx, w).compile()
    client.wait_at_barrier("branch/compiled", 60_000)
    out = local(step(x, idx, w))
    assert np.all(np.isnan(out)), f"process {process_id} paired the data of two call sites: {out[:4]}"
    print(f"process {process_id}: outputs are NaN", flush=True)
    try:
        GROUP[0].check()
    except RuntimeError as error:
        message = str(error)
        assert "in another jax_ep call at the same position" in message, message
        assert message.count("call site") >= 2 and "jax_ep.dispatch at multiprocess_worker.py" in message, message
        print(f"check failed as expected: {message[:600]}", flush=True)
    else:
        raise AssertionError("calls of different call sites at the same position did not fail")


def skew_shared(mesh, process_id, timeout_s):
    """Process 1 reaches the group's first call timeout_s + 2 s after process 0 (as after a slower compile): the
    first call waits the set-up timeout, so both get the reference."""
    host, kw, _, step, (x, idx, w) = _compiled_weights_step(mesh, "skew")
    if process_id == 1:
        time.sleep(timeout_s + 2)
    np.testing.assert_array_equal(local(step(x, idx, w)), reference_run(mesh, host, np.float32, **kw)[1])
    GROUP[0].check()
    print("first call after a skew: cuda == reference", flush=True)


def wrong_rank_shared(mesh, process_id):
    """The call runs over the reversed mesh: lax.axis_index differs from the rank the group gave each GPU."""
    import jax_ep

    reversed_mesh = jax.sharding.Mesh(np.array(list(mesh.devices.flat)[::-1]), ("ep",))
    host = host_inputs(64, 256, 4, 16, np.float32, seed=9, messy=False)
    x, idx, w = (global_array(reversed_mesh, a) for a in host)

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=16, axis_name="ep", backend="cuda").weights[None]

    with jax.set_mesh(reversed_mesh):
        out = local(jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w))
    assert np.all(np.isnan(out)), out[:4]
    try:
        GROUP[0].check()
    except RuntimeError as error:
        assert "differs from the kernels' rank" in str(error), error
        print(f"check failed as expected: {str(error)[:300]}", flush=True)
    else:
        raise AssertionError("a call over a reversed mesh did not fail")


def scan_shared(mesh, process_id):
    """tools/command_buffer_scan.py's scan with two processes on one GPU, each rank against the reference."""
    from tools import command_buffer_scan as scan

    data = scan.inputs(R)
    m = data["m"]
    replicated = jax.make_array_from_callback(m.shape, NamedSharding(mesh, P()), lambda index: m[index])
    args = [global_array(mesh, data[k]) for k in scan.ARGS[:-1]] + [replicated]
    with jax.set_mesh(mesh):
        compiled = scan.scan_fn("cuda").lower(*args).compile()
        jax.block_until_ready(compiled(*args))  # the first run records the command buffers
        result = []
        run = lambda: result.extend(jax.block_until_ready(compiled(*args)))  # noqa: E731
        launches, calls = scan.launches_per_call(GROUP[0], run)
        print(f"captured: {launches} host launches for {calls} calls", flush=True)
        assert launches < calls, "the calls were not captured in command buffers"
        losses, scale = (local(a) for a in result)
    want_losses, want_scale = scan.reference_scan(data, R)
    np.testing.assert_allclose(losses[0], want_losses[process_id], rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(scale[0], want_scale[process_id], rtol=1e-4, atol=1e-5)
    print(f"{scan.STEPS} steps: rank {process_id} matches the reference", flush=True)


def dies_shared(mesh, process_id):
    """Process 1 dies once both have compiled; process 0's call gives up naming rank 1 (NaN outputs), and its
    next call and Group.check say why."""
    client = distributed.global_state.client
    x, idx, w = inputs(mesh, 64, 256, 4, 16, jnp.float32, seed=7, messy=False)

    def body(x, idx, w):
        import jax_ep

        return jax_ep.dispatch(x, idx, w, num_experts=16, axis_name="ep", backend="cuda").weights[None]

    with jax.set_mesh(mesh):
        step = jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))).lower(x, idx, w).compile()
    client.wait_at_barrier("dies/compiled", 60_000)
    local(step(x, idx, w))  # the group's first call, which may wait the set-up timeout, together
    client.wait_at_barrier("dies/first", 60_000)
    if process_id == 1:
        print("process 1: dying without a word", flush=True)
        os._exit(3)
    out = local(step(x, idx, w))
    assert np.all(np.isnan(out)), f"process 0 read data of a call its dead peer never made: {out[:4]}"
    print("process 0: outputs are NaN", flush=True)
    later_calls_fail(lambda: step(x, idx, w), "gave up waiting for rank 1", "the peer died")


GROUP = [None]


def main():
    global R
    port, process_id, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    R = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    gpu = 0 if mode.endswith("_shared") else process_id
    jax.distributed.initialize(f"localhost:{port}", num_processes=R, process_id=process_id, local_device_ids=[gpu])
    import jax_ep

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    short = ("peer_hangs", "late_shared", "dies_shared", "skew_shared", "skew_later_shared")
    timeout_s = 3.0 if mode in short else 30.0
    sizes = dict(num_tokens=256, hidden=2048, topk=8, num_experts=64, timeout_s=timeout_s)
    GROUP[0] = jax_ep.initialize(mesh, "ep", **sizes)
    if mode.startswith("compare"):
        print(f"NCCL ranks: {list(jax_ep.nccl_ranks()[mesh.local_devices[0]])}", flush=True)
        compare(mesh, "reference" if mode == "compare_shared" else "xla")
    elif mode == "late_shared":
        late_shared(mesh, process_id, timeout_s)
    elif mode == "skew_shared":
        skew_shared(mesh, process_id, timeout_s)
    elif mode == "skew_later_shared":
        skew_later_shared(mesh, process_id, timeout_s)
    elif mode == "branch_shared":
        branch_shared(mesh, process_id)
    elif mode == "wrong_rank_shared":
        wrong_rank_shared(mesh, process_id)
    elif mode == "scan_shared":
        scan_shared(mesh, process_id)
    elif mode == "dies_shared":  # its peer is gone: no collective finalize, no leaving together
        dies_shared(mesh, process_id)
        print("OK", flush=True)
        os._exit(0)
    else:
        peer_hangs(mesh, process_id)
    if mode != "peer_hangs":
        jax_ep.finalize()  # collective: every process unmaps its peers' buffers before any frees its own
    print("OK", flush=True)
    # Leave together, without jax.distributed's shutdown handshake (a timed-out group cannot finish it);
    # process 0 hosts the coordination service, so it goes last.
    distributed.global_state.client.wait_at_barrier(f"{mode}/exit", 60_000)
    if process_id == 0:
        time.sleep(2)
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # noqa: BLE001  (leave at once: jax's exit handler would wait 300 s for the others)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
