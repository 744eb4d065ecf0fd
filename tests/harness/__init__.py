"""The shared test harness of gpupool's tests: one concern per module.

* :mod:`harness.sizes`: test sizes by hypothesis profile (:func:`~harness.sizes.sized`), the block size;
* :mod:`harness.device`: the test device and int32 / int64 tensors on it;
* :mod:`harness.keys`: test block hashes (``h(i)``, request hash chains);
* :mod:`harness.state`: a pool's / manager's observable state through the conformance surface, and raw
  device-tensor snapshots;
* :mod:`harness.compare`: the one whole-state comparison of a reference and a device pool / manager;
* :mod:`harness.twins`: a reference and a device pool / manager built with one configuration, and the
  small manager of the single-scenario tests;
* :mod:`harness.ops`: running ops (on both sides, expected to fail, request admission, decode steps,
  threads);
* :mod:`harness.watchers`: reuse-watcher callbacks that log what fired;
* :mod:`harness.strategies`: hypothesis draws shared by several test files.

Import from the module (``from harness.compare import assert_pools_agree``); this file exports nothing.
The contract all of it reads is docs/semantics.md section 4 (the conformance surface).
"""
