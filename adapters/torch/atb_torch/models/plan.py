"""The decode step as a prebuilt plan: a list of bound calls over preallocated buffers.

Built once per (cache, batch, padding) and reused for every step; running a step is
``for call in calls: call()`` — each call a ``functools.partial`` of one torch op with
its tensors bound (GEMVs ``mm(h, W_t, out=buf)`` against pre-transposed weights,
in-place residual adds, the RoPE rotation written into the cache slot), or a small
closure where the op reads the current length (cache slot, attention span) or is an
atb kernel that returns a fresh tensor (norms, activations: copied into the buffer,
so a faster kernel registered for the op later is picked up unchanged).

``static=True`` builds the graph-capturable variant: the cache slot and the
attention span come from device tensors (``index_copy_`` into the cache, attention
over the whole capacity with a key mask updated in place), so the step has no
Python-int dependence. At opt 3 on CUDA it is captured once as a CUDA graph and each
step is one ``graph.replay()``; elsewhere opt 3 runs it as opt 2 (logged).

    plan = plan_for(runner, cache)        # built or reused (cache.plans)
    logits = plan.step(ids, positions)    # [B, V], the plan's own buffer
    plan.launches                         # torch calls per step (kernel launches)
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from atbcore.log import logger

from .cache import ContiguousKVCache

__all__ = ["DecodePlan", "plan_for"]


def plan_for(runner: Any, cache: ContiguousKVCache) -> "DecodePlan | None":
    """The cache's plan for this step (reserving the slot first), or None when this
    model/config has no decode plan (then the general path runs)."""
    cache.reserve(cache.length + 1)
    static = runner.opt_level >= 3 and runner.device.type == "cuda"
    key = (cache.version, cache.batch, cache.key_mask is not None, static)
    plans = cache.__dict__.setdefault("plans", {})
    plan = plans.get(key)
    if plan is None:
        if plans:
            plans.clear()  # storage moved or the batch changed: older plans are stale
        why = DecodePlan.unsupported_reason(runner, static)
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

    def __init__(self, runner: Any, cache: ContiguousKVCache, static: bool = False) -> None:
        self.runner, self.cache, self.static = runner, cache, static
        s = runner.spec
        b, dev, dt = cache.batch, runner.device, runner.dtype
        self.b = b
        self.t = 0
        new = functools.partial(torch.empty, device=dev, dtype=dt)
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.pos = torch.zeros(b, dtype=torch.long, device=dev)
        self.t_buf = torch.zeros(1, dtype=torch.long, device=dev)
        self.x, self.h = new(b, s.hidden_size), new(b, s.hidden_size)
        self.o, self.mlp_out = new(b, s.hidden_size), new(b, s.hidden_size)
        self.attn = new(b, s.q_size)
        self.logits = new(b, runner.lm_head.out_features)
        self.calls: list[Callable[[], Any]] = []
        self.launches = 0
        self.masked = cache.key_mask is not None or static
        if static:  # [B, 1, 1, cap]: real and already-written slots
            self.mbuf = torch.zeros(b, 1, 1, cache.capacity, dtype=torch.bool, device=dev)
            n = cache.length
            self.mbuf[:, 0, 0, :n] = True if cache.key_mask is None else cache.key_mask[:, :n]
        self._embed()
        for blk in runner.blocks:
            self._layer(blk)
        self._add(self.x, self.mlp_out)
        self._norm(runner.final_norm, self.x, self.h)
        self._lin(runner.lm_head, self.h, self.logits)
        self.graph = None
        if static and runner.opt_level >= 3:
            self._capture()

    # ------------------------------------------------------------------ building
    def _call(self, fn: Callable[[], Any], launches: int = 1) -> None:
        self.calls.append(fn)
        self.launches += launches

    def _add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._call(functools.partial(x.add_, y))

    def _norm(self, norm: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
        # the atb kernel returns a fresh tensor: copy it into the bound buffer
        self._call(lambda: dst.copy_(norm(src)), norm.launches + 1)

    def _lin(self, lin: Any, src: torch.Tensor, dst: torch.Tensor) -> None:
        if lin.mode == "t":
            if lin.b is None:
                self._call(functools.partial(torch.mm, src, lin.w, out=dst))
            else:
                self._call(functools.partial(torch.addmm, lin.b, src, lin.w, out=dst))
        else:
            self._call(functools.partial(lin.into, src, dst), lin.k.launches + 1)

    def _embed(self) -> None:
        r = self.runner
        self._call(functools.partial(torch.index_select, r.embed_w, 0, self.ids, out=self.x))
        if r.pos_w is not None:
            pe = torch.empty_like(self.x)
            self._call(functools.partial(torch.index_select, r.pos_w, 0, self.pos, out=pe))
            self._add(self.x, pe)
        if r.spec.rope is not None:
            cos, sin = r.rope_tables(self.cache.capacity + 1)
            rd = r.spec.rope.rotary_dim
            self.cos = torch.empty(self.b, 1, rd, device=r.device)       # [B, 1, rd] fp32
            self.sin = torch.empty(self.b, 1, rd, device=r.device)
            c2, s2 = self.cos.view(self.b, rd), self.sin.view(self.b, rd)
            self._call(functools.partial(torch.index_select, cos, 0, self.pos, out=c2))
            self._call(functools.partial(torch.index_select, sin, 0, self.pos, out=s2))

    def _rope(self, src: torch.Tensor, dst: torch.Tensor) -> list[Callable[[], Any]]:
        """Calls writing rotate-half RoPE of ``src`` [B, n, D] into ``dst`` (fp32
        math; half types go through fp32 scratch and round once)."""
        d = src.shape[-1]
        h2 = d // 2
        cos, sin = self.cos, self.sin
        if src.dtype == torch.float32 and dst.dtype == torch.float32:
            a, out = src, dst
            pre, post = [], []
        else:
            a, out = torch.empty(src.shape, device=src.device), torch.empty(dst.shape, device=src.device)
            pre, post = [functools.partial(a.copy_, src)], [functools.partial(dst.copy_, out)]
        return pre + [
            functools.partial(torch.mul, a, cos, out=out),
            functools.partial(out[..., :h2].addcmul_, a[..., h2:], sin[..., :h2], value=-1.0),
            functools.partial(out[..., h2:].addcmul_, a[..., :h2], sin[..., h2:]),
        ] + post

    def _layer(self, blk: Any) -> None:
        s, b, r = self.runner.spec, self.b, self.runner
        nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
        if blk.idx == 0:
            self._norm(blk.attn_norm, self.x, self.h)
        else:
            self._add(self.x, self.mlp_out)
            self._norm(blk.attn_norm, self.x, self.h)
        qkv = torch.empty(b, s.q_size + 2 * s.kv_size, device=r.device, dtype=r.dtype)
        self._lin(blk.qkv, self.h, qkv)
        q = qkv[:, :s.q_size].view(b, nh, hd)
        k = qkv[:, s.q_size:s.q_size + s.kv_size].view(b, nkv, hd)
        v = qkv[:, s.q_size + s.kv_size:].view(b, nkv, hd)
        if blk.q_norm is not None:
            self._call(lambda: q.copy_(blk.q_norm(q)), blk.q_norm.launches + 1)
            self._call(lambda: k.copy_(blk.k_norm(k)), blk.k_norm.launches + 1)
        kc, vc = self.cache.keys(blk.idx), self.cache.values(blk.idx)    # [B, cap, KV, D]
        qr = torch.empty(b, nh, hd, device=r.device, dtype=r.dtype)
        if s.rope is not None:
            for c in self._rope(q, qr):
                self._call(c)
            kr = torch.empty(b, nkv, hd, device=r.device, dtype=r.dtype)
            for c in self._rope(k, kr):
                self._call(c)
        else:
            self._call(functools.partial(qr.copy_, q))
            kr = k
        if self.static:
            self._call(functools.partial(kc.index_copy_, 1, self.t_buf, kr[:, None]))
            self._call(functools.partial(vc.index_copy_, 1, self.t_buf, v[:, None]))
        else:
            self._call(lambda: kc[:, self.t].copy_(kr), 1)
            self._call(lambda: vc[:, self.t].copy_(v), 1)
        self._call(self._attention(blk, qr, kc, vc), 2)
        self._lin(blk.o, self.attn, self.o)
        self._add(self.x, self.o)
        self._norm(blk.mlp_norm, self.x, self.h)
        self._mlp(blk)

    def _attention(self, blk: Any, qr: torch.Tensor, kc: torch.Tensor,
                   vc: torch.Tensor) -> Callable[[], Any]:
        s, b = self.runner.spec, self.b
        q4 = qr.view(b, s.num_heads, 1, s.head_dim)                      # [B, H, 1, D]
        gqa = s.num_kv_heads != s.num_heads
        scale, win = blk.scale, blk.window
        out = self.attn.view(b, s.num_heads, 1, s.head_dim)

        if self.static:
            kt, vt, m = kc.transpose(1, 2), vc.transpose(1, 2), self.mbuf  # [B, KV, cap, D]

            def attend() -> None:
                out.copy_(F.scaled_dot_product_attention(q4, kt, vt, attn_mask=m, scale=scale,
                                                         enable_gqa=gqa))
            return attend

        cache = self.cache

        def attend() -> None:
            end = self.t + 1
            lo = max(0, end - win) if win is not None else 0             # keys j > t - window
            k = kc[:, lo:end].transpose(1, 2)                            # [B, KV, L, D]
            v = vc[:, lo:end].transpose(1, 2)
            m = None
            if cache.key_mask is not None:
                m = cache.key_mask[:, None, None, lo:end]
            out.copy_(F.scaled_dot_product_attention(q4, k, v, attn_mask=m, scale=scale,
                                                     enable_gqa=gqa))
        return attend

    def _mlp(self, blk: Any) -> None:
        s, b, r = self.runner.spec, self.b, self.runner
        if blk.router is not None:
            m, h, out = s.moe, self.h, self.mlp_out
            from .layers import moe_forward

            self._call(lambda: out.copy_(moe_forward(h, blk.router, blk.experts, m.top_k,
                                                     m.norm_topk_prob, blk.act)),
                       2 + 4 * m.top_k)
            return
        inter = s.intermediate_size
        a = torch.empty(b, inter, device=r.device, dtype=r.dtype)
        if blk.gate_up is not None:
            gu = torch.empty(b, 2 * inter, device=r.device, dtype=r.dtype)
            self._lin(blk.gate_up, self.h, gu)
            self._call(lambda: a.copy_(blk.act(gu)), blk.act.k.launches + 1 if blk.act.k else 3)
        else:
            up = torch.empty(b, inter, device=r.device, dtype=r.dtype)
            self._lin(blk.up, self.h, up)
            self._call(lambda: a.copy_(blk.act(up)), 2)
        self._lin(blk.down, a, self.mlp_out)

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
        if self.graph is not None:
            self.graph.replay()
        else:
            self._run()
        cache.length = t + 1
        return self.logits
