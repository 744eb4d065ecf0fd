"""Test setup: Triton's interpreter without a GPU, and the hypothesis profiles.

Profiles (``GPUPOOL_HYPOTHESIS_PROFILE``): ``dev`` (the default: few examples per property, so
``pytest -m "not slow" tests`` stays under 3 minutes on 2 cores), ``ci`` (what ``.ci/run`` uses with
every test, slow ones included), ``deep`` (1,000 examples, a long hunt). Tests that scale their own
example counts read ``settings().max_examples``. Long runs are marked ``slow``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before gpupool defines its kernels

from hypothesis import settings  # noqa: E402

settings.register_profile("dev", max_examples=4, deadline=None)
# ci: derandomized, so a CI run's examples are the same each time (a failure reproduces); 25
# examples, 6x dev, so the whole suite fits .ci/run's 15 minutes on 2 cores; deep hunts at random
settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("fast", settings.get_profile("ci"))  # the old name of "ci"
settings.register_profile("deep", max_examples=1000, deadline=None)
settings.load_profile(os.environ.get("GPUPOOL_HYPOTHESIS_PROFILE", "dev"))

# The heaviest of the quick tests (2 to 37 s each on 2 cores), run with the slow ones instead, which
# .ci/run runs too: each keeps a lighter sibling in the quick run (another parameter of the same test,
# or a test of the same code path), so `pytest -m "not slow"` stays under 3 minutes on 2 cores.
HEAVY_QUICK = (
    "manager/test_decode_burst.py::test_burst_equals_single_steps_and_reference[full-events-K2]",
    "kernels/test_import_order.py::test_differential_tests_pass_after_importing_triton_first",
    "pool/test_apply_batched.py::test_rounds_equal_the_single_calls_round_after_round",
    "manager/test_allocate_slots_parallel.py::test_decode_batch_is_parallel[full+full]",
    "replay/test_cli.py::test_a_closed_pipe_on_stdout_exits_quietly",
    "manager/test_reservation.py::test_allocation_inside_a_reservation_evicts_in_lru_order[parallel]",
    "manager/test_decode_step.py::test_eager_decode_step_equals_reference[groups1-events]",
    "manager/test_decode_step.py::test_eager_decode_step_equals_reference[groups1-no-events]",
    "kernels/test_kernel_barriers.py::test_cache_blocks_with_its_barrier_is_clean_and_passes_under_stale",
    "vllm_plugin/test_vllm_fast_path_hunts.py::test_device_small_window_big_pops",
    "manager/test_kv_cache_manager.py::test_get_computed_blocks_agree[full+sw]",
    "manager/test_kv_cache_manager.py::test_manager_matches_reference[full+sliding-parallel]",
    "manager/test_allocate_slots_parallel.py::test_sliding_window_hashed_release_is_parallel",
    "manager/test_reservation.py::test_bad_input_is_a_typed_error_and_changes_nothing",
    "manager/test_decode_step.py::test_eager_decode_step_equals_reference[groups0-events]",
    "vllm_plugin/test_vllm_fast_path.py::test_a_decode_step_is_one_flush",
    "decode/test_decode_loop.py::test_a_burst_reads_the_device_once_per_replay",
    "pool/test_pool_errors.py::test_mixed_valid_and_invalid_ops_on_both_pools",
    "vllm_plugin/test_vllm_fast_path_orders.py::test_batch_order_equals_call_order",
    "pool/test_cache_blocks_batched.py::test_one_launch_equals_the_calls_in_order",
    "pool/test_device_pool.py::test_key_table_near_its_limit[1-5-4]",
    "project/test_documented_commands.py::test_documented_command_runs[TRITON_INTERPRET=1 python bench/model_cases.py]",
    "manager/test_allocate_slots_parallel.py::test_zero_ref_hit_an_earlier_request_pops_falls_back",
    "vllm_plugin/test_vllm_publisher.py::test_close_sends_every_queued_batch",
    "vllm_plugin/test_vllm_adapter_args.py::test_fuzz_entry_points",
    "pool/test_batched_input_checks.py::test_fuzz[allocate_slots]",
    "vllm_plugin/test_vllm_fast_path.py::test_deferred_equals_per_call_device",
    "vllm_plugin/test_vllm_fast_path_events.py::test_events_and_metrics_equal_per_call_device",
    "vllm_plugin/test_vllm_fast_path_hunts.py::test_device_small_window",
    "vllm_plugin/test_vllm_fast_path_edges.py::test_edge_sequence_equals_per_call_device[pop every block, keys evicted]",
    "vllm_plugin/test_vllm_fast_path_edges.py::test_edge_sequence_equals_per_call_device[one key, two holders]",
    "kernels/test_kernel_barriers.py::test_cache_blocks_race_is_flagged_and_fails_under_stale",
    "kernels/test_kernel_barriers.py::test_replay_with_its_barrier_passes_under_lag",
    "pool/test_batched_input_checks.py::test_fuzz[release_copied]",
    "pool/test_batched_input_checks.py::test_fuzz[get_computed_blocks]",
    "pool/test_batched_input_checks.py::test_fuzz[decode_step]",
    "pool/test_batched_input_checks.py::test_fuzz[decode_window]",
    "replay/test_cli.py::test_stdout_on_a_full_disk_is_a_one_line_error[extra1]",
    "pool/test_validate.py::test_validate_sees_a_leaked_reference[full+full-device]",
    "manager/test_decode_step.py::test_pending_copy_survives_a_failed_step[full+full]",
    "manager/test_reservation.py::test_reserve_holds_blocks_against_other_requests[exact]",    "pool/test_apply_batched.py::test_one_launch_equals_the_single_calls",
    "manager/test_allocate_slots_parallel.py::test_decode_batch_is_parallel[full]",
    "decode/test_kv_cache.py::test_attention_views_equal_the_host_rows",
    "vllm_plugin/test_vllm_fast_path_hunts.py::test_device_reset_tiny_pools",
    "decode/test_decode_loop.py::test_tokens_equal_contiguous_kv[host-1]",
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("tests/")[-1] in HEAVY_QUICK:
            item.add_marker(pytest.mark.slow)


# ---- strict GPU mode (tests/strict/) --------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption(
        "--strict-gpu", nargs="?", const="detect", default=os.environ.get("GPUPOOL_STRICT_GPU") or None,
        metavar="MODE",
        help="run each non-slow test's kernels under the strict GPU checker (tests/strict/checker.py): "
             "detect (default: flag races the interpreter hides), perturb (another legal schedule), "
             "stale / lag (a load racing a store reads the value from before / after it). Also "
             "GPUPOOL_STRICT_GPU=MODE. Bare, it takes "
             "the next word as its mode: write --strict-gpu=MODE or put it last.")


def pytest_configure(config):
    config.addinivalue_line("markers", "strict_gpu_off: not run under --strict-gpu's checker (tests that run their own, "
                                       "or whose kernels other tests check under it)")
    mode = config.getoption("--strict-gpu")
    if mode:
        from strict.checker import MODES
        from strict.plugin import StrictPlugin

        if mode not in MODES:
            raise pytest.UsageError(f"--strict-gpu: mode must be one of {MODES}, not {mode!r} "
                                    f"(write --strict-gpu=MODE, or put a bare --strict-gpu last)")

        config.pluginmanager.register(StrictPlugin(mode), "strict-gpu")
        if mode != "detect":  # a changed execution fails where it fails: shrinking would rerun it for minutes
            from hypothesis import Phase

            settings.register_profile("strict-gpu", settings(), phases=[Phase.explicit, Phase.reuse, Phase.generate])
            settings.load_profile("strict-gpu")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Why tests were skipped, one line per reason, in the normal output (pytest shows reasons only
    with ``-rs``): a skipped claim (vLLM's tests without their packages, say) must not pass in silence."""
    if set(config.option.reportchars or "") & {"s", "a", "A"}:
        return  # pytest lists every skip itself
    merged: dict[str, int] = {}
    for rep in terminalreporter.stats.get("skipped", []):
        reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
        reason = reason.removeprefix("Skipped: ")
        merged[reason] = merged.get(reason, 0) + 1
    if merged:
        terminalreporter.section("skip reasons (pytest -rs lists each test)", sep="-")
        for reason, n in sorted(merged.items(), key=lambda kv: (-kv[1], kv[0])):
            terminalreporter.write_line(f"{n:>4}  {reason}")
