"""Render a pytest-benchmark JSON of ``bench/`` as one PNG and a short text table.

``plot(json_path, png_path)``: one log-log panel per op (median latency in microseconds against the
batch size; colour = pool, line style = pool size; docs/design.md targets as red stars) and a bar chart
of trace-replay throughput (requests/s). ``table(json_path)``: one line per (op, N, batch), the pools'
median microseconds side by side (and the captured graph's CUDA-event GPU time where measured).

Command line: ``python bench/plot.py OUT.json [--png OUT.png] [--table]``.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

OPS = ("alloc_free", "touch", "lookup", "decode_step")
OP_TITLES = {
    "alloc_free": "get_new_blocks + free_blocks (round trip)",
    "touch": "touch (prefix hits on free cached blocks)",
    "lookup": "prefix lookups (all hit)",
    "decode_step": "decode step: cache full, free finished, allocate",
}
POOL_ORDER = ("reference", "vllm", "device-single", "device-eager", "device-graph", "device")
COLORS = {"reference": "tab:blue", "vllm": "tab:orange", "device-single": "tab:gray", "device-eager": "tab:green",
          "device-graph": "tab:purple", "device": "tab:green"}
SIZE_STYLES = ("-", "--", ":", "-.")
# docs/design.md "Performance targets": (op, batch, microseconds, label)
TARGETS = (
    ("alloc_free", 4096, 20.0, "target: 10 us each"),
    ("decode_step", 1024, 25.0, "target: 25 us GPU time (graph)"),
    ("lookup", 10_000, 10.0, "target: 10 us"),
)


def load(json_path) -> tuple[list[dict], dict]:
    """Rows ``{op, pool, num_blocks, batch, median_us, gpu_us, ...extra_info}`` and the run's metadata."""
    data = json.loads(Path(json_path).read_text(encoding="utf-8"))
    rows = []
    for b in data.get("benchmarks", []):
        info = dict(b.get("extra_info") or {})
        if "op" not in info or "pool" not in info:
            continue
        info["median_us"] = b["stats"]["median"] * 1e6
        info["median_s"] = b["stats"]["median"]
        info["rounds"] = b["stats"].get("rounds")
        info["name"] = b.get("name")
        rows.append(info)
    meta = {"datetime": data.get("datetime", ""), "machine": data.get("machine_info", {}),
            "commit": data.get("commit_info", {})}
    return rows, meta


def _pool_key(p: str) -> int:
    return POOL_ORDER.index(p) if p in POOL_ORDER else len(POOL_ORDER)


def device_of(rows: list[dict]) -> str:
    for r in rows:
        if str(r.get("pool", "")).startswith("device") and r.get("device"):
            return str(r["device"])
    return "not measured"


INTERPRETER_NOTE = ("device pool left out: it ran in Triton's CPU interpreter, whose microseconds say nothing "
                    "about a GPU; run `gpupool bench` on a CUDA machine to compare it")


def comparable(rows: list[dict]) -> tuple[list[dict], str | None]:
    """The rows to put side by side under "lower is better": without the device pool's when it ran
    in the interpreter (then also the note saying so), else all of them."""
    if "interpreter" not in device_of(rows):
        return rows, None
    return [r for r in rows if not str(r.get("pool", "")).startswith("device")], INTERPRETER_NOTE


def _title(left_out: str | None) -> str:
    """The figure's title: a device-vs-host comparison only when the device pool's lines are in it."""
    if left_out:
        return "gpupool: host-side pools only (device pool ran in Triton's CPU interpreter; median per call, lower is better)"
    return "gpupool: device block pool vs host-side pools (median per call, lower is better)"


def plot(json_path, png_path) -> Path:
    """Write the figure of ``json_path`` to ``png_path`` (Agg backend); returns ``png_path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows, meta = load(json_path)
    dev = device_of(rows)
    rows, left_out = comparable(rows)
    fig, axes = plt.subplots(2, 3, figsize=(18, 10.5))
    panels = list(axes.flat)
    sizes = sorted({r["num_blocks"] for r in rows if r["op"] in OPS})
    style_of = {n: SIZE_STYLES[i % len(SIZE_STYLES)] for i, n in enumerate(sizes)}
    pools_seen: set[str] = set()
    for ax, op in zip(panels, OPS):
        op_rows = [r for r in rows if r["op"] == op]
        series: dict[tuple[str, int], list[dict]] = {}
        for r in op_rows:
            series.setdefault((r["pool"], r["num_blocks"]), []).append(r)
        for (pool, n), pts in sorted(series.items(), key=lambda kv: (_pool_key(kv[0][0]), kv[0][1])):
            pts.sort(key=lambda r: r["batch"])
            pools_seen.add(pool)
            ax.plot([r["batch"] for r in pts], [r["median_us"] for r in pts], style_of[n], marker="o", markersize=4,
                    color=COLORS.get(pool, "black"), linewidth=1.6)
            gpu = [r for r in pts if r.get("gpu_us") is not None and pool == "device-graph"]
            if gpu:
                pools_seen.add("gpu time")
                ax.plot([r["batch"] for r in gpu], [r["gpu_us"] for r in gpu], style_of[n], marker="x",
                        color="tab:red", linewidth=1.0, alpha=0.8)
        for t_op, t_b, t_us, label in TARGETS:
            if t_op == op and not left_out:  # GPU targets only beside device lines
                ax.plot([t_b], [t_us], marker="*", markersize=16, color="red", linestyle="none", zorder=5)
                ax.annotate(label, (t_b, t_us), textcoords="offset points", xytext=(-10, -16), fontsize=8,
                            color="red", ha="right")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(OP_TITLES[op], fontsize=11)
        ax.set_xlabel("batch size (blocks, keys or running requests)")
        ax.set_ylabel("median latency per call (us)")
        ax.grid(True, which="both", alpha=0.3)
        if not op_rows:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)

    ax = panels[4]
    rep = sorted([r for r in rows if r["op"] == "replay"], key=lambda r: _pool_key(r["pool"]))
    if rep:
        labels = []
        for r in rep:
            lim = r.get("limit")
            what = f"{r.get('requests', '?'):,} req" + ("" if lim is None else " (limited)")
            labels.append(f"{r['pool']}\n{what}")
        vals = [r.get("requests_per_s") or 0.0 for r in rep]
        bars = ax.bar(range(len(rep)), vals, color=[COLORS.get(r["pool"], "black") for r in rep])
        ax.set_xticks(range(len(rep)), labels, fontsize=9)
        ax.set_yscale("log")
        for bar, v in zip(bars, vals):
            ax.annotate(f"{v:,.0f}", (bar.get_x() + bar.get_width() / 2, v), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=9)
        ax.set_ylim(top=max(vals) * 4 if vals and max(vals) > 0 else None)
    else:
        ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("Mooncake trace replay throughput", fontsize=11)
    ax.set_ylabel("requests / s (higher is better)")
    ax.grid(True, axis="y", which="both", alpha=0.3)

    ax = panels[5]
    ax.axis("off")
    handles = [Line2D([], [], color=COLORS.get(p, "black"), marker="o", label=p)
               for p in sorted(pools_seen - {"gpu time"}, key=_pool_key)]
    if "gpu time" in pools_seen:
        handles.append(Line2D([], [], color="tab:red", marker="x", label="device-graph: GPU time (CUDA events)"))
    handles += [Line2D([], [], color="black", linestyle=style_of[n], label=f"pool of {n:,} blocks") for n in sizes]
    if not left_out:
        handles.append(Line2D([], [], color="red", marker="*", markersize=12, linestyle="none",
                              label="docs/design.md target (GPU)"))
    ax.legend(handles=handles, loc="upper left", fontsize=10, frameon=False)
    mach = meta["machine"]
    notes = [f"run: {meta['datetime'][:19]}", f"host: {mach.get('cpu', {}).get('brand_raw', mach.get('processor', '?'))}",
             f"python {mach.get('python_version', '?')}", f"device pool on: {dev}"]
    missing = [p for p in POOL_ORDER[:5] if p not in pools_seen]
    if left_out:
        notes.append("Device pool left out: it ran in Triton's CPU\ninterpreter, which says nothing about a GPU.")
    elif missing:
        notes.append("not in this run: " + ", ".join(missing))
    ax.text(0.0, 0.02, "\n".join(notes), transform=ax.transAxes, fontsize=9, va="bottom", family="monospace")
    fig.suptitle(_title(left_out), fontsize=14)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _fmt_us(x) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.1f}" if x < 1e5 else f"{x:,.0f}"


def table(json_path) -> str:
    """A short text table, pools side by side: one line per (op, pool size N, batch) with each pool's
    median microseconds per call (``graph gpu``: the captured graph's CUDA-event GPU time), then
    the replay throughput."""
    rows, _ = load(json_path)
    dev = device_of(rows)
    rows, left_out = comparable(rows)
    ops = [r for r in rows if r["op"] in OPS]
    pools = sorted({r["pool"] for r in ops}, key=_pool_key)
    has_gpu = any(r.get("gpu_us") is not None and r["pool"] == "device-graph" for r in ops)
    cols = pools + (["graph gpu"] if has_gpu else [])
    cells: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in ops:
        c = cells.setdefault((r["op"], r["num_blocks"], r["batch"]), {})
        c[r["pool"]] = r["median_us"]
        if r["pool"] == "device-graph" and r.get("gpu_us") is not None:
            c["graph gpu"] = r["gpu_us"]
    lines = ["median us per call (lower is better)",
             f"{'op':<12} {'N':>8} {'batch':>6} " + " ".join(f"{c:>13}" for c in cols)]
    for (op, n, b) in sorted(cells, key=lambda k: (OPS.index(k[0]), k[1], k[2])):
        c = cells[(op, n, b)]
        lines.append(f"{op:<12} {n:>8} {b:>6} " + " ".join(f"{_fmt_us(c.get(p)):>13}" for p in cols))
    rep = sorted([r for r in rows if r["op"] == "replay"], key=lambda r: _pool_key(r["pool"]))
    if rep:
        lines.append("")
        lines.append(f"{'replay':<12} {'pool':<14} {'requests':>9} {'median s':>10} {'requests/s':>11} {'hit blocks':>10}")
        for r in rep:
            lines.append(f"{'replay':<12} {r['pool']:<14} {r.get('requests', 0):>9} {r['median_s']:>10.3f} "
                         f"{r.get('requests_per_s', 0):>11,.0f} {r.get('hit_blocks', 0):>10}")
    lines.append(f"({left_out})" if left_out else f"(device pool on: {dev})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="pytest-benchmark JSON written with --benchmark-json")
    ap.add_argument("--png", help="write the figure here")
    ap.add_argument("--table", action="store_true", help="print the short table")
    args = ap.parse_args(argv)
    if args.png:
        print(f"wrote {plot(args.json, args.png)}")
    if args.table or not args.png:
        print(table(args.json))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
