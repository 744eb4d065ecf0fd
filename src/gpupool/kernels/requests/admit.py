"""``KVCacheManager.admit``: waiting requests admitted in one launch (docs/semantics.md section 9,
"Admission"): the slots checked free, each request started (its hashes' device keys, and for a
request that hashes its own tokens its tail and last digest), then ``allocate_slots`` with a prefix
lookup and ``stop_on_failure`` (head-of-line), the requests not admitted released again, the
admitted ones' lookups recorded in the prefix-cache statistics. Nothing waits for the host: whether
each was admitted and its hit tokens are in the batch's ``admitted`` and ``hits``."""
from typing import NamedTuple

import triton
import triton.language as tl

from ..common import checked_count, lanes, ld, set_status_why, status_clear, warps_for
from ..layout import C_COUNT_PAST_ARRAYS, DW, OP_ADMIT
from .checks import check_slots, or_count_error
from .exact import allocate_slots_exact_checked, record_prefix_stats
from .parallel import allocate_slots_parallel


class AdmitInputs(NamedTuple):
    """What the host packs for an admission of ``B`` requests (one host-to-device copy):
    ``hash_off: int32[B + 1]`` (request k's hashes are ``hash_off[k] .. hash_off[k + 1] - 1`` of the flat
    lists), ``keys: int64[H, G, 2]`` (each hash's device key per group, hi and lo), ``tail_len:
    int32[B]`` (-1: the request does not hash its tokens), ``tails: int32[B, HBS]`` (its tail tokens),
    ``digests: int32[B, 8]`` (the digest its next hash chains on), ``blocked: int32[1]`` (nonzero:
    admit nobody; a window's ``flags``)."""

    hash_off: object
    keys: object
    tail_len: object
    tails: object
    digests: object
    blocked: object


@triton.jit
def start_requests(ms, mc: tl.constexpr, batch, inp, n):
    """Requests ``batch.slots[:n]`` started (``add_request``): active, their hashes' keys, counts 0, and
    the hashing state of those that hash their tokens. Tiles of requests by tiles of positions (no
    loop over requests)."""
    HB: tl.constexpr = 16
    pos = tl.arange(0, HB)
    i = 0
    while i < n:
        k, m = lanes(i, n, mc.BLOCK)
        r = ld(batch.slots + k, m)
        off = ld(inp.hash_off + k, m)
        nh = ld(inp.hash_off + k + 1, m) - off
        tlen = ld(inp.tail_len + k, m)
        zero = tl.zeros([mc.BLOCK], tl.int32)
        tl.store(ms.active + r, (zero + 1).to(tl.int8), mask=m)
        tl.store(ms.num_hashes + r, nh, mask=m)
        tl.store(ms.num_computed + r, zero, mask=m)
        tl.store(ms.num_tail + r, tl.maximum(tlen, 0), mask=m)
        tl.store(ms.hashing + r, (tlen >= 0).to(tl.int8), mask=m)
        for g in tl.static_range(mc.G):
            tl.store(ms.num_cached + g * mc.R + r, zero, mask=m)
        for j in tl.static_range(DW):
            tl.store(ms.last_digest + r.to(tl.int64) * DW + j, ld(inp.digests + k.to(tl.int64) * DW + j, m), mask=m)
        for p0 in range(0, mc.HBS, HB):
            p = p0 + pos
            tm = m[:, None] & (p[None, :] < tlen[:, None])
            tok = tl.load(inp.tails + k[:, None].to(tl.int64) * mc.HBS + p[None, :], mask=tm, other=0)
            tl.store(ms.tail_tok + r[:, None].to(tl.int64) * mc.HBS + p[None, :], tok, mask=tm)
        p0 = 0
        while p0 < tl.max(tl.where(m, nh, 0), axis=0):
            p = p0 + pos
            km = m[:, None] & (p[None, :] < nh[:, None])
            h = (off[:, None] + p[None, :]).to(tl.int64)
            for g in tl.static_range(mc.G):
                at = (r[:, None] * mc.G + g).to(tl.int64) * (mc.M * mc.K) + p[None, :]
                tl.store(ms.req_hi + at, tl.load(inp.keys + (h * mc.G + g) * 2, mask=km, other=0), mask=km)
                tl.store(ms.req_lo + at, tl.load(inp.keys + (h * mc.G + g) * 2 + 1, mask=km, other=0), mask=km)
            p0 += HB
        i += mc.BLOCK


@triton.jit
def release_refused(ms, mc: tl.constexpr, batch, n):
    """The requests of ``batch.slots[:n]`` that were not admitted become free slots again (they hold
    no block: the first was refused before taking any, the rest were never tried)."""
    i = 0
    while i < n:
        k, m = lanes(i, n, mc.BLOCK)
        out = m & (ld(batch.admitted + k, m) == 0)
        r = ld(batch.slots + k, m)
        zero = tl.zeros([mc.BLOCK], tl.int32)
        tl.store(ms.active + r, zero.to(tl.int8), mask=out)
        tl.store(ms.num_hashes + r, zero, mask=out)
        tl.store(ms.num_tail + r, zero, mask=out)
        tl.store(ms.hashing + r, zero.to(tl.int8), mask=out)
        i += mc.BLOCK


@triton.jit
def admit_kernel(ps, pc: tl.constexpr, ms, mc: tl.constexpr, batch, inp, cap, HAS_BLOCKED: tl.constexpr,
                 FORCE_EXACT: tl.constexpr):
    """Grid (1,): the admission of ``batch.slots[:num_reqs]`` (module docstring). The host checked the
    counts, hashes and tails; the device checks the count against its arrays and the slots (in
    range, free, listed once: op ADMIT), then ``allocate_slots`` checks the batch as usual."""
    n, n_ok = checked_count(batch.num_reqs, cap)
    ok = status_clear(ps.status)
    if ok:
        err, val, why = check_slots(ms, mc, slots=batch.slots, nb=n, FREE=True)
        err, val, why, extra = or_count_error(err, val, why, 0, n_ok, batch.num_reqs, cap, CAUSE=C_COUNT_PAST_ARRAYS)
        if err != 0:
            set_status_why(ps.status, code=err, op=OP_ADMIT, value=val, cause=why, extra=extra)
        ok = err == 0
    if HAS_BLOCKED:
        ok = ok & (tl.load(inp.blocked) == 0)
    i = 0
    while i < cap:  # nobody admitted unless the allocation below says so
        k, m = lanes(i, cap, mc.BLOCK)
        tl.store(batch.admitted + k, tl.zeros([mc.BLOCK], tl.int32), mask=m)
        tl.store(batch.hits + k, tl.zeros([mc.BLOCK], tl.int32), mask=m)
        i += mc.BLOCK
    tl.debug_barrier()
    if ok:
        start_requests(ms, mc, batch, inp, n)
        tl.debug_barrier()
        split = allocate_slots_parallel(ps, pc, ms, mc, batch, cap, FORCE_EXACT)
        tl.debug_barrier()
        allocate_slots_exact_checked(ps, pc, ms, mc, batch, STOP_ON_FAILURE=True, num=n, split=split,
                                     ok=status_clear(ps.status))
        tl.debug_barrier()
        release_refused(ms, mc, batch, n)
        tl.debug_barrier()
        record_prefix_stats(ps, pc, ms, mc, batch, n)


def launch_admit(ps, pc, ms, mc, batch, inp: AdmitInputs, *, has_blocked: bool, force_exact: bool = False) -> None:
    """Launch :func:`admit_kernel` (one program); ``has_blocked``: read ``inp.blocked``."""
    admit_kernel[(1,)](ps, pc, ms, mc, batch, inp, batch.slots.numel(), HAS_BLOCKED=bool(has_blocked),
                       FORCE_EXACT=bool(force_exact), num_warps=warps_for(max(pc.BLOCK, mc.BLOCK)))
