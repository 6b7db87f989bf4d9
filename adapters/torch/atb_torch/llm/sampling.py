"""Token choice on torch tensors: greedy or seeded top-k/top-p sampling with the
core's ``TopkToppSampling`` semantics, per-request penalties and log-probabilities
(the settings and the seeding rule live in :mod:`atbcore.serving.sampling_config`)."""

from __future__ import annotations

from typing import Sequence

import torch

from atbcore.serving.sampling_config import SamplingConfig, TokenLogprob, step_seed

__all__ = ["SamplingConfig", "select_tokens", "step_seed", "TokenLogprob"]


def _penalize(row: torch.Tensor, cfg: SamplingConfig, prompt: Sequence[int],
              output: Sequence[int]) -> torch.Tensor:
    """``row`` [V] (fp32, a copy) with ``cfg``'s penalties applied."""
    if cfg.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / cfg.repetition_penalty,
                                    vals * cfg.repetition_penalty)
    if output and (cfg.presence_penalty or cfg.frequency_penalty):
        ids, counts = torch.unique(torch.tensor(list(output), dtype=torch.long),
                                   return_counts=True)
        row[ids] -= cfg.presence_penalty + cfg.frequency_penalty * counts.float()
    return row


def _logprob(row: torch.Tensor, token: int, k: int) -> TokenLogprob:
    lp = torch.log_softmax(row, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, ids = torch.topk(lp, k)
        top = tuple((int(i), float(v)) for i, v in zip(ids, vals))
    return TokenLogprob(token, float(lp[token]), top)


def select_tokens(logits: torch.Tensor, cfgs: Sequence[SamplingConfig],
                  keys: Sequence[tuple[int, int]], positions: Sequence[int],
                  histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                  ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token of each row of ``logits`` ``[R, V]``, and its log-probability when
    the row's config asks for it. Row ``i`` belongs to the request with sampling
    ``cfgs[i]``, ``(seed, stream) = keys[i]`` and ``(prompt, output)`` tokens so far
    ``histories[i]`` (needed for penalties), and produces the token at
    ``positions[i]``. Greedy is the argmax (first maximum)."""
    rows = logits.shape[0]
    toks: list[int] = [0] * rows
    lps: list[TokenLogprob | None] = [None] * rows
    plain = [i for i in range(rows) if cfgs[i].plain_greedy]
    if plain:
        sub = logits if len(plain) == rows else logits[plain]
        for i, t in zip(plain, _argmax(sub)):
            toks[i] = t
    for i in (i for i in range(rows) if not cfgs[i].plain_greedy):
        cfg = cfgs[i]
        row = logits[i].float().clone()
        if cfg.penalized:
            prompt, output = histories[i] if histories is not None else ((), ())
            row = _penalize(row, cfg, prompt, output)
        if cfg.greedy:
            toks[i] = int(torch.argmax(row))
        else:
            toks[i] = _sample(row, cfg, step_seed(keys[i][0], keys[i][1], positions[i]))
        if cfg.logprobs is not None:
            lps[i] = _logprob(row, toks[i], cfg.logprobs)
    return toks, lps


def _argmax(logits: torch.Tensor) -> list[int]:
    from atbcore.backends.cpu_kernels.torch_ops import why_not

    if logits.dim() == 2 and why_not(logits) is None:  # CPU: one C call, torch's rule
        from atbcore.backends.cpu_kernels.torch_decode import argmax_rows

        return argmax_rows(logits).tolist()
    return torch.argmax(logits, dim=-1).tolist()


def _sample(row: torch.Tensor, cfg: SamplingConfig, seed: int) -> int:
    from atbcore.operation import Builder

    op = Builder().build_operation("TopkToppSampling", {
        "top_k": cfg.top_k, "top_p": cfg.top_p, "temperature": cfg.temperature, "seed": seed})
    ids, = op.execute([row.view(1, -1)])
    return int(ids[0])
