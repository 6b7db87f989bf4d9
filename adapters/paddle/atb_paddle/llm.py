"""``atb_paddle.LLM``: a local Hugging Face checkpoint served with Paddle
tensors on the core plan (see :mod:`atbcore.serving.host_llm`).

    import atb_paddle as atb
    llm = atb.LLM("path/to/checkpoint")
    llm.generate(["Hello", "Once upon a time"], max_new_tokens=16)

Weights are read from safetensors into NumPy (memory-mapped) and reach Paddle
through the bridge; no torch is imported."""

from __future__ import annotations

from atbcore.serving.host_llm import HostLLM

__all__ = ["LLM"]


class LLM(HostLLM):
    """:class:`~atbcore.serving.host_llm.HostLLM` on the Paddle backend."""

    framework = "paddle"
