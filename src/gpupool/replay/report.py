"""A replay's results as the ``gpupool replay`` command shows them: one report as text, the device
pool's report checked against the reference pool's (which fields must agree, and both side by side),
and the ``--json`` document (docs/semantics.md section 5 names the fields)."""
from __future__ import annotations

from .model import ReplayReport

#: The fields in which the device pool's report must equal the reference pool's on the same requests.
MATCH_FIELDS = ("requests", "admitted", "rejected", "prompt_blocks", "hit_blocks", "free_queue_sha256")


def mismatched_fields(ref: ReplayReport, dev: ReplayReport) -> list[str]:
    """The :data:`MATCH_FIELDS` in which ``dev`` differs from ``ref`` (empty when they agree)."""
    return [f for f in MATCH_FIELDS if getattr(ref, f) != getattr(dev, f)]


def _fmt_int(x: int) -> str:
    return f"{x:,}"


def format_report(rep: ReplayReport, speed: bool = True) -> str:
    """The text form of a report; ``speed=False`` leaves out the timing lines (interpreter runs)."""
    lines = [
        f"pool            {rep.pool}: {_fmt_int(rep.num_blocks)} blocks x {rep.block_size} tokens, "
        f"tpot {rep.tpot_ms:g} ms",
        f"requests        {_fmt_int(rep.requests)}",
        f"admitted        {_fmt_int(rep.admitted)} ({_fmt_int(rep.waited)} after waiting)",
        f"rejected        {_fmt_int(rep.rejected)}",
        f"prompt blocks   {_fmt_int(rep.prompt_blocks)}",
        f"hit blocks      {_fmt_int(rep.hit_blocks)}",
        f"hit ratio       {rep.hit_ratio:.4f}",
        f"peak in use     {_fmt_int(rep.peak_blocks_in_use)} blocks",
        f"free queue      sha256 {rep.free_queue_sha256}",
    ]
    if speed:
        lines += [f"wall time       {rep.wall_s:.3f} s", f"requests/s      {rep.requests_per_s:,.0f}"]
    else:
        lines += [f"wall time       {rep.wall_s:.3f} s (Triton interpreter: not a speed measurement)"]
    return "\n".join(lines)


def format_comparison(ref: ReplayReport, dev: ReplayReport) -> str:
    """The two reports' checked fields side by side (device pool first)."""
    rows = [("requests", _fmt_int(dev.requests), _fmt_int(ref.requests)),
            ("admitted", _fmt_int(dev.admitted), _fmt_int(ref.admitted)),
            ("rejected", _fmt_int(dev.rejected), _fmt_int(ref.rejected)),
            ("prompt blocks", _fmt_int(dev.prompt_blocks), _fmt_int(ref.prompt_blocks)),
            ("hit blocks", _fmt_int(dev.hit_blocks), _fmt_int(ref.hit_blocks)),
            ("free queue", dev.free_queue_sha256[:16], ref.free_queue_sha256[:16])]
    lines = [f"{'':<16}{'device pool':<20}reference pool"]
    lines += [f"{name:<16}{d:<20}{r}" + ("" if d == r else "   <- differs") for name, d, r in rows]
    return "\n".join(lines)


def json_report(meta: dict, *, reference=None, device=None, checked_requests=None, match=None, mismatched=(),
                speedup=None, reference_on_checked_requests=None) -> dict:
    """The ``--json`` report, one shape in every ``--pool`` mode: the run's metadata, then
    ``reference`` / ``device`` (a pool's report, or null when that pool did not run),
    ``reference_on_checked_requests`` (the reference on the device's prefix when it differs, else
    null), ``checked_requests``, ``match`` (null unless both pools ran), ``mismatched``, ``speedup``."""
    def report(r):
        return None if r is None else r.to_json_dict()
    return {**meta, "reference": report(reference), "device": report(device),
            "reference_on_checked_requests": report(reference_on_checked_requests),
            "checked_requests": checked_requests, "match": match, "mismatched": list(mismatched), "speedup": speedup}
