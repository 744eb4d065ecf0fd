"""Where things are, for tests in any folder under tests/ (one definition, not a ``parents[n]`` per file)."""
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
SRC = ROOT / "src"
EXAMPLES = ROOT / "examples"
BENCH = ROOT / "bench"
# vLLM's own tests run against the plug-in (drivers and the pytest plug-in), and the live engine's helpers
VLLM_PLUGIN = TESTS / "vllm_plugin"  # test_vllm_conformance.py's vllm_tree, for its subfolders' tests
CONFORMANCE = TESTS / "vllm_plugin" / "conformance"
LIVE = TESTS / "vllm_plugin" / "live"
