"""Loading what ``atb serve`` serves and running uvicorn: in the foreground (the CLI)
or on a thread of the calling process (tests, the benchmark)."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from .app import Served

__all__ = ["DEFAULT_MODEL_NAME", "load_served", "run_server", "start_in_thread"]

#: The model id of the embedded default decoder.
DEFAULT_MODEL_NAME = "atb-default"


def load_served(model: str | os.PathLike | None = None, *, device: str = "cpu",
                dtype: str | None = None, embedding_model: str | None = "default",
                served_model_name: str | None = None, seed: int = 0,
                **llm_options: Any) -> Served:
    """The LLM of the checkpoint directory ``model`` (default: the embedded decoder
    with MiniLM's WordPiece tokenizer, weights seeded by ``seed``) and the embedder
    (``"default"``: all-MiniLM-L6-v2 from its package; a directory; None: none)."""
    from ..bench.models import build_default_model, default_tokenizer, minilm_path
    from ..llm import LLM

    if model is None:
        tok = default_tokenizer()
        llm = LLM(build_default_model(seed, tokenizer=tok), tokenizer=tok, device=device,
                  dtype=dtype, **llm_options)
        name = served_model_name or DEFAULT_MODEL_NAME
    else:
        llm = LLM(model, device=device, dtype=dtype, **llm_options)
        name = served_model_name or Path(model).resolve().name
    embedder = None
    if embedding_model is not None:
        from .embeddings import Embedder

        path = minilm_path() if embedding_model == "default" else Path(embedding_model)
        if path is not None:
            embedder = Embedder.load(path, "all-MiniLM-L6-v2"
                                     if embedding_model == "default" else None)
    return Served(llm, name, embedder)


def _config(app: Any, host: str, port: int, log_level: str) -> Any:
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5)


def run_server(app: Any, host: str = "127.0.0.1", port: int = 8000,
               log_level: str = "warning") -> None:
    """Serve ``app`` until interrupted (Ctrl-C stops it gracefully)."""
    import uvicorn

    uvicorn.Server(_config(app, host, port, log_level)).run()


def start_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0,
                    ready_timeout: float = 120.0) -> tuple[Any, int, threading.Thread]:
    """Start ``app`` on a daemon thread, on ``port`` (0: a free one); returns
    ``(server, port, thread)`` once it accepts connections. Stop it with
    ``server.should_exit = True; thread.join()``."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    port = sock.getsockname()[1]
    server = uvicorn.Server(_config(app, host, port, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="atb-serve", daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if not thread.is_alive() or time.monotonic() - t0 > ready_timeout:
            raise RuntimeError("atb serve: the server thread did not start")
        time.sleep(0.02)
    return server, port, thread
