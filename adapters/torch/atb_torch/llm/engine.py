"""``atb_torch.LLM``'s engine: the core serving engine
(:class:`atbcore.serving.engine.Engine`: continuous batching, prefix caching,
preemption, prompt-lookup speculation, per-request sampling, error isolation) on the
compiled model's runner, its tokens chosen on torch logits
(:func:`.sampling.select_tokens`, the same rules as the core's host selection)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from atbcore.serving.engine import Engine as CoreEngine

from .request import Request, SpecConfig
from .sampling import select_tokens

__all__ = ["Request", "Engine", "SpecConfig"]


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
