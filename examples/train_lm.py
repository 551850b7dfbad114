"""Train a small byte-level MoE language model with jax_ep.nn.MoE and optax on the Python standard library's source.

    python examples/train_lm.py --steps 200 --out out/train_lm

The text is real and needs no download: the ``.py`` files directly in the
standard library's folder (``os.path.dirname(os.__file__)``), in sorted order,
concatenated and cut at ``--corpus-mb`` megabytes (MiB). Every 10th block of 64 KiB
is held out for validation. Tokens are bytes (vocabulary 256); the model is a
small transformer (byte and position embeddings, ``--layers`` pre-norm blocks of
causal self-attention and an expert-parallel ``jax_ep.nn.MoE``, a tied output
head) trained on next-byte cross-entropy plus the MoE's load-balancing loss with
optax AdamW. A byte costs 8 bits with no model; the validation bits per byte say
how much the model learned.

Runs on all GPUs when there are some (``--backend auto`` or ``cuda``: backend
"cuda" after ``jax_ep.initialize``), else on 8 simulated CPU devices with the
"xla" backend; one process drives all devices. The mesh has axes ("data",
"ep"): the batch is sharded over both, the experts over "ep" (``--ep``, default
all devices) and replicated over "data". Writes ``loss.png`` (the loss curve)
and ``results.json`` (final train and validation loss, bits per byte, tokens per
second, backend, devices, steps) to ``--out`` (default ``out/train_lm``) and
prints a summary last. Needs flax, optax, tqdm and matplotlib, which the
README's test install command installs.
"""

import argparse
import json
import math
import os
import time
import warnings
from pathlib import Path

# Eight CPU devices when there is no GPU; the flag only sizes the CPU platform.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.nn import MoE  # noqa: E402

VOCAB = 256  # bytes
VALIDATION_BLOCK = 64 * 1024  # every 10th block of this many bytes (fewer in a small corpus) is validation text
LN2 = math.log(2.0)


def load_corpus(max_bytes: int) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Train and validation bytes (uint8) of the standard library's top-level ``.py`` files, and the files read."""
    folder = Path(os.path.dirname(os.__file__))
    parts, files, size = [], [], 0
    for path in sorted(folder.glob("*.py")):
        if size >= max_bytes:
            break
        text = path.read_bytes()[: max_bytes - size]
        parts.append(text)
        files.append(path.name)
        size += len(text)
    data = np.frombuffer(b"".join(parts), np.uint8)
    blocks = np.arange(len(data)) // max(1, min(VALIDATION_BLOCK, len(data) // 10))
    held_out = blocks % 10 == 9
    return data[~held_out], data[held_out], files


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then an expert-parallel MoE instead of the MLP."""

    def __init__(self, dim: int, heads: int, moe: dict, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, decode=False, rngs=rngs)
        self.moe_norm = nnx.LayerNorm(dim, rngs=rngs)
        self.moe = MoE(rngs=rngs, **moe)

    def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [B, S, D]`` float32, ``mask [B, 1, S, S]`` -> ``[B, S, D]``, the MoE's aux loss and dropped slots."""
        x = x + self.attn(self.attn_norm(x), mask=mask)
        moe = self.moe(self.moe_norm(x))
        return x + moe.out, moe.aux_loss, moe.num_dropped


class ByteLM(nnx.Module):
    """Byte and position embeddings, ``layers`` blocks, a final layer norm and the embedding as output head."""

    def __init__(self, *, seq: int, dim: int, heads: int, layers: int, moe: dict, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, dim, rngs=rngs)
        self.position = nnx.Embed(seq, dim, embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.blocks = nnx.List([Block(dim, heads, moe, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``tokens [B, S]`` int32 -> logits ``[B, S, 256]`` float32, and the MoE aux loss and dropped routing
        slots summed over blocks."""
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
        mask = nnx.make_causal_mask(tokens)
        aux_loss, dropped = jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32)
        for block in self.blocks:
            x, aux, num_dropped = block(x, mask)
            aux_loss, dropped = aux_loss + aux, dropped + num_dropped
        return self.embed.attend(self.norm(x)), aux_loss, dropped


def loss_fn(model: ByteLM, seq: jax.Array, aux_weight: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Training loss (next-byte cross-entropy plus ``aux_weight`` times the aux loss), and the cross-entropy
    (nats per byte) and dropped routing slots."""
    logits, aux_loss, dropped = model(seq[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, seq[:, 1:]).mean()
    return ce + aux_weight * aux_loss, (ce, dropped)


@nnx.jit(static_argnums=3)
def train_step(
    model: ByteLM, optimizer: nnx.Optimizer, seq: jax.Array, aux_weight: float
) -> tuple[jax.Array, jax.Array]:
    """One AdamW step on ``seq [B, S + 1]``; returns the cross-entropy before the step and the dropped slots."""
    (_, (ce, dropped)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, seq, aux_weight)
    optimizer.update(model, grads)
    return ce, dropped


@nnx.jit
def eval_loss(model: ByteLM, seq: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats per byte) on ``seq [B, S + 1]``."""
    return loss_fn(model, seq, 0.0)[1][0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--backend", choices=("auto", "xla", "cuda"), default="auto")
    parser.add_argument("--out", default="out/train_lm", help="folder for loss.png and results.json")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step, a multiple of the device count")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (context length)")
    parser.add_argument("--dim", type=int, default=128, help="model width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=128, help="hidden width of each expert")
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--layout", choices=("ragged", "expert"), default="ragged", help="the MoE's dispatch layout")
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=2.0,
        help="rows each rank keeps, as a multiple of its even share of the routing slots; 0: never drop",
    )
    parser.add_argument("--ep", type=int, default=None, help='size of the "ep" mesh axis (default: all devices)')
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine decay)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--aux-weight", type=float, default=0.01, help="weight of the MoE load-balancing loss")
    parser.add_argument("--corpus-mb", type=float, default=3.0, help="megabytes of standard-library source to read")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between validation passes")
    parser.add_argument("--eval-batches", type=int, default=4, help="batches of --batch sequences per validation")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_mesh(ep: int | None) -> jax.sharding.Mesh:
    """Mesh ("data", "ep") of all devices, "ep" of size ``ep`` (all devices when None)."""
    devices = jax.devices()
    ep = ep or len(devices)
    if len(devices) % ep:
        raise SystemExit(f"--ep {ep} must divide the number of devices, {len(devices)}")
    return jax.make_mesh((len(devices) // ep, ep), ("data", "ep"), axis_types=(AxisType.Auto,) * 2)


def capacity(factor: float, layout: str, num_ranks: int, tokens_per_rank: int, topk: int, local_experts: int):
    """The MoE's per-rank capacity: ``factor`` times the rows a rank gets under perfectly even routing, at most
    the capacity that never drops (None).

    A rank receives ``T * K`` rows on average (all of them, ``R * T * min(K, L)`` at worst, which is what
    ``None`` reserves); the "expert" layout counts rows per local expert, ``T * K / L`` on average.
    """
    never_drops = jax_ep.default_capacity(
        num_ranks=num_ranks,
        num_tokens=tokens_per_rank,
        topk=topk,
        num_experts=num_ranks * local_experts,
        layout=layout,
    )
    if factor <= 0:
        return None
    rows = tokens_per_rank * topk / (local_experts if layout == "expert" else 1)
    wanted = max(1, math.ceil(factor * rows))
    return None if wanted >= never_drops else wanted


def choose_backend(requested: str, mesh: jax.sharding.Mesh, moe: dict, tokens_per_rank: int) -> str:
    """Set up the backend that ``jax_ep.nn.MoE`` (``backend="auto"``) will use; returns "cuda" or "xla".

    "cuda" needs GPUs and the CUDA extension; ``jax_ep.initialize`` then makes the EP groups along "ep",
    sized for the per-rank token shard (every call here, train and eval, has that many tokens per rank).
    "auto" takes "xla" where "ep" has one device: nothing is exchanged there, and XLA's gathers beat the
    kernels' copies (docs/performance.md).
    """
    on_gpus = mesh.devices.flat[0].platform == "gpu"
    if requested == "cuda" and not (on_gpus and jax_ep.cuda_available()):
        why = "no GPUs" if not on_gpus else "the jax_ep CUDA extension is not built"
        raise SystemExit(f"--backend cuda cannot run here: {why}")
    alone = mesh.shape["ep"] == 1
    if requested == "cuda" or (requested == "auto" and not alone and on_gpus and jax_ep.cuda_available()):
        jax_ep.initialize(
            mesh,
            "ep",
            num_tokens=tokens_per_rank,
            hidden=moe["hidden"],
            topk=moe["topk"],
            num_experts=moe["num_experts"],
            dtype=jnp.float32,
        )
        return "cuda"
    if on_gpus and requested == "auto":
        why = "one device per EP group exchanges nothing" if alone else "the jax_ep CUDA extension is not built"
        print(f"backend xla on GPUs: {why}")
    # No group for "ep": the layer's backend="auto" resolves to "xla" (said once above, not warned per trace).
    warnings.filterwarnings("ignore", message="jax_ep: backend='auto' uses 'xla'")
    return "xla"


def main() -> None:
    args = parse_args()
    if min(args.steps, args.eval_every, args.eval_batches) < 1:
        raise SystemExit("--steps, --eval-every and --eval-batches must be positive")
    rng = np.random.default_rng(args.seed)
    train_data, val_data, files = load_corpus(int(args.corpus_mb * 2**20))
    if len(val_data) <= args.seq + 1:
        raise SystemExit(f"--corpus-mb {args.corpus_mb} leaves too little validation text for --seq {args.seq}")
    mesh = make_mesh(args.ep)
    devices, ep = mesh.devices.size, mesh.shape["ep"]
    if args.batch % devices:
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {devices} devices")
    num_experts = args.experts_per_rank * ep
    tokens_per_step = args.batch * args.seq
    tokens_per_rank = tokens_per_step // devices
    moe = dict(
        layout=args.layout,
        capacity=capacity(args.capacity_factor, args.layout, ep, tokens_per_rank, args.topk, args.experts_per_rank),
        hidden=args.dim,
        intermediate=args.ffn,
        num_experts=num_experts,
        topk=args.topk,
        mesh=mesh,
        axis_name="ep",
        data_axes=("data",),
    )
    backend = choose_backend(args.backend, mesh, moe, tokens_per_rank)
    batch_sharding = NamedSharding(mesh, P(("data", "ep")))

    def batch_at(data: np.ndarray, starts: np.ndarray) -> jax.Array:
        return jax.device_put(data[starts[:, None] + np.arange(args.seq + 1)].astype(np.int32), batch_sharding)

    # Validation: fixed windows spread evenly over the held-out text, in batches of the training batch size.
    windows = args.eval_batches * args.batch
    val_starts = np.linspace(0, len(val_data) - args.seq - 1, windows).astype(np.int64)
    val_batches = [batch_at(val_data, s) for s in np.split(val_starts, args.eval_batches)]

    print(
        f"corpus: {len(train_data) + len(val_data):,} bytes of {len(files)} standard-library files "
        f"({len(train_data):,} train, {len(val_data):,} validation)"
    )
    print(
        f"{devices} {mesh.devices.flat[0].platform} devices, mesh {dict(mesh.shape)}, backend {backend}; "
        f"{args.layers} blocks, width {args.dim}, {num_experts} experts (top-{args.topk}, ffn {args.ffn}); "
        f"{args.batch} x {args.seq} bytes per step"
    )

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=max(1, args.steps // 10), decay_steps=max(args.steps, 2), end_value=args.lr / 10
    )
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=args.weight_decay))
    history = {"step": [], "val_loss": []}

    def validate(step: int) -> float:
        loss = float(np.mean([float(eval_loss(model, seq)) for seq in val_batches]))
        history["step"].append(step)
        history["val_loss"].append(loss)
        return loss

    try:
        with jax.set_mesh(mesh):
            model = ByteLM(
                seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers, moe=moe, rngs=nnx.Rngs(args.seed)
            )
            optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
            validate(0)
            losses, step_seconds, dropped = [], [], 0
            with tqdm(range(1, args.steps + 1), desc="train", unit="step", disable=None) as bar:  # no bar in logs
                for step in bar:
                    start = time.perf_counter()
                    starts = rng.integers(0, len(train_data) - args.seq - 1, args.batch)
                    ce, num_dropped = train_step(model, optimizer, batch_at(train_data, starts), args.aux_weight)
                    losses.append(float(ce))
                    dropped += int(num_dropped)
                    step_seconds.append(time.perf_counter() - start)
                    bar.set_postfix(loss=f"{losses[-1]:.3f}", bpb=f"{losses[-1] / LN2:.2f}")
                    if step % args.eval_every == 0 and step < args.steps:
                        val = validate(step)
                        bar.write(f"step {step}: validation loss {val:.4f} ({val / LN2:.3f} bits per byte)")
            val_loss = validate(args.steps)
    finally:
        if backend == "cuda":
            jax_ep.finalize()

    # Throughput of the steps after the first (which compiles): bytes predicted per second of wall time.
    timed = step_seconds[1:]
    tokens_per_second = tokens_per_step * len(timed) / sum(timed) if timed else float("nan")
    tail = losses[-max(1, min(10, len(losses) // 5)) :]  # smooth the last steps' noise
    results = {
        "backend": backend,
        "platform": mesh.devices.flat[0].platform,
        "devices": devices,
        "mesh": dict(mesh.shape),
        "steps": args.steps,
        "tokens_per_step": tokens_per_step,
        "corpus_bytes": {"train": int(len(train_data)), "validation": int(len(val_data))},
        "train_loss_first": losses[0],
        "train_loss_final": float(np.mean(tail)),
        "val_loss_initial": history["val_loss"][0],
        "val_loss": val_loss,
        "val_bits_per_byte": val_loss / LN2,
        "tokens_per_second": tokens_per_second,
        "dropped_slot_fraction": dropped / (args.steps * tokens_per_step * args.topk * args.layers),
        "compile_step_seconds": step_seconds[0],
        "train_seconds": sum(step_seconds),
        "train_losses": [round(x, 5) for x in losses],
        "validation": history,
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    figure, axes = plt.subplots(figsize=(6.4, 4))
    axes.plot(range(1, len(losses) + 1), np.asarray(losses) / LN2, lw=0.8, label="train (batch)")
    axes.plot(history["step"], np.asarray(history["val_loss"]) / LN2, "o-", label="validation")
    axes.set(xlabel="step", ylabel="bits per byte", title=f"byte-level MoE LM (jax_ep.nn.MoE, {backend})")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(out / "loss.png", dpi=120, bbox_inches="tight")
    plt.close(figure)

    print(f"train loss {losses[0]:.4f} -> {results['train_loss_final']:.4f} (nats per byte, first step -> last steps)")
    print(f"validation loss {val_loss:.4f}, {val_loss / LN2:.3f} bits per byte (from {history['val_loss'][0]:.4f})")
    print(f"{results['dropped_slot_fraction']:.2%} of the routing slots dropped for capacity")
    print(f"{tokens_per_second:,.0f} tokens/s on {devices} {results['platform']} devices, backend {backend}")
    print(f"wrote {out / 'loss.png'} and {out / 'results.json'}")


if __name__ == "__main__":
    main()
