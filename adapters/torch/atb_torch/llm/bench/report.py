"""Presenting ``atb bench`` results: the table rows, the rich table, JSON and the PNG
chart (matplotlib, Agg backend, so no display is needed).

The terminal table is one table per workload with short columns, so it reads whole at
100 columns; the floors, dtype, threads and anything not "ok" go in lines under it. The
JSON keeps every field of every row."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

__all__ = ["ROW_FIELDS", "spread", "table_rows", "print_table", "write_json", "write_chart",
           "chart_figure"]

# Every row of the table has these keys (None where a number does not apply).
ROW_FIELDS = ("workload", "engine", "throughput", "unit", "spread", "speedup",
              "launches_per_step", "peak_memory_bytes", "max_abs_diff", "floor_throughput",
              "bandwidth_throughput", "status")


def spread(times: list[float] | None) -> float | None:
    """Relative spread of timed rounds: (slowest - fastest) / median, or None for
    fewer than two rounds."""
    if not times or len(times) < 2:
        return None
    ts = sorted(times)
    mid = ts[len(ts) // 2] if len(ts) % 2 else (ts[len(ts) // 2 - 1] + ts[len(ts) // 2]) / 2
    return (ts[-1] - ts[0]) / mid if mid > 0 else None


def _row(workload: str, engine: str, run: dict, unit: str, key: str, base: float | None,
         floor: float | None, bw_floor: float | None = None) -> dict:
    thr = run.get(key)
    ok = run.get("status", "ok") == "ok" and thr is not None
    return {"workload": workload, "engine": engine, "throughput": thr if ok else None,
            "unit": unit, "spread": spread(run.get("times_s")) if ok else None,
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


def _subtitle(results: dict) -> str:
    cfg, env = results["config"], results["env"]
    dtype = cfg["dtype"] if cfg.get("atb_dtype") in (None, cfg["dtype"], _LONG.get(cfg["dtype"])) \
        else f"{cfg['dtype']} (atb {cfg['atb_dtype']})"
    quant = f", atb {cfg['quantize']}" if cfg.get("quantize") else ""
    return (f"{dtype}{quant}, batch {cfg['batch']}, prompt {cfg['prompt_len']}, "
            f"{cfg['new_tokens']} new tokens, {env['threads']} threads, medians of "
            f"{cfg.get('repeats') or '?'}")


_LONG = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def print_table(results: dict, console: Any = None) -> None:
    """The summary on the terminal (rich): one table per workload with the columns
    engine, throughput, spread, speed-up over HF eager, launches per step, peak memory
    and max |Δ| against HF; the floors and runs that did not finish as lines under it."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    con.print(f"[bold]atb bench[/bold] ({_subtitle(results)})")
    workloads = list(dict.fromkeys(r["workload"] for r in results["rows"]))
    for wl in workloads:
        rows = [r for r in results["rows"] if r["workload"] == wl]
        unit = rows[0]["unit"]
        t = Table(title=wl, title_justify="left")
        for col in ("engine", unit, "spread", "vs HF", "launches", "peak MiB", "max |Δ|"):
            t.add_column(col, justify="left" if col == "engine" else "right", no_wrap=True)
        for r in rows:
            if r["throughput"] is None:
                continue
            t.add_row(r["engine"], _fmt(r["throughput"]),
                      "-" if r["spread"] is None else f"±{50 * r['spread']:.0f}%",
                      _fmt(r["speedup"], "x"), _fmt(r["launches_per_step"]),
                      "-" if r["peak_memory_bytes"] is None else
                      f"{r['peak_memory_bytes'] / 2**20:.1f}", _fmt(r["max_abs_diff"], "sci"))
        con.print(t)
        for r in rows:
            if r["floor_throughput"] is not None:
                con.print(f"  floors ({r['engine']}): matmuls {_fmt(r['floor_throughput'])}, "
                          f"bandwidth {_fmt(r['bandwidth_throughput'])} {unit}"
                          f"{_read_note(results)}{_above(r)}")
            if r["throughput"] is None or r["status"] != "ok":
                con.print(f"  {r['engine']}: {r['status']}")
    for note in results.get("notes", []):
        con.print(f"[dim]- {note}[/dim]")


def _above(r: dict) -> str:
    bw, thr = r.get("bandwidth_throughput"), r.get("throughput")
    if bw and thr and thr > bw:  # only possible when the weights are partly served by L3
        return "; above the bandwidth floor: weights partly in cache"
    return ""


def _read_note(results: dict) -> str:
    f = (results.get("decoder") or {}).get("weight_matmul_floor") or {}
    if not f.get("read_gbps"):
        return ""
    size = f" over {f['read_bytes'] / 2**30:.0f} GiB" if f.get("read_bytes") else ""
    return f" (read {f['read_gbps']:.1f} GB/s{size})"


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
    """Save :func:`chart_figure` as a PNG at ``path``; None without matplotlib."""
    fig = chart_figure(results)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=100)
    plt.close(fig)
    return p


def chart_figure(results: dict) -> Any:
    """Bar chart per workload of absolute throughput (tok/s or sent/s, median) with the
    fastest-slowest range of the timed rounds as error bars, each bar labelled with its
    value and its speed-up over HF eager, the decoder's two floors as dashed lines, and
    dtype, batch, threads and repeats in the title (a matplotlib Figure, Agg backend).
    Returns None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in results["rows"] if r["throughput"] is not None]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    n = max(len(workloads), 1)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.6), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        rs = [r for r in rows if r["workload"] == wl]
        unit = rs[0]["unit"]
        names = [r["engine"] for r in rs]
        vals = [r["throughput"] for r in rs]
        lo, hi = zip(*(_range(results, r) for r in rs))
        err = [[v - a for v, a in zip(vals, lo)], [b - v for v, b in zip(vals, hi)]]
        bars = ax.bar(names, vals, yerr=err, capsize=4,
                      color=["#999999" if e == "hf_eager" else "#2a7ab9" for e in names])
        for b, r, top in zip(bars, rs, hi):
            label = f"{_fmt(r['throughput'])} {unit}"
            if r["speedup"] is not None and r["engine"] != "hf_eager":
                label += f"\n{r['speedup']:.2f}x HF"
            ax.text(b.get_x() + b.get_width() / 2, top, label, ha="center", va="bottom",
                    fontsize=9, bbox=dict(facecolor="white", edgecolor="none", pad=1))
        ymax = max(hi) * 1.3
        for key, style, what in (("floor_throughput", ":", "weight-matmul floor"),
                                 ("bandwidth_throughput", "--", "bandwidth floor")):
            f = next((r[key] for r in rs if r.get(key)), None)
            if f:
                ax.axhline(f, ls=style, color="#cc4444", label=f"{what}: {_fmt(f)} {unit}")
                ymax = max(ymax, f * 1.15)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper left", fontsize=8)
        ax.set_ylim(0, ymax)
        ax.set_title(wl)
        ax.set_ylabel(f"{unit} (median; bars: fastest-slowest round)")
    fig.suptitle(f"atb bench: {_subtitle(results)}", fontsize=10)
    fig.tight_layout()
    return fig


def _range(results: dict, row: dict) -> tuple[float, float]:
    """Slowest and fastest throughput of a row's timed rounds (throughput is inversely
    proportional to a round's time, scaled so the median round gives the median)."""
    thr, sp = row["throughput"], row.get("spread")
    section = results.get("decoder" if row["unit"] == "tok/s" else "encoder") or {}
    times = ((section.get("runs") or {}).get(row["engine"]) or {}).get("times_s")
    if not times or sp is None:
        return thr, thr
    ts = sorted(times)
    mid = ts[len(ts) // 2] if len(ts) % 2 else (ts[len(ts) // 2 - 1] + ts[len(ts) // 2]) / 2
    return thr * mid / ts[-1], thr * mid / ts[0]
