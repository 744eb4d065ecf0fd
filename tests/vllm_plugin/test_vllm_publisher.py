"""``gpupool.vllm.ZmqEventPublisher`` under faults (docs/vllm.md, "The publisher"): a batch that cannot
be encoded is logged and skipped (the thread goes on), ``publish()`` never blocks the engine step (a full
queue drops the batch, counted and logged), ``close()`` sends every queued batch before the socket closes.
"""
import logging
import threading
import time

import pytest

from harness.timeouts import scaled, scaled_ms, timeout_scale
from harness.zmq_sub import warm_up

msgspec = pytest.importorskip("msgspec", reason="gpupool.vllm needs msgspec (pip install -e '.[vllm]')")
zmq = pytest.importorskip("zmq", reason="gpupool.vllm needs pyzmq (pip install -e '.[vllm]')")

from gpupool import events as gp_events  # noqa: E402
from gpupool.vllm import BlockStored, KVEventBatch, ZmqEventPublisher  # noqa: E402

GOOD = [gp_events.AllBlocksCleared()]


def _stored(h: int) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None)


def _connected(rcvhwm: int = 0, **kw):
    """A bound publisher and a SUB that has received one warm-up batch (PUB drops what it sends before
    the subscription arrives); returns (pub, sub, the warm-up's last seq)."""
    pub = ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:0", bind=True, **kw)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.connect(pub.endpoint)
    return pub, sub, warm_up(pub, sub, GOOD)


def _call_with_deadline(fn, seconds: float):
    """``fn()`` on a helper thread; fails (instead of hanging the suite) when it has not returned in time."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()), daemon=True)
    t.start()
    t.join(scaled(seconds))
    assert not t.is_alive(), f"blocked for more than {scaled(seconds)} s"
    return out.get("v")


@pytest.mark.parametrize("bad", [
    pytest.param(lambda: KVEventBatch(ts=0.0, events=[_stored(2 ** 70)]), id="int-past-2**64"),
    pytest.param(lambda: KVEventBatch(ts=0.0, events=[object()]), id="not-an-event"),
])
def test_unencodable_batch_is_logged_and_the_thread_goes_on(bad, caplog):
    pub, sub, last = _connected(max_queue_size=4)
    try:
        with caplog.at_level(logging.ERROR, logger="gpupool.vllm.publisher"):
            assert pub.publish(bad()) is True  # queued; encoding happens on the thread, as vLLM's
            for _ in range(20):  # more than the queue holds: a dead thread would block publish() here
                _call_with_deadline(lambda: pub.publish(GOOD), 5)
                got = int.from_bytes(sub.recv_multipart()[1], "big") if sub.poll(scaled_ms(5000)) else None
                assert got is not None, "the publisher thread stopped sending after a bad batch"
        assert got == last + 20  # the bad batch took no sequence number: subscribers see no gap
        assert pub.failed_batches == 1
        assert any("could not be encoded" in r.getMessage() for r in caplog.records)
    finally:
        sub.close(linger=0)
        _call_with_deadline(pub.close, 10)


def test_publish_never_blocks_drops_when_full(caplog):
    pub = ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:0", bind=True, max_queue_size=3)
    gate = threading.Event()
    encode = pub._encode
    pub._encode = lambda batch: (gate.wait(30), encode(batch))[1]  # a consumer stuck on the first batch
    try:
        with caplog.at_level(logging.WARNING, logger="gpupool.vllm.publisher"):
            t0 = time.perf_counter()
            res = [_call_with_deadline(lambda: pub.publish(GOOD), 5) for _ in range(12)]
            took = time.perf_counter() - t0
        # the thread holds one, the queue three; the rest are dropped, none waits
        assert res.count(True) in (3, 4) and res[-1] is False and took < 2 * timeout_scale()
        assert pub.dropped_batches == res.count(False)
        assert any("dropped" in r.getMessage() for r in caplog.records)
    finally:
        gate.set()
        _call_with_deadline(pub.close, 10)


@pytest.mark.heavy
def test_close_sends_every_queued_batch():
    # a subscriber that reads nothing until the publisher is closed: the batches wait in the PUB
    # socket's pipe (not dropped: under its high-water mark), which a close with linger 0 discards
    n = 3000
    pub, sub, last = _connected(rcvhwm=1)
    received = []

    def drain():
        while True:
            if not sub.poll(scaled_ms(3000)):
                return
            received.append(int.from_bytes(sub.recv_multipart()[1], "big"))

    payload = [_stored(i) for i in range(20)]
    for _ in range(n):
        assert pub.publish(KVEventBatch(ts=0.0, events=payload)) is True
    _call_with_deadline(pub.close, 15)
    time.sleep(0.5)  # the thread has closed the socket by now
    drain()
    sub.close(linger=0)
    assert received == list(range(last + 1, last + 1 + n)), f"{n - len(received)} of {n} batches lost"


def test_publish_after_close_raises_and_close_is_idempotent():
    pub = ZmqEventPublisher(0, endpoint="tcp://127.0.0.1:0", bind=True)
    pub.close()
    pub.close()
    with pytest.raises(RuntimeError):
        pub.publish(GOOD)
