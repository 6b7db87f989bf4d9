"""The decode step as a prebuilt plan: a list of bound calls over preallocated buffers.

Built once per (cache, batch, padding) and reused for every step; running a step is
``for call in calls: call()``. Each call is a ``functools.partial`` of one torch op
with its tensors bound, or a small closure where an op reads the current length
(cache slot, attention span) or is an atb kernel returning a fresh tensor (norms,
activations, attention), which is then consumed in the same closure — so a faster
kernel registered for the op later is picked up unchanged. Per layer:

    mm(norm(x), W_qkv_t, out=qkv)                   # RmsNorm kernel + one GEMV (on the
                                                    # CPU one C call: matmul with the
                                                    # RmsNorm of its rows inside)
    RoPE of q|k in place in qkv (3 ops + 1 copy)    # the q and k heads are adjacent
    kv_cache[layer, :, :, t] = qkv[k|v]             # one copy, keys and values (on the
                                                    # CPU one C call: RoPE writing k, v)
    x.addmm_(attention(q, K[:t+1], V[:t+1]), W_o_t) # residual add inside the GEMM (C
                                                    # cache attention on the CPU)
    mm(norm(x), W_gate_up_t, out=gu)
    x.addmm_(act(gu), W_down_t)

On the CPU the steps that use the C matmul run with torch's intra-op pool parked
(:func:`atbcore.backends.cpu_kernels.threads.parked_torch_threads`).

``static=True`` builds the graph-capturable variant: the cache slot and the
attention span come from device tensors (``index_copy_`` into the cache, attention
over the whole capacity with a key mask updated in place), so the step has no
Python-int dependence. At opt 3 on CUDA it is captured once as a CUDA graph and each
step is one ``graph.replay()``; elsewhere opt 3 runs as opt 2 (logged by compile).

    plan = plan_for(runner, cache)        # built or reused (cache.plans)
    logits = plan.step(ids, positions)    # [B, V], the plan's own buffer
    plan.launches                         # declared kernel launches per step

(``atb_torch.llm.bench.measure.count_ops(lambda: plan.step(ids, positions))`` counts
the aten ops a step actually dispatches.)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atbcore.log import logger

from atbcore.backends.cpu_kernels.threads import parked_torch_threads

from .cache import ContiguousKVCache
from .kernels import ROWS_MAX
from .plan_device import device_attention

__all__ = ["DecodePlan", "plan_for"]


def plan_for(runner: Any, cache: ContiguousKVCache) -> "DecodePlan | None":
    """The cache's plan for this step (reserving the slot first), or None when this
    model/config has no decode plan (then the general path runs)."""
    cache.reserve(cache.length + 1)
    static = runner.opt_level >= 3 and runner.device.type == "cuda"
    key = (cache.version, cache.batch, cache.key_mask is not None, static)
    plans = cache.__dict__.setdefault("plans", {})
    if key in plans:
        return plans[key]
    plans.clear()  # storage moved or the batch changed: older plans are stale
    why = DecodePlan.unsupported_reason(runner, static) or (
        "int8 KV cache (the plan binds float cache storage)"
        if getattr(cache, "quantized", False) else "")
    if why:
        logger.debug("compile: no decode plan (%s); general path", why)
        plans[key] = None
        return None
    plan = plans[key] = DecodePlan(runner, cache, static=static)
    runner.stats["plans_built"] += 1
    return plan


class DecodePlan:
    """See the module docstring."""

    @staticmethod
    def unsupported_reason(runner: Any, static: bool) -> str:
        s = runner.spec
        if s.kind != "decoder" or runner.lm_head is None:
            return "not a causal LM"
        if s.rope is not None and s.rope.rotary_dim != s.head_dim:
            return "partial rotary"
        if static and any(w is not None for w in s.windows):
            return "sliding window in a static (graph) plan"
        return ""

    def __init__(self, runner: Any, cache: Any, static: bool = False,
                 batch: int | None = None) -> None:
        self.runner, self.cache, self.static = runner, cache, static
        s = runner.spec
        b, dev, dt = cache.batch if batch is None else batch, runner.device, runner.dtype
        self.b, self.t = b, 0
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)
        self.t_buf = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.empty(b, s.hidden_size, device=dev, dtype=dt)   # the residual stream
        self.logits = torch.empty(b, runner.lm_head.out_features, device=dev, dtype=dt)
        self.calls: list[Callable[[], Any]] = []
        self.launches = 0
        self.parked = False  # True once a C few-row matmul is bound: see step()
        self.c_attn = not static and self._c_attn_reason() == ""
        if static:  # [B, 1, 1, cap]: slots attended (real and already written)
            self.mbuf = torch.zeros(b, 1, 1, cache.capacity, dtype=torch.bool, device=dev)
            n = cache.length
            self.mbuf[:, 0, 0, :n] = True if cache.key_mask is None else cache.key_mask[:, :n]
        self._embed()
        for blk in runner.blocks:
            self._layer(blk)
        self._into(runner.lm_head, runner.final_norm, self.logits)
        self.graph = None
        if static and runner.opt_level >= 3:
            self._capture()

    # ------------------------------------------------------------------ building
    def _c_attn_reason(self) -> str:
        """Why the step's RoPE/cache write/attention cannot run as the C kernels ('' = they can)."""
        from atbcore.backends.cpu_kernels.torch_ops import why_not

        r = self.runner
        probe = torch.empty(0, device=r.device, dtype=r.dtype)
        why = why_not(probe, torch.empty(0, device=r.device, dtype=self._cache_dtype()))
        if why:
            return why
        if not r.opt_level:
            return "opt_level 0"
        if r.spec.head_dim > 512:
            return f"head_dim {r.spec.head_dim} > 512"
        return ""

    def _call(self, fn: Callable[[], Any], launches: int = 1) -> None:
        self.calls.append(fn)
        self.launches += launches

    def _into(self, lin: Any, norm: Any, out: torch.Tensor) -> None:
        """``out = lin(norm(x))``: the norm kernel's fresh output feeds the GEMV."""
        x, n = self.x, norm.launches
        if lin.rows and x.shape[0] <= ROWS_MAX:  # the C few-row matmul, bias (and RmsNorm) inside
            self.parked = True
            call = lin.bound(x, out, norm)  # its arguments packed once (fixed buffers)
            self._call(call or (lambda: lin.into(x, out, norm=norm)), 1 if norm.fusable else n + 1)
        elif lin.mode == "t" and lin.b is None:
            self._call(lambda: torch.mm(norm(x), lin.w, out=out), n + 1)
        elif lin.mode == "t":
            self._call(lambda: torch.addmm(lin.b, norm(x), lin.w, out=out), n + 1)
        else:
            self._call(lambda: out.copy_(lin(norm(x))), n + lin.k.launches + 1)

    def _acc(self, lin: Any, src: Callable[[], torch.Tensor], launches: int,
             src_out: torch.Tensor | None = None) -> None:
        """``x += lin(src())``: the residual add rides in the GEMM (beta = 1).
        ``src_out``: the buffer ``src()`` writes and returns, when it is one; the
        matmul then runs as a prebuilt call on it (checked per step: a ``src`` that
        returned another tensor takes the general call)."""
        x = self.x
        if lin.rows and x.shape[0] <= ROWS_MAX:  # C few-row matmul accumulating into x
            self.parked = True
            call = None if src_out is None else lin.bound(src_out, x, accumulate=True)
            if call is None:
                self._call(lambda: lin.acc(src(), x), launches + 1)
                return
            ptr = src_out.data_ptr()

            def step() -> None:
                r = src()
                if r.data_ptr() == ptr and r.shape == src_out.shape:
                    call()
                else:
                    lin.acc(r, x)
            step.bound = call  # type: ignore[attr-defined]
            self._call(step, launches + 1)
        elif lin.mode == "t" and lin.b is None:
            self._call(lambda: x.addmm_(src(), lin.w), launches + 1)
        elif lin.mode == "t":
            self._call(lambda: x.addmm_(src(), lin.w).add_(lin.b), launches + 2)
        else:
            self._call(lambda: x.add_(lin(src())), launches + lin.k.launches + 1)

    def _embed(self) -> None:
        r = self.runner
        self._call(functools.partial(torch.index_select, r.embed_w, 0, self.ids, out=self.x))
        if r.pos_w is not None:
            pe = torch.empty_like(self.x)
            self._call(functools.partial(torch.index_select, r.pos_w, 0, self.pos, out=pe))
            self._call(functools.partial(self.x.add_, pe))
        if r.spec.rope is not None:
            cos, sin = r.rope_tables(self._positions())
            rd = r.spec.rope.rotary_dim
            self.cos = torch.empty(self.b, 1, rd, device=r.device)       # [B, 1, rd] fp32
            self.sin = torch.empty(self.b, 1, rd, device=r.device)
            c2, s2 = self.cos.view(self.b, rd), self.sin.view(self.b, rd)
            self._call(functools.partial(torch.index_select, cos, 0, self.pos, out=c2))
            self._call(functools.partial(torch.index_select, sin, 0, self.pos, out=s2))

    def _positions(self) -> int:
        """How many positions the step's RoPE tables cover."""
        return self.cache.capacity + 1

    def _cache_dtype(self) -> torch.dtype:
        return self.cache.dtype

    def _rope(self, qk: torch.Tensor) -> None:
        """Rotate-half RoPE of ``qk`` [B, n, D] in place, via an fp32 copy of it
        (half types round once, on the copy back)."""
        h2 = qk.shape[-1] // 2
        cos, sin = self.cos, self.sin
        tmp = torch.empty(qk.shape, device=qk.device)
        out = qk if qk.dtype == torch.float32 else torch.empty(qk.shape, device=qk.device)
        self._call(functools.partial(tmp.copy_, qk))
        self._call(functools.partial(torch.mul, tmp, cos, out=out))
        self._call(functools.partial(out[..., :h2].addcmul_, tmp[..., h2:], sin[..., :h2],
                                     value=-1.0))
        self._call(functools.partial(out[..., h2:].addcmul_, tmp[..., :h2], sin[..., h2:]))
        if out is not qk:
            self._call(functools.partial(qk.copy_, out))

    def _layer(self, blk: Any) -> None:
        s, b, r = self.runner.spec, self.b, self.runner
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        qkv = torch.empty(b, s.q_size + 2 * s.kv_size, device=r.device, dtype=r.dtype)
        self._into(blk.qkv, blk.attn_norm, qkv)
        q = qkv[:, :s.q_size].view(b, nh, hd)
        k = qkv[:, s.q_size:s.q_size + s.kv_size].view(b, nkv, hd)
        if blk.q_norm is not None:  # per-head RmsNorm before RoPE (Qwen3)
            self._call(lambda: q.copy_(blk.q_norm(q)), blk.q_norm.launches + 1)
            self._call(lambda: k.copy_(blk.k_norm(k)), blk.k_norm.launches + 1)
        self._attend_layer(blk, qkv)
        mlp = blk
        if mlp.router is not None:
            self._moe(blk)
            return
        inter = s.intermediate_size
        if mlp.gate_up is not None:
            gu = torch.empty(b, 2 * inter, device=r.device, dtype=r.dtype)
            self._into(mlp.gate_up, blk.mlp_norm, gu)
        else:
            gu = torch.empty(b, inter, device=r.device, dtype=r.dtype)
            self._into(mlp.up, blk.mlp_norm, gu)
        act = mlp.act
        a = (torch.empty(b, inter, device=r.device, dtype=r.dtype)  # the merged gated
             if act.gated and not act.split else None)             # kernel writes into it
        self._acc(mlp.down, lambda: act(gu, out=a), act.k.launches if act.k is not None else 3, a)

    def _attend_layer(self, blk: Any, qkv: torch.Tensor) -> None:
        """RoPE of the step's q/k in ``qkv``, its k/v into the cache, and ``x +=
        o(attention)``."""
        kv = self.cache.layer(blk.idx)                                   # [2, B, cap, KV, D]
        if self.c_attn:  # C kernels: RoPE writing the cache slot, then cache attention
            self._c_layer_attention(blk, qkv, kv)
        else:
            self._torch_layer_attention(blk, qkv, kv)

    def _torch_layer_attention(self, blk: Any, qkv: torch.Tensor, kv: torch.Tensor) -> None:
        """RoPE, cache write and attention with torch ops (and the RoPE op's kernel)."""
        s, b = self.runner.spec, self.b
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        q = qkv[:, :s.q_size].view(b, nh, hd)
        self._rope_step(blk, qkv)
        new_kv = qkv[:, s.q_size:].view(b, 2, nkv, hd).transpose(0, 1)  # [2, B, KV, D]
        if self.static:
            self._call(functools.partial(kv.index_copy_, 2, self.t_buf, new_kv[:, :, None]))
        else:
            self._call(lambda: kv[:, :, self.t].copy_(new_kv))
        self._acc(blk.o, self._attention(blk, q, kv), 1)

    def _rope_step(self, blk: Any, qkv: torch.Tensor) -> None:
        """RoPE of the step's q and k, in place in ``qkv`` (the op's kernel when it
        writes into given buffers, else torch ops)."""
        s, b = self.runner.spec, self.b
        if s.rope is not None and blk.rope.writes_out:  # the RoPE kernel, in place in qkv
            qv = qkv[:, :s.q_size].view(b, 1, s.q_size)                  # BSH, S = 1
            kv_ = qkv[:, s.q_size:s.q_size + s.kv_size].view(b, 1, s.kv_size)
            ins = dict.fromkeys(blk.rope.names)
            ins.update(q=qv, k=kv_, cos=self.cos, sin=self.sin)          # per-token tables
            self._call(functools.partial(blk.rope.fn, blk.rope.p, ins, out=[qv, kv_]),
                       blk.rope.launches)
        elif s.rope is not None:  # q and k heads are adjacent in qkv: one rotation
            self._rope(qkv[:, :s.q_size + s.kv_size].view(b, s.num_heads + s.num_kv_heads,
                                                          s.head_dim))

    def _c_layer_attention(self, blk: Any, qkv: torch.Tensor, kv: torch.Tensor) -> None:
        """Two C calls: RoPE of q in place with k (rotated) and v stored into the cache
        slot, then one-token attention over the cache into a preallocated buffer."""
        from atbcore.backends.cpu_kernels.torch_decode import (decode_attention_bound,
                                                               rope_cache_bound)

        s, b, cache = self.runner.spec, self.b, self.cache
        qs, ks, hd = s.q_size, s.kv_size, s.head_dim
        q, k, v = qkv[:, :qs], qkv[:, qs:qs + ks], qkv[:, qs + ks:]
        if s.rope is not None:
            write = rope_cache_bound(q, k, v, self.cos, self.sin, kv[0], kv[1], head_dim=hd,
                                     rotary_dim=s.rope.rotary_dim)
            self._call(lambda: write(self.t))
        else:
            new_kv = qkv[:, qs:].view(b, 2, s.num_kv_heads, hd).transpose(0, 1)
            self._call(lambda: kv[:, :, self.t].copy_(new_kv))
        out = torch.empty(b, s.num_heads, hd, device=qkv.device, dtype=qkv.dtype)
        q3, win = q.view(b, s.num_heads, hd), blk.window
        scale = blk.scale if blk.scale is not None else hd ** -0.5
        bound = {"mask": None, "call": None}

        def attend() -> torch.Tensor:
            m = cache.key_mask
            if bound["call"] is None or bound["mask"] is not m:  # the mask tensor moved
                bound["mask"], bound["call"] = m, decode_attention_bound(
                    q3, kv[0], kv[1], scale=scale, key_mask=m, out=out)
            end = self.t + 1
            return bound["call"](max(0, end - win) if win is not None else 0, end).view(b, qs)
        self._acc(blk.o, attend, 1, out.view(b, qs))

    def _attention(self, blk: Any, q: torch.Tensor, kv: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A function running attention of the step's query over the cache, as ``[B, Q]``."""
        s, b = self.runner.spec, self.b
        q4 = q[:, :, None]                                               # [B, H, 1, D]
        gqa = s.num_kv_heads != s.num_heads
        scale, win, qs = blk.scale, blk.window, s.q_size
        kt, vt = kv[0].transpose(1, 2), kv[1].transpose(1, 2)            # [B, KV, cap, D]
        on_device = None if self.static else device_attention(self, blk, q, kv)
        if on_device is not None:
            return on_device
        if self.static:
            m = self.mbuf
            return lambda: F.scaled_dot_product_attention(
                q4, kt, vt, attn_mask=m, scale=scale, enable_gqa=gqa).view(b, qs)
        cache = self.cache

        def attend() -> torch.Tensor:
            end = self.t + 1
            lo = max(0, end - win) if win is not None else 0             # keys j > t - window
            m = None if cache.key_mask is None else cache.key_mask[:, None, None, lo:end]
            return F.scaled_dot_product_attention(q4, kt[:, :, lo:end], vt[:, :, lo:end],
                                                  attn_mask=m, scale=scale,
                                                  enable_gqa=gqa).view(b, qs)
        return attend

    def _moe(self, blk: Any) -> None:
        from .kernels import moe_forward

        m, x, norm = self.runner.spec.moe, self.x, blk.mlp_norm
        self._call(lambda: x.add_(moe_forward(norm(x), blk.router, blk.experts, m.top_k,
                                              m.norm_topk_prob, blk.act)),
                   norm.launches + 6 + 4 * m.top_k)

    def _capture(self) -> None:
        if any(blk.router is not None for blk in self.runner.blocks):
            logger.info("compile opt 3: MoE routing syncs with the host; no CUDA graph")
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        self.t_buf.fill_(self.cache.length)
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: writes only the upcoming slot, as the step will
                self._run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._run()

    # ------------------------------------------------------------------ running
    def _run(self) -> None:
        for c in self.calls:
            c()

    def _execute(self) -> None:
        """Run the bound calls once: the CUDA graph's replay when captured."""
        if self.graph is not None:
            self.graph.replay()
        elif self.parked:  # torch's pool parked so its spinning workers leave the C pool the cores
            with parked_torch_threads():
                self._run()
        else:
            self._run()

    def step(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One token per row: ``ids``/``positions`` int [B]. Writes the cache slot
        ``cache.length`` and advances it; returns logits ``[B, V]`` (this buffer is
        rewritten by the next step)."""
        cache = self.cache
        self.ids.copy_(ids)
        self.pos.copy_(positions)
        self.t = t = cache.length
        if self.static:
            self.t_buf.fill_(t)
            self.mbuf[:, 0, 0, t] = True if cache.key_mask is None else cache.key_mask[:, t]
        self._execute()
        cache.length = t + 1
        return self.logits
