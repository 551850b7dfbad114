"""Train a tiny MoE transformer with jax_ep.nn.MoE and optax on a synthetic sequence task.

    python examples/train_moe.py --steps 300 --plot moe_loss.png

Each sequence starts with two random tokens and continues with
``x[t] = (x[t-1] + x[t-2]) % VOCAB``, so every token after the second is
predictable from the two before it. The model (2 blocks of causal
self-attention and an expert-parallel MoE) learns the rule. The script prints
the next-token cross-entropy on those tokens of a fixed evaluation batch, drawn
before training and never trained on, before and after training: it starts
above ln(VOCAB) = 3.47, a uniform guess (about 4.0 with the default seed), and
falls as the model learns.

Runs on all GPUs when there are some, else on 8 simulated CPU devices; the
batch and the experts are sharded over the mesh axis "ep". Needs flax, optax,
tqdm and matplotlib (``python -m pip install -e ".[nn]"``).
"""

import argparse
import os

# Eight CPU devices when there is no GPU; the flag only sizes the CPU platform.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from tqdm import tqdm  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep.nn import MoE  # noqa: E402

VOCAB, SEQ, DIM, HEADS, LAYERS, TOPK = 32, 32, 64, 4, 2, 2
AUX_LOSS_WEIGHT = 0.01


class Block(nnx.Module):
    """Pre-norm transformer block: causal self-attention, then a MoE instead of the MLP."""

    def __init__(self, mesh: jax.sharding.Mesh, num_experts: int, *, rngs: nnx.Rngs) -> None:
        self.attn_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, DIM, decode=False, rngs=rngs)
        self.moe_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.moe = MoE(DIM, 2 * DIM, num_experts=num_experts, topk=TOPK, mesh=mesh, axis_name="ep", rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [B, S, DIM]`` float32, ``mask [B, 1, S, S]`` -> ``[B, S, DIM]`` and the MoE's aux loss."""
        x = x + self.attn(self.attn_norm(x), mask=mask)
        moe = self.moe(self.moe_norm(x))
        return x + moe.out, moe.aux_loss


class Transformer(nnx.Module):
    """Token and position embeddings, ``LAYERS`` blocks, and a linear head."""

    def __init__(self, mesh: jax.sharding.Mesh, num_experts: int, *, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.position = nnx.Embed(SEQ, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(mesh, num_experts, rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``tokens [B, S]`` int32 -> logits ``[B, S, VOCAB]`` float32 and the summed aux loss."""
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
        mask = nnx.make_causal_mask(tokens)
        aux_loss = jnp.zeros((), jnp.float32)
        for block in self.blocks:
            x, aux = block(x, mask)
            aux_loss = aux_loss + aux
        return self.head(self.norm(x)), aux_loss


def sequences(rng: np.random.Generator, size: int) -> np.ndarray:
    """``[size, SEQ + 1]`` int32 sequences of the task."""
    seq = np.empty((size, SEQ + 1), np.int32)
    seq[:, :2] = rng.integers(0, VOCAB, (size, 2))
    for t in range(2, SEQ + 1):
        seq[:, t] = (seq[:, t - 1] + seq[:, t - 2]) % VOCAB
    return seq


def loss_fn(model: Transformer, seq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Training loss (cross-entropy plus weighted aux loss) and the cross-entropy on the predictable tokens."""
    logits, aux_loss = model(seq[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits[:, 1:], seq[:, 2:]).mean()
    return ce + AUX_LOSS_WEIGHT * aux_loss, ce


@nnx.jit
def train_step(model: Transformer, optimizer: nnx.Optimizer, seq: jax.Array) -> jax.Array:
    """One optimizer step on ``seq [B, SEQ + 1]``; returns the cross-entropy."""
    (_, ce), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, seq)
    optimizer.update(model, grads)
    return ce


@nnx.jit
def eval_loss(model: Transformer, seq: jax.Array) -> jax.Array:
    """Cross-entropy on ``seq [B, SEQ + 1]``."""
    return loss_fn(model, seq)[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step, a multiple of the device count")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    parser.add_argument("--plot", default="moe_loss.png", help="where to write the loss curve")
    args = parser.parse_args()

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("ep",), axis_types=(AxisType.Auto,))
    num_experts = 2 * len(devices)
    if devices[0].platform == "gpu" and jax_ep.cuda_available():  # backend "auto" then picks "cuda"
        tokens_per_rank = args.batch * (SEQ + 1) // len(devices)
        jax_ep.initialize(mesh, "ep", num_tokens=tokens_per_rank, hidden=DIM, topk=TOPK, num_experts=num_experts)
    batch_sharding = NamedSharding(mesh, P("ep"))
    rng = np.random.default_rng(0)
    eval_seq = jax.device_put(sequences(rng, args.batch), batch_sharding)
    print(f"{len(devices)} {devices[0].platform} devices, {num_experts} experts, top-{TOPK}, {LAYERS} layers")

    with jax.set_mesh(mesh):
        model = Transformer(mesh, num_experts, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=nnx.Param)
        initial = float(eval_loss(model, eval_seq))
        losses = []
        tokens_per_step = args.batch * (SEQ - 1)
        bar = tqdm(total=args.steps * tokens_per_step, unit="tok", unit_scale=True, desc="train", disable=None)
        with bar:  # disable=None: no bar when stdout is not a terminal (logs)
            for _ in range(args.steps):
                seq = jax.device_put(sequences(rng, args.batch), batch_sharding)
                losses.append(float(train_step(model, optimizer, seq)))
                bar.update(tokens_per_step)
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
        final = float(eval_loss(model, eval_seq))

    figure = Figure(figsize=(6, 4))
    axes = figure.subplots()
    axes.plot(losses)
    axes.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="tiny MoE transformer (jax_ep.nn.MoE)")
    figure.savefig(args.plot, dpi=120, bbox_inches="tight")
    print(f"initial eval loss {initial:.4f} (the fixed evaluation batch, before training)")
    print(f"final eval loss {final:.4f} (the same batch, after {args.steps} steps)")
    print(f"loss curve written to {args.plot}")


if __name__ == "__main__":
    main()
