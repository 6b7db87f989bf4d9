"""Fused decoder blocks built from atb's torch kernels (:mod:`.kernels`).

Each op is the core's own torch kernel with its params object built once, at
compile time, and called directly: no ``Operation.execute`` (validation, dispatch,
conversion) per call. What a block holds depends on the opt level (see ``Prep``):

* opt 0 — op by op: separate q/k/v and gate/up Linears on the model's own weights,
  ResidualAdd then the norm;
* opt >= 1 — fused: one QKV Linear and one gate|up Linear over weights concatenated
  once (pre-transposed ``[in, out]`` contiguous copies, the fastest layout for
  decode GEMVs), AddRmsNorm / AddLayerNorm, RoPE on q and k together,
  FlashAttention, the gated activation on the merged gate|up output, MoE;
* ``quantize="w8"`` — every Linear (not embeddings / norms) as int8 weights with
  a per-output-channel scale (``atbcore.ops.linear.quantize_w8``) through the Linear
  kernel's int8 path.

The blocks here run any number of tokens (prefill, multi-token steps); the
decode fast path (:mod:`.plan`) reuses their prepared weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atbcore.backends.cpu_kernels import torch_ops as ck
from atbcore.backends.cpu_kernels.torch_prefill import MAX_HEAD_DIM, prefill_attention

from .arch import LayerWeights, ModelSpec
from .kernels import Act, Kern, Lin, Norm, Prep, detach, moe_forward

__all__ = ["AttnCtx", "DecoderBlock", "Kern", "Lin", "Norm", "Act", "Prep",
           "moe_forward", "detach", "run_blocks"]


@dataclass
class AttnCtx:
    """Per-forward attention inputs shared by every layer.

    ``cos``/``sin`` fp32 ``[B|1, T, rotary_dim]`` at the tokens' positions; ``cache``
    (or None: attend over the current tokens only) written at slots
    ``start .. start+T-1``; ``mask`` bool ``[B, 1, 1|T, L]`` (True = attend) or an
    additive float mask; ``causal`` False only for a caller's 4-D mask."""

    cos: Any = None
    sin: Any = None
    cache: Any = None
    start: int = 0
    mask: Any = None
    causal: bool = True
    seq_lens: Any = None
    ws: Any = None  # the runner's prefill Workspace (None: every tensor allocated)


class DecoderBlock:
    """A pre-norm decoder block (Llama family, GPT-2), prepared per :class:`Prep`."""

    def __init__(self, spec: ModelSpec, lw: LayerWeights, idx: int, prep: Prep) -> None:
        self.idx, self.spec = idx, spec
        nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.sizes = [spec.q_size, spec.kv_size, spec.kv_size]
        self.attn_norm = Norm(spec.norm, lw.attn_norm, lw.attn_norm_b, spec.norm_eps, prep)
        self.mlp_norm = Norm(spec.norm, lw.mlp_norm, lw.mlp_norm_b, spec.norm_eps, prep)
        if prep.fused or prep.quantize:
            self.qkv = Lin([lw.q, lw.k, lw.v], [lw.q_b, lw.k_b, lw.v_b], prep)
            self.q = self.k = self.v = None
        else:
            self.qkv = None
            self.q, self.k, self.v = (Lin([w], [b], prep) for w, b in
                                      ((lw.q, lw.q_b), (lw.k, lw.k_b), (lw.v, lw.v_b)))
        self.o = Lin([lw.o], [lw.o_b], prep)
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = Norm("rms", lw.q_norm, None, spec.norm_eps, prep)
            self.k_norm = Norm("rms", lw.k_norm, None, spec.norm_eps, prep)
        self.rope = None
        if spec.position == "rope":
            self.rope = Kern("RoPE", num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                             rotary_dim=spec.rope.rotary_dim, layout="BSH")
        win, scale = spec.windows[idx], spec.scales[idx]
        self.window, self.scale = win, scale
        self.fa = {c: Kern("FlashAttention", num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                           scale=scale, causal=c, window=win if c else None, layout="BSH")
                   for c in (True, False)}
        self.rac = Kern("ReshapeAndCache")
        self.pa = Kern("PagedAttention", num_heads=nh, num_kv_heads=nkv, head_dim=hd, scale=scale,
                       causal=True, window=win)
        self.act = Act(spec.activation, spec.gated)
        self.experts: list[tuple[Lin, Lin]] = []
        self.router = None
        self.gate_up = self.gate = self.up = None
        if spec.moe is not None:
            self.router = detach(lw.router, prep.dtype).to(prep.device)
            inter = spec.intermediate_size
            for e in range(spec.moe.num_experts):
                gu = lw.experts_gate_up[e]                               # [2I, H]
                gu_lin = (Lin([gu], [None], prep) if prep.fused or prep.quantize else
                          _SplitGateUp(gu, inter, prep))
                self.experts.append((gu_lin, Lin([lw.experts_down[e]], [None], prep)))
        elif spec.gated and (prep.fused or prep.quantize):
            self.gate_up = Lin([lw.gate, lw.up], [lw.gate_b, lw.up_b], prep)
        elif spec.gated:
            self.gate, self.up = Lin([lw.gate], [lw.gate_b], prep), Lin([lw.up], [lw.up_b], prep)
        else:
            self.up = Lin([lw.up], [lw.up_b], prep)
        self.down = None if spec.moe is not None else Lin([lw.down], [lw.down_b], prep)

    # ------------------------------------------------------------------ pieces
    def qkv_proj(self, h: torch.Tensor,
                 ws: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is not None:
            out = None if ws is None else ws.take("qkv", (*h.shape[:-1], self.qkv.out_features),
                                                   h.dtype)
            q, k, v = self.qkv(h, out=out).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        if self.q_norm is not None:  # per-head RmsNorm before RoPE (Qwen3)
            hd = self.spec.head_dim
            q = self.q_norm(q.unflatten(-1, (-1, hd))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, hd))).flatten(-2)
        return q, k, v

    def attention(self, h: torch.Tensor, ctx: AttnCtx, keep: Any = None) -> torch.Tensor:
        """The attention sub-block's output ``[B, T, H]``; with ``keep`` (an index
        along T) only those rows' (keys and values are still cached for every row)."""
        if getattr(ctx, "paged", False):
            return self.attention_paged(h, ctx, keep)
        q, k, v = self.qkv_proj(h, ctx.ws)                               # [B, T, Q|KV]
        if self.rope is not None:
            q, k = self.rope(q=q, k=k, cos=ctx.cos, sin=ctx.sin)
        if ctx.cache is not None:
            ctx.cache.write(self.idx, k, v, ctx.start)
            k, v = ctx.cache.view(self.idx, ctx.start + h.shape[1])      # [B, L, KV]
        o = self.fa[ctx.causal](q=q, k=k, v=v, mask=ctx.mask, seq_lens=ctx.seq_lens)[0]
        if keep is not None:
            return self._o(o[:, keep], None)
        return self._o(o, ctx.ws)

    def attention_paged(self, h: torch.Tensor, ctx: Any, keep: Any = None) -> torch.Tensor:
        """Packed tokens ``h`` [1, T, H] of several sequences over a paged cache.
        When every sequence's context is exactly its new tokens (a prefill without
        prefix-cache hits, ``ctx.fresh_lens``), attention runs per sequence on the
        packed q/k/v slices themselves: nothing is gathered back from the cache.
        ``keep``: the last token of each sequence (int64 [B]), the only rows whose
        output is wanted; the C attention then runs those queries alone."""
        s = self.spec
        q, k, v = self.qkv_proj(h, ctx.ws)                               # [1, T, Q|KV]
        if self.rope is not None:
            q, k = self.rope(q=q, k=k, cos=ctx.cos, sin=ctx.sin)
        t = h.shape[1]
        kc, vc = ctx.cache.key_cache(self.idx), ctx.cache.value_cache(self.idx)
        b = ctx.batch
        self.rac(key=k.reshape(t, s.num_kv_heads, s.head_dim),
                 value=v.reshape(t, s.num_kv_heads, s.head_dim), key_cache=kc, value_cache=vc,
                 slot_mapping=b.slot_mapping)
        if ctx.fresh_lens is not None:
            o = self._attend_packed(q, k, v, ctx.fresh_lens, ctx.ws, keep)  # [1, T|B, Q]
            if keep is not None:
                return self._o(o, None)
        elif ctx.decode is not None:  # one token per sequence: the kept decode copy
            o = ctx.decode.attend(self.idx, q.reshape(t, s.num_heads, s.head_dim),
                                  k.reshape(t, s.num_kv_heads, s.head_dim),
                                  v.reshape(t, s.num_kv_heads, s.head_dim), kc, vc,
                                  self.scale if self.scale is not None else s.head_dim ** -0.5,
                                  self.window)                           # [B, H, D]
        else:
            o = self.pa(query=q.reshape(t, s.num_heads, s.head_dim), key_cache=kc,
                        value_cache=vc, block_tables=b.block_tables,
                        context_lens=b.context_lens, q_seq_lens=b.q_seq_lens)[0]  # [T, H, D]
        o = o.reshape(1, t, s.q_size)
        return self._o(o, ctx.ws) if keep is None else self._o(o[:, keep], None)

    def _o(self, o: torch.Tensor, ws: Any) -> torch.Tensor:
        """The output projection (into the workspace on a long prefill)."""
        out = None if ws is None else ws.take("o", (*o.shape[:-1], self.o.out_features), o.dtype)
        return self.o(o, out=out)

    def _attend_packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       lens: list[int], ws: Any = None, last: Any = None) -> torch.Tensor:
        """Causal attention of each sequence over its own tokens: q/k/v [1, T, Q|KV]
        packed, ``lens`` tokens per sequence; returns [1, T, Q]. On the CPU one C
        call serves every sequence (the packed slices read in place), else one
        FlashAttention call per sequence. ``last`` (each sequence's last token, int64
        [B]): [1, B, Q] of those rows comes back (on the C path only they run)."""
        s, t = self.spec, q.shape[1]
        if ck.why_not(q, k, v) is None and s.head_dim <= MAX_HEAD_DIM:
            nh, nkv, hd = s.num_heads, s.num_kv_heads, s.head_dim
            ql = lens
            if last is not None:  # bottom-right aligned: a sequence's one query sees all its keys
                q, ql, ws = q[:, last], [1] * len(lens), None
            rows = q.shape[1]
            shape = (1, rows, s.q_size)
            out = torch.empty(shape, dtype=q.dtype) if ws is None else ws.take("attn", shape,
                                                                                 q.dtype)
            prefill_attention(q[0].reshape(rows, nh, hd), k[0].reshape(t, nkv, hd),
                              v[0].reshape(t, nkv, hd),
                              scale=self.scale if self.scale is not None else hd ** -0.5,
                              q_lens=ql, kv_lens=lens, causal=True, window=self.window,
                              out=out[0].view(rows, nh, hd))
            return out
        fa, outs, a = self.fa[True], [], 0
        for n in lens:
            outs.append(fa(q=q[:, a:a + n], k=k[:, a:a + n], v=v[:, a:a + n])[0])
            a += n
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return o if last is None else o[:, last]

    def mlp(self, h: torch.Tensor, ws: Any = None) -> torch.Tensor:
        if self.router is not None:
            m = self.spec.moe
            return moe_forward(h, self.router, self.experts, m.top_k, m.norm_topk_prob, self.act)
        if self.gate_up is not None and ws is not None:  # the big intermediates reused
            lead = h.shape[:-1]
            gu = self.gate_up(h, out=ws.take("gate_up", (*lead, self.gate_up.out_features),
                                                 h.dtype))
            half = self.gate_up.out_features // 2
            a = self.act(gu, out=ws.take("act", (*lead, half), h.dtype) if self.act.gated
                         else None)
            # the block's output: the next block's first norm reads it before its own
            # down projection takes the buffer again
            return self.down(a, out=ws.take("down", (*lead, self.down.out_features), h.dtype))
        if self.gate_up is not None:
            return self.down(self.act(self.gate_up(h)))
        if self.gate is not None:
            return self.down(self.act(self.gate(h), self.up(h)))
        return self.down(self.act(self.up(h)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttnCtx, keep: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous block's MLP output (or the embeddings when
        ``residual`` is None). Returns ``(mlp_out, residual)``; the next block (or
        the final norm) adds them. ``keep`` (an index along the token dim): the
        rows wanted from the block (the last block when only the last tokens' logits
        are): every row's keys and values are cached, while the output projection,
        the MLP and, where it can, the attention run the kept rows alone."""
        ws = getattr(ctx, "ws", None)

        def bufs(res: str) -> list | None:  # the residual alternates between two buffers
            if ws is None:
                return None
            return [ws.take("h", x.shape, x.dtype), ws.take(res, x.shape, x.dtype)]
        if residual is None:
            h, residual = self.attn_norm(x), x
        else:
            h, residual = self.attn_norm.add(x, residual, out=bufs("res_a"))
        a = self.attention(h, ctx, keep)
        if keep is not None:
            residual, ws = residual[:, keep], None
        h, residual = self.mlp_norm.add(a, residual, out=bufs("res_b"))
        return self.mlp(h, ws), residual


def run_blocks(blocks: list, x: torch.Tensor, ctx: Any,
               keep: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder blocks over ``x`` (embeddings), returning the last one's
    ``(mlp_out, residual)``; ``keep``: the rows wanted at the end (see
    :meth:`DecoderBlock.forward`), which the last block runs alone."""
    res, last = None, len(blocks) - 1
    for i, blk in enumerate(blocks):
        x, res = blk.forward(x, res, ctx, keep if i == last else None)
    return x, res


class _SplitGateUp:
    """opt 0 for a MoE expert: gate and up Linears apart, output [..., 2I]."""

    def __init__(self, gu: torch.Tensor, inter: int, prep: Prep) -> None:
        self.gate, self.up = Lin([gu[:inter]], [None], prep), Lin([gu[inter:]], [None], prep)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.gate(x), self.up(x)], dim=-1)
