"""Where a transfer kernel's time goes, block by block: %globaltimer stamps at its phases.

    git apply bench/phase_times.patch   # stamps in DispatchKernel and CombineKernel; never commit it applied
    JAX_EP_CUDA=ON python -m pip install --no-build-isolation --no-deps --target /tmp/phase .
    git apply -R bench/phase_times.patch
    PYTHONPATH=/tmp/phase python bench/profile_kernels.py run --tokens 128 > phase.log
    python bench/phase_times.py phase.log OUT.json

With the patch, thread 0 of every block of those two kernels keeps six stamps in shared memory and prints them
at its end with its SM: ``PH <D|C> <block> <t0> ... <t5> <sm>``. The phases between the stamps:
check (CurrentCall, CallMayRun), send (the send phase and the wait for the peers), tables (dispatch's row
tables; none in combine), items (the block's warp items, to a block barrier), finish (FinishCall). This keeps
the last launch of each kernel in the log. The stamped build runs slower than the real one at training sizes
(at T=4096 its dispatch kernel spans about 190 us against ncu's 154 us for the real one), so read it for the
shape of a kernel, and time the kernel with ncu (bench/profile_kernels.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

PHASES = ("check", "send", "tables", "items", "finish")
KERNELS = {"D": "DispatchKernel", "C": "CombineKernel"}


def read_launches(lines) -> list[tuple[str, dict[int, list[int]]]]:
    """Every launch in the log, in order: (kernel letter, {block: [t0 .. t5, sm]}). A launch ends where the letter
    changes or a block comes again."""
    launches: list[tuple[str, dict[int, list[int]]]] = []
    for line in lines:
        fields = line.split()
        if len(fields) != 10 or fields[0] != "PH":
            continue
        kernel, block, values = fields[1], int(fields[2]), [int(v) for v in fields[3:]]
        if not launches or launches[-1][0] != kernel or block in launches[-1][1]:
            launches.append((kernel, {}))
        launches[-1][1][block] = values
    return launches


def summarize_launch(blocks: dict[int, list[int]]) -> dict:
    """Span, each phase's median and max over the blocks (ns), and each block's item time and SM."""
    first = min(v[0] for v in blocks.values())
    order = sorted(blocks)
    phases = {}
    for i, name in enumerate(PHASES):
        spans = [blocks[b][i + 1] - blocks[b][i] for b in order]
        phases[name] = {"median_ns": statistics.median(spans), "max_ns": max(spans)}
    return {
        "blocks": len(blocks),
        "span_ns": max(v[5] for v in blocks.values()) - first,
        "start_spread_ns": max(v[0] for v in blocks.values()) - first,
        "phases": phases,
        "items_ns_by_block": [blocks[b][4] - blocks[b][3] for b in order],
        "sm_by_block": [blocks[b][6] for b in order],
    }


def summarize(log: Path, out: Path) -> int:
    from jax_ep.bench.record import provenance, write

    launches = read_launches(log.read_text().splitlines())
    last = {}
    for kernel, blocks in launches:
        last[KERNELS.get(kernel, kernel)] = summarize_launch(blocks)
    payload = {
        **provenance("python bench/phase_times.py " + " ".join(sys.argv[1:])),
        "method": "bench/phase_times.patch applied: %globaltimer stamps by thread 0 of every block, the last launch "
        "of each kernel in the log; phases " + ", ".join(PHASES),
        "kernels": last,
    }
    if not last:
        payload["error"] = f"no PH line in {log}: was the patch applied to the build that ran?"
    write(out, payload)
    for name, result in last.items():
        phases = ", ".join(f"{p} {v['median_ns'] / 1000:.2f}" for p, v in result["phases"].items())
        print(
            f"{name}: {result['blocks']} blocks, {result['span_ns'] / 1000:.1f} us first start to last end; "
            f"median us: {phases}"
        )
    return 0 if last else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="output of a stamped build's run")
    parser.add_argument("out", type=Path, help="JSON to write")
    args = parser.parse_args()
    sys.exit(summarize(args.log, args.out))


if __name__ == "__main__":
    main()
