"""The request-parallel ``allocate_slots``' scratch as named views (docs/algorithms.md section 6).

Manager state holds three buffers (``gpupool/manager.py`` ``allocate_manager_state``): ``s_par:
int32[NPAR, R + 1]``, a row per per-request field (index k, the request's place in the batch);
``s_kg: int32[NKG, G * R + 1]``, a row per per-(request, group) field (index ``k * G + g``); and
``s_map: int32[NMAP, MAPS]``, the segment of each flattened item, a row per kind of item. The phases
of ``parallel.py`` pass their results to each other through these rows; :func:`scratch_views` names
them once per launch (pointer arithmetic on constexpr sizes, no load), so code reads
``sc.req.slot + k``, ``sc.grp.start + j``, ``sc.maps.pop``.

A call writes every field it reads before reading it and leaves them as they are (a field a path does
not need, say the lookups' offsets in a decode step, keeps an older call's value).
"""
from typing import NamedTuple

import triton
import triton.language as tl



class RequestScratch(NamedTuple):
    """Per-request fields, each a row ``int32[R + 1]`` of ``s_par`` (offset rows hold ``nb + 1``
    entries: the total after the last request)."""

    slot: tl.tensor
    nblk: tl.tensor  # row length before the step
    cap: tl.tensor  # positions the lookup may hit
    loff: tl.tensor  # offsets of the flattened lookups (nb + 1 entries)
    miss: tl.tensor  # first missing position (BIG: none)
    hits: tl.tensor
    zref: tl.tensor  # hits on blocks with ref 0 that no earlier request hits (per position, group)
    rel: tl.tensor  # sliding-window blocks released
    need: tl.tensor  # new blocks per group
    eff: tl.tensor  # tokens with slots after the step
    popoff: tl.tensor  # offsets of the popped blocks (nb + 1 entries)
    zoff: tl.tensor  # zero-ref hits of earlier requests
    evict: tl.tensor  # keys evicted by the request's pops
    qoff: tl.tensor  # evicted keys of earlier requests
    evbase: tl.tensor  # first event row (nb + 1 entries)
    nf: tl.tensor  # full blocks known after the step
    rleft: tl.tensor  # the request's reservation after it is admitted (docs/semantics.md section 8)
    take: tl.tensor  # blocks it draws from its reservation
    cmiss: tl.tensor  # first position a windowed group misses (BIG: none; ManagerConfig.CHUNKED)


class GroupScratch(NamedTuple):
    """Per (request, group) fields, each a row ``int32[G * R + 1]`` of ``s_kg``, index ``k * G + g``."""

    start: tl.tensor  # first block to key
    nskip: tl.tensor  # blocks outside the sliding window
    lead: tl.tensor  # leading null blocks of the row
    reloff: tl.tensor  # offsets of the released blocks (nseg + 1 entries)
    coff: tl.tensor  # offsets of the blocks to key (nseg + 1 entries)
    rm: tl.tensor  # old keys removed by caching
    st: tl.tensor  # keys stored
    rmoff: tl.tensor  # removed keys of earlier segments
    stoff: tl.tensor  # stored keys of earlier segments
    ev: tl.tensor  # first event row of the segment's caching


class MapScratch(NamedTuple):
    """Rows ``int32[MAPS]`` of ``s_map``: the segment of each flattened item."""

    lookup: tl.tensor  # request of each lookup item; later (request, group) of each released block
    cache: tl.tensor  # (request, group) of each block to key
    pop: tl.tensor  # request of each popped block


class Scratch(NamedTuple):
    req: RequestScratch
    grp: GroupScratch
    maps: MapScratch


NPAR = len(RequestScratch._fields)
NKG = len(GroupScratch._fields)
NMAP = len(MapScratch._fields)


@triton.jit
def scratch_views(ms, mc: tl.constexpr):
    """The :class:`Scratch` views of manager state ``ms`` (rows in the field order above)."""
    p = ms.s_par
    n = mc.R + 1
    req = RequestScratch(p, p + n, p + 2 * n, p + 3 * n, p + 4 * n, p + 5 * n, p + 6 * n, p + 7 * n, p + 8 * n,
                         p + 9 * n, p + 10 * n, p + 11 * n, p + 12 * n, p + 13 * n, p + 14 * n, p + 15 * n,
                         p + 16 * n, p + 17 * n, p + 18 * n)
    q = ms.s_kg
    n = mc.G * mc.R + 1
    grp = GroupScratch(q, q + n, q + 2 * n, q + 3 * n, q + 4 * n, q + 5 * n, q + 6 * n, q + 7 * n, q + 8 * n,
                       q + 9 * n)
    maps = MapScratch(ms.s_map, ms.s_map + mc.MAPS, ms.s_map + 2 * mc.MAPS)
    return Scratch(req, grp, maps)

