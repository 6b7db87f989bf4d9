"""``atb_torch.LLM``'s engine: the core serving engine
(:class:`atbcore.serving.engine.Engine`: continuous batching, prefix caching,
preemption, prompt-lookup speculation, per-request sampling, error isolation), as
MindSpore's and Paddle's ``LLM`` run it, over the core lowered decoder
(:func:`core_runner`: every architecture, dtype and quantization ``compile()`` lowers,
on the CPU, CUDA or NPU kernels; host token selection). :class:`Engine` is that engine
choosing tokens with torch (:func:`.sampling.select_tokens`: the same rules as the
host's), the base of the tensor-parallel engine."""

from __future__ import annotations

from typing import Any

import torch

from atbcore.errors import InputError
from atbcore.serving.engine import Engine as CoreEngine

from .request import Request, SpecConfig
from .sampling import select_tokens

__all__ = ["Request", "Engine", "SpecConfig", "core_runner"]


def core_runner(hf: Any, device: torch.device, dtype: torch.dtype | None,
                quantize: str | None, opt_level: int = 2) -> Any:
    """``hf`` on the core engine: a :class:`~..models.core_runner.CoreRunner` whose
    lowered GraphOp keeps each sequence's last token. InputError for a model that is
    not a causal LM; CapabilityError (naming it) for a decoder the core cannot lower."""
    from ..models.arch import resolve_architecture
    from ..models.core_runner import CoreRunner

    arch = resolve_architecture(hf.config)
    spec = arch.describe(hf.config)
    if spec.kind != "decoder":
        raise InputError("LLM", "model", "a causal LM (decoder with an LM head)", spec.arch)
    weights = arch.extract(hf, spec)  # once: it can move parameters onto huge pages
    if weights.lm_head is None:
        raise InputError("LLM", "model", "a causal LM (decoder with an LM head)",
                         f"{spec.arch} without an LM head")
    return CoreRunner(spec, weights, opt_level=opt_level, dtype=dtype, quantize=quantize,
                      device=device)


class Engine(CoreEngine):
    """The core engine selecting tokens with torch (logits as torch tensors)."""

    select = staticmethod(select_tokens)
