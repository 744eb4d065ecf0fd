"""Traces for the replay: Mooncake's JSON-lines format, read and checked (docs/semantics.md section 5).

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [id, ...]}

``hash_ids`` holds one prefix-hash id per ``block_size``-token block of the prompt (the last one may
cover a partial block); block ``i``'s hash is ``trace_block_hash(hash_ids[i])``, i.e.
``sha256(str(id).encode()).digest()``, in group 0. The bundled trace (12,031 requests of a chat
service, released with the Mooncake paper; see ``gpupool/data/mooncake/README.md``) has ids per
512-token block.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from os import PathLike
from pathlib import Path

BUNDLED_TRACE = "data/mooncake/conversation_trace.jsonl"  # package data of gpupool


@dataclass(frozen=True)
class TraceRequest:
    """One trace line: arrival ``timestamp`` (ms), prompt and output token counts, prefix-hash ids."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def bundled_trace_path():
    """The bundled Mooncake conversation trace (an importlib.resources Traversable)."""
    return resources.files("gpupool").joinpath(BUNDLED_TRACE)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_line(text: str, where: str) -> TraceRequest:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, inp, out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"{where}: timestamp must be a finite number >= 0, got {ts!r}")
    if not _is_int(inp) or inp < 1:
        raise ValueError(f"{where}: input_length must be an integer >= 1, got {inp!r}")
    if not _is_int(out) or out < 0:
        raise ValueError(f"{where}: output_length must be an integer >= 0, got {out!r}")
    if not isinstance(ids, list) or not all(_is_int(h) for h in ids):
        raise ValueError(f"{where}: hash_ids must be a list of integers")
    return TraceRequest(ts, inp, out, tuple(ids))


def load_trace(path: str | PathLike | None = None, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake-format JSON-lines trace (default: the bundled conversation trace).

    Blank lines are skipped; ``limit`` keeps the first ``limit`` requests (in file order).
    Raises ValueError naming the file and line for a malformed line (bad JSON, a missing field, a
    negative or non-integer length, non-integer hash ids), FileNotFoundError for a missing file.
    """
    if limit is not None and (not _is_int(limit) or limit < 0):
        raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
    if path is None:
        source, name = bundled_trace_path(), "bundled trace " + BUNDLED_TRACE
    else:
        source, name = Path(path), str(path)
    out: list[TraceRequest] = []
    if limit == 0:
        return out
    with source.open("r", encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            out.append(_parse_line(text, f"{name}, line {lineno}"))
            if limit is not None and len(out) >= limit:
                break
    return out


