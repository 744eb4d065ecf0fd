"""The trace replay, the project's main job (docs/semantics.md section 5): trace loading
(``trace``), the model driving any pool op by op (``model``: the reference loop), the device loop
(``device``) and the reports' text and JSON forms (``report``)."""
from .model import (
    DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS, DEFAULT_TPOT_MS, ReplayReport, free_queue_digest, replay,
)
from .report import MATCH_FIELDS, format_comparison, format_report, json_report, mismatched_fields
from .trace import (
    BUNDLED_TRACE, TRACE_BLOCK_SIZE, Trace, TraceError, TraceRequest, bundled_trace_path, load_trace, read_trace,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE", "DEFAULT_NUM_BLOCKS", "DEFAULT_TPOT_MS", "BUNDLED_TRACE", "TRACE_BLOCK_SIZE", "ReplayReport",
    "Trace", "TraceError", "TraceRequest", "bundled_trace_path", "free_queue_digest", "load_trace", "read_trace",
    "replay", "MATCH_FIELDS", "format_comparison", "format_report", "json_report", "mismatched_fields",
]
