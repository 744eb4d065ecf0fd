"""The reference request manager: vLLM's KVCacheManager over ``ReferenceBlockPool`` in plain Python,
the oracle of ``gpupool.manager.KVCacheManager`` (docs/semantics.md section 6)."""
from __future__ import annotations

from collections.abc import Sequence

from ..args import (
    NULL_BLOCK, ManagerShape, admit_lists, as_flag_list, as_hash_bytes_list, as_host_list, as_id_list, as_int, as_token_list,
    check_slot, check_slot_list, check_tail, own_hashing_message,
)
from ..errors import (
    ArgumentTypeError, InvalidArgumentError, InvalidCountError, InvariantError, OutOfBlocksError, position_message,
    pending_copy_message, token_count_message,
)
from ..groups import longest_cache_hit
from ..keys import hash_block_tokens
from ..reservations import check_reservations
from ..locking import Locked, locked
from ..stats import PrefixCacheStats
from .pool import ReferenceBlockPool


class ReferenceKVCacheManager(Locked):
    """The request layer (vLLM's KVCacheManager and its coordinator) over ``ReferenceBlockPool``: the
    oracle of ``gpupool.manager.KVCacheManager``. Semantics are documented there, op by op.

    Requests live in slots ``0 .. max_num_reqs-1``; every KV-cache group (``groups``: "full",
    ("sliding_window", tokens) or ("chunked_local_attention", tokens)) has a block table row per
    slot, all of one ``block_size``, sharing one pool; group g's keys use group id g. Request hashes are per ``hash_block_size`` tokens (a divisor
    of ``block_size``, k = block_size / hash_block_size of them per block): full block i is keyed by
    hash ``(i + 1) * k - 1``; with k > 1 a partly written block is also keyed at its last complete
    hash-block boundary (``cache_partial_block``).
    """

    def __init__(self, num_blocks: int, *, block_size: int, max_num_reqs: int, max_blocks_per_req: int,
                 groups=("full",), hash_block_size: int | None = None, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False, max_keys_per_block: int = 4):
        self.shape = sh = ManagerShape.make(block_size, hash_block_size, max_num_reqs, max_blocks_per_req, groups)
        self.block_size, self.hash_block_size, self.hashes_per_block = sh.block_size, sh.hash_block_size, \
            sh.hashes_per_block
        self.max_num_reqs, self.max_blocks_per_req, self.groups = sh.max_num_reqs, sh.max_blocks_per_req, sh.groups
        self.pool = ReferenceBlockPool(num_blocks, enable_caching=enable_caching,
                                       enable_kv_cache_events=enable_kv_cache_events,
                                       max_keys_per_block=max_keys_per_block)
        self._lock = self.pool._lock  # one lock for the manager and its pool
        self.enable_caching = bool(enable_caching)
        G, R = len(self.groups), self.max_num_reqs
        self.tables: list[list[list[int]]] = [[[] for _ in range(R)] for _ in range(G)]
        self.num_cached = [[0] * R for _ in range(G)]
        self.num_computed = [0] * R
        self.hashes: list[list[bytes]] = [[] for _ in range(R)]
        self.active = [False] * R
        self.reserved = [0] * R  # blocks booked per request (docs/semantics.md section 8)
        self.num_reserved = 0  # their sum, held against the free blocks
        self.pending_copies: list[tuple[int, int, int]] = []  # (src, dst, block released after the copy)
        # tokens past the last hash block of a request that hashes its own tokens (section 9); None: it does not
        self.tails: list[list[int] | None] = [None] * R
        self.prefix_cache_stats = PrefixCacheStats()

    # ---- checks ------------------------------------------------------------------------------
    def _slot(self, op: str, slot, active: bool | None = True) -> int:
        return check_slot(op, as_int(op, slot, "slot"), self.max_num_reqs, self.active.__getitem__, active)

    def _slots(self, op: str, slots) -> list[int]:
        """Distinct slots in use; the first bad entry in list order raises (a repeat at its first)."""
        return check_slot_list(op, as_id_list(op, slots), self.max_num_reqs, self.active.__getitem__)

    # ---- requests ----------------------------------------------------------------------------
    def _full_hashes(self, r: int) -> list[bytes]:
        k = self.hashes_per_block
        return self.hashes[r][k - 1::k]

    @locked
    def add_request(self, slot: int, block_hashes: Sequence[bytes] = (), tail_tokens: Sequence[int] | None = None) -> None:
        """Start a request in a free slot with the hashes of its known hash blocks (prompt). With
        ``tail_tokens`` (the tokens after the last hash block, fewer than ``hash_block_size``) the
        manager hashes the request's further tokens itself as :meth:`append_tokens` gives them
        (docs/semantics.md section 9, "Keys of generated blocks"); the hashes must then be 32-byte
        (vLLM's sha256). Raises InvalidArgumentError (slot in use or out of range, too many hashes or
        tokens), ArgumentTypeError (hashes that are not bytes, tokens that are not ints)."""
        op = "add_request"
        r = self._slot(op, slot, active=False)
        hs, tail = self._request_args(op, block_hashes, tail_tokens)
        self._start(r, hs, tail)

    def _request_args(self, op: str, block_hashes, tail_tokens) -> tuple[list[bytes], list[int] | None]:
        """``add_request``'s hashes and tail tokens, checked (section 9)."""
        hs = as_hash_bytes_list(op, block_hashes)
        if len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, f"{len(hs)} block hashes exceed max_blocks_per_req", len(hs))
        if tail_tokens is None:
            return hs, None
        tail = as_token_list(op, tail_tokens, "tail_tokens")
        check_tail(op, hs, tail, self.hash_block_size, self.max_blocks_per_req * self.block_size)
        return hs, tail

    def _start(self, r: int, hs: list[bytes], tail: list[int] | None) -> None:
        self.active[r] = True
        self.hashes[r] = hs
        self.tails[r] = tail
        self.num_computed[r] = 0
        for g in range(len(self.groups)):
            self.tables[g][r] = []
            self.num_cached[g][r] = 0

    @locked
    def append_block_hashes(self, slot: int, block_hashes: Sequence[bytes]) -> None:
        """Hashes of further full blocks of a running request (tokens it generated)."""
        op = "append_block_hashes"
        r = self._slot(op, slot)
        hs = as_hash_bytes_list(op, block_hashes)
        if self.tails[r] is not None:
            raise InvalidArgumentError(op, own_hashing_message(r), r)
        if len(self.hashes[r]) + len(hs) > self.max_blocks_per_req * self.hashes_per_block:
            raise InvalidArgumentError(op, "block hashes exceed max_blocks_per_req", len(self.hashes[r]) + len(hs))
        self.hashes[r].extend(hs)

    def _lookup_hits(self, r: int, num_tokens: int) -> list[list[int]]:
        """Per group, the hit blocks of the longest prefix every group accepts (``longest_cache_hit``,
        gpupool/groups.py); a windowed group's blocks before its hit's start are the null block."""
        G, bs = len(self.groups), self.block_size
        if not self.enable_caching:
            return [[] for _ in range(G)]
        full = self._full_hashes(r)
        cap = min(max(num_tokens - 1, 0) // bs, len(full))
        found = [[self.pool.get_cached_block(full[i], [g]) for i in range(cap)] for g in range(G)]
        n = longest_cache_hit(self.groups, [[b is not None for b in found[g]] for g in range(G)], bs)
        return [[NULL_BLOCK] * (s := kind.spec.hit_start(kind.window, n, bs)) + [found[g][i][0] for i in range(s, n)]
                for g, kind in enumerate(self.groups)]

    @locked
    def get_computed_blocks(self, slots, num_tokens) -> list[tuple[int, list[list[int]]]]:
        """For each request: (hit blocks, per-group hit block ids): the longest cached prefix of its
        hashes, at most ``(num_tokens - 1) // block_size`` blocks, all groups hitting. Pure."""
        op = "get_computed_blocks"
        rs = self._slots(op, slots)
        nts = as_id_list(op, num_tokens)
        if len(nts) != len(rs):
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        out = []
        for r, nt in zip(rs, nts):
            hits = self._lookup_hits(r, nt)
            out.append((len(hits[0]), hits))
        return out

    def _remove_skipped_blocks(self, r: int) -> None:
        for g, kind in enumerate(self.groups):
            row = self.tables[g][r]
            n_skip = kind.num_skipped_blocks(self.num_computed[r], self.block_size, len(row))
            removed = []
            for i in range(n_skip - 1, -1, -1):
                if row[i] == NULL_BLOCK:
                    break
                removed.append(row[i])
                row[i] = NULL_BLOCK
            if removed:
                self.pool.free_blocks(removed)

    @locked
    def allocate_slots(self, slots, num_tokens, target_tokens, lookup=None, stop_on_failure: bool = True,
                       resumed=None, hit_tokens: list | None = None) -> list[bool]:
        """Give each request, in order, blocks for ``target_tokens`` tokens (all or nothing per request).

        For request k (slot r): first the blocks each group's kind skips are freed and
        replaced by the null block (by ``num_computed`` before the step; vLLM's remove_skipped_blocks).
        If ``lookup[k]``, the longest cached prefix (``get_computed_blocks`` with ``num_tokens[k]``)
        is taken as hits, computed after the earlier requests of the batch. ``eff = max(target,
        hits * block_size)``; ``need = ceil(eff / block_size) - table length - hits`` new blocks per
        group. If ``need * groups + (hit blocks with ref_cnt 0) > free`` the request gets nothing (and
        with ``stop_on_failure`` neither do the ones after it). Else every group's hits are touched,
        then each group in order gets ``get_new_blocks(need)``, and blocks that became full are
        cached: ``cache_full_blocks(row, full_hashes, num_cached, nf, bs, g)`` with ``nf =
        min(min(eff, num_tokens) // bs, len(full_hashes))``; with hash_block_size < block_size the
        block after them, if written up to a hash-block boundary ``nh * hbs > nf * bs`` (``nh =
        min(min(eff, num_tokens) // hbs, len(hashes))``), is then ``cache_partial_block(row[nf],
        hashes, nh * hbs, g, bs, hbs)`` (null blocks skipped). Returns one admitted flag per request.

        An admitted request that looked up (``lookup[k]``, an empty row, caching on) is recorded in
        :attr:`prefix_cache_stats` (``num_tokens[k]`` queried, its hit tokens; in the ``preempted_*``
        counters where ``resumed[k]``; docs/semantics.md section 9). ``hit_tokens``: a list of at
        least ``len(slots)`` entries, filled with each request's prefix-hit tokens (0 where not
        admitted).
        """
        op = "allocate_slots"
        rs = self._slots(op, slots)
        nts = as_id_list(op, num_tokens)
        tgt = as_id_list(op, target_tokens)
        lk = as_flag_list(op, lookup) if lookup is not None else [False] * len(rs)
        rsm = as_flag_list(op, resumed) if resumed is not None else [False] * len(rs)
        if not len(nts) == len(tgt) == len(lk) == len(rsm) == len(rs):
            raise InvalidArgumentError(op, "slots, num_tokens, target_tokens, lookup and resumed differ in length")
        if hit_tokens is not None and (not isinstance(hit_tokens, list) or len(hit_tokens) < len(rs)):
            raise InvalidArgumentError(op, f"hit_tokens must be a list of at least {len(rs)} entries")
        bs = self.block_size
        for t in (t for pair in zip(nts, tgt) for t in pair):  # request by request, as a batch of single calls
            if not 0 <= t <= self.max_blocks_per_req * bs:
                raise InvalidCountError(op, token_count_message(t, 0, self.max_blocks_per_req * bs), t)
        admitted = [False] * len(rs)
        hits = [0] * len(rs)
        for k, r in enumerate(rs):
            hit = self._allocate_one(r, nts[k], tgt[k], lk[k], rsm[k])
            if hit is None:
                if stop_on_failure:
                    break
                continue
            admitted[k], hits[k] = True, hit
        if hit_tokens is not None:
            hit_tokens[: len(rs)] = hits
        return admitted

    def _allocate_one(self, r: int, nt: int, target: int, lookup: bool, resumed: bool = False) -> int | None:
        """``allocate_slots`` of one request whose arguments are checked: its prefix-hit tokens if
        admitted, else None (nothing changed but the skipped blocks)."""
        bs, G = self.block_size, len(self.groups)
        self._remove_skipped_blocks(r)
        looked = lookup and not self.tables[0][r]
        hits = self._lookup_hits(r, nt) if looked else [[] for _ in range(G)]
        nh = len(hits[0])
        eff = max(target, nh * bs)
        need = max(0, -(-eff // bs) - len(self.tables[0][r]) - nh)
        zero_ref = sum(1 for g in range(G) for b, c in zip(hits[g], self.pool.ref_counts(hits[g]))
                       if c == 0 and b != NULL_BLOCK)
        if need * G + zero_ref > self._room(r):
            return None
        self._draw(r, need * G + zero_ref)
        for g in range(G):
            self.pool.touch(hits[g])
        for g in range(G):
            self.tables[g][r].extend(hits[g])
            self.num_cached[g][r] = max(self.num_cached[g][r], nh)
        for g in range(G):
            self.tables[g][r].extend(self.pool.get_new_blocks(need))
        if self.enable_caching:
            self._cache_blocks(r, min(eff, nt))
            if looked:
                self.prefix_cache_stats.record(nt, nh * bs, resumed)
        self.num_computed[r] = eff
        return nh * bs

    def _cache_blocks(self, r: int, known: int) -> None:
        """Key the blocks of slot r that ``known`` tokens fill (``allocate_slots``' last step)."""
        bs = self.block_size
        full = self._full_hashes(r)
        nf = min(known // bs, len(full))
        nh = min(known // self.hash_block_size, len(self.hashes[r]))
        for g in range(len(self.groups)):
            if nf > self.num_cached[g][r]:
                self.pool.cache_full_blocks(self.tables[g][r], full, self.num_cached[g][r], nf, bs, g)
                self.num_cached[g][r] = nf
            row = self.tables[g][r]
            if nh * self.hash_block_size > nf * bs and nf < len(row) and row[nf] != NULL_BLOCK \
                    and self._partial_key_fits(row[nf], nh * self.hash_block_size):
                self.pool.cache_partial_block(row[nf], self.hashes[r], nh * self.hash_block_size, g, bs,
                                              self.hash_block_size)

    @locked
    def allocate_running(self, slots, num_tokens, num_lookahead_tokens: int = 0) -> tuple[list[bool], list[bool]]:
        """vLLM's scheduler over its running requests (docs/semantics.md section 9, "Preemption"):
        each request in order gets blocks for ``num_tokens[k] + num_lookahead_tokens`` tokens
        (``allocate_slots`` without lookup; blocks keyed as far as ``num_tokens[k]``); when one does not
        fit, the LAST request still in the list is preempted (:meth:`free`: its blocks go back, tail
        first; its reservation is released) and the request tries again; a request that had to
        preempt itself ends the loop (every request after it was preempted before it). Returns
        ``(admitted, preempted)``, one flag each per request. Raises InvalidArgumentError (slots),
        InvalidCountError (a token count below 1, or ``num_tokens + num_lookahead_tokens`` past
        ``max_blocks_per_req * block_size``), nothing changed."""
        op = "allocate_running"
        rs = self._slots(op, slots)
        nts = as_id_list(op, num_tokens)
        d = as_int(op, num_lookahead_tokens, "num_lookahead_tokens")
        if len(nts) != len(rs):
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        cap = self.max_blocks_per_req * self.block_size
        if d < 0:
            raise InvalidCountError(op, f"num_lookahead_tokens must be >= 0, got {d}", d)
        for r, t in zip(rs, nts):
            if not 1 <= t <= cap - d:
                raise InvalidCountError(op, token_count_message(t, 1, cap - d, r), t)
        admitted, preempted = [False] * len(rs), [False] * len(rs)
        i, last = 0, len(rs) - 1
        while i <= last:
            if self._allocate_one(rs[i], nts[i], nts[i] + d, False) is not None:
                admitted[i] = True
                i += 1
                continue
            self.free([rs[last]])
            preempted[last] = True
            if last == i:
                break
            last -= 1
        return admitted, preempted

    @locked
    def admit(self, slots, block_hashes, num_tokens, tail_tokens=None, resumed=None,
              blocked: bool = False) -> tuple[list[bool], list[int]]:
        """Admit waiting requests in order (docs/semantics.md section 9, "Admission"): each is
        :meth:`add_request` (``block_hashes[k]``, ``tail_tokens[k]``) then ``allocate_slots`` of
        ``num_tokens[k]`` tokens with a prefix lookup, recorded in :attr:`prefix_cache_stats`
        (``resumed[k]``: a request resumed after a preemption). The first request that does not fit
        is not admitted and neither is any after it (head-of-line); their slots stay free. With
        ``blocked`` (vLLM: no admission in a step that preempted) none is. Returns ``(admitted,
        hit_tokens)`` per request. Raises InvalidArgumentError (a slot out of range, in use or listed
        twice; hashes or tails as ``add_request`` checks them; lengths), InvalidCountError (a token
        count outside ``1 .. max_blocks_per_req * block_size``), nothing changed."""
        op = "admit"
        rs, hls, nts, tls, rsm = admit_lists(op, slots, block_hashes, num_tokens, tail_tokens, resumed)
        check_slot_list(op, rs, self.max_num_reqs, self.active.__getitem__, active=False)
        reqs = [self._request_args(op, hs, tl) for hs, tl in zip(hls, tls)]
        cap = self.max_blocks_per_req * self.block_size
        for r, t in zip(rs, nts):
            if not 1 <= t <= cap:
                raise InvalidCountError(op, token_count_message(t, 1, cap, r), t)
        admitted, hits = [False] * len(rs), [0] * len(rs)
        if blocked:
            return admitted, hits
        for k, r in enumerate(rs):
            self._start(r, *reqs[k])
            hit = self._allocate_one(r, nts[k], nts[k], True, rsm[k])
            if hit is None:
                self.free([r])
                break
            admitted[k], hits[k] = True, hit
        return admitted, hits

    @locked
    def append_tokens(self, slots, tokens) -> None:
        """Tokens the requests ``slots`` gained (sampled, or accepted drafts), in order: a request
        that hashes its own tokens (:meth:`add_request` with ``tail_tokens``) adds them to its tail
        and hashes every hash block they fill (``hash_block_tokens`` chained on its last hash, no
        extra keys), so a later ``allocate_slots`` keys the blocks (docs/semantics.md section 9).
        Other requests ignore them. ``tokens[k]``: a sequence of token ids (int32). Raises
        InvalidArgumentError (slots, lengths, a token outside int32), InvalidCountError (a request's
        tokens past ``max_blocks_per_req * block_size``), nothing changed."""
        op = "append_tokens"
        rs = self._slots(op, slots)
        toks = [as_token_list(op, t) for t in as_host_list(op, tokens, "tokens")]
        if len(toks) != len(rs):
            raise InvalidArgumentError(op, "slots and tokens differ in length")
        cap = self.max_blocks_per_req * self.block_size
        for r, t in zip(rs, toks):
            tail = self.tails[r]
            if tail is not None and len(self.hashes[r]) * self.hash_block_size + len(tail) + len(t) > cap:
                n = len(self.hashes[r]) * self.hash_block_size + len(tail) + len(t)
                raise InvalidCountError(op, token_count_message(n, 1, cap, r), n)
        for r, t in zip(rs, toks):
            self._append(r, t)

    def _append(self, r: int, tokens: list[int]) -> None:
        tail = self.tails[r]
        if tail is None:
            return
        hbs = self.hash_block_size
        tail.extend(tokens)
        while len(tail) >= hbs:
            parent = self.hashes[r][-1] if self.hashes[r] else None
            self.hashes[r].append(hash_block_tokens(parent, tail[:hbs]))
            del tail[:hbs]

    def forget_tokens(self, r: int) -> None:
        """Slot r's request stops hashing its tokens (tokens it gained that the manager was not given)."""
        self.tails[r] = None

    @locked
    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix-cache statistics since the last call, and a fresh count (vLLM's name)."""
        out, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return out

    def _partial_key_fits(self, b: int, num_tokens: int) -> bool:
        """A partial key replaces the block's keys if its primary covers fewer tokens, else it is a
        secondary key: the manager skips one that would exceed max_keys_per_block."""
        p = self.pool
        return not p.keys[b] or p.hash_num_tokens[b] < num_tokens or len(p.keys[b]) < p.max_keys_per_block

    @locked
    def free(self, slots) -> None:
        """Finish requests, in order: each group's blocks freed tail first (one free_blocks per group);
        their reservations are released (docs/semantics.md section 8)."""
        op = "free"
        rs = self._slots(op, slots)
        for r in rs:
            for g in range(len(self.groups)):
                self.pool.free_blocks(self.tables[g][r][::-1])
                self.tables[g][r] = []
                self.num_cached[g][r] = 0
            self.active[r] = False
            self.num_computed[r] = 0
            self.hashes[r] = []
            self.tails[r] = None
            self.num_reserved -= self.reserved[r]
            self.reserved[r] = 0

    @locked
    def slot_mapping(self, slots, positions, group: int = 0) -> list[int]:
        """KV slot of each (request, token position): ``block_id * block_size + position % block_size``."""
        op = "slot_mapping"
        rs = as_id_list(op, slots)
        ps = as_id_list(op, positions)
        g = as_int(op, group, "group")
        if not 0 <= g < len(self.groups):
            raise InvalidArgumentError(op, f"group {g} out of range 0..{len(self.groups) - 1}", g)
        if len(ps) != len(rs):
            raise InvalidArgumentError(op, "slots and positions differ in length")
        out = []
        for r, p in zip(rs, ps):  # entry by entry: its slot, then its position
            row = self.tables[g][self._slot(op, r)]
            if not 0 <= p < len(row) * self.block_size:
                raise InvalidArgumentError(op, position_message(p, r), p)
            out.append(row[p // self.block_size] * self.block_size + p % self.block_size)
        return out

    @locked
    def block_table(self, group: int = 0) -> list[list[int]]:
        return [list(row) for row in self.tables[group]]

    @locked
    def validate(self) -> None:
        """The pool's invariants, then the manager's: every block's ref count equals its references
        from the active requests' block tables plus the pending copies' held blocks (so a leaked
        reference shows), when only the manager takes references; and the reservations' (section 8:
        each >= 0 and 0 on a free slot, their sum the total, the total <= the free blocks).
        Raises InvariantError."""
        self.pool.validate()
        expect = [0] * self.pool.num_blocks
        for table in self.tables:
            for r, row in enumerate(table):
                if row and not self.active[r]:
                    raise InvariantError("validate", f"free slot {r} still holds blocks", r)
                for b in row:
                    expect[b] += 1
        for c in self.pending_copies:
            expect[c[2]] += 1
        for b in range(1, self.pool.num_blocks):
            if self.pool.ref_cnt[b] != expect[b]:
                raise InvariantError("validate", f"block {b} has ref_cnt {self.pool.ref_cnt[b]} but {expect[b]} "
                                                 "references from block tables and pending copies", b)
        check_reservations(self.reserved, self.active, self.num_reserved, self.pool.get_num_free_blocks())

    # ---- reservations (docs/semantics.md section 8) -----------------------------------------
    def _room(self, r: int) -> int:
        """Free blocks request ``r`` may take: the free queue less what the other requests reserved."""
        return self.pool.get_num_free_blocks() - (self.num_reserved - self.reserved[r])

    def _draw(self, r: int, n: int) -> None:
        """Request ``r`` takes ``n`` blocks off the free queue: they come out of its reservation first."""
        take = min(self.reserved[r], n)
        self.reserved[r] -= take
        self.num_reserved -= take

    def reservation_need(self, r: int, num_tokens: int) -> int:
        """Blocks request ``r`` needs for ``num_tokens`` more tokens: ``G * max(0, ceil((num_computed +
        num_tokens) / block_size) - row length)`` (the row counts its null blocks; section 8)."""
        bs = self.block_size
        return len(self.groups) * max(0, -(-(self.num_computed[r] + num_tokens) // bs) - len(self.tables[0][r]))

    @locked
    def reserve(self, slots, num_tokens) -> list[bool]:
        """Book, for each running request in order, the blocks it needs for ``num_tokens[k]`` more
        tokens (:meth:`reservation_need`) without taking any off the free queue (no eviction): the
        request's reservation becomes ``max(its reservation, need)``. The growth must fit the free
        blocks nobody reserved (``free - reserved total``); the first request whose growth does not
        fit gets nothing, and neither do the ones after it. Returns one flag per request (its
        reservation now covers ``num_tokens``). Raises InvalidArgumentError (a slot out of range,
        not in use or listed twice; lengths differ), InvalidCountError (``num_tokens < 0`` or
        ``num_computed + num_tokens > max_blocks_per_req * block_size``), with nothing changed."""
        op = "reserve"
        rs = self._slots(op, slots)
        nts = as_id_list(op, num_tokens)
        if len(nts) != len(rs):
            raise InvalidArgumentError(op, "slots and num_tokens differ in length")
        cap = self.max_blocks_per_req * self.block_size
        for r, n in zip(rs, nts):
            if n < 0 or self.num_computed[r] + n > cap:
                raise InvalidCountError(op, token_count_message(n, 0, cap - self.num_computed[r], r), n)
        out = [False] * len(rs)
        room = self.pool.get_num_free_blocks() - self.num_reserved
        for k, (r, n) in enumerate(zip(rs, nts)):
            grow = max(0, self.reservation_need(r, n) - self.reserved[r])
            if grow > room:
                break
            room -= grow
            self.reserved[r] += grow
            self.num_reserved += grow
            out[k] = True
        return out

    @locked
    def release_reservation(self, slots) -> None:
        """Return the unused reservations of the requests to the pool (each becomes 0). Raises
        InvalidArgumentError (a slot out of range, not in use or listed twice), nothing changed."""
        rs = self._slots("release_reservation", slots)
        for r in rs:
            self.num_reserved -= self.reserved[r]
            self.reserved[r] = 0

    @locked
    def get_num_reserved_blocks(self) -> int:
        """Blocks reserved by all requests (held against the free blocks)."""
        return self.num_reserved

    @locked
    def reservations(self) -> list[int]:
        """Each slot's reserved blocks (0 for a free slot)."""
        return list(self.reserved)

    # ---- copy-on-write ----------------------------------------------------------------------
    @locked
    def cow_append(self, slot: int, srcs: Sequence[int]) -> list[int]:
        """Partial prefix hit of a request: for every group g, the cached block ``srcs[g]`` that
        partly matches its next tokens is copied into a private block ``dst_g`` appended to its row
        (null srcs get the null block, no copy). Each src is touched, so it is held by the pending
        copy until :meth:`release_copied`. Returns the dsts. Raises OutOfBlocksError (nothing changed)."""
        op = "cow_append"
        r = self._slot(op, slot)
        G = len(self.groups)
        ss = self.pool._ids(op, srcs)
        if len(ss) != G:
            raise InvalidArgumentError(op, f"need one src per group ({G}), got {len(ss)}", len(ss))
        if len(self.tables[0][r]) >= self.max_blocks_per_req:
            raise InvalidArgumentError(op, f"slot {r}'s row is full", r)
        real = [s for s in ss if s != NULL_BLOCK]
        self._check_not_pending_dst(op, real)
        need = len(real) + sum(1 for s in set(real) if self.pool.ref_cnt[s] == 0)
        if need > self._room(r):
            raise OutOfBlocksError(op, f"copy-on-write needs {need} free blocks", need)
        self._draw(r, need)
        self.pool.touch(real)
        dsts = []
        for g, s in enumerate(ss):
            dst = self.pool.get_new_blocks(1)[0] if s != NULL_BLOCK else NULL_BLOCK
            self.tables[g][r].append(dst)
            if s != NULL_BLOCK:
                self.pending_copies.append((s, dst, s))
            dsts.append(dst)
        return dsts

    @locked
    def cow_move(self, slot: int, index: int) -> list[int]:
        """A running request must keep writing its blocks at ``index`` while they are cached: for every
        group, the block's keys move to a fresh block ``dst_g`` (``move_block_hashes``), which gets a
        copy of the contents and is released after it; the rows stay append-only (null entries are
        skipped, dst null). Returns the dsts. Raises OutOfBlocksError, InvalidArgumentError."""
        op = "cow_move"
        r = self._slot(op, slot)
        i = as_int(op, index, "index")
        if not 0 <= i < len(self.tables[0][r]):
            raise InvalidArgumentError(op, f"slot {r} has no block at index {i}", i)
        srcs = [self.tables[g][r][i] for g in range(len(self.groups))]
        self._check_not_pending_dst(op, [s for s in srcs if s != NULL_BLOCK])
        need = sum(1 for s in srcs if s != NULL_BLOCK)
        if need > self._room(r):
            raise OutOfBlocksError(op, f"copy-on-write needs {need} free blocks", need)
        self._draw(r, need)
        dsts = []
        for s in srcs:
            if s == NULL_BLOCK:
                dsts.append(NULL_BLOCK)
                continue
            dst = self.pool.get_new_blocks(1)[0]
            self.pool.move_block_hashes(s, dst)
            self.pending_copies.append((s, dst, dst))
            dsts.append(dst)
        return dsts

    def _check_not_pending_dst(self, op: str, srcs: list[int]) -> None:
        """A block still waiting to receive a copy cannot be copied from (one copy launch runs them all)."""
        pending = {c[1] for c in self.pending_copies}
        for s in srcs:
            if s in pending:
                raise InvalidArgumentError(op, pending_copy_message(s), s)

    @locked
    def take_pending_copies(self) -> list[tuple[int, int, int]]:
        """Drain the queue: ``(src, dst, release)`` per copy, in order. After the copies have run, pass
        the list to :meth:`release_copied`."""
        out, self.pending_copies = self.pending_copies, []
        return out

    @locked
    def release_copied(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """Drop the references the copies held: ``free_blocks`` of the released endpoints, in order."""
        op = "release_copied"
        if isinstance(copies, (str, bytes)) or not isinstance(copies, Sequence):
            raise ArgumentTypeError(op, f"copies must be a sequence of (src, dst, release), got {type(copies).__name__}")
        try:
            release = [c[2] for c in copies]
        except (TypeError, IndexError, KeyError):
            raise ArgumentTypeError(op, "copies must be (src, dst, release) triples") from None
        self.pool.free_blocks(release)

