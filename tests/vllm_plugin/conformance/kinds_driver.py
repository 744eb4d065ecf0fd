"""vLLM 0.33's own kind rules over abstract cases (tests/vllm_plugin/test_vllm_kinds.py): its
coordinator's ``find_longest_cache_hit`` and its single-type managers' ``remove_skipped_blocks``, on
vLLM's ``BlockPool``. A subprocess (``python kinds_driver.py CASES.json OUT.json``; vLLM's source and
the plugin's stubs on sys.path); :func:`chain` is imported by the test too, so both sides key the
same hashes.

A case: ``bs`` (block size = hash block size), ``groups`` (``[kind, tokens]`` per group: ``"full"``
or ``"chunked_local_attention"``), ``cached`` (per group, per block of the chain: whether that
block's key is cached for that group, each on its own block, all freed), ``num_tokens`` (the
request's tokens: its chain has ``num_tokens // bs`` hashes), then ``skip`` (``group``, ``row_len``,
``lead``: a row of ``row_len`` fresh blocks whose first ``lead`` were skipped before, and
``num_computed``). Recorded: the hit's tokens and each group's hit blocks as the (block, group) of
the key that made them, None for the null block; then the row after ``remove_skipped_blocks`` and the
free queue, in block ids.
"""
from __future__ import annotations

import hashlib


def chain(n: int) -> list[bytes]:
    """The chain's block hashes (32 bytes, as vLLM's sha256)."""
    return [hashlib.sha256(b"kinds %d" % i).digest() for i in range(n)]


def num_blocks(case: dict) -> int:
    """A pool big enough for every cached key and the skip row (and the null block)."""
    return 2 + sum(map(sum, case["cached"])) + case["skip"]["row_len"]


def main():
    import json
    import sys
    import types

    import plugin  # noqa: F401 - vLLM's source and the stubs
    import torch
    from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
    )

    out = []
    for c in json.load(open(sys.argv[1])):
        bs = c["bs"]
        specs = [FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32) if k == "full" else
                 ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                           attention_chunk_size=w) for k, w in c["groups"]]
        kcc = KVCacheConfig(num_blocks=num_blocks(c), kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec([f"layer{g}"], s) for g, s in enumerate(specs)])
        coord = get_kv_cache_coordinator(kcc, max_model_len=1 << 16, max_in_flight_tokens=1 << 16, use_eagle=False,
                                         enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1,
                                         pcp_world_size=1, scheduler_block_size=bs, hash_block_size=bs)
        pool = coord.block_pool
        hashes = chain(c["num_tokens"] // bs)
        req = types.SimpleNamespace(block_hashes=hashes, request_id="r", lora_request=None, all_token_ids=[],
                                    mm_features=[], cache_salt=None, prompt_embeds=None, session_id=None)
        label, held = {}, []
        for g, row in enumerate(c["cached"]):
            for i, cached in enumerate(row):
                if cached:
                    b = pool.get_new_blocks(1)[0]
                    pool.cache_full_blocks(req, [pool.null_block] * i + [b], i, i + 1, bs, g)
                    label[b.block_id] = [i, g]
                    held.append(b)
        pool.free_blocks(held)
        blocks, hit, _ = coord.find_longest_cache_hit(hashes, c["num_tokens"] - 1)
        hits = [[None if b.is_null else label[b.block_id] for b in blocks[g]] for g in range(len(specs))]
        s = c["skip"]
        mgr = coord.single_type_managers[s["group"]]
        row = pool.get_new_blocks(s["row_len"])
        pool.free_blocks(reversed(row[: s["lead"]]))
        row[: s["lead"]] = [pool.null_block] * s["lead"]
        mgr.req_to_blocks["r"] = row
        mgr.remove_skipped_blocks("r", s["num_computed"])
        out.append({"hit": hit, "hits": hits, "row": [b.block_id for b in mgr.req_to_blocks["r"]],
                    "free": [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]})
    json.dump(out, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
