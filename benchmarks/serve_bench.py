"""Serving benchmark (not a test): ``atb serve`` against the same model behind a simple
loop server on Hugging Face ``generate``, at 1, 8 and 32 concurrent streaming clients.

Both servers speak the same OpenAI ``/v1/completions`` streaming API and serve the
embedded default model (seeded random weights, MiniLM's WordPiece tokenizer):

* ``atb``      — ``atb serve``'s app: continuous batching over the paged KV cache.
* ``hf_loop``  — one worker thread takes requests in arrival order and runs HF eager
  ``generate`` on each alone, streaming tokens through a ``BaseStreamer`` (what a
  minimal "put a model behind HTTP" server does).
* ``llama.cpp`` — its server (``llama-cpp-python[server]``) when installed; it is
  skipped with a note otherwise (it needs a GGUF export of the model as well).

Each server runs in a subprocess of its own (its own GIL); the clients are asyncio
``httpx`` streams in this process. Levels alternate between the servers (interleaved
rounds) and medians over rounds are reported: requests/s, generated tokens/s, time to
first token (TTFT, p50/p90) and inter-token latency (ITL, p50/p90). Every request
asks for exactly ``--max-tokens`` greedy tokens (end-of-sequence ignored), so both
servers do the same work.

    python benchmarks/serve_bench.py [--levels 1,8,32] [--rounds 3] [--max-tokens 32] \
        [--out bench-results/serve.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from starlette.requests import Request  # module level: FastAPI reads the annotation by name

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT / "adapters" / "torch", ROOT):
    sys.path.insert(0, str(p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

WORDS = ("the of and to in is was for on that with as by at from model fast kernel memory "
         "token layer attention graph cache batch vector weight sentence language").split()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- servers
def hf_loop_app(model, tok):  # noqa: ANN001, ANN201
    """A minimal OpenAI-style streaming server: one worker, one request at a time."""
    import queue
    import threading

    import torch
    from fastapi import FastAPI
    from starlette.responses import StreamingResponse
    from transformers.generation.streamers import BaseStreamer

    jobs: queue.Queue = queue.Queue()

    class Sink(BaseStreamer):
        def __init__(self, loop, q):  # noqa: ANN001
            self.loop, self.q, self.skip = loop, q, 1  # generate puts the prompt first

        def put(self, value):  # noqa: ANN001
            if self.skip:
                self.skip = 0
                return
            self.loop.call_soon_threadsafe(self.q.put_nowait, value.view(-1).tolist())

        def end(self):
            self.loop.call_soon_threadsafe(self.q.put_nowait, None)

    def worker() -> None:
        while True:
            ids, n, sink = jobs.get()
            x = torch.tensor([ids])
            with torch.inference_mode():
                model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, streamer=sink)

    threading.Thread(target=worker, daemon=True).start()
    app = FastAPI()

    @app.get("/health")
    async def health():  # noqa: ANN202
        return {"status": "ok"}

    @app.post("/v1/completions")
    async def completions(request: Request):  # noqa: ANN202
        body = await request.json()
        ids = tok(body["prompt"]).input_ids
        q: asyncio.Queue = asyncio.Queue()
        jobs.put((ids, int(body["max_tokens"]), Sink(asyncio.get_running_loop(), q)))

        async def events():  # noqa: ANN202
            while (toks := await q.get()) is not None:
                text = tok.decode(toks, skip_special_tokens=True)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": text}]}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def serve(kind: str, port: int, max_batch: int, threads: int) -> None:
    """Run one server in this (sub)process until killed."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    from atb_torch.llm.bench.models import build_default_model, default_tokenizer
    from atb_torch.llm.server import build_app, load_served, run_server

    if kind == "atb":
        app = build_app(lambda: load_served(None, embedding_model=None,
                                            max_batch_size=max_batch), max_queue=4096)
    else:
        tok = default_tokenizer()
        app = hf_loop_app(build_default_model(0, tokenizer=tok).eval(), tok)
    run_server(app, "127.0.0.1", port, log_level="error")


def start(kind: str, port: int, max_batch: int, threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port),
                             "--max-batch", str(max_batch), "--threads", str(threads)])
    import httpx

    t0 = time.monotonic()
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - t0 > 300:
            raise RuntimeError(f"{kind} server did not start")
        time.sleep(0.25)


# ---------------------------------------------------------------------- clients
async def one_request(client, url: str, prompt: str, n: int) -> dict:  # noqa: ANN001
    body = {"model": "atb-default", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "gaps": [b - a for a, b in zip(stamps, stamps[1:])],
            "end": stamps[-1]}


async def level(port: int, clients: int, per_client: int, n: int, seed: int) -> dict:
    import httpx

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))
               for _ in range(clients * per_client)]
    url = f"http://127.0.0.1:{port}/v1/completions"
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def worker(i: int) -> list[dict]:
            return [await one_request(client, url, prompts[i * per_client + k], n)
                    for k in range(per_client)]

        t0 = time.perf_counter()
        done = await asyncio.gather(*(worker(i) for i in range(clients)))
        wall = time.perf_counter() - t0
    res = [r for rs in done for r in rs]
    gaps = sorted(g for r in res for g in r["gaps"])
    ttft = sorted(r["ttft"] for r in res)

    def q(v: list[float], p: float) -> float:
        return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")

    return {"requests_per_s": len(res) / wall, "tokens_per_s": len(res) * n / wall,
            "ttft_p50_s": q(ttft, 0.5), "ttft_p90_s": q(ttft, 0.9),
            "itl_p50_s": q(gaps, 0.5), "itl_p90_s": q(gaps, 0.9), "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--per-client", type=int, default=2, help="requests per client per round")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=32, help="atb's max batch size")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads of both servers (0: torch's default). On a machine "
                    "whose cores are busy with other work, OpenMP's spinning barriers make "
                    "2+ threads far slower than 1: give both servers 1 there")
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve", choices=("atb", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve, args.port, args.max_batch, args.threads)
        return 0
    levels = [int(x) for x in args.levels.split(",")]
    ports = {"atb": 18431, "hf_loop": 18432}
    procs = {}
    try:
        for name, kind in (("atb", "atb"), ("hf_loop", "hf")):
            log(f"starting {name}")
            procs[name] = start(kind, ports[name], args.max_batch, args.threads)
        runs: dict = {name: {c: [] for c in levels} for name in ports}
        for rnd in range(args.rounds + 1):  # round 0 warms both up and is dropped
            for c in levels:
                for name in (("atb", "hf_loop") if rnd % 2 else ("hf_loop", "atb")):
                    r = asyncio.run(level(ports[name], c, args.per_client, args.max_tokens,
                                          seed=rnd * 100 + c))
                    log(f"round {rnd} {name:8s} clients={c:3d} {r['tokens_per_s']:8.1f} tok/s "
                        f"ttft50 {r['ttft_p50_s'] * 1e3:7.1f} ms itl50 "
                        f"{r['itl_p50_s'] * 1e3:6.1f} ms")
                    if rnd:
                        runs[name][c].append(r)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)
    out: dict = {"max_tokens": args.max_tokens, "per_client": args.per_client,
                 "rounds": args.rounds, "cpu_count": os.cpu_count(),
                 "threads": args.threads or "torch default", "results": {}}
    for name in ports:
        out["results"][name] = {str(c): {k: statistics.median(r[k] for r in rs)
                                         for k in rs[0]} for c, rs in runs[name].items()}
    for c in levels:
        a, h = out["results"]["atb"][str(c)], out["results"]["hf_loop"][str(c)]
        out["results"].setdefault("atb_over_hf_loop", {})[str(c)] = {
            "tokens_per_s": a["tokens_per_s"] / h["tokens_per_s"],
            "ttft_p50": a["ttft_p50_s"] / h["ttft_p50_s"]}
    try:
        import llama_cpp  # noqa: F401
        out["results"]["llama.cpp"] = {"status": "installed, but this benchmark needs a GGUF "
                                       "export of the default model; not run"}
    except ImportError:
        out["results"]["llama.cpp"] = {"status": "not installed (pip install "
                                       "'llama-cpp-python[server]'); not run"}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
