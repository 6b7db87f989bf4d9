"""``atb serve``: an OpenAI-compatible HTTP server on the engine loop (see :mod:`.app`).

    from atb_torch.llm.server import build_app, Served, run_server
    app = build_app(lambda: Served(LLM("./my-llama"), "my-llama"))
    run_server(app, host="127.0.0.1", port=8000)
"""

from .app import MAX_BODY_BYTES, Served, ServerState, build_app
from .chat import DEFAULT_CHAT_TEMPLATE
from .embeddings import Embedder
from .runner import load_served, run_server, start_in_thread

__all__ = ["build_app", "Served", "ServerState", "Embedder", "DEFAULT_CHAT_TEMPLATE",
           "MAX_BODY_BYTES", "load_served", "run_server", "start_in_thread"]
