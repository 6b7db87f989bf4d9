"""``atb_torch.LLM``'s engine: the core serving engine
(:class:`atbcore.serving.engine.Engine`: continuous batching, prefix caching,
preemption, prompt-lookup speculation, per-request sampling, error isolation), as
MindSpore's and Paddle's ``LLM`` run it. On the CPU it runs the core lowered decoder
(:func:`core_runner`: every architecture, dtype and quantization ``compile()`` lowers;
host token selection); elsewhere (and with ``ATB_ENGINE=runner``, for side-by-side
benchmarks) the hand-written runner's ``forward_paged`` with torch token selection
(:class:`Engine`, :func:`.sampling.select_tokens`: the same rules as the host's)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from atbcore.serving.engine import Engine as CoreEngine

from .request import Request, SpecConfig
from .sampling import select_tokens

__all__ = ["Request", "Engine", "SpecConfig", "core_runner"]


def core_runner(hf: Any, device: torch.device, dtype: torch.dtype | None,
                quantize: str | None, opt_level: int = 2) -> Any:
    """``hf`` on the core engine (a :class:`~..models.core_runner.CoreRunner`, whose
    lowered GraphOp keeps each sequence's last token) when the core serves it on
    ``device``, else None (the runner serves it)."""
    import os

    from ..models.arch import resolve_architecture
    from ..models.core_runner import CoreRunner, why_not_core

    if os.environ.get("ATB_ENGINE") == "runner":
        return None
    arch = resolve_architecture(hf.config)
    spec = arch.describe(hf.config)
    if why_not_core(spec, quantize):
        return None
    weights = arch.extract(hf, spec)  # once: it can move parameters onto huge pages
    if weights.lm_head is None:
        return None
    return CoreRunner(spec, weights, opt_level=opt_level, dtype=dtype, quantize=quantize,
                      device=device)


class Engine(CoreEngine):
    """The core engine over ``runner.forward_paged`` (token ids as a torch tensor on
    the runner's device), selecting tokens with torch."""

    select = staticmethod(select_tokens)

    def __init__(self, runner: Any, cache: Any, max_batch_size: int = 32,
                 max_prefill_tokens: int = 4096, max_model_len: int | None = None,
                 spec: SpecConfig | None = None,
                 on_step: Callable[[str, int, int], None] | None = None) -> None:
        super().__init__(_TorchIds(runner), cache, max_batch_size, max_prefill_tokens,
                         max_model_len, spec, on_step)
        self.runner, self.device = runner, runner.device


class _TorchIds:
    """``runner`` taking the engine's token id lists as a torch tensor."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.parked = getattr(runner, "parked", None)

    def forward_paged(self, ids: list[int], batch: Any, cache: Any,
                      all_logits: bool = False) -> torch.Tensor:
        x = torch.tensor(ids, dtype=torch.long, device=self.runner.device)
        return self.runner.forward_paged(x, batch, cache, all_logits=all_logits)
