"""``atb generate``: text from a local Hugging Face checkpoint through ``atb_torch.LLM``.

    atb generate --model ./tiny-llama --prompt "Once upon a time" --max-new-tokens 32
    atb generate --model DIR --prompt "a" --prompt "b" --temperature 0.8 --seed 1
    atb generate --model DIR --prompt "Hello" --stream --stats

One prompt prints its text; several print one block each, in order. ``--stream``
prints tokens as they are produced (one prompt).
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="local checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for several: served by continuous batching)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--quantize", choices=("w8",), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--speculative", action="store_true",
                   help="prompt-lookup speculative decoding")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--stream", action="store_true", help="print tokens as they come")
    p.add_argument("--stats", action="store_true",
                   help="print generation statistics (JSON) to stderr")


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from atbcore.errors import AtbError

    try:
        from transformers.utils import logging as hf_logging

        from atb_torch.llm import LLM
    except ImportError as e:
        print(f"atb generate needs the torch front-end and transformers: {e}", file=sys.stderr)
        return 2
    hf_logging.disable_progress_bar()  # the CLI's output is the text (and --stats JSON)
    try:
        llm = LLM(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize,
                  enable_prefix_caching=not args.no_prefix_caching,
                  enable_speculative=args.speculative)
        kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop)
        prompts = args.prompt
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
    if args.stats:
        print(json.dumps(llm.last_stats.as_dict(), indent=2), file=sys.stderr)
    return 0
