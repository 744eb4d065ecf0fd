"""The attention kinds' rules against vLLM 0.33's own (its released source, in a subprocess:
tests/vllm_plugin/conformance/kinds_driver.py): for chunked local attention, alone and beside full
attention, the reference manager's cache hit (``get_computed_blocks``: its length and each group's
blocks, the null block where vLLM's ``ChunkedLocalAttentionManager`` puts one) equals vLLM's
coordinator's ``find_longest_cache_hit``, and its skip rule leaves the same row and free queue as
vLLM's ``remove_skipped_blocks``. The device manager equals the reference on the same kinds
(tests/manager/test_kv_cache_manager.py, ``full+chunked`` and ``chunked``)."""
from harness.paths import CONFORMANCE
import json
import sys

import pytest
from hypothesis import given, settings, strategies as st

from gpupool.args import NULL_BLOCK
from gpupool.reference import ReferenceKVCacheManager

sys.path.insert(0, str(CONFORMANCE))
import kinds_driver  # noqa: E402
from harness.vllm_ops import run_in_vllm_tree  # noqa: E402

CL = "chunked_local_attention"
LAYOUTS = [["full", CL], [CL, "full"], [CL], ["full", CL, CL], ["full", "full", CL]]


@st.composite
def cases(draw):
    bs = draw(st.sampled_from([1, 2, 4]))
    chunk = bs * draw(st.integers(1, 3))
    groups = [[k, chunk if k == CL else 0] for k in draw(st.sampled_from(LAYOUTS))]
    nt = draw(st.integers(1, 10 * bs + bs - 1))
    n = nt // bs
    # mostly cached, so hits run long and the chunk's start matters
    cached = [draw(st.lists(st.sampled_from([True, True, True, False]), min_size=n, max_size=n)) for _ in groups]
    row_len = draw(st.integers(0, 10))
    skip = {"group": draw(st.integers(0, len(groups) - 1)), "row_len": row_len, "lead": draw(st.integers(0, row_len)),
            "num_computed": draw(st.integers(0, 12 * bs))}
    return {"bs": bs, "groups": groups, "cached": cached, "num_tokens": nt, "skip": skip}


def ours(c: dict) -> dict:
    """The reference manager over the same case (kinds_driver's module docstring)."""
    bs, G = c["bs"], len(c["groups"])
    m = ReferenceKVCacheManager(kinds_driver.num_blocks(c), block_size=bs, max_num_reqs=1, max_blocks_per_req=16,
                                groups=[k if k == "full" else (k, w) for k, w in c["groups"]])
    pool = m.pool
    hashes = kinds_driver.chain(c["num_tokens"] // bs)
    label, held = {}, []
    for g, row in enumerate(c["cached"]):
        for i, cached in enumerate(row):
            if cached:
                b = pool.get_new_blocks(1)[0]
                pool.cache_full_blocks([NULL_BLOCK] * i + [b], hashes, i, i + 1, bs, g)
                label[b] = [i, g]
                held.append(b)
    pool.free_blocks(held)
    m.add_request(0, hashes)
    [(hit, blocks)] = m.get_computed_blocks([0], [c["num_tokens"]])
    m.free([0])
    s = c["skip"]
    row = pool.get_new_blocks(s["row_len"])
    pool.free_blocks(row[: s["lead"]][::-1])
    row[: s["lead"]] = [NULL_BLOCK] * s["lead"]
    m.add_request(0, [])
    m.tables[s["group"]][0] = row
    m.num_computed[0] = s["num_computed"]
    m._remove_skipped_blocks(0)
    return {"hit": hit * bs, "hits": [[None if b == NULL_BLOCK else label[b] for b in blocks[g]] for g in range(G)],
            "row": list(m.tables[s["group"]][0]), "free": pool.free_queue()}


@pytest.mark.slow
def test_chunked_local_attention_is_vllms(tmp_path):
    """The cases of a seeded hypothesis run give the same hits, rows and free queues from vLLM 0.33's
    coordinator and single-type managers (its released source) as from the reference manager."""
    from test_vllm_conformance import vllm_tree

    root = vllm_tree()
    drawn = []

    @settings(max_examples=max(200, settings().max_examples), database=None, derandomize=True)
    @given(cases())
    def draw(case):
        drawn.append(case)

    draw()
    (tmp_path / "cases.json").write_text(json.dumps(drawn))
    run_in_vllm_tree(root, "kinds_driver.py", tmp_path / "out.json", {"PYTHONPATH": str(CONFORMANCE)},
                     [tmp_path / "cases.json"])
    theirs = json.loads((tmp_path / "out.json").read_text())
    # not vacuous: hits that start with null blocks and end inside a chunk, and released blocks
    assert any(t["hits"] and None in t["hits"][-1] and t["hits"][-1][-1] is not None for t in theirs)
    assert any(NULL_BLOCK in t["row"] and t["row"][-1] != NULL_BLOCK for t in theirs)
    for c, t in zip(drawn, theirs):
        assert ours(c) == t, c
