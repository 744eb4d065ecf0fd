"""The host mirror of a gpupool pool (docs/vllm.md, "The drop-in BlockPool"; docs/algorithms.md section 8):
the fields vLLM's callers read thousands of times per step, kept on the host so that a read never
touches the device. An engine (:mod:`gpupool.vllm.engine`) owns it; its lists are read directly
(``ref``, ``keys``, ``ntok``, ``holders``) and every write is one of :class:`HostMirror`'s methods."""
from __future__ import annotations

from ..kernels.layout import MIRROR_KEY_WIDTH, MirrorCol, MirrorKey, mirror_key_col


def vllm_key(block_hash: bytes, group_id: int) -> bytes:
    """vLLM's ``BlockHashWithGroupId``: the hash bytes, then the group id as 4 bytes big-endian."""
    return bytes(block_hash) + int(group_id).to_bytes(4, "big", signed=False)


def get_block_hash(key: bytes) -> bytes:
    """The hash bytes of a :func:`vllm_key`."""
    return key[:-4]


def get_group_id(key: bytes) -> int:
    """The group id of a :func:`vllm_key`."""
    return int.from_bytes(key[-4:], "big", signed=False)


class HostMirror:
    """Per mirror slot (a block id; the fast path's placeholders use slots ``>= num_blocks``): ``ref``
    (ref count), ``keys`` (vLLM key bytes, primary first), ``ntok`` (tokens of the primary key, None
    without); per key ``holders``: ``{slot: insertion seq}`` (the earliest-inserted holder answers a
    lookup). ``seq``: the host's own insertion counter (the reference backend's order). The lists are
    changed in place only (readers keep references to them)."""

    __slots__ = ("ref", "keys", "ntok", "holders", "seq")

    def __init__(self, num_blocks: int):
        self.ref = [0] * num_blocks
        self.keys: list[tuple[bytes, ...]] = [()] * num_blocks
        self.ntok: list[int | None] = [None] * num_blocks
        self.holders: dict[bytes, dict[int, int]] = {}
        self.seq = 0

    def earliest(self, key: bytes) -> int | None:
        """The slot holding ``key`` that inserted it first, or None."""
        hs = self.holders.get(key)
        return min(hs, key=hs.__getitem__) if hs else None

    def _drop_keys(self, slot: int) -> None:
        """Every key of ``slot`` leaves the key map; ``keys[slot]`` is left to the caller."""
        holders = self.holders
        for key in self.keys[slot]:
            hs = holders.get(key)
            if hs is not None:
                hs.pop(slot, None)
                if not hs:
                    del holders[key]

    def next_seqs(self, n: int) -> range:
        """The next ``n`` insertion seqs of the host's own counter (:attr:`seq`), taken."""
        q = self.seq
        self.seq = q + n
        return range(q + 1, q + 1 + n)

    # ---- the fast path's rules (docs/semantics.md section 2), applied on the host ------------------
    def pop(self, slots: list[int]) -> None:
        """A pop took ``slots``: each is held once, its keys evicted."""
        keys, ref = self.keys, self.ref
        for s in slots:
            if keys[s]:
                self.evict(s)
            ref[s] = 1

    def evict(self, slot: int) -> None:
        """``slot`` loses its keys (a pop evicted them): out of the key map, no covered tokens."""
        self._drop_keys(slot)
        self.keys[slot] = ()
        self.ntok[slot] = None

    def touch(self, slots: list[int]) -> list[int]:
        """One more reference of each of ``slots`` (in order); returns those that were free (ref 0)."""
        ref, was_free = self.ref, []
        for s in slots:
            if ref[s] == 0:
                was_free.append(s)
            ref[s] += 1
        return was_free

    def release(self, slots: list[int]) -> tuple[list[int], list[int]]:
        """One reference less of each of ``slots`` (in order, each held often enough); returns the
        blocks that reached 0, (without a key, with one): the queue's front and back."""
        ref, keys, front, back = self.ref, self.keys, [], []
        for s in slots:
            ref[s] -= 1
            if ref[s] == 0:
                (back if keys[s] else front).append(s)
        return front, back

    def add_keys(self, slots: list[int], keys: list[bytes], seqs, ntok: list[int]) -> None:
        """Each of ``slots`` (un-keyed) holds its key of ``keys`` (its only one, the primary), inserted
        at its seq of ``seqs``, covering its count of ``ntok`` tokens."""
        holders, mk, mt = self.holders, self.keys, self.ntok
        for s, key, q, t in zip(slots, keys, seqs, ntok):
            mk[s] = (key,)
            holders.setdefault(key, {})[s] = q
            mt[s] = t

    # ---- from the pool ----------------------------------------------------------------------------
    def apply_rows(self, ids: list[int], rows: list[list[int]], key_name) -> None:
        """Set ``ids`` from ``gpupool.BlockPool.mirror_rows``' rows (``kernels/layout.py``'s MirrorCol;
        ``key_name``: device key -> (hash, group)); the key map from the difference."""
        holders = self.holders
        hi, lo, sq = (mirror_key_col(0, c) for c in (MirrorKey.HI, MirrorKey.LO, MirrorKey.SEQ))
        for b, row in zip(ids, rows):
            self.ref[b] = row[MirrorCol.REF_CNT]
            nt = row[MirrorCol.HASH_NTOK]
            self.ntok[b] = None if nt < 0 else nt
            new, seqs = [], []
            for o in range(0, MIRROR_KEY_WIDTH * row[MirrorCol.NUM_KEYS], MIRROR_KEY_WIDTH):
                new.append(vllm_key(*key_name((row[hi + o], row[lo + o]))))
                seqs.append(row[sq + o])
            new_t = tuple(new)
            if self.keys[b] == new_t and all(holders[k].get(b) == q for k, q in zip(new_t, seqs)):
                continue
            self._drop_keys(b)
            for k, q in zip(new_t, seqs):
                holders.setdefault(k, {})[b] = q
            self.keys[b] = new_t

    def apply_reference(self, ids, pool) -> None:
        """Set ``ids`` from a ``gpupool.reference.ReferenceBlockPool`` (its lists; new keys ordered by
        :attr:`seq`)."""
        holders = self.holders
        for b in ids:
            self.ref[b] = pool.ref_cnt[b]
            self.ntok[b] = pool.hash_num_tokens[b]
            new_t = tuple(vllm_key(h, g) for h, g in pool.keys[b])
            old = self.keys[b]
            if old == new_t:
                continue
            for k in old:
                if k not in new_t:
                    hs = holders[k]
                    hs.pop(b, None)
                    if not hs:
                        del holders[k]
            for k in new_t:
                if k not in old:
                    self.seq += 1
                    holders.setdefault(k, {})[b] = self.seq
            self.keys[b] = new_t

    # ---- placeholders (the fast path's pops whose ids are not known yet) ----------------------------
    def add_placeholder(self) -> None:
        """One more slot past the blocks: a held block (ref 1, no key) whose id is not known yet."""
        self.ref.append(1)
        self.keys.append(())
        self.ntok.append(None)

    def bind(self, num_blocks: int, ids: list[int]) -> None:
        """Placeholder slot ``num_blocks + k`` becomes block ``ids[k]``: the block's old keys (evicted
        by the pop) leave the key map, the placeholder's keys move onto it with their order; the
        placeholder slots are dropped."""
        holders = self.holders
        for k, b in enumerate(ids):
            s = num_blocks + k
            self._drop_keys(b)
            for key in self.keys[s]:
                hs = holders[key]
                hs[b] = hs.pop(s)
            self.keys[b] = self.keys[s]
            self.ref[b], self.ntok[b] = self.ref[s], self.ntok[s]
        self.drop_placeholders(num_blocks)

    def drop_placeholders(self, num_blocks: int) -> None:
        """The placeholder slots leave (their keys the key map: pops that did not run)."""
        for s in range(num_blocks, len(self.ref)):
            for key in self.keys[s]:
                hs = self.holders.get(key, {})
                hs.pop(s, None)
                if not hs:
                    self.holders.pop(key, None)
        del self.ref[num_blocks:], self.keys[num_blocks:], self.ntok[num_blocks:]
