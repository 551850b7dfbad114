"""One process of the multi-process GPU tests (tests/test_cuda_multiprocess.py); one GPU per process.

    python tests/multiprocess_worker.py PORT PROCESS_ID {compare,compare_shared,peer_hangs}

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
"""

import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src import distributed  # noqa: E402  (its key-value client; jax has no public one)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

R = 2


def global_array(mesh, data):
    return jax.make_array_from_callback(data.shape, NamedSharding(mesh, P("ep")), lambda index: data[index])


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
        out = jax_ep.combine(d.x * 2 + 1, d.handle, weights=d.weights)
        return d.x[None], d.weights[None], d.group_sizes[None], out

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
    import reference

    xs, ids, ws = (a.reshape(R, a.shape[0] // R, -1) for a in (host[0].astype(np.float32), *host[1:]))
    ref = reference.dispatch(xs, ids, ws, num_experts=num_experts, layout=layout, capacity=capacity)
    out = reference.combine(ref, ref.x * 2 + 1, ref.weights)
    y = np.asarray(jnp.tanh(ref.x).astype(dtype).astype(jnp.float32))  # the loss's tanh, rounded like its cast
    g = 2 * reference.combine(ref, y, ref.weights)
    dy, dweights = reference.combine_vjp(ref, y, ref.weights, g)
    dx, dw = reference.dispatch_vjp(ref, dy * (1 - np.tanh(ref.x.astype(np.float64)) ** 2), dweights)
    rank = list(mesh.devices.flat).index(mesh.local_devices[0])
    return [ref.x[rank][None], ref.weights[rank][None], ref.group_sizes[rank][None], out[rank], dx[rank], dw[rank]]


def compare(mesh, against):
    """backend "cuda" against ``against``: "xla", or "reference" (tests/reference.py)."""
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
        assert np.abs(want[3]).sum() > 0
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


def main():
    port, process_id, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    gpu = 0 if mode == "compare_shared" else process_id
    jax.distributed.initialize(f"localhost:{port}", num_processes=R, process_id=process_id, local_device_ids=[gpu])
    import jax_ep

    mesh = jax.make_mesh((R,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    timeout_s = 3.0 if mode == "peer_hangs" else 30.0
    jax_ep.initialize(mesh, "ep", num_tokens=256, hidden=2048, topk=8, num_experts=64, timeout_s=timeout_s)
    if mode.startswith("compare"):
        print(f"NCCL ranks: {list(jax_ep.nccl_ranks()[mesh.local_devices[0]])}", flush=True)
        compare(mesh, "reference" if mode == "compare_shared" else "xla")
        jax_ep.finalize()  # collective: every process unmaps its peers' buffers before any frees its own
    else:
        peer_hangs(mesh, process_id)
    print("OK", flush=True)
    # Leave together, without jax.distributed's shutdown handshake (a timed-out group cannot finish it);
    # process 0 hosts the coordination service, so it goes last.
    distributed.global_state.client.wait_at_barrier(f"{mode}/exit", 60_000)
    if process_id == 0:
        time.sleep(2)
    os._exit(0)


if __name__ == "__main__":
    main()
