"""Request-level kernels of the KV cache manager, one concern a module:

* ``checks``: input checks (slot lists, an ``allocate_slots`` batch, a decode window's inputs);
* ``steps``: vLLM's per-request admission steps, written once, each returning a NamedTuple
  (``remove_skipped_blocks``, ``find_longest_cache_hit``, ``get_num_blocks_to_allocate``, ``admit``,
  ``allocate_blocks``, ``cache_blocks``); the exact path and the trace replay's loop run them;
* ``exact``: ``allocate_slots``, the exact sequential path (a loop over ``steps``);
* ``parallel``: ``allocate_slots`` of a batch, request-parallel, up to the first order-dependent
  request (the exact path continues from there);
* ``free``: ``free`` of many requests as one batched free;
* ``slot_mapping``, ``copies`` (the copy-on-write queue's release), ``reserve`` (reservations);
* ``window``: a decode window's begin, its pool steps and its end, one launch each; ``admit``:
  admission of waiting requests in one launch;
* ``rows``: addressing (a slot's block-table row and its keys).

An op a decode window runs after its own checks comes in two parts: the plain op, which checks its
count and inputs and then runs, and ``*_checked``, which takes the already checked values
(``allocate_slots_exact_checked``, ``free_requests_checked``).

Manager state ``ms`` (``gpupool/manager.py`` ManagerState) and sizes ``mc`` (ManagerConfig: G groups,
R request slots, M blocks per row, K hash blocks per block, BS block size, BLOCK lanes): block table
``int32[G, R, M]``, per slot ``num_blocks`` (row length, equal across groups), ``num_computed``,
``num_cached: int32[G, R]``, request keys ``req_hi, req_lo: int64[R, G, M * K]`` (device keys of each
hash block's hash in group g; full block i is keyed by hash ``(i + 1) * K - 1``), ``num_hashes``,
``kinds: int32[G]`` (each group's ``KindCode``) and ``windows: int32[G]`` (its parameter in tokens: the
sliding window, the attention chunk; 0 for full attention), ``active: int8[R]``.
The semantics are ``ReferenceKVCacheManager``'s, op for op (docs/semantics.md section 6).
"""
