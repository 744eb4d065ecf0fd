"""The device event buffer ``ev: int64[EV_CAP, 7]``: (kind, block, key hi, key lo, group, op tag, aux).

``aux`` is the stored key's position in its request's hash chain where the host needs it to name
the parent hash (the manager's steps), else 0.

Kernels write events at ``ctrl[EV_COUNT] + (index in op order)``; the host drains them in
``take_events()`` and turns removals and stored items into vLLM's KV events.
"""
import triton
import triton.language as tl

EVW = tl.constexpr(7)


@triton.jit
def write_event(ev, idx, kind, block, hi, lo, grp, op_tag, active, aux=0):
    row = ev + idx.to(tl.int64) * EVW
    tl.store(row + 0, tl.zeros_like(hi) + kind, mask=active)
    tl.store(row + 1, block.to(tl.int64), mask=active)
    tl.store(row + 2, hi, mask=active)
    tl.store(row + 3, lo, mask=active)
    tl.store(row + 4, grp.to(tl.int64), mask=active)
    tl.store(row + 5, tl.zeros_like(hi) + op_tag, mask=active)
    tl.store(row + 6, tl.zeros_like(hi) + aux, mask=active)
