"""Token choice on host (NumPy) logits, the same rules as ``atb_torch``'s: greedy is
the argmax (first maximum); sampling runs the core ``TopkToppSampling`` op with the
per-token seed of :func:`~.sampling_config.step_seed`; penalties and
log-probabilities as :mod:`.sampling_config` defines them."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .sampling_config import SamplingConfig, TokenLogprob, step_seed

__all__ = ["select_tokens"]


def _penalize(row: np.ndarray, cfg: SamplingConfig, prompt: Sequence[int],
              output: Sequence[int]) -> np.ndarray:
    """``row`` [V] (fp32, a copy) with ``cfg``'s penalties applied."""
    if cfg.repetition_penalty != 1.0:
        seen = np.array(sorted(set(prompt) | set(output)), dtype=np.int64)
        if seen.size:
            vals = row[seen]
            row[seen] = np.where(vals > 0, vals / np.float32(cfg.repetition_penalty),
                                 vals * np.float32(cfg.repetition_penalty))
    if output and (cfg.presence_penalty or cfg.frequency_penalty):
        ids, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
        row[ids] -= np.float32(cfg.presence_penalty) + \
            np.float32(cfg.frequency_penalty) * counts.astype(np.float32)
    return row


def _logprob(row: np.ndarray, token: int, k: int) -> TokenLogprob:
    shifted = row.astype(np.float64) - row.max()
    lp = (shifted - np.log(np.exp(shifted).sum())).astype(np.float32)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        ids = np.argsort(-lp, kind="stable")[:k]
        top = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprob(token, float(lp[token]), top)


def _sample(row: np.ndarray, cfg: SamplingConfig, seed: int) -> int:
    from ..operation import Builder

    op = Builder().build_operation("TopkToppSampling", {
        "top_k": cfg.top_k, "top_p": cfg.top_p, "temperature": cfg.temperature, "seed": seed})
    ids, = op.execute([np.ascontiguousarray(row.reshape(1, -1))])
    return int(np.asarray(ids).reshape(-1)[0])


def select_tokens(logits: np.ndarray, cfgs: Sequence[SamplingConfig],
                  keys: Sequence[tuple[int, int]], positions: Sequence[int],
                  histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
                  ) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token of each row of ``logits`` ``[R, V]`` (see
    ``atb_torch.llm.sampling.select_tokens``: the same arguments and results)."""
    rows = logits.shape[0]
    toks: list[int] = [0] * rows
    lps: list[TokenLogprob | None] = [None] * rows
    for i in range(rows):
        cfg = cfgs[i]
        if cfg.plain_greedy:
            toks[i] = int(np.argmax(logits[i]))
            continue
        row = np.array(logits[i], dtype=np.float32)
        if cfg.penalized:
            prompt, output = histories[i] if histories is not None else ((), ())
            row = _penalize(row, cfg, prompt, output)
        if cfg.greedy:
            toks[i] = int(np.argmax(row))
        else:
            toks[i] = _sample(row, cfg, step_seed(keys[i][0], keys[i][1], positions[i]))
        if cfg.logprobs is not None:
            lps[i] = _logprob(row, toks[i], cfg.logprobs)
    return toks, lps
