"""The prefix-cache statistics rule in the kernel (``record_prefix_stats`` reading the row length the
request-parallel scan left): a lookup flag on a row that holds blocks looks nothing up and is not
recorded, a resumed request's lookup counts in the ``preempted_*`` counters, on the request-parallel
and the exact path, in ``allocate_slots`` and ``admit``, as ``ReferenceKVCacheManager`` records them
(docs/semantics.md section 9). The whole state (statistics included) is compared after every op."""
import pytest

from harness.manager_pair import HASH, add, admitted_norm, small_pair


def _alloc(p, slots, nts, tgs, lks, resumed, sof=True):
    return p.do(f"allocate_slots({slots}, {nts}, {tgs}, {lks}, resumed={resumed}, sof={sof})",
                lambda: p.ref.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof, resumed=resumed),
                lambda: p.dev.allocate_slots(slots, nts, tgs, lks, stop_on_failure=sof, resumed=resumed),
                admitted_norm)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "exact"])
def test_lookups_on_rows_with_blocks_and_resumed_requests(parallel):
    p = small_pair(num_blocks=12)
    p.dev.parallel = parallel
    add(p, 0, [0, 1, 2, 3], 16)
    assert _alloc(p, [0], [16], [16], [True], [False]) == [True]  # looked up, recorded
    add(p, 1, [0, 1, 2, 3], 16)
    # row 0 holds blocks: its flag looks nothing up (not recorded, resumed or not); row 1 hits 3 blocks
    assert _alloc(p, [0, 1], [17, 16], [17, 16], [True, True], [True, True]) == [True, True]
    add(p, 2, [0, 1, 9], 12)
    add(p, 3, [0, 5], 8)
    # a batch mixing a row with blocks between fresh rows, resumed and not
    assert _alloc(p, [2, 0, 3], [12, 18, 8], [12, 18, 8], [True, True, True], [False, True, True]) == [True] * 3
    # a request that does not fit is not recorded; the ones after it (stop_on_failure off) are
    p.do("free 1, 2, 3", lambda: p.ref.free([1, 2, 3]), lambda: p.dev.free([1, 2, 3]))
    add(p, 1, [20, 21, 22, 23, 24, 25, 26, 27], 32)
    add(p, 2, [0, 1], 8)
    assert _alloc(p, [1, 2], [32, 8], [32, 8], [True, True], [True, False], sof=False) == [False, True]


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "exact"])
def test_admissions_record_as_the_reference(parallel):
    p = small_pair(num_blocks=24)
    p.dev.parallel = parallel
    add(p, 0, [0, 1, 2, 3], 16)
    assert _alloc(p, [0], [16], [16], [True], [False]) == [True]
    hs = [[HASH[x] for x in c] for c in ([0, 1, 2], [0, 1, 7, 8], [30, 30])]
    p.do("admit([1, 2, 3], resumed=[True, False, True])",
         lambda: p.ref.admit([1, 2, 3], hs, [12, 16, 8], resumed=[True, False, True]),
         lambda: p.dev.admit([1, 2, 3], hs, [12, 16, 8], resumed=[True, False, True]),
         lambda o: ([bool(x) for x in (o[0].tolist() if hasattr(o[0], "tolist") else o[0])],
                    list(o[1].tolist() if hasattr(o[1], "tolist") else o[1])))
