"""The device pool of a vLLM adapter as its other users reach it (docs/vllm.md, "Other users of the
device pool"; docs/algorithms.md section 8).

``adapter.device_pool`` is a :class:`SharedDevicePool`: every call goes through the adapter, so the
adapter sees each one before it runs. A call that reads the pool's state runs after the adapter has
launched and checked every op it answered (so it sees them all); a call that changes the state runs
after that too, waits for the device and raises its error at the call (a batched op's recorded
error included, so no launch of the adapter's meets it later), and then the adapter reads its whole
mirror again from the device (ref counts, keys, the free count) and forgets its copy of the free
queue: its next answers are what the device's state gives, as the per-call adapter's are. A request
manager over the pool (``handle()``) is refused: its launches would bypass the adapter.
"""
from __future__ import annotations

from ..errors import InvalidArgumentError

# the pool's calls that read its state (both kinds of pool); every other public call may change it
READS = frozenset({
    "check", "synchronize", "validate", "free_queue", "ref_counts", "block_keys", "block_hash_num_tokens",
    "num_watchers", "get_cached_block", "is_block_writable", "get_num_free_blocks", "get_usage", "take_events",
    "lookup_batched", "longest_prefix_batched", "metadata_bytes", "statistics", "mirror_rows", "free_window",
    "counters", "key_name", "host_tensor",
})

# refused, with why
REFUSED = {
    "handle": "a request manager over a vLLM adapter's device pool would change it past the adapter; "
              "build the manager over a pool of its own",
}


class SharedDevicePool:
    """A vLLM adapter's device pool (``gpupool.BlockPool``, or the reference pool) for its other users
    (module docstring). Attributes that are not calls (``num_blocks``, ``device``, ``state``, ...) are
    the pool's own: a write into its tensors or lists is not seen by the adapter. Raises
    InvalidArgumentError for :data:`REFUSED` calls and for setting an attribute; AttributeError for
    names the pool lacks or that are private."""

    __slots__ = ("_adapter",)

    def __init__(self, adapter):
        object.__setattr__(self, "_adapter", adapter)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in REFUSED:
            def refused(*args, **kwargs):
                raise InvalidArgumentError(f"device_pool.{name}", REFUSED[name])
            return refused
        adapter = self._adapter
        attr = getattr(adapter._dev, name)
        if not callable(attr):
            return attr
        if name in READS:
            return lambda *args, **kwargs: adapter._other_user_reads(attr, args, kwargs)
        return lambda *args, **kwargs: adapter._other_user_changes(name, attr, args, kwargs)

    def __setattr__(self, name: str, value) -> None:
        raise InvalidArgumentError("device_pool", f"{name!r}: the pool's attributes are not set through a vLLM "
                                                  "adapter's device_pool")

    def __dir__(self):
        return [n for n in dir(self._adapter._dev) if not n.startswith("_")]

    def __repr__(self) -> str:
        return f"<device pool of {type(self._adapter).__name__}: {self._adapter._dev!r}>"


__all__ = ["SharedDevicePool", "READS", "REFUSED"]
