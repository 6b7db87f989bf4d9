"""``atb_torch.LLM``'s engine: the core serving engine
(:class:`atbcore.serving.engine.Engine`: continuous batching, prefix caching,
preemption, prompt-lookup speculation, per-request sampling, error isolation), as
MindSpore's and Paddle's ``LLM`` run it: on the runner with torch token selection
(:class:`Engine`, :func:`.sampling.select_tokens`: the same rules as the host's), or
with ``LLM(core_plan=True)`` on the core lowered decoder (:func:`core_decoder`: CPU,
unquantized fp32 models of the architectures ``decoder_layers`` covers; host token
selection). The runner stays the default while the core decoder's paged prefill is
slower than the runner's (``benchmarks/serve_engines.py``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from atbcore.serving.engine import Engine as CoreEngine

from .request import Request, SpecConfig
from .sampling import select_tokens

__all__ = ["Request", "Engine", "SpecConfig", "core_decoder"]


def core_decoder(hf: Any, device: torch.device, dtype: torch.dtype | None,
                 quantize: str | None) -> Any:
    """``hf`` lowered to the core decoder (a GraphOp keeping each sequence's last
    token) when the core plan serves it, else None (the runner serves it)."""
    from atbcore.errors import CapabilityError

    from ..models.lower import lower_decoder

    weight = next(hf.parameters(), None)
    if device.type != "cpu" or quantize is not None or weight is None or \
            weight.dtype != torch.float32 or dtype not in (None, torch.float32):
        return None
    try:
        return lower_decoder(hf, last_token=True)
    except CapabilityError:
        return None


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
