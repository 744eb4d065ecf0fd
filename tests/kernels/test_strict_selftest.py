"""Self-tests of the strict GPU mode (tests/strict/checker.py): for each kind a hazardous
kernel is flagged as that kind (and nothing else) and its fixed twin is not; perturb and stale change
the outcome of order-dependent kernels and leave order-free / fixed ones alone; a marker comment
suppresses exactly its line; the pytest plugin fails a test with an unmarked hazard."""
import pytest
import torch
import triton
import triton.language as tl

from strict import Checker
from strict.plugin import StrictGPUFailure, StrictPlugin

pytestmark = pytest.mark.strict_gpu_off  # these tests run their own checkers and launch hazards on purpose
B = 16


# ---- kernels: cross-program ---------------------------------------------------------------------
@triton.jit
def x_ww(x):
    tl.store(x, tl.program_id(0))


@triton.jit
def x_ww_fixed(x):
    tl.store(x + tl.program_id(0), tl.program_id(0))


@triton.jit
def x_rw(x, out):
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(x, 7)
    else:
        tl.store(out + pid, tl.load(x))


@triton.jit
def x_rw_fixed(x, out):
    pid = tl.program_id(0)
    tl.store(x + pid, 7)
    tl.debug_barrier()
    tl.store(out + pid, tl.load(x + pid))


@triton.jit
def x_at(x):
    if tl.program_id(0) == 0:
        tl.store(x, 1)
    else:
        tl.atomic_add(x, 1)


@triton.jit
def x_at_fixed(x):
    tl.atomic_add(x, 1)


# ---- kernels: intra-program ---------------------------------------------------------------------
@triton.jit
def raw_tile(x, out, BLOCK: tl.constexpr, BARRIER: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, offs + 1)
    if BARRIER:
        tl.debug_barrier()
    tl.store(out + offs, tl.load(x + offs + SHIFT))  # SHIFT 1: thread k reads what thread k + 1 stored


@triton.jit
def war_tile(x, out, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    v = tl.load(x + offs + 1)
    if BARRIER:
        tl.debug_barrier()
    tl.store(x + offs, v + 1)
    tl.store(out + offs, v)


@triton.jit
def waw_tile(x, BLOCK: tl.constexpr, BARRIER: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, offs)
    if BARRIER:
        tl.debug_barrier()
    tl.store(x + offs // 2, -offs, mask=offs % 2 == 0)  # thread 2k writes what thread k wrote


@triton.jit
def raw_scalar(x, out, BARRIER: tl.constexpr):
    tl.store(x, 5)  # thread 0
    if BARRIER:
        tl.debug_barrier()
    tl.store(out, tl.load(x))  # every thread reads


@triton.jit
def war_scalar(x, BARRIER: tl.constexpr):
    v = tl.load(x)
    if BARRIER:
        tl.debug_barrier()
    tl.store(x, v + 1)


@triton.jit
def two_scalar_stores(x):
    tl.store(x, 1)
    tl.store(x, 2)  # both thread 0


@triton.jit
def tile_vs_scalar(x, out, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, offs)
    tl.store(out, tl.load(x + 3))


@triton.jit
def put(p, v):
    tl.store(p, v)


@triton.jit
def raw_helper(x, out, BARRIER: tl.constexpr):
    put(x, 3)
    if BARRIER:
        tl.debug_barrier()
    tl.store(out, tl.load(x))


@triton.jit
def masked(x, out, BLOCK: tl.constexpr, N: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, offs, mask=offs < N)
    tl.store(out + offs, tl.load(x + 8 + offs, mask=offs < 8, other=0))  # reads x[8..16) in lanes 0..7


@triton.jit
def atomic_then_load(x, out, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.atomic_add(x + offs, 1)
    tl.store(out + offs, tl.load(x + offs + SHIFT))


@triton.jit
def atomic_atomic(x, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.atomic_add(x + offs, 1)
    tl.atomic_add(x + offs + 1, 1)


@triton.jit
def dup_store(x, BLOCK: tl.constexpr, SAME: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    if SAME:
        tl.store(x + offs // 4, tl.full([BLOCK], 7, tl.int32))
    else:
        tl.store(x + offs // 4, offs)


@triton.jit
def two_hazards(x, out, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x + offs, offs)
    a = tl.load(x + offs + 1)  # strict: benign, self-test marker
    tl.store(x + 2 * BLOCK + offs, a)
    tl.store(out + offs, tl.load(x + 2 * BLOCK + offs + 1))


def z(n=64, dtype=torch.int32):
    return torch.zeros(n, dtype=dtype)


def run(fn, *, mode="detect"):
    with Checker(mode) as c:
        fn()
    return c


def kinds(c, unmarked=True):
    return sorted({h.kind for h in (c.unmarked() if unmarked else c.hazards())})


def lines(h):
    return (h.a[-1][1], h.b[-1][1])


# ---- detection ----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad,good,want", [
    (lambda: x_ww[(4,)](z()), lambda: x_ww_fixed[(4,)](z()), ["X-WW"]),
    (lambda: x_rw[(3,)](z(), z()), lambda: x_rw_fixed[(3,)](z(), z()), ["X-RW"]),
    (lambda: x_at[(3,)](z()), lambda: x_at_fixed[(3,)](z()), ["X-AT"]),
    (lambda: raw_tile[(1,)](z(), z(), BLOCK=B, BARRIER=False, SHIFT=1),
     lambda: raw_tile[(1,)](z(), z(), BLOCK=B, BARRIER=True, SHIFT=1), ["RAW"]),
    (lambda: raw_tile[(1,)](z(), z(), BLOCK=B, BARRIER=False, SHIFT=1),
     lambda: raw_tile[(1,)](z(), z(), BLOCK=B, BARRIER=False, SHIFT=0), ["RAW"]),  # same thread
    (lambda: war_tile[(1,)](z(), z(), BLOCK=B, BARRIER=False),
     lambda: war_tile[(1,)](z(), z(), BLOCK=B, BARRIER=True), ["WAR"]),
    (lambda: waw_tile[(1,)](z(), BLOCK=B, BARRIER=False), lambda: waw_tile[(1,)](z(), BLOCK=B, BARRIER=True),
     ["WAW"]),
    (lambda: raw_scalar[(1,)](z(), z(), BARRIER=False), lambda: raw_scalar[(1,)](z(), z(), BARRIER=True), ["RAW"]),
    (lambda: war_scalar[(1,)](z(), BARRIER=False), lambda: war_scalar[(1,)](z(), BARRIER=True), ["WAR"]),
    (lambda: tile_vs_scalar[(1,)](z(), z(), BLOCK=B), lambda: two_scalar_stores[(1,)](z()), ["RAW"]),
    (lambda: raw_helper[(1,)](z(), z(), BARRIER=False), lambda: raw_helper[(1,)](z(), z(), BARRIER=True), ["RAW"]),
    (lambda: masked[(1,)](z(), z(), BLOCK=B, N=9), lambda: masked[(1,)](z(), z(), BLOCK=B, N=8), ["RAW"]),
    (lambda: atomic_then_load[(1,)](z(), z(), BLOCK=B, SHIFT=1),
     lambda: atomic_atomic[(1,)](z(), BLOCK=B), ["RAW"]),
    (lambda: dup_store[(1,)](z(), BLOCK=B, SAME=False), lambda: dup_store[(1,)](z(), BLOCK=B, SAME=True),
     ["DUP-DIFF"]),
], ids=["x-ww", "x-rw", "x-at", "raw-tile", "raw-same-thread", "war-tile", "waw-tile", "raw-scalar",
        "war-scalar", "tile-vs-scalar/two-scalar-stores", "raw-helper", "masked-lanes", "atomic-vs-plain",
        "dup-diff/dup-same"])
def test_hazard_flagged_and_fixed_twin_clean(bad, good, want):
    c = run(bad)
    assert kinds(c) == want, c.report()
    assert all(h.count >= 1 and h.samples for h in c.unmarked())
    c = run(good)
    assert c.hazards() == [], c.report()


def test_details_sites_counts_and_names():
    c = run(lambda: masked[(1,)](z(), z(), BLOCK=B, N=9))
    (h,) = c.unmarked()
    assert (h.kind, h.a_cls, h.b_cls, h.count, h.samples, h.grid, h.num_warps) == \
        ("RAW", "store", "load", 1, ["x[8]"], (1,), 4)
    src = masked.fn.__code__.co_firstlineno
    assert lines(h) == (src + 3, src + 4)
    c = run(lambda: raw_helper[(1,)](z(), z(), BARRIER=False))
    (h,) = c.unmarked()
    assert h.a[-1][2] == "put" and h.a[-2][2] == "raw_helper" and h.b[-1][2] == "raw_helper"
    assert "(put) via kernels/test_strict_selftest.py:" in h.describe()
    c = run(lambda: dup_store[(1,)](z(), BLOCK=B, SAME=True))
    assert c.stats["dup_same"] == 1 and c.hazards() == []
    c = run(lambda: x_ww[(4,)](z()))
    (h,) = c.unmarked()
    assert h.count == 1 and h.samples == ["x[0]"]


def test_marker_suppresses_exactly_its_line():
    c = run(lambda: two_hazards[(1,)](z(), z(), BLOCK=B))
    src = two_hazards.fn.__code__.co_firstlineno  # the decorator's line
    by_line = {lines(h): h for h in c.hazards()}
    assert sorted(by_line) == [(src + 3, src + 4), (src + 5, src + 6)]
    assert by_line[(src + 3, src + 4)].benign == "self-test marker"  # store x[offs] -> the marked load
    assert [lines(h) for h in c.unmarked()] == [(src + 5, src + 6)]


# ---- perturb -------------------------------------------------------------------------------------
@triton.jit
def atomic_xchg_lanes(x, old, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(old + offs, tl.atomic_xchg(x + offs * 0, offs + 1))


@triton.jit
def cas_winner(x, old, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(old + offs, tl.atomic_cas(x + offs * 0, tl.zeros([BLOCK], tl.int32), offs + 1))


@triton.jit
def order_free(x):
    pid = tl.program_id(0)
    tl.atomic_add(x, 1)
    tl.store(x + 1 + pid, pid)


def outcome(launch, mode, *bufs):
    fresh = [b.clone() for b in bufs]
    if mode is None:  # no checker
        launch(*fresh)
    else:
        with Checker(mode):
            launch(*fresh)
    return [b.tolist() for b in fresh]


@pytest.mark.parametrize("launch,bufs", [
    (lambda x: x_ww[(4,)](x), (z(),)),  # the last program wins
    (lambda x: dup_store[(1,)](x, BLOCK=B, SAME=False), (z(),)),  # the last duplicate lane wins
    (lambda x, o: atomic_xchg_lanes[(1,)](x, o, BLOCK=B), (z(), z())),  # atomic lane order
    (lambda x, o: cas_winner[(1,)](x, o, BLOCK=B), (z(), z())),  # CAS winner
], ids=["last-program", "dup-lane", "atomic-order", "cas-winner"])
def test_perturb_changes_order_dependent_outcomes(launch, bufs):
    plain = outcome(launch, "detect", *bufs)
    pert = outcome(launch, "perturb", *bufs)
    assert plain != pert
    assert plain == outcome(launch, None, *bufs)  # detect does not change execution


def test_perturb_leaves_an_order_free_kernel_alone():
    with Checker("perturb") as c:
        x = z()
        order_free[(5,)](x)
    assert x[:7].tolist() == [5, 0, 1, 2, 3, 4, 0]
    assert c.stats["reversed_launches"] == 1 and c.hazards() == []


def test_perturb_first_lane_and_reversed_programs():
    assert outcome(lambda x: x_ww[(4,)](x), "perturb", z())[0][0] == 0
    assert outcome(lambda x: x_ww[(4,)](x), "detect", z())[0][0] == 3
    assert outcome(lambda x: dup_store[(1,)](x, BLOCK=B, SAME=False), "perturb", z())[0][:4] == [0, 4, 8, 12]


# ---- stale ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("launch,bufs,changes", [
    (lambda x, o: raw_scalar[(1,)](x, o, BARRIER=False), (z(), z()), True),
    (lambda x, o: raw_tile[(1,)](x, o, BLOCK=B, BARRIER=False, SHIFT=1), (z(), z()), True),
    (lambda x, o: raw_scalar[(1,)](x, o, BARRIER=True), (z(), z()), False),
    (lambda x, o: raw_tile[(1,)](x, o, BLOCK=B, BARRIER=True, SHIFT=1), (z(), z()), False),
    (lambda x, o: raw_tile[(1,)](x, o, BLOCK=B, BARRIER=False, SHIFT=0), (z(), z()), False),  # same thread
], ids=["scalar", "tile", "scalar-barrier", "tile-barrier", "tile-same-thread"])
def test_stale_reads_the_value_before_an_unordered_store(launch, bufs, changes):
    plain = outcome(launch, "detect", *bufs)
    stale = outcome(launch, "stale", *bufs)
    assert (plain != stale) == changes, (plain, stale)
    if changes:
        assert stale[1][0] == 0  # out[0] got x's value from before the store


# ---- lag (a lagging reader) ----------------------------------------------------------------------
@pytest.mark.parametrize("launch,bufs,changes", [
    (lambda x, o: war_tile[(1,)](x, o, BLOCK=B, BARRIER=False), (torch.arange(64, dtype=torch.int32), z()), True),
    (lambda x: war_scalar[(1,)](x, BARRIER=False), (z(),), True),
    (lambda x, o: war_tile[(1,)](x, o, BLOCK=B, BARRIER=True), (torch.arange(64, dtype=torch.int32), z()), False),
    (lambda x: war_scalar[(1,)](x, BARRIER=True), (z(),), False),
    (lambda x, o: raw_tile[(1,)](x, o, BLOCK=B, BARRIER=False, SHIFT=1), (z(), z()), False),  # RAW: not a lag
], ids=["tile", "scalar", "tile-barrier", "scalar-barrier", "raw"])
def test_lag_reads_the_value_of_a_later_unordered_store(launch, bufs, changes):
    plain = outcome(launch, "detect", *bufs)
    lag = outcome(launch, "lag", *bufs)
    assert (plain != lag) == changes, (plain, lag)
    if changes and len(bufs) == 2:
        assert lag[1][0] == plain[0][1]  # thread 0 read x[1] after thread 1 stored it
    if changes and len(bufs) == 1:
        assert (plain[0][0], lag[0][0]) == (1, 2)


def test_lag_reports_hazards_once():
    with Checker("lag") as c:
        war_tile[(1,)](torch.arange(64, dtype=torch.int32), z(), BLOCK=B, BARRIER=False)
    assert kinds(c) == ["WAR"] and c.stats["launches"] == 1 and c.stats["lag_lanes"] == B - 1


# ---- the plugin ----------------------------------------------------------------------------------
class _Item:
    nodeid = "fake::test"

    def __init__(self, slow=False):
        self.slow = slow

    def get_closest_marker(self, name):
        return object() if name == "slow" and self.slow else None


def drive(plugin, item, body):
    gen = plugin._run(item)
    next(gen)
    body()
    try:
        gen.send(None)
    except StopIteration:
        return None
    raise AssertionError("the wrapper did not finish")


def test_plugin_fails_a_test_with_an_unmarked_hazard_and_skips_slow_ones():
    p = StrictPlugin("detect")
    with pytest.raises(StrictGPUFailure, match=r"RAW in raw_scalar .*test_strict_selftest.py:\d+"):
        drive(p, _Item(), lambda: raw_scalar[(1,)](z(), z(), BARRIER=False))
    drive(p, _Item(), lambda: raw_scalar[(1,)](z(), z(), BARRIER=True))
    drive(p, _Item(slow=True), lambda: raw_scalar[(1,)](z(), z(), BARRIER=False))
    assert p.strict_tests == 2
    p = StrictPlugin("stale")  # outcome modes do not fail on hazards
    drive(p, _Item(), lambda: raw_scalar[(1,)](z(), z(), BARRIER=False))
