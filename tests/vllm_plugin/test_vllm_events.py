"""gpupool.vllm's KV events and publisher against vLLM 0.33's own (docs/vllm.md).

vLLM's classes come from vLLM 0.33.0's source, never from a copy in this repo: its sdist in
``~/.cache/gpupool`` (``harness.vllm_source``). These tests are quick, so they never download it (the
slow vLLM tests do, once): without it they skip with the reason, or, under ``GPUPOOL_REQUIRE_VLLM=1``
(``.ci/run``), download it. ``vllm/distributed/kv_events.py`` is executed as it is, with
these imports stubbed because they pull in the rest of vLLM: ``vllm.config.kv_events.KVEventsConfig``
(an empty class; only the publisher's config uses it), ``vllm.logger.init_logger`` (``logging``),
``vllm.utils.network_utils`` (``get_ip``, ``get_tcp_uri``, ``is_valid_ipv6_address``,
``split_zmq_path``: raise if called; only the publisher's ``tcp://*:0`` path calls them) and
``vllm.v1.core.kv_cache_utils``, which is built from vLLM's real ``kv_cache_utils.py`` by executing only
its ``ExternalBlockHash`` alias, ``maybe_convert_block_hash`` and ``to_event_extra_keys`` (with vLLM's
``envs`` replaced by a namespace holding ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).
"""
import ast
import logging
import os
import sys
import time
import types
import typing
from collections.abc import Iterable
from unittest import mock

import pytest

msgspec = pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")
zmq = pytest.importorskip("zmq", reason="gpupool.vllm needs pyzmq (pip install -e '.[vllm]')")

import gpupool  # noqa: E402
from gpupool import events as gp_events  # noqa: E402
from gpupool.vllm import KVEventBatch, ZmqEventPublisher, to_vllm_events  # noqa: E402
from harness import vllm_source
from harness.timeouts import scaled_ms
from harness.zmq_sub import warm_up
from harness.keys import hashes  # noqa: E402

FILES = ("vllm/distributed/kv_events.py", "vllm/v1/core/kv_cache_utils.py")
#: set by .ci/run: the comparison with vLLM must run there (download the sdist if need be), not skip
REQUIRED = os.environ.get("GPUPOOL_REQUIRE_VLLM") == "1"


def _vllm_sources() -> dict[str, str]:
    try:
        return vllm_source.read(FILES, download=REQUIRED)
    except vllm_source.SourceUnavailable as e:
        if REQUIRED:
            pytest.fail(f"{e} (GPUPOOL_REQUIRE_VLLM=1: this comparison is required)", pytrace=False)
        pytest.skip(str(e))


def _exec_parts(src: str, names: set[str], ns: dict) -> dict:
    """Execute only the top-level statements of ``src`` that define ``names``."""
    tree = ast.parse(src)
    keep = [n for n in tree.body
            if (isinstance(n, ast.FunctionDef) and n.name in names)
            or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id in names)]
    assert {getattr(n, "name", None) or n.target.id for n in keep} == names
    exec(compile(ast.Module(keep, []), "vllm/v1/core/kv_cache_utils.py", "exec"), ns)
    return ns


@pytest.fixture(scope="module")
def vllm():
    """vLLM 0.33's kv_events module (stubs: module doc) and its kv_cache_utils helpers, as a namespace."""
    src = _vllm_sources()
    envs = types.SimpleNamespace(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=True)
    utils = _exec_parts(src["vllm/v1/core/kv_cache_utils.py"],
                        {"ExternalBlockHash", "maybe_convert_block_hash", "to_event_extra_keys"},
                        {"TypeAlias": typing.TypeAlias, "Any": typing.Any, "Iterable": Iterable, "BlockHash": bytes,
                         "envs": envs})

    def unreachable(*a, **k):
        raise AssertionError("stubbed vLLM network helper called")

    stubs = {
        "vllm": types.ModuleType("vllm"),
        "vllm.config.kv_events": types.SimpleNamespace(KVEventsConfig=type("KVEventsConfig", (), {})),
        "vllm.logger": types.SimpleNamespace(init_logger=logging.getLogger),
        "vllm.utils.network_utils": types.SimpleNamespace(get_ip=unreachable, get_tcp_uri=unreachable,
                                                          is_valid_ipv6_address=unreachable,
                                                          split_zmq_path=unreachable),
        "vllm.v1.core.kv_cache_utils": types.SimpleNamespace(ExternalBlockHash=utils["ExternalBlockHash"]),
    }
    mod = types.ModuleType("vllm_0_33_kv_events")
    with mock.patch.dict(sys.modules, stubs):
        exec(compile(src["vllm/distributed/kv_events.py"], "vllm/distributed/kv_events.py", "exec"), mod.__dict__)
    return types.SimpleNamespace(ev=mod, envs=envs, maybe_convert_block_hash=utils["maybe_convert_block_hash"],
                                 to_event_extra_keys=utils["to_event_extra_keys"])


def _pool_events() -> list:
    """gpupool's events from a real device-pool op sequence: allocate, cache_full_blocks (twice, the
    second with a parent), free, allocate again (evicts), cache under group 1, evict_blocks,
    cache_partial_block, reset_prefix_cache."""
    pool = gpupool.BlockPool(8, enable_kv_cache_events=True, device="cpu")
    b = pool.get_new_blocks(4).tolist()
    hs = hashes(range(4))
    pool.cache_full_blocks(b, hs, 0, 2, 16, 0)
    pool.cache_full_blocks(b, hs, 2, 4, 16, 0)
    pool.free_blocks(b[::-1])
    c = pool.get_new_blocks(7).tolist()  # takes every free block: the cached ones are evicted
    pool.cache_full_blocks(c[:2], hashes(range(10, 12)), 0, 2, 16, 1)
    pool.evict_blocks([c[0]])
    pool.free_blocks(c)
    d = pool.get_new_blocks(1).tolist()  # a partial block: 8 tokens of 16, hash blocks of 4
    assert pool.cache_partial_block(d[0], hashes(range(20, 24)), 8, 0, 16, 4) is not None
    pool.free_blocks(d)
    assert pool.reset_prefix_cache()
    events = pool.take_events()
    kinds = [type(e).__name__ for e in events]
    assert kinds.count("BlockStored") == 4 and kinds.count("BlockRemoved") == 5 and kinds[-1] == "AllBlocksCleared"
    return events


def _as_vllm_builds(v, events) -> list:
    """gpupool's events as vLLM 0.33's BlockPool builds them (block_pool.py ``_build_block_stored_event``,
    ``_remove_block_hash`` events, ``reset_prefix_cache``), with what gpupool cannot know (no Request:
    token ids, LoRA, extra keys, session) as a request without them gives."""
    c, E = v.maybe_convert_block_hash, v.ev
    out = []
    for e in events:
        if isinstance(e, gp_events.BlockStored):
            out.append(E.BlockStored(
                block_hashes=[c(h) for h in e.block_hashes],
                parent_block_hash=None if e.parent_block_hash is None else c(e.parent_block_hash),
                token_ids=[], block_size=e.block_size, lora_id=None, medium=E.MEDIUM_GPU, lora_name=None,
                extra_keys=v.to_event_extra_keys([None] * len(e.block_hashes)), group_idx=e.group_id,
                session_id=None, lookahead_token_ids=None))
        elif isinstance(e, gp_events.BlockRemoved):
            out.append(E.BlockRemoved(block_hashes=[c(e.block_hash)], medium=E.MEDIUM_GPU, group_idx=e.group_id))
        else:
            out.append(E.AllBlocksCleared())
    return out


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_encoding_equals_vllm(vllm, int_hashes):
    vllm.envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES = int_hashes
    events = _pool_events()
    ours = to_vllm_events(events, int_block_hashes=int_hashes)
    theirs = _as_vllm_builds(vllm, events)
    ts = time.time()
    ours_b = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=ts, events=ours, data_parallel_rank=0))
    theirs_b = msgspec.msgpack.Encoder().encode(vllm.ev.KVEventBatch(ts=ts, events=theirs, data_parallel_rank=0))
    assert ours_b == theirs_b
    for o, t in zip(ours, theirs):  # event by event too, so a failure names the event
        assert msgspec.msgpack.encode(o) == msgspec.msgpack.encode(t)
    decoded = msgspec.msgpack.Decoder(vllm.ev.KVEventBatch).decode(ours_b)
    assert decoded.events == theirs and decoded.data_parallel_rank == 0
    hash_type = int if int_hashes else bytes
    assert all(type(h) is hash_type for e in decoded.events for h in getattr(e, "block_hashes", []))
    assert sum(isinstance(e, vllm.ev.BlockStored) and e.parent_block_hash is not None for e in decoded.events) == 2
    assert [e.block_size for e in decoded.events if isinstance(e, vllm.ev.BlockStored)] == [16, 16, 16, 4]


def test_env_default_matches_vllm(monkeypatch):
    from gpupool.vllm.kv_events import wire_block_hash

    h = hashes([7])[0]
    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert wire_block_hash(h) == int.from_bytes(h[-8:], "big")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    assert wire_block_hash(h) == h
    with pytest.raises(TypeError):
        to_vllm_events([object()])


def _recv(sock, timeout_ms=5000):
    assert sock.poll(scaled_ms(timeout_ms)), "no message within the timeout"
    return sock.recv_multipart()


@pytest.fixture
def pub_sub():
    pub = ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                            topic="kv", bind=True, buffer_steps=100)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(pub.endpoint)
    last = warm_up(pub, sub, [gp_events.AllBlocksCleared()])
    yield pub, sub, last
    sub.close(linger=0)
    pub.close()


def _decoder(vllm_or_none):
    return msgspec.msgpack.Decoder(vllm_or_none.ev.KVEventBatch if vllm_or_none else KVEventBatch)


@pytest.fixture
def vllm_if_loadable(request):
    try:
        return request.getfixturevalue("vllm")
    except pytest.skip.Exception:
        return None  # then decode with gpupool's own classes


def test_sub_receives_batches(pub_sub, vllm_if_loadable):
    pub, sub, last = pub_sub
    dec = _decoder(vllm_if_loadable)
    events = _pool_events()
    assert pub.publish([]) is False
    batches = [events[:3], events[3:8], events[8:]]
    for batch in batches:
        assert pub.publish(batch) is True
        assert pub.publish([]) is False
    seqs = []
    for batch in batches:
        topic, seq, payload = _recv(sub)
        assert topic == b"kv" and len(seq) == 8
        seqs.append(int.from_bytes(seq, "big"))
        got = dec.decode(payload)
        assert got.data_parallel_rank == 0 and isinstance(got.ts, float)
        assert msgspec.msgpack.encode(got.events) == msgspec.msgpack.encode(to_vllm_events(batch))
    assert seqs == [last + 1, last + 2, last + 3]
    assert not sub.poll(300), "an empty publish() sent a batch"
    # vLLM's calling convention: an EventBatch of wire events, rank filled in when None
    assert pub.publish(KVEventBatch(ts=1.5, events=[], data_parallel_rank=None)) is False
    assert pub.publish(KVEventBatch(ts=1.5, events=to_vllm_events(events[:1]), data_parallel_rank=None)) is True
    topic, seq, payload = _recv(sub)
    got = dec.decode(payload)
    assert int.from_bytes(seq, "big") == last + 4 and got.ts == 1.5 and got.data_parallel_rank == 0
    assert msgspec.msgpack.encode(got.events) == msgspec.msgpack.encode(to_vllm_events(events[:1]))


def test_replay_router_returns_missed_batches(pub_sub, vllm_if_loadable):
    pub, sub, last = pub_sub
    dec = _decoder(vllm_if_loadable)
    events = _pool_events()
    sent = {}
    for i in range(4):
        pub.publish(events[i:i + 2])
        topic, seq, payload = _recv(sub)
        sent[int.from_bytes(seq, "big")] = payload
    start = last + 2  # a subscriber that missed everything from the second batch on
    dealer = zmq.Context.instance().socket(zmq.DEALER)  # a REQ-style request: empty delimiter + start seq
    dealer.connect(pub.replay_endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = {}
        while True:
            empty, topic, seq, payload = _recv(dealer)
            assert empty == b""
            if seq == ZmqEventPublisher.END_SEQ:
                assert topic == b"" and payload == b""
                break
            assert topic == b"kv"
            replayed[int.from_bytes(seq, "big")] = payload
    finally:
        dealer.close(linger=0)
    assert replayed == {s: p for s, p in sent.items() if s >= start} and len(replayed) == 3
    for p in replayed.values():
        dec.decode(p)


def test_core_package_does_not_import_vllm_subpackage():
    import subprocess

    code = ("import sys, gpupool; gpupool.BlockPool; gpupool.KVCacheManager; "
            "assert 'gpupool.vllm' not in sys.modules and 'zmq' not in sys.modules and 'msgspec' not in sys.modules")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
