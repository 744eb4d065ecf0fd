"""Small ``@triton.jit`` helpers every kernel uses: the sticky status word, checked device counts,
first-offending-lane reductions.

Every state-changing kernel reads ``status[CODE]`` first and does nothing once it is set (sticky
errors, docs/semantics.md section 3); it validates its whole input, then commits.
"""
import triton
import triton.language as tl

from .layout import BIG, ST_CAUSE, ST_CODE, ST_EXTRA, ST_LIMIT, ST_OP, ST_VALUE


@triton.jit
def set_status(status, code, op, value):
    """Record the first error, its cause 0 (:func:`set_status_why`)."""
    set_status_why(status, code, op, value, cause=0, extra=0)


@triton.jit
def set_status_why(status, code, op, value, cause, extra):
    """Record the first error with its ``Cause`` and second value (single-program kernels only: no
    other program races on it). Every slot is written under the one test of the code, so a cause
    never outlives its error or joins a later one."""
    # strict: benign, thread 0 stores; the others' read only guards stores they do not do (no barrier inside)
    if tl.load(status + ST_CODE) == 0:
        tl.store(status + ST_CODE, tl.cast(code, tl.int64))
        tl.store(status + ST_OP, tl.cast(op, tl.int64))
        tl.store(status + ST_VALUE, tl.cast(value, tl.int64))
        tl.store(status + ST_CAUSE, tl.cast(cause, tl.int64))
        tl.store(status + ST_EXTRA, tl.cast(extra, tl.int64))


@triton.jit
def set_status_limit(status, code, op, value, cause, extra, limit):
    """:func:`set_status_why` with the bound ``value`` passed (``Status.LIMIT``), for checks whose
    bound the host cannot know: a window's token counts, whose room depends on its lookahead D."""
    # strict: benign, as set_status_why's (the same test of the code, thread 0 stores)
    if tl.load(status + ST_CODE) == 0:
        tl.store(status + ST_LIMIT, tl.cast(limit, tl.int64))
    set_status_why(status, code, op, value, cause, extra)


@triton.jit
def status_clear(status):
    # strict: benign, read at kernel start, before any working path's barrier; alloc's fillers end -1 either way
    return tl.load(status + ST_CODE) == 0


@triton.jit
def checked_count(count_ptr, cap):
    """A count read from the device, checked against its array's capacity ``cap``: (count or 0, ok).
    ``count_ptr`` None (a constexpr): the whole array counts, so no glue kernel has to fill a count."""
    n = raw_count(count_ptr, cap)
    ok = (n >= 0) & (n <= cap)
    return tl.where(ok, n, 0), ok


@triton.jit
def tile_of(ptr, idx, n):
    """``ptr[idx]`` on the lanes with ``idx < n`` (0 elsewhere), and that mask: one tile of a list."""
    m = idx < n
    return tl.load(ptr + idx, mask=m, other=0), m


@triton.jit
def ld(ptr, m):
    """``ptr[...]`` on lanes ``m``, 0 elsewhere."""
    return tl.load(ptr, mask=m, other=0)


@triton.jit
def first_index(cur, bad, k):
    """The lower of ``cur`` and the first lane index where ``bad`` holds."""
    return tl.minimum(cur, tl.min(tl.where(bad, k, BIG), axis=0))


@triton.jit
def raw_count(count_ptr, cap):
    """The count as given (``cap`` when ``count_ptr`` is None), for error values."""
    if count_ptr is None:
        n = tl.zeros([], tl.int32) + cap
    else:
        n = tl.load(count_ptr)
    return n


@triton.jit
def first_bad(bad, idx, val):
    """(any, index, value) of the lowest-index lane where ``bad`` holds; index BIG when none. Lanes
    may share an index if they share its value (a repeat reported at its first occurrence)."""
    i = tl.min(tl.where(bad, idx, BIG), axis=0)
    v = tl.max(tl.where(bad & (idx == i), val.to(tl.int64), -9223372036854775807), axis=0)
    return i < BIG, i, tl.where(i < BIG, v, 0)


@triton.jit
def keep_first(err, err_val, err_i, new_err, bad, idx, val):
    """Fold the lowest bad lane of this tile into a running (code, value, index): the earlier index
    wins, so a batch reports the error its sequence of single ops would hit first."""
    anyb, i, v = first_bad(bad, idx, val)
    take = anyb & (i < err_i)
    return tl.where(take, new_err, err), tl.where(take, v, err_val), tl.where(take, i, err_i)


@triton.jit
def keep_first_why(err, err_val, why, extra, err_i, new_err, bad, idx, val, cause, ext):
    """:func:`keep_first` with the lane's ``Cause`` and second value: (code, value, cause, extra,
    index). Lanes that share the lowest index share its slot, so they agree on both."""
    anyb, i, v = first_bad(bad, idx, val)
    take = anyb & (i < err_i)
    if take:  # the detail's reductions only on a tile that holds the new first error
        at = bad & (idx == i)
        why = tl.max(tl.where(at, cause, 0), axis=0).to(tl.int32)
        extra = tl.max(tl.where(at, ext.to(tl.int64), -9223372036854775807), axis=0)
    return tl.where(take, new_err, err), tl.where(take, v, err_val), why, extra, tl.where(take, i, err_i)


@triton.jit
def no_error():
    """The start of a :func:`keep_first` fold: (no code, no value, no index)."""
    return tl.zeros([], tl.int32), tl.zeros([], tl.int64), tl.full([], BIG, tl.int32)


@triton.jit
def no_error_why():
    """The start of a :func:`keep_first_why` fold: (no code, value, cause, extra, index)."""
    return tl.zeros([], tl.int32), tl.zeros([], tl.int64), tl.zeros([], tl.int32), tl.zeros([], tl.int64), \
        tl.full([], BIG, tl.int32)


WIDE_BLOCK = 4096


def batch_config(pc, n: int):
    """``pc`` with tiles wide enough for a batch of ``n`` ids (up to WIDE_BLOCK lanes, never wider than
    the pool's next power of two, so a tile never spans the ring twice): one tile walk instead of four
    for 4,096 ids, where each walk's dependent loads set the latency."""
    block = 1 << max(0, (max(1, min(n, pc.N)) - 1).bit_length())
    block = min(WIDE_BLOCK, block)
    return pc._replace(BLOCK=block) if block > pc.BLOCK else pc


def warps_for(block: int) -> int:
    """Warps of a one-program kernel with ``block`` lanes (host side): 2 to 4 lanes per thread."""
    return 16 if block >= 1024 else 8 if block >= 512 else 4


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def lanes(i, n, BLOCK: tl.constexpr):
    """Tile ``i`` of a list of ``n``: the indices ``i .. i + BLOCK - 1`` and the mask of those ``< n``."""
    idx = i + tl.arange(0, BLOCK)
    return idx, idx < n


@triton.jit
def _segment_clear(out, total, i, BLOCK: tl.constexpr):
    """``out[i : i + BLOCK] = -1`` (below ``total``)."""
    idx, m = lanes(i, total, BLOCK)
    tl.store(out + idx, tl.full([BLOCK], -1, tl.int32), mask=m)


@triton.jit
def _segment_heads(seg_off, nseg, total, i, BLOCK: tl.constexpr):
    """Segments ``j`` of tile ``i``, their first index and whether they mark it (non-empty, inside):
    loads only, so two maps' loads can be issued back to back before either's stores."""
    j, m = lanes(i, nseg, BLOCK)
    o = tl.load(seg_off + j, mask=m, other=0)
    return j, o, m & (o < total) & (tl.load(seg_off + j + 1, mask=m, other=0) > o)


@triton.jit
def _segment_marks(out, total, i, BLOCK: tl.constexpr):
    """Tile ``i`` of the marks (a load; :func:`_running_max` folds it)."""
    f, m = lanes(i, total, BLOCK)
    return f, m, tl.load(out + f, mask=m, other=-1)


@triton.jit
def _running_max(x, carry):
    return tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)


@triton.jit
def segment_ids(seg_off, nseg, total, out, BLOCK: tl.constexpr):
    """``out[f]`` = the segment holding flat index ``f < total`` (``seg_off[j] <= f < seg_off[j + 1]``,
    nondecreasing offsets from 0): each non-empty segment marks its first index, then a running max
    fills the rest. O(total) work with no dependent chain per item (a binary search per item costs
    log2(nseg) dependent loads in every pass that needs the mapping)."""
    i = 0
    while i < total:
        _segment_clear(out, total, i, BLOCK)
        i += BLOCK
    tl.debug_barrier()
    i = 0
    while i < nseg:
        j, o, mark = _segment_heads(seg_off, nseg, total, i, BLOCK)
        tl.store(out + o, j, mask=mark)
        i += BLOCK
    tl.debug_barrier()
    carry = tl.full([], -1, tl.int32)
    i = 0
    while i < total:
        f, m, x = _segment_marks(out, total, i, BLOCK)
        run = _running_max(x, carry)
        tl.store(out + f, run, mask=m)
        carry = tl.max(run, axis=0)
        i += BLOCK
    tl.debug_barrier()


@triton.jit
def segment_ids_pair(seg_a, nseg_a, total_a, out_a, seg_b, nseg_b, total_b, out_b, BLOCK: tl.constexpr):
    """:func:`segment_ids` of two independent maps in one walk: each pass loads both maps' tiles before
    storing either's, so the two maps share each pass's memory wait and its barrier (three barriers,
    not six)."""
    i = 0
    while i < tl.maximum(total_a, total_b):
        _segment_clear(out_a, total_a, i, BLOCK)
        _segment_clear(out_b, total_b, i, BLOCK)
        i += BLOCK
    tl.debug_barrier()
    i = 0
    while i < tl.maximum(nseg_a, nseg_b):
        ja, oa, mark_a = _segment_heads(seg_a, nseg_a, total_a, i, BLOCK)
        jb, ob, mark_b = _segment_heads(seg_b, nseg_b, total_b, i, BLOCK)
        tl.store(out_a + oa, ja, mask=mark_a)
        tl.store(out_b + ob, jb, mask=mark_b)
        i += BLOCK
    tl.debug_barrier()
    carry_a = tl.full([], -1, tl.int32)
    carry_b = tl.full([], -1, tl.int32)
    i = 0
    while i < tl.maximum(total_a, total_b):
        fa, ma, xa = _segment_marks(out_a, total_a, i, BLOCK)
        fb, mb, xb = _segment_marks(out_b, total_b, i, BLOCK)
        run_a = _running_max(xa, carry_a)
        run_b = _running_max(xb, carry_b)
        tl.store(out_a + fa, run_a, mask=ma)
        tl.store(out_b + fb, run_b, mask=mb)
        carry_a = tl.max(run_a, axis=0)
        carry_b = tl.max(run_b, axis=0)
        i += BLOCK
    tl.debug_barrier()
