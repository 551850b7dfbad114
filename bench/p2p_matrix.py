"""Which pairs of the visible GPUs reach each other by CUDA peer access, from the built extension.

    python -m bench.p2p_matrix [OUT.json]

For every ordered pair (a, b) of the GPUs jax sees, ``jax_ep.ep.group.extension().can_access_peer(a, b)``
(cudaDeviceCanAccessPeer, by CUDA ordinal): the fact ``jax_ep.initialize(transport="auto")`` decides peer stores
against NCCL by. Prints the matrix (row: the GPU that stores, column: the GPU stored into) and whether every pair
can; OUT.json gets the same as JSON. One GPU gives a 1x1 matrix (nothing to pair).

Exit status: 0 when it printed a matrix (a pair without P2P is a fact about the machine, not a failure), 77
("skipped", as automake's tests use it) when jax sees no GPU, 1 when there are GPUs but the extension does not
load. bench/device_run.sh runs it as the suite's P2P step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

SKIPPED = 77


def main(argv: list[str]) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # only a look at the devices
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    out = Path(argv[0]) if argv else None
    import jax

    try:
        gpus = jax.devices("gpu")
    except RuntimeError as error:
        print(f"SKIP: jax sees no GPU ({str(error).splitlines()[0][:200]})")
        return SKIPPED
    if not gpus:
        print("SKIP: jax sees no GPU")
        return SKIPPED
    from jax_ep.ep import group as _group

    if not _group.available():
        print(f"FAIL: {len(gpus)} GPU(s) but the CUDA extension did not load: {_group.unavailable_reason()}")
        return 1
    extension = _group.extension()
    ordinals = [d.local_hardware_id for d in gpus]
    matrix = [[a == b or bool(extension.can_access_peer(a, b)) for b in ordinals] for a in ordinals]
    pairs = [(i, j) for i in range(len(gpus)) for j in range(len(gpus)) if i != j]
    missing = [(ordinals[i], ordinals[j]) for i, j in pairs if not matrix[i][j]]

    for d in gpus:
        print(f"GPU {d.local_hardware_id}: {d.device_kind} (jax id {d.id}, process {d.process_index})")
    width = max(5, *(len(f"GPU{o}") for o in ordinals))
    print("P2P, cudaDeviceCanAccessPeer (row: the GPU that stores; column: the GPU stored into):")
    print(" " * width + "".join(f"{f'GPU{o}':>{width}}" for o in ordinals))
    for i, a in enumerate(ordinals):
        cells = ("-" if i == j else "yes" if matrix[i][j] else "NO" for j in range(len(ordinals)))
        print(f"{f'GPU{a}':<{width}}" + "".join(f"{cell:>{width}}" for cell in cells))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "gpus": [{"ordinal": d.local_hardware_id, "kind": d.device_kind} for d in gpus],
            "can_access_peer": matrix,
            "pairs_without_p2p": missing,
            "every_pair": not missing,
        }
        out.write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {out}")
    if not pairs:
        print("one GPU: no pair to reach")
    elif missing:
        print(f"{len(missing)} of {len(pairs)} ordered pairs have no P2P: {missing} (transport 'auto' uses NCCL there)")
    else:
        print(f"every one of the {len(pairs)} ordered pairs has P2P (transport 'auto' uses peer stores)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
