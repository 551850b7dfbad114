"""XLA's own kernels for a T=4096 dispatch's bytes, then three dispatch + combine calls, for Nsight Compute.

    ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\\
        lts__t_bytes.sum --csv --print-units base --log-file K.csv python bench/write_ceilings.py

On [32768, 7168] bf16 (the delivered rows of T=4096, K=8), three times each: a fill (``jnp.full``: writes
470 MB), a copy (``a * 1.5``: reads and writes 470 MB) and a broadcast of x [4096, 7168] to 8 rows each (reads
58.7 MB, writes 470 MB: a dispatch's bytes). Then ``bench/profile_kernels.py run --tokens 4096``. Kernels run
one at a time under ncu, so one GPU only.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROWS, HIDDEN, TOKENS = 32768, 7168, 4096


def main() -> None:
    src = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal((ROWS, HIDDEN)), jnp.bfloat16))
    tokens = jax.device_put(jnp.asarray(np.random.default_rng(1).standard_normal((TOKENS, HIDDEN)), jnp.bfloat16))
    fill = jax.jit(lambda s: jnp.full((ROWS, HIDDEN), s, jnp.bfloat16))
    copy = jax.jit(lambda a: a * jnp.bfloat16(1.5))
    copies = ROWS // TOKENS
    broadcast = jax.jit(
        lambda a: jnp.broadcast_to(a[:, None, :] * jnp.bfloat16(1.5), (TOKENS, copies, HIDDEN)).reshape(ROWS, HIDDEN)
    )
    for _ in range(3):
        jax.block_until_ready(fill(jnp.bfloat16(1.25)))
        jax.block_until_ready(copy(src))
        jax.block_until_ready(broadcast(tokens))
    sys.path.insert(0, str(Path(__file__).parent))
    import profile_kernels

    profile_kernels.run(TOKENS, HIDDEN)


if __name__ == "__main__":
    main()
