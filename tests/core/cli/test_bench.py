"""`atb bench --quick`: runs end to end with small settings; its JSON has every field
and the numbers are finite and sane (no speed target: speed is never asserted)."""

import json
import math

import pytest

from atbcore.cli.main import main

RUN_FIELDS = {"status", "tokens_per_s", "decode_tokens_per_s", "prefill_s", "decode_s", "times_s",
              "launches_per_step", "aten_ops_per_step", "aten_views_per_step", "resident_bytes",
              "transient_peak_bytes", "peak_memory_bytes"}
ENC_FIELDS = {"status", "sentences_per_s", "times_s", "max_abs_diff", "cosine_min",
              "launches_per_step", "aten_ops_per_step", "resident_bytes", "transient_peak_bytes",
              "peak_memory_bytes"}


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    assert main(["bench", "--quick", "--prompt-len", "12", "--new-tokens", "4", "--repeats", "1",
                 "--sentences", "12", "--no-progress", "--out", str(out)]) == 0
    return json.loads(out.read_text()), out


def test_bench_json_has_every_field(results):
    res, out = results
    assert set(res) >= {"env", "config", "notes", "decoder", "encoder", "rows", "elapsed_s"}
    assert res["env"]["threads"] >= 1 and res["env"]["torch"]
    cfg = res["config"]
    assert (cfg["prompt_len"], cfg["new_tokens"], cfg["batch"], cfg["dtype"]) == (12, 4, 1, "fp32")
    dec = res["decoder"]
    assert set(dec) >= {"name", "params", "runs", "speedup", "decode_speedup", "launch_ratio",
                        "max_abs_logits_diff", "weight_matmul_floor", "floor_fraction"}
    assert dec["params"] == 54_927_872  # the embedded default: hidden 512, 8 layers, vocab 32000
    for name in ("hf_eager", "atb"):
        run = dec["runs"][name]
        assert set(run) >= RUN_FIELDS, name
        assert all(finite(run[k]) and run[k] > 0 for k in RUN_FIELDS - {"status", "times_s"})
        assert len(run["times_s"]) == 1
    atb = dec["runs"]["atb"]
    assert set(atb) >= {"max_abs_logits_diff", "logits_cosine_min", "tokens_match", "compile_s"}
    floor = dec["weight_matmul_floor"]
    assert all(finite(floor[k]) and floor[k] > 0 for k in ("seconds", "bytes", "gbps",
                                                           "tokens_per_s", "read_gbps",
                                                           "bandwidth_tokens_per_s"))
    assert floor["bytes"] == 4 * (54_927_872 - 32000 * 512 - 17 * 512)  # fp32 matmul weights
    assert out.with_suffix(".png").stat().st_size > 1000


def test_bench_numbers_are_sane(results):
    res, _ = results
    dec = res["decoder"]
    runs = dec["runs"]
    assert dec["speedup"] > 0 and dec["decode_speedup"] > 0
    # fp32 atb against fp32 HF on the same weights: close logits, the same greedy tokens
    assert dec["max_abs_logits_diff"] < 1e-3 and runs["atb"]["logits_cosine_min"] > 0.99999
    assert runs["atb"]["tokens_match"] is True
    assert runs["hf_eager"]["launches_per_step"] > 200  # HF's decode step: ~300 aten ops
    assert 0 < dec["launch_ratio"] < 1
    assert runs["hf_eager"]["resident_bytes"] >= 4 * 54_927_872
    assert dec["floor_fraction"] > 0
    enc = res["encoder"]
    if enc["status"] == "ok":
        for name in ("hf_eager", "atb"):
            assert set(enc["runs"][name]) >= ENC_FIELDS
            assert finite(enc["runs"][name]["sentences_per_s"])
        assert enc["cosine_min"] > 0.99999 and enc["speedup"] > 0
        assert "onnxruntime" in enc["runs"]  # timed, or why not ("not installed")
    rows = res["rows"]
    assert {(r["engine"]) for r in rows} >= {"hf_eager", "atb"}
    assert all(set(r) >= {"workload", "engine", "throughput", "speedup", "launches_per_step",
                          "peak_memory_bytes", "max_abs_diff", "floor_throughput",
                          "bandwidth_throughput", "status"}
               for r in rows)


def test_bench_table_reads_whole_at_100_columns(results):
    """No cell is cut to an ellipsis and no line is wider than the terminal; every
    engine's throughput is printed; the JSON rows keep every field."""
    from rich.console import Console

    from atb_torch.llm.bench.report import ROW_FIELDS, _fmt, print_table, spread

    res, _ = results
    con = Console(width=100, record=True, color_system=None)
    print_table(res, con)
    text = con.export_text()
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= 100
    for r in res["rows"]:
        assert set(r) >= set(ROW_FIELDS)
        if r["throughput"] is not None:
            assert any(line.startswith(f"│ {r['engine']} ") and f" {_fmt(r['throughput'])} "
                       in line for line in text.splitlines()), r
    dec = res["decoder"]
    atb_row = next(r for r in res["rows"] if r["engine"] == "atb" and r["unit"] == "tok/s")
    assert atb_row["spread"] == spread(dec["runs"]["atb"]["times_s"])  # None: one round here
    floor = dec["weight_matmul_floor"]
    assert floor["read_bytes"] >= 2**30 and floor["read_threads"] >= 1
    assert f"read {floor['read_gbps']:.1f} GB/s over 1 GiB" in text
    assert f"{res['config']['dtype']}, batch 1" in text and f"{res['env']['threads']} threads" in text


def test_spread_of_timed_rounds():
    from atb_torch.llm.bench.report import spread

    assert spread([2.0, 1.0, 4.0]) == (4.0 - 1.0) / 2.0
    assert spread([1.0, 3.0]) == (3.0 - 1.0) / 2.0
    assert spread([1.0]) is None and spread(None) is None


def test_bench_chart_shows_absolute_figures_dtype_threads_and_floors(results):
    import matplotlib.pyplot as plt

    from atb_torch.llm.bench.report import _fmt, chart_figure

    res, _ = results
    fig = chart_figure(res)
    try:
        assert f"{res['config']['dtype']}, batch 1" in fig._suptitle.get_text()
        assert f"{res['env']['threads']} threads" in fig._suptitle.get_text()
        dec_ax = next(ax for ax in fig.axes if ax.get_title() == res["decoder"]["name"])
        labels = [t.get_text() for t in dec_ax.texts]
        for r in res["rows"]:
            if r["unit"] == "tok/s" and r["throughput"] is not None:
                assert any(lab.startswith(f"{_fmt(r['throughput'])} tok/s") for lab in labels)
        atb_row = next(r for r in res["rows"] if r["engine"] == "atb" and r["unit"] == "tok/s")
        assert any(f"{atb_row['speedup']:.2f}x HF" in lab for lab in labels)
        legend = [t.get_text() for t in dec_ax.get_legend().get_texts()]
        assert legend == [f"weight-matmul floor: {_fmt(atb_row['floor_throughput'])} tok/s",
                          f"bandwidth floor: {_fmt(atb_row['bandwidth_throughput'])} tok/s"]
        assert dec_ax.get_ylabel().startswith("tok/s")
    finally:
        plt.close(fig)
