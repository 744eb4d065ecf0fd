"""The kernels' barriers and benign-race marks, under the strict checker (tests/strict/; README,
"Strict mode"; docs/design.md, "Without a GPU"). The three races the first hazard run found
(fixed in 7f4ccec, ../shared/hazards-first-run.md rows 1-3): with each ``# strict: orders ...``
barrier removed from a fresh copy of its kernel module, the strict checker flags the race under
``detect`` and a real scenario (device against the reference) goes wrong under ``stale`` (the two
RAWs) or ``lag`` (the WAR); with the barrier, it does not. And a block listed in two tiles of one
release: the checker sees the ``# strict: benign`` stores and both pools agree."""
import importlib.util
import pathlib
import re

import pytest

import gpupool.kernels
import gpupool.kernels.requests.exact
import gpupool.replay.device
from gpupool.replay import TraceRequest, replay
from gpupool.replay.device import replay_on_device
from strict import Checker

from harness.compare import assert_pools_agree, assert_replays_agree
from harness.twins import pool_twin

from harness.manager_pair import preemption_and_stop_on_failure

KERNELS = pathlib.Path(gpupool.kernels.__file__).resolve().parent


def without_barrier(module: str, what: str, tmp_path):
    """A fresh module ``gpupool.kernels.<module>`` (dotted, e.g. ``requests.steps``) from its file with
    the barrier lines whose comment is ``# strict: orders <what>...`` replaced by ``pass`` (line
    numbers kept). Returns it, its path and the line numbers."""
    src = (KERNELS / f"{module.replace('.', '/')}.py").read_text().splitlines(keepends=True)
    hit = []
    for i, line in enumerate(src):
        if re.search(r"tl\.debug_barrier\(\)\s+# strict: orders " + re.escape(what), line):
            src[i] = line.replace("tl.debug_barrier()", "pass").replace("# strict: orders", "# (removed) orders")
            hit.append(i + 1)
    assert hit, f"no barrier '# strict: orders {what}' in kernels/{module}.py"
    package, _, name = f"gpupool.kernels.{module}".rpartition(".")
    path = tmp_path / f"{name}_without_barrier.py"
    path.write_text("".join(src))
    spec = importlib.util.spec_from_file_location(f"{package}._{name}_without_barrier", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path, hit


def ctrl_raws(c, path):
    """RAWs from cache_full_blocks' stores (in ``path``) to the ctrl words read by cache_range / add_key."""
    return [h for h in c.unmarked() if h.kind == "RAW" and h.a[-1][0] == str(path)
            and h.a[-1][2] == "cache_full_blocks"
            and h.b[-1][0].endswith("kernels/cache.py") and any(s.startswith("ps.ctrl[") for s in h.samples)]


# ---- rows 1 and 2: cache_full_blocks' KEY_SEQ / EV_COUNT stores (thread 0) vs the next group's reads ---
def preemption_scenario():
    preemption_and_stop_on_failure()  # two full groups: cache_blocks runs per group


@pytest.fixture
def manager_without_barrier(tmp_path, monkeypatch):
    mod, path, lines = without_barrier("requests.steps", "KEY_SEQ / EV_COUNT", tmp_path)
    monkeypatch.setattr(gpupool.kernels.requests.exact, "cache_blocks", mod.cache_blocks)
    return path, lines


@pytest.mark.heavy
def test_cache_blocks_race_is_flagged_and_fails_under_stale(manager_without_barrier):
    path, (line,) = manager_without_barrier
    with Checker("detect") as c:
        preemption_scenario()
    raw = ctrl_raws(c, path)
    assert raw, c.report()
    assert {h.a[-1][1] for h in raw} == {line - 2, line - 1}  # the KEY_SEQ and EV_COUNT stores
    assert {h.b[-1][2] for h in raw} == {"cache_range"} and {h.kernel for h in raw} == {"allocate_slots_kernel"}
    with pytest.raises(AssertionError), Checker("stale") as c:
        preemption_scenario()  # the next group's cache_range reuses key seqs and event rows
    assert c.stats["stale_lanes"] > 0


@pytest.mark.heavy
def test_cache_blocks_with_its_barrier_is_clean_and_passes_under_stale():
    with Checker("detect") as c:
        preemption_scenario()
    assert not ctrl_raws(c, KERNELS / "requests" / "steps.py"), c.report()
    with Checker("stale"):
        preemption_scenario()


# ---- row 3: replay_loop reads the heap root in every thread, heap_pop overwrites it ---------------
TRACE = [TraceRequest(0, 9, 2, (1, 2, 3)), TraceRequest(0, 5, 1, (4, 5)), TraceRequest(1, 13, 3, (1, 2, 6, 7)),
         TraceRequest(1, 4, 2, (8,)), TraceRequest(2, 6, 1, (1, 9))]


def replay_scenario():
    ref_pool, pool = pool_twin(16)
    ref = replay(ref_pool, TRACE, block_size=4, tpot_ms=1.0)
    dev = replay_on_device(pool, TRACE, block_size=4, tpot_ms=1.0)
    pool.validate()
    assert_replays_agree(ref, dev)


@pytest.fixture
def replay_without_barrier(tmp_path, monkeypatch):
    mod, path, lines = without_barrier("replay", "every thread's read of the root", tmp_path)
    monkeypatch.setattr(gpupool.replay.device, "launch_replay_loop", mod.launch_replay_loop)
    return path, lines


def test_replay_root_race_is_flagged_and_fails_under_lag(replay_without_barrier):
    path, (line,) = replay_without_barrier
    with Checker("detect") as c:
        replay_scenario()
    war = [h for h in c.unmarked() if h.kind == "WAR" and h.a[-1] == (str(path), line - 1, "replay_loop_kernel")]
    assert war and war[0].b[-1][2] == "heap_pop", c.report()
    with pytest.raises(AssertionError) as e, Checker("lag", only_loads=[(path, line - 1)]) as c:
        replay_scenario()  # a lagging thread frees another request's blocks
    assert c.stats["lag_lanes"] > 0, e.value


@pytest.mark.heavy
def test_replay_with_its_barrier_passes_under_lag():
    with Checker("detect") as c:
        replay_scenario()
    src = str(KERNELS / "replay.py")
    assert not [h for h in c.hazards() if h.kind == "WAR" and h.a[-1][0] == src and h.b[-1][2] == "heap_pop"
                and h.a[-1][2] == "replay_loop_kernel"]
    root = next(i + 1 for i, t in enumerate(open(src)) if "# strict: orders every thread's read of the root" in t)
    with Checker("lag", only_loads=[(src, root - 1)]) as c:  # the same load, now ordered by the barrier
        replay_scenario()
    assert c.stats["lag_lanes"] == 0


# ---- found by CI's detect run (ci profile): a block listed twice, in two tiles of one release -----
@pytest.mark.strict_gpu_off  # runs its own checker
@pytest.mark.parametrize("op", ["unpin_blocks", "free_blocks_failing"])
def test_a_block_listed_in_two_tiles_is_benign_and_matches_the_reference(op):
    """``release_kernel`` (its body ``release_batch``) over more ids than one tile (``pc.BLOCK``
    lanes), one block listed in two tiles: the ``ps.watched`` stores (unpin) and ``reset_ids``'
    scratch resets write that block from two threads with no barrier between, each the same value,
    so the order does not matter. The
    checker sees them (marked ``# strict: benign``), nothing unmarked, and both pools agree; the
    failing free (a double free past the tile) takes the recount path, ``reset_ids`` over the batch."""
    ref, dev = pool_twin(16, device="cpu")  # tiles of 16 lanes
    pools = [dev, ref]
    for p in pools:
        p.get_new_blocks(15)
        p.touch([1] * 19)  # block 1 held 20 times
    ids = [1] * 18 + [2, 3]  # 20 ids: block 1 in both tiles
    with Checker("detect") as c:
        for p in pools:
            if op == "unpin_blocks":
                p.unpin_blocks(ids, lambda b: None)
            else:
                with pytest.raises(Exception) as e:
                    p.free_blocks(ids + [1, 1, 1])  # 21 releases of block 1: a double free
                assert type(e.value).__name__ == "DoubleFreeError"
    assert c.unmarked() == [], c.report(c.unmarked())
    flagged = {(h.kind, h.a[-1][2]) for h in c.hazards()}
    assert ("WAW", "reset_ids") in flagged, flagged  # the pattern is there, and marked
    if op == "unpin_blocks":
        assert ("WAW", "release_batch") in flagged, flagged
    assert_pools_agree(ref, dev)
