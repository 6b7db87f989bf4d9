"""The decode plan's attention on an NPU: FlashAttention's device kernel (torch_npu's
``npu_fused_infer_attention_score``) over the whole contiguous cache, each row's
length given as ``seq_lens``, so no slice is copied per step. Elsewhere the plan keeps
its own attention (C kernels on the CPU, SDPA on the cache slice on CUDA)."""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["device_attention"]


def device_attention(plan: Any, blk: Any, q: torch.Tensor,
                     kv: torch.Tensor) -> Callable[[], torch.Tensor] | None:
    """A step function returning the attention ``[B, Q]`` of ``plan``'s query ``q``
    ``[B, H, D]`` over the layer's cache ``kv`` ``[2, B, cap, KV, D]``, or None where
    the device kernel does not take the call (or the device is not an NPU)."""
    from atbcore.backends.npu import kernel_device
    from atbcore.backends.torch.device_kernels import device_kernel_takes

    if kernel_device(plan.runner.device.type) != "npu":
        return None
    s, b, cache, fa = plan.runner.spec, plan.b, plan.cache, blk.fa[True]
    ins = {"q": q.reshape(b, 1, s.q_size), "k": kv[0].view(b, cache.capacity, s.kv_size),
           "v": kv[1].view(b, cache.capacity, s.kv_size),                # BSH
           "mask": None if cache.key_mask is None else cache.key_mask[:, None, None, :],
           # on the host: torch_npu's op takes kv lengths as host ints (no sync per step)
           "seq_lens": torch.ones(b, dtype=torch.long)}
    if not device_kernel_takes("FlashAttention", fa.p, ins):
        return None

    def attend() -> torch.Tensor:
        ins["seq_lens"].fill_(plan.t + 1)
        m = cache.key_mask  # the mask tensor may move                     [B, cap]
        ins["mask"] = None if m is None else m[:, None, None, :]
        return fa(**ins)[0].view(b, s.q_size)
    return attend
