"""A bounded slice of the fuzzer (tools/fuzz.py) and proof that its checks catch wrong results.

The slice: 200 fixed cases (campaign seed 0) over R = 1, 2, 4, 8, two shape buckets per R, backend "xla",
every case bit for bit or within the contract's rounding of tests/reference.py. The bigger CPU campaign
is ``python -m tools.fuzz --cases 100000 --buckets 8 --budget-s 1200`` (bench/results/reliability_fuzz_cpu.json).
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers import assert_bits_equal
from tools import fuzz

SLICE = dict(seed=0, cases=200, ranks=[1, 2, 4, 8], buckets=2)


@pytest.fixture(scope="module")
def slice_report():
    return fuzz.campaign(**SLICE, log=lambda line: print(line), progress_s=1e9)


@pytest.mark.slow
def test_fuzz_slice_has_no_mismatch(slice_report):
    report = slice_report
    details = "\n".join(f"seed {m['seed']}: {m['case']}\n  {m['mismatches'][0]}" for m in report["mismatches"])
    assert report["mismatching_cases"] == 0, f"replay with python -m tools.fuzz --replay SEED:\n{details}"
    assert report["cases"] == SLICE["cases"]
    counts = report["counts"]
    # The slice covers what the fuzzer is for.
    assert counts["by_ranks"] == {"1": 50, "2": 50, "4": 50, "8": 50}
    assert set(counts["by_layout"]) == {"ragged", "expert"}
    assert set(counts["by_x_dtype"]) == set(fuzz.DTYPES)
    assert set(counts["by_drop_policy"]) == {"balanced", "expert"}
    for category in ("dropped_slots", "invalid_slots", "repeated_expert", "exact_products", "poisoned_free_rows"):
        assert counts[category].get("True", 0) > 0, category
    assert counts["by_routing"].get("unused", 0) > 0 and counts["by_routing"].get("hot", 0) > 0
    assert all(len(b["seeds"]) == 25 for b in report["buckets"])


@pytest.mark.slow
def test_replay_is_the_same_case(slice_report):
    """A case seed fixes the whole case: its bucket, routing, flags and data."""
    seed = slice_report["buckets"][-1]["seeds"][3]
    first, second = fuzz.make_case(seed), fuzz.make_case(seed)
    assert first.describe() == second.describe()
    for name, value in first.inputs.items():
        assert_bits_equal(second.inputs[name], value, err_msg=name)
    assert fuzz.replay(seed, "xla") == 0


def test_seeds_do_not_depend_on_the_split():
    """A campaign split by R over several runs (same seed) runs the same cases as one run."""
    whole = fuzz.schedule(3, 40, [1, 2, 4, 8], 6)
    parts = [fuzz.schedule(3, 10, [r], 6) for r in (1, 2, 4, 8)]
    assert sorted(whole) == sorted(s for part in parts for s in part)
    for seed in whole:
        assert fuzz.encode_seed(*fuzz.decode_seed(seed)) == seed
    assert fuzz.decode_seed(fuzz.encode_seed(1, 8, 3, 17)) == (1, 8, 3, 17)


@pytest.mark.multiprocess
def test_two_processes_each_check_their_own_rank(tmp_path):
    """--processes 2: R=2 as two jax.distributed processes (here one CPU device each, gloo); both run the same
    cases, each checks its own rank's outputs against the reference, and one report joins them."""
    out = tmp_path / "two.json"
    command = [sys.executable, "-m", "tools.fuzz", "--processes", "2", "--cases", "4", "--buckets", "2"]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [*command, "--seed", "5", "--out", str(out)], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cases"] == 4 and report["mismatching_cases"] == 0 and report["mismatches"] == []
    assert [p["cases"] for p in report["per_process"]] == [4, 4]
    assert report["counts"]["by_ranks"] == {"2": 4}
    assert report["processes"].startswith("2, one CPU device each")


# ---------------------------------------------------------------------------------------------------------------------
# The checker catches wrong results: one case per layout, its true outputs corrupted in one place at a time.

BUCKETS = {
    layout: fuzz.Bucket(
        num_ranks=2,
        num_tokens=6,
        hidden=5,
        y_hidden=3,
        topk=3,
        num_experts=4,
        layout=layout,
        capacity=None,
        expert_alignment=3,
        x_dtype="float32",
        y_dtype="bfloat16",
        partial_dtype=None,
        weights_dtype="float32" if layout == "ragged" else "bfloat16",
    )
    for layout in ("ragged", "expert")
}


@pytest.fixture(scope="module", params=sorted(BUCKETS))
def checked_case(request):
    flags = dict(exact=True, poison=True, specials=False, rerun=False)
    case = fuzz.make_case(12345, bucket=BUCKETS[request.param], routing="repeat", **flags)
    got = fuzz.run_case(case)
    assert fuzz.check_case(case, got) == []
    return case, got


def _rows(case, kind):
    """``(rank, flat row)`` of the first layout row of a kind: ``held`` (a slot), ``padding`` (specified, no slot)."""
    used = fuzz.used_rows(case.ref).reshape(case.bucket.num_ranks, -1)
    specified = np.ones_like(used)
    if case.bucket.layout == "ragged":
        specified = np.arange(used.shape[1])[None, :] < case.ref.group_sizes.sum(-1)[:, None]
    want = used if kind == "held" else specified & ~used
    rank, row = np.argwhere(want)[0]
    return int(rank), int(row)


def _ulp(value):
    """``value`` (a 0-d float array) one unit in the last place further from zero."""
    value = np.asarray(value)
    as_uint = np.dtype(f"uint{8 * value.dtype.itemsize}")
    return (value.view(as_uint) + 1).view(value.dtype)


def _set_row(got, name, case, kind, fn, col=0):
    """Apply ``fn`` to element ``col`` of the first ``kind`` row of layout-shaped output ``name`` (a copy)."""
    rank, row = _rows(case, kind)
    values = np.array(got[name])
    layout_dims = 1 if case.bucket.layout == "ragged" else 2
    trailing = values.shape[1 + layout_dims :]
    flat = values.reshape(case.bucket.num_ranks, -1, *trailing)
    index = (rank, row, col) if trailing else (rank, row)
    flat[index] = fn(flat[index])
    return {**got, name: values}


def _set(got, name, index, fn):
    values = np.array(got[name])
    values[index] = fn(values[index])
    return {**got, name: values}


CORRUPTIONS = {
    # name: (corrupt(got, case) -> got, the field the mismatch must name)
    "x_one_bit": (lambda g, c: _set_row(g, "x", c, "held", _ulp), "dispatch.x"),
    "x_padding_row": (lambda g, c: _set_row(g, "x", c, "padding", lambda v: np.ones_like(v)), "dispatch.x"),
    "weights_minus_zero": (
        lambda g, c: _set_row(g, "weights", c, "padding", lambda v: np.float32(-0.0)),
        "dispatch.weights",
    ),
    "group_sizes": (lambda g, c: _set(g, "group_sizes", (0, 0), lambda v: v + 1), "dispatch.group_sizes"),
    "num_dropped": (lambda g, c: _set(g, "num_dropped", 1, lambda v: v + 1), "dispatch.num_dropped"),
    "num_invalid": (lambda g, c: _set(g, "num_invalid", 0, lambda v: v - 1), "dispatch.num_invalid"),
    "combine_off": (
        lambda g, c: _set(g, "out_w", (0, 0, 0), lambda v: (v.astype(np.float32) + 0.5).astype(v.dtype)),
        "combine(weights=row_weights):",
    ),
    "combine_one_ulp": (lambda g, c: _set(g, "out_1", (1, 0, 1), _ulp), "combine(weights=None) vs combine_ordered"),
    "dx_one_ulp": (lambda g, c: _set(g, "dx", (0, 0, 2), _ulp), "dispatch vjp dx vs combine_ordered"),
    "dtopk_weights": (lambda g, c: _set(g, "dtopk_weights", (1, 0, 0), lambda v: -v), "dispatch vjp dtopk_weights"),
    "dy_held": (
        lambda g, c: _set_row(g, "dy", c, "held", lambda v: (v.astype(np.float32) * 1.5).astype(v.dtype)),
        "combine vjp dy",
    ),
    "dy_padding": (
        lambda g, c: _set_row(g, "dy", c, "padding", lambda v: np.ones_like(v)),
        "combine vjp dy (specified rows)",
    ),
    "dweights_free_row": (
        lambda g, c: _set_row(g, "dweights", c, "padding", lambda v: np.float32(1e-3)),
        "combine vjp dweights",
    ),
    "dweights_nan": (lambda g, c: _set_row(g, "dweights", c, "held", lambda v: np.float32(np.nan)), "dweights"),
    "dy_1": (lambda g, c: _set_row(g, "dy_1", c, "held", _ulp), "combine vjp dy, weights=None"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_checker_catches_corruption(checked_case, corruption):
    case, got = checked_case
    corrupt, field = CORRUPTIONS[corruption]
    problems = fuzz.check_case(case, corrupt(got, case))
    assert problems, f"{corruption} was not caught"
    assert any(field in p for p in problems), problems


def test_checker_and_the_unfilled_rows(checked_case):
    """Ragged: rows past sum(group_sizes) are unspecified, so NaN there in x, dy and dy_1 is no mismatch.
    Expert: rows past group_sizes[j] are zero, so NaN there is one, in each of the three."""
    case, got = checked_case
    group_sizes = case.ref.group_sizes
    if case.bucket.layout == "ragged":
        unfilled = np.arange(got["x"].shape[1])[None, :] >= group_sizes.sum(-1)[:, None]  # [R, C]
    else:
        unfilled = np.arange(got["x"].shape[2])[None, None, :] >= group_sizes[:, :, None]  # [R, L, C]
    assert unfilled.any()
    poisoned = dict(got)
    for name in ("x", "dy", "dy_1"):
        poisoned[name] = np.where(unfilled[..., None], np.asarray(np.nan, got[name].dtype), got[name])
    problems = fuzz.check_case(case, poisoned)
    if case.bucket.layout == "ragged":
        assert problems == []
    else:
        for field in ("dispatch.x", "combine vjp dy (specified rows)", "combine vjp dy, weights=None"):
            assert any(p.startswith(field) for p in problems), (field, problems)


def test_checker_catches_nondeterminism(checked_case):
    case, got = checked_case
    assert fuzz.determinism_mismatch(case, got, fuzz.run_case(case)) == []
    changed = _set(got, "out_w", (0, 1, 0), _ulp)
    assert any("determinism: out_w" in p for p in fuzz.determinism_mismatch(case, got, changed))


@pytest.mark.slow
def test_fuzzer_finds_an_injected_bug(monkeypatch):
    """A real bug in the xla backend, not only a corrupted result: combine summing a token's rows in descending
    instead of ascending row order (which the contract fixes) is caught by the bit-for-bit order checks."""
    from jax_ep.ep import xla

    bucket = fuzz.Bucket(
        num_ranks=2,
        num_tokens=8,
        hidden=16,
        y_hidden=16,
        topk=8,
        num_experts=2,
        layout="expert",
        capacity=None,
        expert_alignment=1,
        x_dtype="float32",
        y_dtype="float32",
        partial_dtype=None,
    )
    case = fuzz.make_case(777, bucket=bucket, routing="random", exact=True, poison=False, specials=False, rerun=False)
    assert fuzz.check_case(case, fuzz.run_case(case)) == []

    def descending(rows):
        return jnp.flip(jnp.sort(jnp.where(rows < 0, -1, rows), axis=-1), axis=-1)

    monkeypatch.setattr(xla, "_rows_in_order", descending)
    fuzz.program.cache_clear()  # trace the bucket's program again, with the bug
    try:
        problems = fuzz.check_case(case, fuzz.run_case(case))
    finally:
        fuzz.program.cache_clear()  # later tests trace the unpatched backend
    assert any("vs combine_ordered" in p for p in problems), problems


def test_tolerances_follow_the_contract():
    """bfloat16 y with bfloat16 partials: two bfloat16 roundings; float32 partials: one."""
    b = BUCKETS["ragged"]
    two = fuzz.tolerances(b)["combine"]
    one = fuzz.tolerances(dataclasses.replace(b, partial_dtype="float32"))["combine"]
    assert 2 * 2.0**-8 < two < 2.1 * 2.0**-8 and 2.0**-8 < one < 1.1 * 2.0**-8
    assert fuzz.tolerances(dataclasses.replace(b, y_dtype="float32"))["combine"] < 1e-5
    assert jnp.dtype(b.y_dtype) == jnp.bfloat16


def test_merged_reports_merge_again():
    """--merge takes reports that were merged before: cases add up, and commits, seeds and runs are joined."""

    def report(seed, commit, cases):
        time = dict(wall_s=float(cases), cases_per_s=1.0)
        return dict(
            backend="cuda", platform="gpu", jax_version="0", commit=commit, jax_ep_tree="t", jax_ep_uncommitted=False,
            sources=f"s{commit}",
            command=f"run {seed}", campaign_seed=seed, ranks=[1], cases=cases, mismatching_cases=0,
            counts={"by_ranks": {"1": cases}}, time=time, mismatches=[], buckets=[],
        )  # fmt: skip

    first = fuzz.merge([report(11, "a", 3), report(12, "b", 4)])
    both = fuzz.merge([first, report(13, "c", 5)])
    assert both["cases"] == 12 and both["counts"]["by_ranks"] == {"1": 12}
    assert both["commit"] == ["a", "b", "c"] and both["campaign_seed"] == [11, 12, 13]
    assert both["sources"] == ["sa", "sb", "sc"]
    assert [run["command"] for run in both["time"]["runs"]] == ["run 11", "run 12", "run 13"]
