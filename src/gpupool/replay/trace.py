"""Traces for the replay: Mooncake's JSON-lines format, read and checked (docs/semantics.md section 5).

    {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [id, ...]}

``hash_ids`` holds one prefix-hash id per ``trace_block_size``-token block of the prompt (512 for
Mooncake's traces; the last id may cover a partial block), so a well-formed line has exactly
``ceil(input_length / trace_block_size)`` ids. Ids are integers or strings (other public traces use
ids such as ``"conv_17:3"``); block ``i``'s hash is ``trace_block_hash(hash_ids[i])``, i.e.
``sha256(str(id).encode()).digest()``, in group 0. The bundled trace (12,031 requests of a chat
service, released with the Mooncake paper; see ``gpupool/data/mooncake/README.md``) has ids per
512-token block.

:func:`read_trace` checks every line and returns a :class:`Trace` that says what it had to fix
(lines out of time order, which it sorts; ``hash_ids`` of the wrong length, which it accepts only
when ``lenient``); :func:`load_trace` returns just the requests.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from importlib import resources
from os import PathLike
from pathlib import Path

BUNDLED_TRACE = "data/mooncake/conversation_trace.jsonl"  # package data of gpupool
TRACE_BLOCK_SIZE = 512  # tokens per hash id in Mooncake's traces


class TraceError(ValueError):
    """A trace that cannot be replayed: a malformed line (the message names the file, the line and the
    field), or no request at all."""


@dataclass(frozen=True)
class TraceRequest:
    """One trace line: arrival ``timestamp`` (ms), prompt and output token counts, prefix-hash ids
    (ints or strs)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int | str, ...]


@dataclass
class Trace:
    """A checked trace. ``requests`` in time order (stable: ties keep file order), at most ``limit``.

    ``name``: the file (or the bundled trace's name); ``lines``: requests in the file;
    ``out_of_order``: lines whose timestamp is below the previous line's (the file was sorted when 0);
    ``short_hash_ids`` / ``long_hash_ids``: lines with fewer / more ids than
    ``ceil(input_length / block_size)``, accepted only with ``lenient`` (long lists are cut, short ones
    kept: blocks without an id are not cached); ``block_size``: the trace's tokens per id.
    """

    requests: list[TraceRequest]
    name: str
    block_size: int = TRACE_BLOCK_SIZE
    lines: int = 0
    out_of_order: int = 0
    short_hash_ids: int = 0
    long_hash_ids: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def clamped(self) -> int:
        """Lines whose ``hash_ids`` did not match the prompt (lenient mode only)."""
        return self.short_hash_ids + self.long_hash_ids

    def summary(self) -> dict:
        """What the checks found, for a JSON report."""
        return {"name": self.name, "lines": self.lines, "trace_block_size": self.block_size,
                "reordered_by_timestamp": self.out_of_order > 0, "out_of_order": self.out_of_order,
                "clamped_short_hash_ids": self.short_hash_ids, "clamped_long_hash_ids": self.long_hash_ids}


def bundled_trace_path():
    """The bundled Mooncake conversation trace (an importlib.resources Traversable)."""
    return resources.files("gpupool").joinpath(BUNDLED_TRACE)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


#: characters of an offending value an error message shows (a 4 MiB string stays one readable line)
_SHOWN = 60
#: an integer id with more bits than this may have more decimal digits than ``str()`` converts
#: (``sys.get_int_max_str_digits()``, 4300 by default: about 14,284 bits)
_ID_BITS_CHECKED = 14_000


def _show(x) -> str:
    """``repr(x)``, cut to about _SHOWN characters (a list nested too deeply for ``repr``: its type)."""
    try:
        r = repr(x)
    except (RecursionError, ValueError):  # nested too deeply; an int past the str-conversion limit
        return f"a {type(x).__name__} value too large to show"
    return r if len(r) <= _SHOWN else f"{r[:_SHOWN - 3]}... ({len(r):,} characters)"


def _finite_at_least_0(x) -> bool:
    """``x`` is a finite number >= 0 (an int too large for a float is not: timestamps are floats)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(x) and x >= 0
    except OverflowError:  # an int past float range
        return False


def hash_id_problem(h) -> str | None:
    """Why ``h`` cannot be a trace hash id (None when it can): an integer or a string whose
    :func:`gpupool.keys.trace_block_hash` exists, i.e. ``str(h)`` encodes as UTF-8 (no lone surrogate,
    which valid JSON can spell as ``"\\ud800"``) and an integer has at most the decimal digits Python
    converts to text."""
    if isinstance(h, str):
        if h.isascii():
            return None
        try:
            h.encode("utf-8")
        except UnicodeEncodeError as e:
            return (f"must be valid Unicode text, got a string with a lone surrogate "
                    f"{h[e.start]!r} at character {e.start}")
        return None
    if not _is_int(h):
        return f"must be an integer or a string, got {_show(h)}"
    if h.bit_length() > _ID_BITS_CHECKED:
        try:
            str(h)
        except ValueError:
            return f"is an integer of about {int(h.bit_length() * 0.30103):,} digits, too long to hash"
    return None


def check_fields(where: str, ts, inp, out, ids, ids_type=(list, tuple)) -> None:
    """One request's fields as docs/semantics.md section 5 allows them: a finite ``timestamp >= 0``,
    integers ``input_length >= 1`` and ``output_length >= 0``, ``hash_ids`` a list (tuple) of integers
    or strings that :func:`hash_id_problem` accepts. Raises TraceError naming ``where`` and the field
    (the offending value cut to about 60 characters)."""
    if not _finite_at_least_0(ts):
        raise TraceError(f"{where}: field timestamp must be a finite number >= 0, got {_show(ts)}")
    if not _is_int(inp) or inp < 1:
        raise TraceError(f"{where}: field input_length must be an integer >= 1, got {_show(inp)}")
    if not _is_int(out) or out < 0:
        raise TraceError(f"{where}: field output_length must be an integer >= 0, got {_show(out)}")
    if not isinstance(ids, ids_type):
        raise TraceError(f"{where}: field hash_ids must be a list of integers or strings, got {type(ids).__name__}")
    for k, h in enumerate(ids):
        if (_is_int(h) and h.bit_length() <= _ID_BITS_CHECKED) or (isinstance(h, str) and h.isascii()):
            continue  # the common case, checked without a call
        why = hash_id_problem(h)
        if why is not None:
            raise TraceError(f"{where}: field hash_ids[{k}] {why}")


def check_requests(trace) -> list[TraceRequest]:
    """``trace`` (an iterable of :class:`TraceRequest`) as a list, every request checked as a trace
    line is (:func:`check_fields`). Raises TraceError naming ``trace[i]`` and the field, TypeError for
    an entry that is not a TraceRequest."""
    out = list(trace)
    for i, tr in enumerate(out):
        if not isinstance(tr, TraceRequest):
            raise TypeError(f"trace[{i}] must be a TraceRequest, got {type(tr).__name__}")
        check_fields(f"trace[{i}]", tr.timestamp, tr.input_length, tr.output_length, tr.hash_ids)
    return out


#: bytes a trace line may hold (the bundled trace's longest is about 2 KB): a file without newlines
#: (``/dev/zero``) is refused at this length instead of read until memory runs out
MAX_LINE_BYTES = 4 << 20
_BOM = b"\xef\xbb\xbf"


def _parse_line(text: str, where: str, block_size: int, lenient: bool, counts: list[int]) -> TraceRequest:
    """One line as a TraceRequest; ``counts`` = [short, long] hash-id lists seen (lenient)."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise TraceError(f"{where}: not a trace line (JSON nested too deeply)") from None
    except ValueError as e:  # an integer past Python's str-to-int limit (sys.get_int_max_str_digits())
        raise TraceError(f"{where}: a number too long to read ({str(e).split(';')[0]})") from None
    if not isinstance(row, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in row]
    if missing:
        raise TraceError(f"{where}: missing field(s) {', '.join(missing)}")
    ts, inp, out, ids = row["timestamp"], row["input_length"], row["output_length"], row["hash_ids"]
    check_fields(where, ts, inp, out, ids, list)
    expect = -(-inp // block_size)
    if len(ids) != expect:
        if not lenient:
            what = "empty" if not ids else f"{len(ids)} ids"
            raise TraceError(f"{where}: field hash_ids has {what} but input_length {inp} needs {expect} "
                             f"(one per {block_size}-token block); pass --trace-block-size if the trace's "
                             f"blocks are not {block_size} tokens, or --lenient to accept it")
        if len(ids) < expect:
            counts[0] += 1
        else:
            counts[1] += 1
            ids = ids[:expect]
    return TraceRequest(ts, inp, out, tuple(ids))


def _lines(f, name: str):
    """The lines of the binary file ``f`` as text: UTF-8 (a byte-order mark at the start is dropped, as
    Python's ``utf-8-sig`` does), at most MAX_LINE_BYTES each; TraceError names the line otherwise."""
    lineno = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        lineno += 1
        if len(raw) > MAX_LINE_BYTES:
            raise TraceError(f"{name}, line {lineno}: longer than {MAX_LINE_BYTES >> 20} MiB without a newline; "
                             f"not a JSON-lines trace")
        if lineno == 1 and raw.startswith(_BOM):
            raw = raw[len(_BOM):]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TraceError(f"{name}, line {lineno}: not UTF-8 (byte {e.start + 1} of the line is "
                             f"{raw[e.start]:#04x})") from None


def read_trace(path: str | PathLike | None = None, *, limit: int | None = None,
               block_size: int = TRACE_BLOCK_SIZE, lenient: bool = False) -> Trace:
    """Read and check a Mooncake-format JSON-lines trace (default: the bundled conversation trace).

    Every line is checked (docs/semantics.md section 5): a JSON object with a finite ``timestamp >= 0``,
    an integer ``input_length >= 1``, an integer ``output_length >= 0`` and ``hash_ids``, a list of
    integers or strings with ``ceil(input_length / block_size)`` entries (with ``lenient``, a longer
    list is cut and a shorter one kept, and both are counted). Blank lines are skipped. Requests are
    sorted by timestamp (stable) and then cut to the first ``limit``.
    The file is UTF-8 (a leading byte-order mark is accepted), each line at most MAX_LINE_BYTES.
    Raises TraceError (a ValueError) naming the file, line and field of the first bad line (also for
    a line that is not UTF-8, too long, nested too deeply or holds a number too long to read), or for a
    trace without any request; ValueError for a bad ``limit`` or ``block_size``; FileNotFoundError or
    OSError when the file cannot be read.
    """
    if limit is not None and (not _is_int(limit) or limit < 0):
        raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if path is None:
        source, name = bundled_trace_path(), "bundled trace " + BUNDLED_TRACE
    else:
        source, name = Path(path), str(path)
        if source.is_dir():
            raise TraceError(f"{name} is a directory, not a trace file")
    reqs: list[TraceRequest] = []
    counts = [0, 0]
    out_of_order = 0
    with source.open("rb") as f:
        for lineno, text in enumerate(_lines(f, name), 1):
            if not text.strip():
                continue
            r = _parse_line(text, f"{name}, line {lineno}", block_size, lenient, counts)
            if reqs and r.timestamp < reqs[-1].timestamp:
                out_of_order += 1
            reqs.append(r)
    if not reqs:
        raise TraceError(f"{name}: no requests (the file is empty or blank)")
    lines = len(reqs)
    if out_of_order:
        reqs.sort(key=lambda r: r.timestamp)  # stable: ties keep file order, as the replay's own order
    if limit is not None:
        reqs = reqs[:limit]
    t = Trace(reqs, name, block_size, lines, out_of_order, counts[0], counts[1])
    if out_of_order:
        t.notes.append(f"{out_of_order:,} {'line was' if out_of_order == 1 else 'lines were'} out of timestamp order: "
                       "sorted by timestamp (ties in file order)")
    if t.clamped:
        t.notes.append(f"--lenient: {t.clamped:,} of {lines:,} lines had hash_ids of the wrong length "
                       f"({counts[0]:,} short: their last blocks are not cached; {counts[1]:,} long: cut)")
    return t


def load_trace(path: str | PathLike | None = None, limit: int | None = None, *,
               block_size: int = TRACE_BLOCK_SIZE, lenient: bool = False) -> list[TraceRequest]:
    """The requests of :func:`read_trace` (same checks and errors), in time order; ``limit=0`` gives []
    without reading the file."""
    if limit == 0:
        return []
    return read_trace(path, limit=limit, block_size=block_size, lenient=lenient).requests
