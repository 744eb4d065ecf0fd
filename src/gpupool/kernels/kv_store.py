"""Writing a step's new K and V into a paged KV cache through ``slot_mapping`` (vLLM's
``reshape_and_cache``): token ``t``'s key ``key[t]: [H, D]`` goes to block ``slot // block_size``,
row ``slot % block_size`` of ``k_cache: [num_blocks, block_size, H, D]``, its value likewise; a token
whose slot is negative (a lane the step did not admit, padding) writes nothing, and so does one past
the cache (``slot >= num_blocks * block_size``): no out-of-bounds store on any input.

Grid ``(cdiv(T, TOKENS),)``: a program stores ``TOKENS`` tokens, ``[TOKENS, ROW]`` tiles over the
``H * D`` elements of a row. Counts may come from the device (``num_tokens: int32[1]``), so a captured
graph replays with a changing count. The copy moves the source dtype into the cache dtype (both
floats; equal dtypes copy bits)."""
import triton
import triton.language as tl

TOKENS = 16  # tokens a program stores
ROW = 128  # elements of a row (H * D) per tile step


@triton.jit
def store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, num_tokens, T, row_elems, num_slots,
                    HAS_COUNT: tl.constexpr, TOKENS: tl.constexpr, ROW: tl.constexpr):
    """``k_cache.view(-1, row_elems)[slot_mapping[t]] = key.view(T, row_elems)[t]`` (and ``v``) for
    ``t < num_tokens[0]`` (``T`` without a count) with ``0 <= slot < num_slots``."""
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    n = T
    if HAS_COUNT:
        n = tl.minimum(tl.maximum(tl.load(num_tokens), 0), T)
    live = t < n
    slot = tl.load(slot_mapping + t, mask=live, other=-1).to(tl.int64)
    ok = live & (slot >= 0) & (slot < num_slots)
    src_row = t.to(tl.int64) * row_elems
    dst_row = slot * row_elems
    for c in range(0, row_elems, ROW):
        col = c + tl.arange(0, ROW)
        m = ok[:, None] & (col[None, :] < row_elems)
        src = src_row[:, None] + col[None, :]
        dst = dst_row[:, None] + col[None, :]
        tl.store(k_cache + dst, tl.load(key + src, mask=m).to(k_cache.dtype.element_ty), mask=m)
        tl.store(v_cache + dst, tl.load(value + src, mask=m).to(v_cache.dtype.element_ty), mask=m)


def launch_store_kv(key, value, k_cache, v_cache, slot_mapping, num_tokens=None) -> None:
    """Launch :func:`store_kv_kernel` over ``key.shape[0]`` tokens (arguments checked by the caller:
    ``gpupool.kv_cache.store_kv``)."""
    T = key.shape[0]
    if T == 0:
        return
    row = key[0].numel()
    grid = (triton.cdiv(T, TOKENS),)
    store_kv_kernel[grid](key, value, k_cache, v_cache, slot_mapping, slot_mapping if num_tokens is None else num_tokens,
                          T, row, k_cache.shape[0] * k_cache.shape[1], HAS_COUNT=num_tokens is not None,
                          TOKENS=TOKENS, ROW=min(ROW, triton.next_power_of_2(row)), num_warps=4)
