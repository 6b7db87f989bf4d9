"""Fused decoder / encoder blocks built from atb's torch kernels.

Each op is the core's own torch kernel (``get_backend("torch").kernel(op).fn``) with
its params object built once here, at compile time, and called directly: no
``Operation.execute`` (validation, dispatch, conversion) per call. What a block
holds depends on the opt level (see :class:`Prep`):

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
from typing import Any, Callable

import torch

from atbcore.backends import get_backend
from atbcore.ops import get_op

from .arch import LayerWeights, ModelSpec

__all__ = ["Kern", "Lin", "Norm", "Act", "Prep", "AttnCtx", "DecoderBlock", "EncoderBlock",
           "moe_forward", "detach"]


def detach(t: Any, dtype: torch.dtype | None = None) -> Any:
    """``t`` without autograd history (optionally cast); None stays None."""
    if t is None:
        return None
    t = t.detach()
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


class Kern:
    """The torch kernel of one atb op with params bound once: ``k(x=..., weight=...)``
    returns the kernel's output list."""

    __slots__ = ("op", "fn", "p", "names", "launches")

    def __init__(self, op: str, **params: Any) -> None:
        opdef = get_op(op)
        kernel = get_backend("torch").kernel(opdef.name)
        if kernel is None:  # pragma: no cover - every op used here has one
            from atbcore.errors import CapabilityError

            raise CapabilityError(op, "no torch kernel", "a registered torch kernel", "none")
        self.op, self.fn, self.launches = opdef.name, kernel.fn, kernel.launches
        self.p = opdef.make_params(params)
        self.names = opdef.input_names

    def __call__(self, **ins: Any) -> list:
        d = dict.fromkeys(self.names)
        d.update(ins)
        return self.fn(self.p, d)


@dataclass(frozen=True)
class Prep:
    """How weights are prepared: ``opt_level`` (0 = unfused, model weights as they
    are), compute ``dtype``, ``quantize`` (None | "w8"), ``device``."""

    opt_level: int
    dtype: torch.dtype
    quantize: str | None = None
    device: torch.device = torch.device("cpu")

    @property
    def fused(self) -> bool:
        return self.opt_level >= 1


class Lin:
    """A (possibly merged) Linear: ``lin(x) -> [..., out]``.

    ``mode``: "dense" (weight ``[out, in]``, the model's own tensor), "t" (a merged
    ``[in, out]`` contiguous copy; :meth:`into` is one ``mm``/``addmm`` into a
    preallocated buffer) or "w8" (int8 ``[out, in]`` + per-channel scale)."""

    def __init__(self, weights: list, biases: list, prep: Prep) -> None:
        ws = [detach(w) for w in weights]
        self.out_features = sum(w.shape[0] for w in ws)
        self.in_features = ws[0].shape[1]
        self.b = None
        if any(b is not None for b in biases):
            self.b = torch.cat([detach(b, prep.dtype) if b is not None else
                                torch.zeros(w.shape[0], dtype=prep.dtype, device=w.device)
                                for w, b in zip(ws, biases)]).to(prep.device)
        self.scale = None
        if prep.quantize == "w8":
            from atbcore.ops.linear import quantize_w8

            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            self.w, scale = quantize_w8(w)
            self.w = self.w.to(prep.device).contiguous()
            # bf16 activations take the int8pack kernel only with bf16 scales
            self.scale = scale.to(prep.device, torch.bfloat16 if prep.dtype == torch.bfloat16
                                  else torch.float32)
            self.mode = "w8"
            self.k = Kern("Linear", quant="w8", bias=self.b is not None)
        elif prep.fused:
            w = torch.cat(ws) if len(ws) > 1 else ws[0]
            self.w = w.to(prep.device, prep.dtype).t().contiguous()       # [in, out]
            self.mode = "t"
            self.k = Kern("Linear", transpose_weight=False, bias=self.b is not None)
        else:
            assert len(ws) == 1, "opt 0 keeps Linears separate"
            self.w = ws[0].to(prep.device, prep.dtype)
            self.mode = "dense"
            self.k = Kern("Linear", bias=self.b is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.k(x=x, weight=self.w, bias=self.b, scale=self.scale)[0]

    def into(self, x2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``x2`` [M, in] -> ``out`` [M, out] in place (the decode fast path)."""
        if self.mode == "t":
            if self.b is None:
                return torch.mm(x2, self.w, out=out)
            return torch.addmm(self.b, x2, self.w, out=out)
        return out.copy_(self(x2))

    @property
    def nbytes(self) -> int:
        n = self.w.numel() * self.w.element_size()
        return n + (0 if self.scale is None else self.scale.numel() * self.scale.element_size())


class Norm:
    """RmsNorm / LayerNorm with its Add+Norm variant (fused at opt >= 1)."""

    def __init__(self, kind: str, w: Any, b: Any, eps: float, prep: Prep) -> None:
        self.kind = kind
        self.w = detach(w, prep.dtype)
        self.b = detach(b, prep.dtype)
        self.eps = float(eps)
        name = "RmsNorm" if kind == "rms" else "LayerNorm"
        self.k = Kern(name, eps=eps)
        self.kadd = Kern("Add" + name, eps=eps) if prep.fused else None
        self.kres = Kern("ResidualAdd")
        self.launches = self.k.launches

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rms":
            return self.k(x=x, weight=self.w)[0]
        return self.k(x=x, weight=self.w, bias=self.b)[0]

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``."""
        if self.kadd is None:
            s = self.kres(x=x, residual=residual)[0]
            return self(s), s
        if self.kind == "rms":
            y, s = self.kadd(x=x, residual=residual, weight=self.w)
        else:
            y, s = self.kadd(x=x, residual=residual, weight=self.w, bias=self.b)
        return y, s


_GATED = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh"}


class Act:
    """The MLP activation: ``act(x)``; gated: ``act(gate) * up`` given either the
    merged ``[..., 2I]`` (gate first) or ``gate`` and ``up`` apart."""

    def __init__(self, name: str, gated: bool) -> None:
        from atbcore.errors import AtbError
        from atbcore.ops.activation import get_activation

        self.gated = gated
        self.torch_fn: Callable | None = None
        try:
            get_activation(name)
        except AtbError:  # provided by a plugin's atb_activation hook only
            from atbcore.plugin import resolve_activation

            spec = resolve_activation(name)
            if spec.torch_fn is None:
                from .arch import unsupported

                raise unsupported("hidden_act", "an activation with a torch function", name)
            self.torch_fn = spec.torch_fn
        self.k = None if self.torch_fn else Kern("Activation", activation_type=_GATED.get(name, name)
                                                   if gated and name in _GATED else name)
        self.split = gated and (self.torch_fn is not None or name not in _GATED)
        self.mul = Kern("Elewise", elewise_type="mul")

    def _plain(self, x: torch.Tensor) -> torch.Tensor:
        if self.torch_fn is not None:
            return self.torch_fn(x.float()).to(x.dtype)
        return self.k(x=x)[0]

    def __call__(self, x: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
        if not self.gated:
            return self._plain(x)
        if not self.split:
            return self.k(x=x, up=up)[0]
        if up is None:
            x, up = x.chunk(2, dim=-1)  # [..., 2I] -> gate, up
        return self.mul(x=self._plain(x), y=up)[0]


def moe_forward(x: torch.Tensor, router: torch.Tensor, experts: list[tuple[Lin, Lin]],
                top_k: int, norm_topk: bool, act: Act) -> torch.Tensor:
    """Mixtral-style MoE on ``x`` [..., H]: router softmax in fp32 over all experts,
    top-k, optional renormalisation, weighted sum of the chosen experts' gated FFNs.
    (No MoE kernel is registered in the core yet; this is its torch form.)"""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])                                        # [T, H]
    logits = torch.mm(x2, router.t())                                    # [T, E]
    probs = torch.softmax(logits.float(), dim=-1)
    top_w, top_i = torch.topk(probs, top_k, dim=-1)                      # [T, k]
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(x2)
    hit = torch.unique(top_i).tolist()
    for e in hit:
        rows, slot = torch.where(top_i == e)
        gu, down = experts[e]
        y = down(act(gu(x2[rows])))                                      # [n, H]
        out.index_add_(0, rows, (y * top_w[rows, slot, None]).to(out.dtype))
    return out.reshape(shape)


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
    def qkv_proj(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv is not None:
            q, k, v = self.qkv(h).split(self.sizes, dim=-1)
        else:
            q, k, v = self.q(h), self.k(h), self.v(h)
        if self.q_norm is not None:  # per-head RmsNorm before RoPE (Qwen3)
            hd = self.spec.head_dim
            q = self.q_norm(q.unflatten(-1, (-1, hd))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, hd))).flatten(-2)
        return q, k, v

    def attention(self, h: torch.Tensor, ctx: AttnCtx) -> torch.Tensor:
        if getattr(ctx, "paged", False):
            return self.attention_paged(h, ctx)
        q, k, v = self.qkv_proj(h)                                       # [B, T, Q|KV]
        if self.rope is not None:
            q, k = self.rope(q=q, k=k, cos=ctx.cos, sin=ctx.sin)
        if ctx.cache is not None:
            ctx.cache.write(self.idx, k, v, ctx.start)
            k, v = ctx.cache.view(self.idx, ctx.start + h.shape[1])      # [B, L, KV]
        o = self.fa[ctx.causal](q=q, k=k, v=v, mask=ctx.mask, seq_lens=ctx.seq_lens)[0]
        return self.o(o)

    def attention_paged(self, h: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Packed tokens ``h`` [1, T, H] of several sequences over a paged cache."""
        s = self.spec
        q, k, v = self.qkv_proj(h)                                       # [1, T, Q|KV]
        if self.rope is not None:
            q, k = self.rope(q=q, k=k, cos=ctx.cos, sin=ctx.sin)
        t = h.shape[1]
        kc, vc = ctx.cache.key_cache(self.idx), ctx.cache.value_cache(self.idx)
        b = ctx.batch
        self.rac(key=k.reshape(t, s.num_kv_heads, s.head_dim),
                 value=v.reshape(t, s.num_kv_heads, s.head_dim), key_cache=kc, value_cache=vc,
                 slot_mapping=b.slot_mapping)
        o = self.pa(query=q.reshape(t, s.num_heads, s.head_dim), key_cache=kc, value_cache=vc,
                    block_tables=b.block_tables, context_lens=b.context_lens,
                    q_seq_lens=b.q_seq_lens)[0]                          # [T, H, D]
        return self.o(o.reshape(1, t, s.q_size))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        if self.router is not None:
            m = self.spec.moe
            return moe_forward(h, self.router, self.experts, m.top_k, m.norm_topk_prob, self.act)
        if self.gate_up is not None:
            return self.down(self.act(self.gate_up(h)))
        if self.gate is not None:
            return self.down(self.act(self.gate(h), self.up(h)))
        return self.down(self.act(self.up(h)))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: AttnCtx) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous block's MLP output (or the embeddings when
        ``residual`` is None). Returns ``(mlp_out, residual)``; the next block (or
        the final norm) adds them."""
        if residual is None:
            h, residual = self.attn_norm(x), x
        else:
            h, residual = self.attn_norm.add(x, residual)
        a = self.attention(h, ctx)
        h, residual = self.mlp_norm.add(a, residual)
        return self.mlp(h), residual


class _SplitGateUp:
    """opt 0 for a MoE expert: gate and up Linears apart, output [..., 2I]."""

    def __init__(self, gu: torch.Tensor, inter: int, prep: Prep) -> None:
        self.gate, self.up = Lin([gu[:inter]], [None], prep), Lin([gu[inter:]], [None], prep)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.gate(x), self.up(x)], dim=-1)


class EncoderBlock:
    """A post-norm encoder block (BERT) over packed tokens ``[T, H]``; attention
    runs on the re-padded ``[B, S, 3H]`` QKV with per-row lengths (varlen)."""

    def __init__(self, spec: ModelSpec, lw: LayerWeights, idx: int, prep: Prep) -> None:
        self.spec = spec
        self.attn_norm = Norm(spec.norm, lw.attn_norm, lw.attn_norm_b, spec.norm_eps, prep)
        self.mlp_norm = Norm(spec.norm, lw.mlp_norm, lw.mlp_norm_b, spec.norm_eps, prep)
        self.sizes = [spec.q_size, spec.kv_size, spec.kv_size]
        if prep.fused or prep.quantize:
            self.qkv = Lin([lw.q, lw.k, lw.v], [lw.q_b, lw.k_b, lw.v_b], prep)
        else:
            self.qkv = None
            self.q, self.k, self.v = (Lin([w], [b], prep) for w, b in
                                      ((lw.q, lw.q_b), (lw.k, lw.k_b), (lw.v, lw.v_b)))
        self.o = Lin([lw.o], [lw.o_b], prep)
        self.fa = Kern("FlashAttention", num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                       head_dim=spec.head_dim, scale=spec.scales[idx], causal=False, layout="BSH")
        self.act = Act(spec.activation, spec.gated)
        self.up = Lin([lw.up], [lw.up_b], prep)
        self.down = Lin([lw.down], [lw.down_b], prep)

    def forward(self, x: torch.Tensor, pad: Callable, unpad: Callable,
                seq_lens: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H] packed tokens; ``pad``/``unpad`` move between packed and the
        right-padded ``[B, S, ...]`` layout; ``seq_lens`` int [B]."""
        if self.qkv is not None:
            qkv = pad(self.qkv(x))                                       # [B, S, 3H]
        else:
            qkv = pad(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1))
        q, k, v = qkv.split(self.sizes, dim=-1)
        o = unpad(self.fa(q=q, k=k, v=v, seq_lens=seq_lens)[0])          # [T, H]
        y, _ = self.attn_norm.add(self.o(o), x)
        f = self.down(self.act(self.up(y)))
        out, _ = self.mlp_norm.add(f, y)
        return out
