"""Presenting ``atb bench`` results: the table rows, the rich table, JSON and the PNG
chart (matplotlib, Agg backend, so no display is needed)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["ROW_FIELDS", "table_rows", "print_table", "write_json", "write_chart"]

# Every row of the table has these keys (None where a number does not apply).
ROW_FIELDS = ("workload", "engine", "throughput", "unit", "speedup", "launches_per_step",
              "peak_memory_bytes", "max_abs_diff", "floor_throughput", "bandwidth_throughput",
              "status")


def _row(workload: str, engine: str, run: dict, unit: str, key: str, base: float | None,
         floor: float | None, bw_floor: float | None = None) -> dict:
    thr = run.get(key)
    ok = run.get("status", "ok") == "ok" and thr is not None
    return {"workload": workload, "engine": engine, "throughput": thr if ok else None,
            "unit": unit,
            "speedup": (thr / base) if ok and base else None,
            "launches_per_step": run.get("launches_per_step"),
            "peak_memory_bytes": run.get("peak_memory_bytes"),
            "max_abs_diff": None if engine == "hf_eager" else  # the reference itself
            run.get("max_abs_logits_diff", run.get("max_abs_diff")),
            "floor_throughput": floor, "bandwidth_throughput": bw_floor,
            "status": run.get("status", "ok")}


def _ordered(runs: dict) -> list[tuple[str, dict]]:
    """The baseline first, atb second, then the extra engines as they came."""
    rank = {"hf_eager": 0, "atb": 1}
    return sorted(runs.items(), key=lambda kv: rank.get(kv[0], 2))


def table_rows(results: dict) -> list[dict]:
    """One row per (workload, engine) of the results dict ``run_bench`` builds."""
    rows: list[dict] = []
    dec = results.get("decoder")
    if dec:
        runs = dec["runs"]
        base = runs["hf_eager"].get("decode_tokens_per_s")
        floor = dec["weight_matmul_floor"]["tokens_per_s"]
        bw = dec["weight_matmul_floor"].get("bandwidth_tokens_per_s")
        for name, run in _ordered(runs):
            rows.append(_row(dec["name"], name, run, "tok/s", "decode_tokens_per_s", base,
                             floor if name == "atb" else None,
                             bw if name == "atb" else None))
    enc = results.get("encoder")
    if enc and enc.get("status") == "ok":
        runs = enc["runs"]
        base = runs["hf_eager"].get("sentences_per_s")
        for name, run in _ordered(runs):
            rows.append(_row(enc["name"], name, run, "sent/s", "sentences_per_s", base, None))
    elif enc:
        rows.append(_row(enc.get("name", "encoder"), "-", {"status": enc.get("status")},
                         "sent/s", "sentences_per_s", None, None))
    return rows


def _fmt(v: Any, kind: str = "") -> str:
    if v is None:
        return "-"
    if kind == "bytes":
        return f"{v / 2**20:.1f} MiB"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "sci":
        return f"{v:.2e}"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"
    return str(v)


def print_table(results: dict, console: Any = None) -> None:
    """The summary table on the terminal (rich)."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    t = Table(title=f"atb bench ({results['config']['dtype']}, batch {results['config']['batch']}, "
                    f"prompt {results['config']['prompt_len']}, {results['config']['new_tokens']} "
                    f"new tokens, {results['env']['threads']} threads; medians)")
    for col in ("workload", "engine", "throughput", "speedup", "launches/step", "peak mem",
                "max |Δ|", "floor: matmul / bandwidth", "status"):
        t.add_column(col, justify="left" if col in ("workload", "engine", "status") else "right")
    for r in results["rows"]:
        unit = r["unit"]
        t.add_row(r["workload"], r["engine"],
                  "-" if r["throughput"] is None else f"{_fmt(r['throughput'])} {unit}",
                  _fmt(r["speedup"], "x"), _fmt(r["launches_per_step"]),
                  _fmt(r["peak_memory_bytes"], "bytes"), _fmt(r["max_abs_diff"], "sci"),
                  "-" if r["floor_throughput"] is None else
                  f"{_fmt(r['floor_throughput'])} / {_fmt(r['bandwidth_throughput'])} {unit}",
                  r["status"])
    con.print(t)
    for note in results.get("notes", []):
        con.print(f"[dim]- {note}[/dim]")


def _clean(v: Any) -> Any:
    """JSON-safe: NaN/inf become None (strict JSON has neither)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def write_json(results: dict, path: str | os.PathLike) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_clean(results), indent=2))
    return p


def write_chart(results: dict, path: str | os.PathLike) -> Path | None:
    """Bar chart of speedups over HF eager per workload (plus the matmul floor as a
    dashed line for decoding). Returns None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results["rows"] if r["speedup"] is not None]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, max(len(workloads), 1), figsize=(5 * max(len(workloads), 1), 4),
                             squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        rs = [r for r in rows if r["workload"] == wl]
        names = [r["engine"] for r in rs]
        vals = [r["speedup"] for r in rs]
        bars = ax.bar(names, vals, color=["#999999" if n == "hf_eager" else "#2a7ab9" for n in names])
        for b, v in zip(bars, vals):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}x", ha="center", va="bottom")
        floor = next((r["floor_throughput"] for r in rs if r["floor_throughput"]), None)
        base = next((r["throughput"] for r in rs if r["engine"] == "hf_eager"), None)
        if floor and base:
            f = floor / base
            if f <= 2 * max(vals):  # on scale: a line; far above the bars: a note
                ax.axhline(f, ls="--", color="#cc4444", label="weight-matmul floor")
                ax.legend(loc="upper left")
            else:
                ax.text(0.02, 0.95, f"weight-matmul floor: {f:.1f}x", transform=ax.transAxes,
                        color="#cc4444", va="top")
        ax.set_title(wl)
        ax.set_ylabel(f"speedup over HF eager ({rs[0]['unit']}, median)")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p
