"""A KV-event publisher with vLLM 0.33's ``ZmqEventPublisher`` wire (vllm/distributed/kv_events.py).

PUB socket: each batch is the multipart message ``(topic, seq, payload)``: ``topic`` the UTF-8 topic
(default ``b""``), ``seq`` the batch's sequence number as 8 bytes big-endian (0, 1, 2, ...), ``payload``
the msgspec msgpack of a :class:`~gpupool.vllm.kv_events.KVEventBatch` ``[ts, [events], dp_rank]``.
Optional ROUTER replay socket: a client (REQ or DEALER, which adds the empty delimiter frame) sends a
start sequence number as 8 bytes big-endian and gets every buffered batch with ``seq >= start`` as
``(topic, seq, payload)`` and then the end marker ``(b"", (-1).to_bytes(8, "big", signed=True), b"")``.

As vLLM's, one background thread owns both sockets (ZMQ sockets are not thread-safe), encodes and sends
the batches and serves replay requests between them; ``publish`` only queues. Unlike vLLM 0.33's (whose
``publish`` waits on a full queue, so a slow thread stalls the engine step), ``publish`` never waits: a
full queue drops the batch, counted in ``dropped_batches`` and logged. A batch the thread cannot encode is
logged, counted in ``failed_batches`` and skipped, takes no sequence number, and the thread goes on (as
vLLM's). ``close()`` lets the thread send what is queued, then the sockets close with a bounded linger
(``LINGER_S``) so the last batches still reach a subscriber that reads slowly.
"""
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from itertools import count

import msgspec
import zmq

from .kv_events import EventBatch, KVCacheEvent, KVEventBatch, to_vllm_events

_log = logging.getLogger(__name__)


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's rule: a tcp port moves up by the DP rank (port 0 stays 0); inproc gets ``_dp<rank>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        if ":" in endpoint:
            base, port = endpoint.rsplit(":", 1)
            return endpoint if int(port) == 0 else f"{base}:{int(port) + data_parallel_rank}"
        return endpoint
    raise ValueError("Invalid endpoint: must contain 'inproc' or 'tcp'")


class ZmqEventPublisher:
    """Publish gpupool's KV events as vLLM 0.33's ``ZmqEventPublisher`` does.

    Args:
        data_parallel_rank: stamped into each batch and added to the endpoints' ports (vLLM's rule).
        endpoint: PUB address; bound when it has ``*``, ``::``, or is ipc/inproc (vLLM's rule), else
            connected, unless ``bind`` says otherwise. ``self.endpoint`` is the address in use (the
            OS's port when bound with port 0).
        replay_endpoint: optional ROUTER address (always bound) for replay requests.
        buffer_steps: batches kept for replay. hwm: the PUB socket's high-water mark.
        max_queue_size: batches queued for the thread; past it ``publish`` drops the batch.
        topic: the first frame of every message.
        medium, int_block_hashes: passed to :func:`~gpupool.vllm.kv_events.to_vllm_events`.

    Raises ``zmq.ZMQError`` when a socket cannot bind or connect.

    ``dropped_batches``: batches ``publish`` dropped on a full queue; ``failed_batches``: batches the
    thread could not encode or send (each logged).
    """

    SHUTDOWN_TIMEOUT = 1.0  # close(): the longest wait for the thread to send what is queued
    LINGER_S = 2.0  # how long a closed socket still tries to deliver its last messages
    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, data_parallel_rank: int = 0, endpoint: str = "tcp://*:5557",
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "", *, bind: bool | None = None,
                 medium: str | None = "GPU", int_block_hashes: bool | None = None):
        self.data_parallel_rank = data_parallel_rank
        self._medium, self._int_hashes = medium, int_block_hashes
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._topic = topic.encode("utf-8")
        self._seq = count()
        self._pack = msgspec.msgpack.Encoder()
        self.dropped_batches = 0
        self.failed_batches = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        if bind is None:
            bind = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            if bind:
                self._pub.bind(endpoint)
                endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a full replay + marker fits
                self._replay.bind(replay_endpoint)
                replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True, name="gpupool-zmq-publisher")
        self._thread.start()

    def publish(self, events: Iterable) -> bool:
        """Queue one batch of ``events`` (gpupool's events, e.g. ``pool.take_events()``, or vLLM wire
        events), or an ``EventBatch`` as vLLM's ``publish`` takes (its ``data_parallel_rank`` set to this
        publisher's when None); an empty list or batch sends nothing. Never waits: returns whether the
        batch was queued (False also when the queue is full and the batch was dropped, which is counted
        in ``dropped_batches`` and logged).

        Raises RuntimeError after ``close()``, TypeError for an object that is no gpupool or vLLM KV event
        (a vLLM ``EventBatch`` is not checked here: what the thread cannot encode it logs and skips).
        """
        if not self._running:
            raise RuntimeError("Publisher is closed")
        if isinstance(events, EventBatch):
            if not events.events:
                return False
            if events.data_parallel_rank is None:
                events.data_parallel_rank = self.data_parallel_rank
            return self._enqueue(events)
        events = list(events)
        if not events:
            return False
        wire = [e if isinstance(e, KVCacheEvent) else None for e in events]
        if None in wire:
            rest = to_vllm_events([e for e in events if not isinstance(e, KVCacheEvent)], medium=self._medium,
                                  int_block_hashes=self._int_hashes)
            it = iter(rest)
            wire = [w if w is not None else next(it) for w in wire]
        return self._enqueue(KVEventBatch(ts=time.time(), events=wire, data_parallel_rank=self.data_parallel_rank))

    def _enqueue(self, batch) -> bool:
        try:
            self._queue.put_nowait(batch)
            return True
        except queue.Full:
            self.dropped_batches += 1
            n = self.dropped_batches
            if n & (n - 1) == 0:  # 1, 2, 4, ...: a slow consumer does not flood the log
                _log.warning("gpupool.vllm publisher: queue full (%d batches), batch dropped (%d dropped so far)",
                             self._queue.maxsize, n)
            return False

    def close(self) -> None:
        """Let the thread send what is queued (up to ``SHUTDOWN_TIMEOUT`` seconds; what is left then is
        logged as not sent), then it closes the sockets, which still deliver for up to ``LINGER_S``
        seconds in ZMQ's I/O thread. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._stop.set()
        self._thread.join(timeout=self.SHUTDOWN_TIMEOUT)
        if self._thread.is_alive():
            _log.warning("gpupool.vllm publisher: %d batches not sent after %.1f s at close",
                         self._queue.qsize(), self.SHUTDOWN_TIMEOUT)

    shutdown = close  # vLLM's name

    def _encode(self, batch) -> bytes:
        return self._pack.encode(batch)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    try:
                        self._serve_replay()
                    except Exception:  # noqa: BLE001 - a bad request must not stop the publishing
                        _log.exception("gpupool.vllm publisher: replay request failed")
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    if self._stop.is_set():
                        break  # closed and everything queued is sent
                    continue
                self._send(batch)
        finally:  # the thread owns the sockets to the end
            linger = int(self.LINGER_S * 1000)
            self._pub.close(linger=linger)
            if self._replay is not None:
                self._replay.close(linger=linger)

    def _send(self, batch) -> None:
        try:
            payload = self._encode(batch)
        except Exception:  # noqa: BLE001 - as vLLM's thread: log, skip the batch, go on
            self.failed_batches += 1
            _log.exception("gpupool.vllm publisher: a batch could not be encoded; skipped")
            return
        seq = next(self._seq)
        self._buffer.append((seq, payload))  # replayable even if this send fails
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self.failed_batches += 1
            _log.exception("gpupool.vllm publisher: batch %d could not be sent", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:  # (client id, empty delimiter, start seq), as vLLM's
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", self.END_SEQ, b""))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
