"""jax_ep.grouped_matmul against jax.lax.ragged_dot: forward, dx and dw.

The CPU tests run the custom VJP with XLA's ops in place of the kernels (``jax.lax.platform_dependent``
picks them off CUDA, after tracing the Mosaic kernels too) and check the kernels' tile table. The GPU tests
run the Mosaic GPU kernels themselves; they skip without a Hopper GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from jax_ep.gmm import grouped_matmul as gm
from jax_ep.gmm import padded as padded
from jax_ep.gmm.mosaic import Blocks, num_row_tiles, tile_table
from jax_ep.gmm.padded import padded_rows
from tests.gpu import require_gpu
from tests.helpers import slow

# (M, K, N, group_sizes, rows past the groups); sizes not multiples of 64, empty groups first, inside and last.
CASES = {
    "ragged": (300, 128, 192, [0, 37, 64, 0, 70, 1, 0], True),
    "full": (250, 64, 128, [65, 0, 120, 65], False),  # sum == M, M not a multiple of any tile
    "one_group": (130, 192, 64, [129], True),
    "all_empty": (96, 64, 64, [0, 0, 0], True),
    "many_small": (600, 128, 128, [3, 5, 0, 7, 1, 64, 128, 2, 9, 30, 0, 11] * 2 + [10], True),
    "tiny": (5, 64, 64, [2, 0, 2], True),  # fewer rows than the kernels' 8-row tile
    "wide": (300, 128, 256, [5, 0, 130, 64, 1], True),  # N = 256: the forward's 64 x 256 tiles on CUDA
    # Groups of about M / G rows, all within the padded path's 352 rows, and one group of 400 that is not: on
    # CUDA dx and dw take the padded path for "even" and their kernels for "uneven"; the forward runs its kernel
    # (fewer than 256 groups). The padded functions are also tested alone below.
    "even": (2048, 128, 192, [250, 260, 255, 262, 248, 251, 259, 253], True),
    "uneven": (2048, 128, 192, [400, 200, 255, 262, 200, 251, 259, 200], True),
}
ON_HOPPER = gm.hopper_available()
hopper = require_gpu("needs a Hopper GPU (compute capability 9.x)", needed=ON_HOPPER)
# The CPU sweeps' cases in the default tier (groups with gaps and a NaN tail, no rows at all, fewer rows than a tile);
# the slow tier runs the others.
CPU_CASES = [case if case in ("ragged", "all_empty", "tiny") else slow(case) for case in sorted(CASES)]


def make(case: str, dtype=jnp.bfloat16, seed: int = 0):
    """x [M, K], w [G, K, N], group_sizes, dy [M, N]; rows of x and dy past sum(group_sizes) are NaN."""
    m, k, n, sizes, tail = CASES[case]
    sizes = np.asarray(sizes, np.int32)
    assert sizes.sum() <= m and (sizes.sum() < m) == tail
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    x[sizes.sum() :] = np.nan
    dy[sizes.sum() :] = np.nan
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(sizes), jnp.asarray(dy, dtype)


def reference(x, w, sizes, dy):
    """y, dx, dw from jax.lax.ragged_dot in float32 on the valid rows (rows past the groups zeroed first)."""
    s = int(np.sum(sizes))
    x32 = jnp.asarray(x, jnp.float32).at[s:].set(0)
    dy32 = jnp.asarray(dy, jnp.float32).at[s:].set(0)
    y, pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, sizes), x32, jnp.asarray(w, jnp.float32))
    dx, dw = pullback(dy32)
    return [np.asarray(v) for v in (y, dx, dw)]


def vjp_step(fn, x, w, sizes, dy):
    """y, dx, dw of ``fn(x, w, sizes)`` with cotangent ``dy``."""
    y, pullback = jax.vjp(lambda a, b: fn(a, b, sizes), x, w)
    return (y, *pullback(dy))


def run(fn, x, w, sizes, dy):
    """y, dx, dw of ``fn(x, w, sizes)`` as float32 NumPy arrays, jitted."""
    return [np.asarray(v, np.float32) for v in jax.jit(functools.partial(vjp_step, fn))(x, w, sizes, dy)]


def check(got, want, sizes, *, tol):
    """y on the valid rows, dx on every row (0 past the groups), dw everywhere: finite and close."""
    s = int(np.sum(sizes))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = got, want
    assert y.shape == y_ref.shape and dx.shape == dx_ref.shape and dw.shape == dw_ref.shape
    for name, g, r in (("y", y[:s], y_ref[:s]), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert np.all(np.isfinite(g)), f"{name} is not finite"
        np.testing.assert_allclose(g, r, rtol=tol, atol=tol * max(1.0, float(np.abs(r).max(initial=0))), err_msg=name)
    assert np.all(dx[s:] == 0), "dx must be 0 past sum(group_sizes)"
    empty = np.asarray(sizes) == 0
    assert np.all(dw[empty] == 0), "dw of an empty group must be 0"


# CPU (and any platform): the custom VJP with XLA's ops, and the tile table.


@pytest.mark.parametrize("case", CPU_CASES)
def test_custom_vjp_matches_ragged_dot(case):
    x, w, sizes, dy = make(case)
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)
    assert plan is not None and None not in plan[:3]
    got = run(lambda a, b, c: gm.custom_grouped_matmul(a, b, c, plan), x, w, sizes, dy)
    check(got, reference(x, w, sizes, dy), sizes, tol=2e-2)


@pytest.mark.parametrize("case", ["ragged", "many_small"])
def test_auto_is_ragged_dot_without_hopper(case):
    if ON_HOPPER and gm.MOSAIC_BY_DEFAULT:
        pytest.skip("on a Hopper GPU auto picks the kernels (tested below)")
    x, w, sizes, dy = make(case)
    got = run(jax_ep.grouped_matmul, x, w, sizes, dy)
    want = run(jax.lax.ragged_dot, x, w, sizes, dy)
    s = int(np.sum(sizes))
    np.testing.assert_array_equal(got[0][:s], want[0][:s])
    np.testing.assert_array_equal(got[2], want[2])
    assert np.all(np.isfinite(got[2]))


@pytest.mark.parametrize("impl", ["plan", pytest.param("mosaic", marks=list(hopper))])
def test_nan_in_a_group_stays_in_that_group(impl):
    """NaN in x and Inf in dy on rows inside group 5 reach those rows and dw[5] only, as with ragged_dot: through
    the custom VJP of the shape's plan (off CUDA, with XLA's ops in place of the kernels), and on a Hopper GPU
    through jax_ep.grouped_matmul(impl="mosaic")."""
    x, w, sizes, dy = make("many_small")
    if impl == "plan":
        fn = functools.partial(gm.custom_grouped_matmul, plan=gm.plan_for(x.shape, w.shape, x.dtype, w.dtype))
    else:
        fn = functools.partial(jax_ep.grouped_matmul, impl="mosaic")
    row = int(np.sum(sizes[:5])) + 3  # group 5 has 64 rows; row and row + 1 are inside it
    s = int(np.sum(sizes))
    clean = run(fn, x, w, sizes, dy)
    got = run(fn, x.at[row].set(jnp.nan), w, sizes, dy.at[row + 1].set(jnp.inf))
    assert np.all(np.isnan(got[0][row])) and not np.any(np.isfinite(got[2][5]))
    assert not np.any(np.isfinite(got[1][row + 1]))
    others = np.arange(len(sizes)) != 5
    keep_y, keep_dx = np.arange(s) != row, np.arange(len(dy)) != row + 1
    np.testing.assert_array_equal(got[0][:s][keep_y], clean[0][:s][keep_y])
    np.testing.assert_array_equal(got[1][keep_dx], clean[1][keep_dx])
    np.testing.assert_array_equal(got[2][others], clean[2][others])
    assert np.all(np.isfinite(got[2][others]))


def test_custom_vjp_inside_shard_map():
    """Under jax.shard_map the kernel branch's output is cast to varying like XLA's, so both branches trace."""
    from jax.sharding import PartitionSpec as P

    from tests.conftest import cpu_mesh

    x, w, sizes, dy = make("ragged")
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)
    ranks = 2
    mesh = cpu_mesh((ranks,), ("ep",))

    def body(x, w, sizes, dy):
        fn = functools.partial(gm.custom_grouped_matmul, plan=plan)
        return tuple(v[None] for v in vjp_step(fn, x[0], w[0], sizes[0], dy[0]))

    def per_rank(a):
        return jnp.stack([a] * ranks)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    got = [np.asarray(v[1], np.float32) for v in step(*map(per_rank, (x, w, sizes, dy)))]
    check(got, reference(x, w, sizes, dy), sizes, tol=2e-2)


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("block_m", [slow(8), 64, slow(128)])
@pytest.mark.parametrize("case", CPU_CASES)
def test_tile_table_covers_each_valid_row_once(case, block_m, align):
    m, _, _, sizes, _ = CASES[case]
    sizes = np.asarray(sizes, np.int32)
    num_tiles = num_row_tiles(m, len(sizes), block_m, align)
    table = tile_table(jnp.asarray(sizes), block_m, num_tiles, align)
    group, row, skip, rows = (np.asarray(a) for a in table)
    starts = np.cumsum(sizes) - sizes
    covered = np.zeros(m, np.int32)
    for g, r, k, n in zip(group, row, skip, rows, strict=True):
        assert 0 <= n and 0 <= k and k + n <= block_m
        if n:
            assert r % align == 0, "a tile starts off the alignment"
            assert starts[g] <= r + k and r + k + n <= starts[g] + sizes[g], "a tile leaves its group"
            assert k == 0 or r + k == starts[g], "only a group's first tile skips rows"
            covered[r + k : r + k + n] += 1
    assert np.all(covered[: sizes.sum()] == 1) and np.all(covered[sizes.sum() :] == 0)
    lead = starts % align
    assert np.sum(rows > 0) == np.sum(np.where(sizes > 0, -(-(lead + sizes) // block_m), 0))
    assert rows[-1] == 0 or num_tiles == np.sum(rows > 0), "num_row_tiles must bound the tiles"


def test_tile_table_from_starts_covers_the_rows_past_each_groups_first():
    """Groups from explicit starts (the rows past each group's first C, as Plan.beyond's forward and dx kernel
    takes them): each of their rows is covered once, no other row, and num_row_tiles still bounds the tiles."""
    sizes = np.asarray([300, 0, 40, 90, 200, 64, 3], np.int32)
    m, rows, block_m = int(sizes.sum()) + 13, 64, 64
    rest, starts = (np.asarray(a) for a in padded.rows_beyond(jnp.asarray(sizes), rows, m))
    assert rest.tolist() == [236, 0, 0, 26, 136, 0, 0]
    num_tiles = num_row_tiles(m, len(sizes), block_m)
    group, row, skip, count = (np.asarray(a) for a in tile_table(jnp.asarray(rest), block_m, num_tiles, 8, starts))
    covered = np.zeros(m, np.int32)
    for g, r, k, n in zip(group, row, skip, count, strict=True):
        if n:
            assert r % 8 == 0 and starts[g] <= r + k and r + k + n <= starts[g] + rest[g]
            covered[r + k : r + k + n] += 1
    want = np.zeros(m, np.int32)
    for start, n in zip(starts, rest, strict=True):
        want[start : start + n] = 1
    np.testing.assert_array_equal(covered, want)


def test_tile_table_bound_is_tight_enough():
    """Many 1-row groups each 7 rows into an 8-row tile: every group takes a tile of its own."""
    sizes = np.asarray([7] + [1] * 40, np.int32)
    m, block_m = int(sizes.sum()), 64
    num_tiles = num_row_tiles(m, len(sizes), block_m)
    rows = np.asarray(tile_table(jnp.asarray(sizes), block_m, num_tiles)[3])
    assert np.sum(rows > 0) == len(sizes) <= num_tiles


def _held_rows(m: int, starts, sizes):
    """``[G, M]`` bool: row r is one of group g's, rows ``[starts[g], starts[g] + sizes[g])``."""
    r = jnp.arange(m)[None, :]
    return (r >= starts[:, None]) & (r < (starts + sizes)[:, None])


def fake_kernels(monkeypatch, seen):
    """Run the custom VJP's kernel branch on any platform, with XLA standing in for the kernels.

    The stand-ins check that every operand with rows has a multiple of 8 of them (as the kernels need),
    and leave NaN in the forward/dx rows past ``sum(group_sizes)`` (which the kernels do not write). The row
    copies (tested alone in test_row_copies.py) are XLA's.
    """
    mosaic = gm._mosaic

    def rows_ok(name, *arrays):
        for a in arrays:
            assert a.shape[0] % mosaic.ROW_MULTIPLE == 0, f"{name} got {a.shape[0]} rows"
        seen.append(name)

    def ragged(lhs, rhs, group_sizes, blocks, *, transpose_rhs=False, specialized=False, group_starts=None):
        rows_ok("ragged_dot" if group_starts is None else "ragged_dot_from_starts", lhs)
        rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
        if group_starts is None:
            out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
            return jnp.where(gm._rows_below(lhs.shape[0], group_sizes), out, jnp.nan).astype(lhs.dtype)
        held = _held_rows(lhs.shape[0], group_starts, group_sizes)  # [G, M]
        out = jnp.einsum("gm,mk,gkn->mn", held.astype(jnp.float32), lhs.astype(jnp.float32), rhs.astype(jnp.float32))
        return jnp.where(held.any(0)[:, None], out, jnp.nan).astype(lhs.dtype)

    def transposed(lhs, rhs, group_sizes, blocks, *, specialized=False, group_starts=None):
        rows_ok("transposed_ragged_dot" if group_starts is None else "transposed_ragged_dot_from_starts", lhs, rhs)
        if group_starts is None:
            return gm._xla_dw(lhs, rhs, group_sizes).astype(lhs.dtype)
        held = _held_rows(lhs.shape[0], group_starts, group_sizes)[..., None]  # rows outside a group: 0, never NaN
        lhs_g, rhs_g = jnp.where(held, lhs.astype(jnp.float32), 0), jnp.where(held, rhs.astype(jnp.float32), 0)
        return jnp.einsum("gmk,gmn->gkn", lhs_g, rhs_g).astype(lhs.dtype)

    monkeypatch.setattr(mosaic, "ragged_dot", ragged)
    monkeypatch.setattr(mosaic, "upstream_ragged_dot", ragged)
    monkeypatch.setattr(mosaic, "transposed_ragged_dot", transposed)
    monkeypatch.setattr(gm.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    rc = padded._row_copies
    if rc is not None:  # None with a jax without Pallas Triton: the copies are XLA's already
        monkeypatch.setattr(rc, "pad", lambda a, starts, sizes, rows: padded._xla_pad(a, sizes, rows))

        def unpad(p, starts, sizes, m, plus=None, *, into=None):
            return padded._xla_unpad(padded.summed(p, plus), sizes, m, starts, into)

        monkeypatch.setattr(rc, "unpad", unpad)
        zero = lambda a, first: jnp.where(jnp.arange(a.shape[0])[:, None] < first, a, 0)  # noqa: E731
        monkeypatch.setattr(rc, "zero_rows_from", zero)


# Sizes for Plan.beyond at padded rows 96: all fit; one group past them; three past them; more past them than
# BEYOND_GROUPS (set to 2 here), where dw takes its kernel for every row.
BEYOND = {
    "fit": [90, 0, 64, 96, 30],
    "one_larger": [90, 0, 150, 96, 30],
    "three_larger": [200, 0, 97, 96, 130, 1],
    "past_most": [200, 0, 97, 96, 130, 1],
}


@pytest.mark.parametrize("case", [c if c in ("one_larger", "past_most") else slow(c) for c in sorted(BEYOND)])
def test_beyond_takes_the_padded_path_past_its_rows(monkeypatch, case):
    """Plan.beyond: where a group has more rows than the padded path's, the forward pass and dx still take the padded
    path for every group's first rows and the row-tile kernel for the rest, and dw its kernel for the larger
    groups whole; ragged_dot's results exactly (integer values, exact in float32), NaN past the groups reaching
    nothing; dw falls back to its kernel where more than BEYOND_GROUPS groups are larger."""
    fake_kernels(monkeypatch, [])
    monkeypatch.setattr(gm, "BEYOND_GROUPS", 2 if case == "past_most" else 4)
    # The kernels this case must not run give NaN (every branch of a lax.cond is traced, one runs).
    barred = {"fit": {"rows", "rows_from_starts", "dw", "dw_from_starts"}, "past_most": {"rows", "dw_from_starts"}}
    barred = barred.get(case, {"rows", "dw"})

    def unless_barred(kernel, name):
        def run_or_nan(*args, group_starts=None, **kwargs):
            out = kernel(*args, group_starts=group_starts, **kwargs)
            return out * jnp.nan if name + ("" if group_starts is None else "_from_starts") in barred else out

        return run_or_nan

    monkeypatch.setattr(gm._mosaic, "ragged_dot", unless_barred(gm._mosaic.ragged_dot, "rows"))
    monkeypatch.setattr(gm._mosaic, "transposed_ragged_dot", unless_barred(gm._mosaic.transposed_ragged_dot, "dw"))
    sizes = np.asarray(BEYOND[case], np.int32)
    m, k, n = int(sizes.sum()) + 11, 64, 128
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (m, k)).astype(np.float32)
    dy = rng.integers(-3, 4, (m, n)).astype(np.float32)
    x[sizes.sum() :] = dy[sizes.sum() :] = np.nan
    w = rng.integers(-3, 4, (len(sizes), k, n)).astype(np.float32)
    x, w, dy = (jnp.asarray(a, jnp.bfloat16) for a in (x, w, dy))
    plan = gm.Plan(Blocks(64, 64, 64, 2, 1), Blocks(64, 64, 64, 2, 1), Blocks(64, 64, 64, 2, 1), "tiles")
    plan = plan._replace(padded=96, padded_ops=("fwd", "dx", "dw"), beyond=True)
    y, dx, dw = run(lambda a, b, c: gm.custom_grouped_matmul(a, b, c, plan), x, w, jnp.asarray(sizes), dy)
    y_ref, dx_ref, dw_ref = reference(x, w, sizes, dy)
    s = int(sizes.sum())
    np.testing.assert_array_equal(y[:s], y_ref[:s])
    np.testing.assert_array_equal(dx, dx_ref)  # 0 past the groups
    np.testing.assert_array_equal(dw, dw_ref)


@pytest.mark.parametrize("rows", ["upstream", "tiles", "specialized"])
@pytest.mark.parametrize("case", CPU_CASES)
def test_kernel_branch_pads_rows(monkeypatch, case, rows):
    """Any M: the kernels see rows padded to a multiple of 8, and the results are ragged_dot's."""
    seen = []
    fake_kernels(monkeypatch, seen)
    x, w, sizes, dy = make(case)
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)._replace(rows=rows)
    got = run(lambda a, b, c: gm.custom_grouped_matmul(a, b, c, plan), x, w, sizes, dy)
    check(got, reference(x, w, sizes, dy), sizes, tol=2e-2)
    assert sorted(set(seen)) == ["ragged_dot", "transposed_ragged_dot"]
    jaxpr = str(jax.make_jaxpr(lambda a, b: gm.custom_grouped_matmul(a, b, sizes, plan))(x, w))
    assert ("pad[" in jaxpr) == (x.shape[0] % 8 != 0), "pad exactly when M is not a multiple of 8"


def test_kernels_refuse_rows_not_a_multiple_of_8():
    x, w, sizes, _ = make("ragged")  # M = 300
    blocks = Blocks(64, 64, 64, 2, 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        gm._mosaic.ragged_dot(x, w, sizes, blocks)
    with pytest.raises(ValueError, match="multiple of 8"):
        gm._mosaic.upstream_ragged_dot(x, w, sizes, blocks)
    with pytest.raises(ValueError, match="multiple of 8"):
        gm._mosaic.transposed_ragged_dot(x, x[:, :128], sizes, blocks)


def test_padded_rows_cover_groups_of_uniform_routing():
    assert padded_rows(32768, 256) == 192 and padded_rows(8192, 64) == 192  # groups of 128 rows on average
    assert padded_rows(32768, 32) == 1184
    assert padded_rows(2048, 8) == 352
    assert padded_rows(600, 25) is None and padded_rows(96, 3) is None  # more than 1.5x the useful flops
    assert padded_rows(0, 4) is None
    bf16 = jnp.bfloat16
    many = gm.plan_for((32768, 7168), (256, 7168, 2048), bf16, bf16)
    assert many.padded == 192 and many.padded_ops == ("fwd", "dx", "dw") and many.padded_rows("dx") == 192
    assert many.beyond == gm.BEYOND_BY_DEFAULT  # larger groups keep the padded path, where it is on
    few = gm.plan_for((32768, 7168), (32, 7168, 2048), bf16, bf16)  # groups of 1024 rows: the kernels won
    assert few.padded == 1184 and few.padded_ops == () and few.padded_rows("dw") is None and not few.beyond
    small = gm.plan_for((8192, 4096), (64, 4096, 1024), bf16, bf16)
    assert small.padded == 192 and small.padded_ops == ("dx", "dw") and small.padded_rows("dw") == 192
    assert not small.beyond
    decode = gm.plan_for((1024, 7168), (256, 7168, 2048), bf16, bf16)  # 4 rows a group: padding would cost too much
    assert decode.padded is None and decode.padded_ops == () and decode.padded_rows("dw") is None
    assert not decode.beyond
    assert bool(padded.fits(jnp.asarray(CASES["even"][3], jnp.int32), 352))
    assert not bool(padded.fits(jnp.asarray(CASES["uneven"][3], jnp.int32), 352))


@pytest.mark.parametrize("case", CPU_CASES)
def test_padded_path_matches_ragged_dot(case):
    """The padded dense path alone (any platform), forward, dx and dw: NaN past the groups and in the gaps never
    enters a group, and an empty group's dw is 0."""
    x, w, sizes, dy = make(case)
    rows = -(-max(int(np.max(sizes)), 1) // 8) * 8 + 8  # every group fits, with rows to spare
    ops = jax.jit(lambda x, w, s, dy: (padded.fwd(x, w, s, rows), padded.dx(dy, w, s, rows), padded.dw(x, dy, s, rows)))
    y, dx, dw = (np.asarray(v, np.float32) for v in ops(x, w, sizes, dy))
    y_ref, dx_ref, dw_ref = reference(x, w, sizes, dy)
    s = int(np.sum(sizes))
    assert dw.shape == w.shape
    for name, got, want in (("y", y[:s], y_ref[:s]), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert np.all(np.isfinite(got)), f"{name} is not finite"
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(want).max(initial=0))))
    assert np.all(y[s:] == 0) and np.all(dx[s:] == 0), "0 past sum(group_sizes)"
    assert np.all(dw[np.asarray(sizes) == 0] == 0), "an empty group's dw is 0"


def test_custom_vjp_sums_dw_over_the_axes_w_is_replicated_on():
    """Inside shard_map, with x sharded over ("data", "ep") and w only over "ep", the custom VJP's dw is the sum
    over the data shards, as autodiff of ragged_dot gives (it used to fail: the cotangent varied over "data")."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    cpus = jax.devices("cpu")  # 8 simulated CPU devices (conftest), also where a single GPU is the default
    if len(cpus) < 8:
        pytest.skip("needs 8 CPU devices")
    mesh = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(AxisType.Auto,) * 2, devices=cpus[:8])
    m, k, n, g = 64, 64, 64, 2
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((8 * m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4 * g, k, n)) / 8, jnp.bfloat16)
    sizes = jnp.asarray(np.tile([30, 26], 8), jnp.int32)  # per shard [30, 26]: 56 of 64 rows, the rest past them
    plan = gm.plan_for((m, k), (g, k, n), jnp.bfloat16, jnp.bfloat16)

    def loss(fn):
        def body(x, w, s):
            return jnp.sum(fn(x, w, s).astype(jnp.float32)[:56] ** 2)[None]

        mapped = jax.shard_map(
            body, mesh=mesh, in_specs=(P(("data", "ep")), P("ep"), P(("data", "ep"))), out_specs=P(("data", "ep"))
        )
        return jax.jit(jax.grad(lambda x, w: jnp.sum(mapped(x, w, sizes)), argnums=(0, 1)))

    got = loss(lambda a, b, c: gm.custom_grouped_matmul(a, b, c, plan))(x, w)
    want = loss(jax.lax.ragged_dot)(x, w)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)


def test_plan_for_shapes_and_dtypes():
    bf16 = jnp.bfloat16
    plan = gm.plan_for((4096, 7168), (32, 7168, 2048), bf16, bf16)
    assert plan is not None and None not in plan[:3]
    assert 7168 % plan.fwd.block_k == 0 and 2048 % plan.fwd.block_n == 0
    assert 2048 % plan.dx.block_k == 0 and 7168 % plan.dx.block_n == 0
    assert 7168 % plan.dw.block_m == 0 and 2048 % plan.dw.block_n == 0
    assert plan.rows != "specialized"  # 128 rows a group
    large = gm.plan_for((32768, 7168), (32, 7168, 2048), bf16, bf16)  # 1024 rows a group
    assert large.rows == "specialized" and large.fwd == large.dx == large.dw == gm.SPECIALIZED
    assert large.dw_specialized and large.padded_ops == () and plan.dw_specialized and plan.padded_ops == ("dx", "dw")
    odd = gm.plan_for((4096, 7168), (32, 7168, 2112), bf16, bf16)  # N not a multiple of 256: the pipelined dw
    assert not odd.dw_specialized and 2112 % odd.dw.block_n == 0
    assert gm.plan_for((32768, 7168), (32, 7168, 2112), bf16, bf16).rows != "specialized"  # N not a multiple of 256
    assert gm.plan_for((2048, 128), (8, 128, 192), bf16, bf16, rows="specialized") is None
    assert gm.plan_for((32768, 7168), (256, 7168, 2048), bf16, bf16).rows == "tiles"  # many small groups
    if gm._mosaic.upstream_signature_ok():
        assert plan.rows == "upstream" and gm.plan_for((8192, 4096), (64, 4096, 1024), bf16, bf16).rows == "upstream"
    swept = gm.plan_for((8192, 4096), (64, 4096, 1024), bf16, bf16)  # the shape the forward and dx tiles won at
    assert swept.fwd == Blocks(64, 256, 64, 4, 4) and swept.dx == Blocks(128, 128, 64, 6, 16)
    assert gm.plan_for((2048, 128), (8, 128, 192), bf16, bf16).fwd == Blocks(64, 64, 64, 4, 1)  # 192 columns
    assert gm.plan_for((300, 128), (5, 128, 256), bf16, bf16).fwd == Blocks(64, 256, 64, 4, 1)  # CASES["wide"]
    assert gm.plan_for((64, 128), (2, 128, 128), jnp.float32, jnp.float32) is None
    assert gm.plan_for((64, 128), (2, 128, 128), bf16, jnp.float16) is None
    assert gm.plan_for((64, 100), (2, 100, 128), bf16, bf16) is None  # K not a multiple of 64
    partial = gm.plan_for((64, 128), (2, 128, 96), bf16, bf16)  # N = 96: only dx's contraction step fits
    assert partial is None or (partial.fwd is None and partial.dw is None)


def test_environment_variable_picks_the_implementation(monkeypatch):
    x, w, sizes, _ = make("ragged")

    def ops(impl_env):
        monkeypatch.setenv("JAX_EP_GROUPED_MATMUL", impl_env)
        return str(jax.make_jaxpr(lambda a, b: jax_ep.grouped_matmul(a, b, sizes))(x, w))

    assert "custom_vjp" not in ops("xla") and "ragged_dot" in ops("xla")
    if ON_HOPPER:
        assert "custom_vjp" in ops("mosaic")
    else:
        with pytest.raises(ValueError, match="Hopper"):
            ops("mosaic")
    with pytest.raises(ValueError, match="JAX_EP_GROUPED_MATMUL"):
        ops("cutlass")


def test_bad_arguments():
    x, w, sizes, _ = make("ragged")
    with pytest.raises(ValueError, match="impl"):
        jax_ep.grouped_matmul(x, w, sizes, impl="cutlass")
    with pytest.raises(TypeError, match="group_sizes"):
        jax_ep.grouped_matmul(x, w, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="share K"):
        jax_ep.grouped_matmul(x[:, :64], w, sizes)
    with pytest.raises(ValueError, match="mosaic"):
        jax_ep.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), sizes, impl="mosaic")
    if not ON_HOPPER:
        with pytest.raises(ValueError, match="Hopper"):
            jax_ep.grouped_matmul(x, w, sizes, impl="mosaic")


@pytest.mark.parametrize("sizes_dtype", [jnp.int8, jnp.uint16, jnp.int32])
def test_ragged_dots_call(sizes_dtype):
    """grouped_matmul takes jax.lax.ragged_dot's call keyword for keyword (group_sizes of any integer dtype,
    precision, preferred_element_type as the output dtype) and gives its values and gradients, under jit."""
    x, w, sizes, dy = make("ragged")
    call = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)

    def ours(a, b):
        return jax_ep.grouped_matmul(lhs=a, rhs=b, group_sizes=sizes.astype(sizes_dtype), group_offset=None, **call)

    def theirs(a, b):
        return jax.lax.ragged_dot(lhs=a, rhs=b, group_sizes=sizes, **call)

    s = int(np.sum(sizes))
    x, dy32 = x.at[s:].set(0), dy.astype(jnp.float32).at[s:].set(0)
    got = jax.jit(lambda a, b: vjp_step(lambda a, b, _: ours(a, b), a, b, None, dy32))(x, w)
    want = jax.jit(lambda a, b: vjp_step(lambda a, b, _: theirs(a, b), a, b, None, dy32))(x, w)
    assert got[0].dtype == jnp.float32 and got[1].dtype == x.dtype and got[2].dtype == w.dtype
    for name, g, r in zip(("y", "dx", "dw"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32), err_msg=name)
    positional = jax_ep.grouped_matmul(x, w, sizes, None, jnp.float32)
    np.testing.assert_array_equal(positional[:s], jax.lax.ragged_dot(x, w, sizes, None, jnp.float32)[:s])


def test_ragged_dots_call_refusals():
    """group_offset (ragged_dot's sharded groups) is not implemented; impl="mosaic" cannot write another dtype
    than the operands'; a non-float preferred_element_type and a float group_sizes are refused by name."""
    x, w, sizes, _ = make("ragged")
    with pytest.raises(NotImplementedError, match="group_offset"):
        jax_ep.grouped_matmul(x, w, sizes, group_offset=jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="(?s)(?=.*preferred_element_type)(?=.*float32)(?=.*bfloat16)"):
        jax_ep.grouped_matmul(x, w, sizes, preferred_element_type=jnp.float32, impl="mosaic")
    with pytest.raises(TypeError, match="(?s)(?=.*preferred_element_type)(?=.*int32)"):
        jax_ep.grouped_matmul(x, w, sizes, preferred_element_type=jnp.int32)
    with pytest.raises(TypeError, match="(?s)(?=.*group_sizes)(?=.*integer)(?=.*float32)"):
        jax_ep.grouped_matmul(x, w, sizes.astype(jnp.float32))
    with pytest.raises(ValueError, match="(?s)(?=.*lhs)(?=.*rhs)(?=.*share K)"):
        jax_ep.grouped_matmul(x[:, :64], w, sizes)


# GPU: the Mosaic kernels themselves.


@hopper
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_mosaic_matches_ragged_dot(case, dtype):
    x, w, sizes, dy = make(case, dtype)
    got = run(lambda a, b, c: jax_ep.grouped_matmul(a, b, c, impl="mosaic"), x, w, sizes, dy)
    check(got, reference(x, w, sizes, dy), sizes, tol=2e-2)


@hopper
@pytest.mark.parametrize("rows", ["upstream", "tiles"])
@pytest.mark.parametrize(
    "blocks",
    [Blocks(64, 64, 64, 2, 1), Blocks(64, 128, 64, 4, 2), Blocks(128, 128, 64, 4, 1), Blocks(128, 64, 64, 3, 1)],
)
def test_mosaic_tiles(blocks, rows):
    """Both forward kernels and other tiles than the defaults, on many small groups and a NaN tail."""
    x, w, sizes, dy = make("many_small")
    plan = gm.Plan(blocks, blocks, blocks, rows)
    got = run(lambda a, b, c: gm.custom_grouped_matmul(a, b, c, plan), x, w, sizes, dy)
    check(got, reference(x, w, sizes, dy), sizes, tol=2e-2)


@hopper
@pytest.mark.parametrize("blocks", [Blocks(128, 256, 64, 3, 2), Blocks(64, 128, 64, 4, 1)])
@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize(
    "sizes",
    [
        [100, 0, 333, 7, 200, 0, 17],  # groups starting off multiples of 8, empty groups, a NaN tail
        [64, 65, 129, 192, 0, 63, 1, 250],  # rows that fill a tile's first half exactly, and one more
        [1024],  # every row
    ],
)
def test_specialized_kernel(sizes, transpose_rhs, blocks):
    """The warp-specialized kernel: the rows of each group (tiles of one half and of both), nothing past them."""
    m, k, n = 1024, 256, 512
    sizes = np.asarray(sizes, np.int32)
    s = int(sizes.sum())
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x[s:] = np.nan
    w = (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(np.float32)
    rhs = np.swapaxes(w, 1, 2) if transpose_rhs else w
    kernel = functools.partial(gm._mosaic.ragged_dot, blocks=blocks, transpose_rhs=transpose_rhs, specialized=True)
    got = jax.jit(kernel)(jnp.asarray(x, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16), jnp.asarray(sizes))
    got = np.asarray(got, np.float32)
    xb = np.asarray(jnp.asarray(x[:s], jnp.bfloat16), np.float32)
    wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float32)
    want = np.asarray(jax.lax.ragged_dot(jnp.asarray(xb), jnp.asarray(wb), jnp.asarray(sizes)))
    assert np.all(np.isfinite(got[:s])), "no NaN from the rows past the groups"
    np.testing.assert_allclose(got[:s], want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max()))


@hopper
@pytest.mark.parametrize(
    "specialized,blocks", [(False, Blocks(128, 128, 64, 4, 1)), (True, Blocks(128, 256, 64, 3, 2))]
)
@pytest.mark.parametrize(
    "sizes",
    [
        [100, 0, 333, 7, 200, 0, 17],  # groups starting and ending inside a row block, empty groups, a NaN tail
        [64, 1, 63, 128, 0, 500],  # groups on row-block edges, one row
        [1024],  # every row
    ],
)
def test_transposed_kernels(sizes, specialized, blocks):
    """dw's kernels: each group's own rows alone, whatever the others hold (NaN in one group and past the groups),
    and 0 for an empty group. A freed NaN buffer of the output's size comes first, which the allocator most likely
    hands the output, so that an element left unwritten shows."""
    r, m, n = 1024, 256, 512
    sizes = np.asarray(sizes, np.int32)
    ends = np.cumsum(sizes)
    rng = np.random.default_rng(5)
    lhs = rng.standard_normal((r, m)).astype(np.float32)
    rhs = rng.standard_normal((r, n)).astype(np.float32)
    nan_group = int(np.argmax(sizes)) if len(sizes) > 1 else None
    for a in (lhs, rhs):
        a[ends[-1] :] = np.nan
        if nan_group is not None:
            a[ends[nan_group] - sizes[nan_group] : ends[nan_group]] = np.nan
    kernel = functools.partial(gm._mosaic.transposed_ragged_dot, blocks=blocks, specialized=specialized)
    args = jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16), jnp.asarray(sizes)
    step = jax.jit(kernel).lower(*args).compile()
    jnp.full((len(sizes), m, n), jnp.nan, jnp.bfloat16).block_until_ready()  # freed at once
    got = np.asarray(step(*args))
    lb, rb = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (lhs, rhs))
    for g, (size, end) in enumerate(zip(sizes, ends, strict=True)):
        if g == nan_group:
            continue
        want = lb[end - size : end].T @ rb[end - size : end]
        got_g = got[g].astype(np.float32)
        assert np.all(np.isfinite(got_g)), f"group {g}: NaN or unwritten elements"
        np.testing.assert_allclose(got_g, want, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(want).max())))


@hopper
@pytest.mark.parametrize("case", ["ragged", "one_group", "tiny", "full"])
def test_mosaic_tiles_kernel_any_m(case):
    """The per-group-tile forward kernel (Plan.rows="tiles") on groups starting off multiples of 8."""
    x, w, sizes, dy = make(case)
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)._replace(rows="tiles")
    got = run(lambda a, b, c: gm.custom_grouped_matmul(a, b, c, plan), x, w, sizes, dy)
    check(got, reference(x, w, sizes, dy), sizes, tol=2e-2)


@hopper
def test_mosaic_kernels_are_what_runs():
    """The compiled forward and backward hold Mosaic GPU custom calls and no ragged_dot."""
    x, w, sizes, dy = make("ragged")

    step = functools.partial(vjp_step, functools.partial(jax_ep.grouped_matmul, impl="mosaic"))
    hlo = jax.jit(step).lower(x, w, sizes, dy).compile().as_text()
    assert hlo.count("mosaic_gpu") >= 3, "expected the three Mosaic kernels"
    assert " ragged-dot(" not in hlo, "XLA's ragged dot must not run"


def routed_sizes(rng, rows: int, g: int, fit: int, skew: bool) -> np.ndarray:
    """Sizes of ``g`` groups of ``rows`` rows routed uniformly at random; with ``skew`` group 0 takes rows from every
    other group until it has more than ``fit``."""
    sizes = np.bincount(rng.integers(0, g, rows), minlength=g).astype(np.int32)
    if skew:
        per = -(-(fit + 10 - sizes[0]) // (g - 1))
        sizes[1:] -= per
        sizes[0] += per * (g - 1)
    assert sizes.sum() == rows and (sizes.max() > fit) == skew and sizes.min() >= 0
    return sizes


@hopper
@pytest.mark.parametrize("beyond", [False, True], ids=["kernels_past_it", "beyond"])
@pytest.mark.parametrize("skew", [False, True])
@pytest.mark.parametrize(
    "m,k,n,g,ops",
    # 1024 rows a group: the warp-specialized kernels, none on the padded path
    [(32768, 64, 128, 256, ("fwd", "dx", "dw")), (4096, 4096, 2048, 4, ())],
    ids=["256_groups", "4_groups_large_weights"],
)
def test_groups_that_fit_take_the_padded_path(monkeypatch, m, k, n, g, ops, skew, beyond):
    """The ops of the plan's padded_ops hold the padded path under a conditional, and all three match a per-group
    float32 matmul with every group fitting (the padded path) and with one group too large: the kernels, or with
    BEYOND_BY_DEFAULT at 256 groups the padded path past its rows (Plan.beyond, the kernels over groups from
    explicit starts)."""
    monkeypatch.setattr(gm, "BEYOND_BY_DEFAULT", beyond)
    plan = gm.plan_for((m, k), (g, k, n), jnp.bfloat16, jnp.bfloat16)
    fit = padded_rows(m, g)
    assert plan.padded == fit and plan.padded_ops == ops and plan.beyond == (beyond and g >= gm.MANY_GROUPS)
    rng = np.random.default_rng(3)
    sizes = routed_sizes(rng, m - 100, g, fit, skew)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, k, n)) / np.sqrt(k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    x[-100:], dy[-100:] = np.nan, np.nan
    args = [jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes)]
    step = functools.partial(vjp_step, functools.partial(jax_ep.grouped_matmul, impl="mosaic"))
    hlo = jax.jit(step).lower(*args, jnp.asarray(dy, jnp.bfloat16)).compile().as_text()
    assert hlo.count("conditional(") >= len(ops), f"expected a conditional for each of {ops}"
    y, dx, dw = (np.asarray(v, np.float32) for v in jax.jit(step)(*args, jnp.asarray(dy, jnp.bfloat16)))
    xb, wb, dyb = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) for a in (x, w, dy))
    start = 0
    for group, size in enumerate(sizes):
        rows = slice(start, start + size)
        np.testing.assert_allclose(y[rows], xb[rows] @ wb[group], rtol=2e-2, atol=2e-2 * 4)
        np.testing.assert_allclose(dx[rows], dyb[rows] @ wb[group].T, rtol=2e-2, atol=2e-2 * 4)
        np.testing.assert_allclose(dw[group], xb[rows].T @ dyb[rows], rtol=2e-2, atol=2e-2 * 16)
        start += size
    assert np.all(dx[start:] == 0)
