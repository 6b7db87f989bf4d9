"""The CPU fast path of encoder blocks (BERT): four oneDNN GEMMs, one SDPA and two
C LayerNorms per layer.

Built lazily by :meth:`.runner.ModelRunner.encode` from the runner's own prepared
blocks (opt >= 1, fp32/bf16 on a CPU with oneDNN, not quantized, or quantize="w8a8":
then the GEMMs are the C w8a8 matmul's, :class:`_W8A8Layer`); it keeps no
weight copies: the GEMMs read the blocks' weights as ``[out, in]`` views (transposed
views of the ``[in, out]`` copies fused Linears keep).
Per layer (post-norm BERT)::

    qkv = x @ Wqkv + b                        oneDNN linear             [N, 3H]
    o   = SDPA(q, k, v, key-padding mask)     torch flash kernel        [N, H]
    y   = LayerNorm(o @ Wo + b + x)           oneDNN linear(+add), C LN
    h   = gelu(y @ Wup + b)                   oneDNN linear, fused GELU [N, I]
    x   = LayerNorm(h @ Wdown + b + y)        oneDNN linear(+add), C LN

Why these: ``mkldnn._linear_pointwise`` is measured ~1.3x faster than
``F.linear``/``addmm`` for the encoder's large-M GEMMs (fp32 and bf16) and applies
the bias, the GELU and the residual add inside the GEMM; every op avoided is also
one less 2-thread barrier on a shared machine. The tokens run either padded
(``[B*S, H]`` rows, the layout sentence-transformers' length-sorted batches come
in: padding is small and the attention needs no re-layout) or packed (``[T, H]``
real tokens only, re-padded around the attention), chosen per batch by the share
of real tokens (:data:`PACK_BELOW`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from atbcore.log import logger

__all__ = ["FastEncoder", "PACK_BELOW", "fast_encoder_reason"]

# Below this share of real tokens in a [B, S] batch the rows are packed (the GEMMs
# skip padding; attention pays an index_copy_ and an index_select per layer); at
# or above it they run padded. Measured on MiniLM's length-sorted batches (2
# threads): even at 84-86 % real tokens packing was a little faster, at 90 % the
# two were even.
PACK_BELOW = 0.9

# atb activation -> (oneDNN post-op, algorithm); others run as a separate op
_PW_ACT = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


# Lin.mode -> its weight as oneDNN's [out, in] operand (a view: "t" holds [in, out])
_LAYOUT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "t": lambda w: w.t(), "rows": lambda w: w, "dense": lambda w: w}


def _weight(lin: Any) -> torch.Tensor:
    return _LAYOUT[lin.mode](lin.w)


def _pw_available() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available()) and \
            hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):  # pragma: no cover - torch built without oneDNN
        return False


def fast_encoder_reason(runner: Any) -> str | None:
    """Why ``runner`` cannot take the fast path (None = it can)."""
    s = runner.spec
    if s.kind != "encoder":
        return f"{s.arch} is not an encoder"
    if runner.opt_level < 1:
        return "opt_level 0 runs op by op"
    w8a8 = runner.quantize == "w8a8"
    if runner.quantize and not w8a8:
        return f"quantize={runner.quantize!r} runs the int8 Linear kernel"
    if runner.device.type != "cpu":
        return f"oneDNN linear is CPU-only; device {runner.device}"
    if runner.dtype not in (torch.float32, torch.bfloat16):
        return f"oneDNN linear path takes fp32/bf16; dtype {runner.dtype}"
    if s.num_kv_heads != s.num_heads:
        return "grouped KV heads"
    if not w8a8 and not _pw_available():
        return "torch built without oneDNN (mkldnn)"
    for blk in runner.blocks:
        if getattr(blk, "qkv", None) is None:
            return "blocks without a merged QKV Linear"
        modes = {getattr(lin, "mode", None) for lin in (blk.qkv, blk.o, blk.up, blk.down)}
        if w8a8 and modes != {"w8a8"}:
            return "quantize='w8a8' without the C w8a8 matmul"
        if not w8a8 and not modes <= set(_LAYOUT):
            return "Linear weights in a layout oneDNN linear does not take"
    return None


def _check_range(t: torch.Tensor, n: int, what: str) -> None:
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        from atbcore.errors import InputError

        raise InputError("compile", f"{what} out of range", f"values in [0, {n})",
                         f"[{int(t.min())}, {int(t.max())}]")


def _layer_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """LayerNorm of rows ``x`` [N, H]: the C kernel (one pass, fp32 compute) when it
    can run, else ``F.layer_norm`` in fp32."""
    from atbcore.backends.cpu_kernels import torch_ops as ck

    if ck.why_not(x, norm.w, norm.b) is None:
        return ck.layer_norm(x, norm.w, norm.b, x.shape[-1], norm.eps)[0]
    return F.layer_norm(x.float(), (x.shape[-1],), norm.w.float(), norm.b.float(),
                        norm.eps).to(x.dtype)


class _Layer:
    """One encoder block's weights as oneDNN-linear operands (views, no copies)."""

    def __init__(self, blk: Any, act: str, scale: float, heads: int) -> None:
        self.wqkv, self.bqkv = _weight(blk.qkv), blk.qkv.b              # [3H, H]
        self.wo, self.bo = _weight(blk.o), blk.o.b
        self.wup, self.bup = _weight(blk.up), blk.up.b
        self.wdown, self.bdown = _weight(blk.down), blk.down.b
        self.n1, self.n2 = blk.attn_norm, blk.mlp_norm
        self.post = _PW_ACT.get(act)
        self.act = None if self.post is not None else blk.act
        self.scale, self.heads = scale, heads

    def forward(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        """``x`` [N, H] rows -> the block's output rows [N, H]."""
        lin = torch.ops.mkldnn._linear_pointwise
        qkv = lin(x, self.wqkv, self.bqkv, "none", [], "")               # [N, 3H]
        o = attend(qkv)                                                  # [N, H]
        y = _layer_norm(lin.binary(o, x, self.wo, self.bo, "add"), self.n1)
        if self.post is not None:
            h = lin(y, self.wup, self.bup, self.post[0], [], self.post[1])
        else:
            h = self.act(lin(y, self.wup, self.bup, "none", [], ""))
        return _layer_norm(lin.binary(h, y, self.wdown, self.bdown, "add"), self.n2)


class _W8A8Layer:
    """One encoder block on the C w8a8 matmul (quantize="w8a8"): the same four GEMMs,
    bias and residual adds inside the matmul, the activation a separate op."""

    def __init__(self, blk: Any, scale: float) -> None:
        self.qkv, self.o, self.up, self.down = blk.qkv, blk.o, blk.up, blk.down
        self.n1, self.n2, self.act = blk.attn_norm, blk.mlp_norm, blk.act
        self.scale = scale

    def forward(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
                ) -> torch.Tensor:
        """``x`` [N, H] rows -> the block's output rows [N, H]."""
        o = attend(self.qkv(x))                                          # [N, H]
        y = _layer_norm(self.o._c(o, residual=x), self.n1)
        return _layer_norm(self.down._c(self.act(self.up(y)), residual=y), self.n2)


class FastEncoder:
    """The encoder layers of a runner on the fast path; ``run(x, mask, b, s)``."""

    def __init__(self, runner: Any) -> None:
        s = runner.spec
        self.heads, self.head_dim, self.hidden = s.num_heads, s.head_dim, s.hidden_size
        self.layers = [_W8A8Layer(blk, s.scales[i]) if runner.quantize == "w8a8" else
                       _Layer(blk, s.activation, s.scales[i], s.num_heads)
                       for i, blk in enumerate(runner.blocks)]
        # position + token-type embeddings summed once into one table indexed by
        # type * P + position: one gather instead of two gathers and an add per batch
        self.pos_type = None
        if runner.pos_w is not None and runner.type_w is not None and \
                runner.embed_norm is not None:
            p, t = runner.pos_w.float(), runner.type_w.float()
            self.pos_type = (t[:, None, :] + p[None]).reshape(-1, p.shape[1]).to(runner.dtype)
        self.word, self.embed_norm = runner.embed_w, runner.embed_norm
        self.n_pos = 0 if runner.pos_w is None else runner.pos_w.shape[0]
        self.n_type = 0 if runner.type_w is None else runner.type_w.shape[0]
        self.pooler = None
        if runner.pooler is not None and getattr(runner.pooler, "mode", None) in _LAYOUT:
            self.pooler = (_weight(runner.pooler), runner.pooler.b)

    def embed(self, ids: torch.Tensor, pos: torch.Tensor, tt: torch.Tensor) -> torch.Tensor | None:
        """LayerNorm(word + position + token type) of flat ``ids``/``pos``/``tt`` [N]
        -> [N, H] (each range-checked, InputError naming it), or None when the
        model has no such embeddings."""
        if self.pos_type is None:
            return None
        _check_range(ids, self.word.shape[0], "input_ids")
        _check_range(pos, self.n_pos, "position_ids")
        _check_range(tt, self.n_type, "token_type_ids")
        word = F.embedding(ids, self.word)                               # [N, H]
        pt = F.embedding(tt.long() * self.n_pos + pos.long(), self.pos_type)
        from atbcore.backends.cpu_kernels import torch_ops as ck

        norm = self.embed_norm
        if ck.why_not(word, pt, norm.w, norm.b) is None:
            return ck.layer_norm(word, norm.w, norm.b, word.shape[-1], norm.eps, residual=pt)[0]
        return _layer_norm(word + pt, norm)

    def pool(self, first: torch.Tensor) -> torch.Tensor:
        """BERT's pooler on the first tokens [B, H]: tanh(dense) as one oneDNN op."""
        w, b = self.pooler
        return torch.ops.mkldnn._linear_pointwise(first.contiguous(), w, b, "tanh", [], "")

    @classmethod
    def build(cls, runner: Any) -> "FastEncoder | None":
        """The fast path for ``runner``, or None (reason logged) when it cannot run."""
        why = fast_encoder_reason(runner)
        if why is None:
            try:
                fe = cls(runner)
                fe._probe(runner.dtype)
                return fe
            except RuntimeError as e:  # oneDNN refusing this dtype/ISA
                why = f"oneDNN linear failed a probe: {str(e)[:120]}"
        logger.debug("encode: general encoder path (%s)", why)
        return None

    def _probe(self, dtype: torch.dtype) -> None:
        layer = self.layers[0]
        if isinstance(layer, _W8A8Layer):  # no oneDNN GEMM to probe
            return
        x = torch.zeros(2, layer.wqkv.shape[1], dtype=dtype)
        torch.ops.mkldnn._linear_pointwise(x, layer.wqkv, layer.bqkv, "none", [], "")

    # ------------------------------------------------------------------ attention
    def _sdpa(self, qkv: torch.Tensor, b: int, s: int, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
        """Attention over padded rows ``qkv`` [B*S, 3H] -> [B*S, H]."""
        nh, hd = self.heads, self.head_dim
        q, k, v = qkv.view(b, s, 3, nh, hd).permute(2, 0, 3, 1, 4)      # each [B, nh, S, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        return o.transpose(1, 2).reshape(b * s, nh * hd)                 # [B*S, H]

    def _c_attend(self, qkv: torch.Tensor, scale: float, q_lens: list[int] | None,
                  kv_lens: list[int] | None, b: int, s: int) -> torch.Tensor:
        """The C prefill attention (full, no positions) over ``qkv``: packed real tokens
        [T, 3H] with ``q_lens`` per sequence, or padded rows [B*S, 3H] whose first
        ``kv_lens[b]`` keys are real (None: all). Returns [T | B*S, H]."""
        from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention

        nh, hd, n = self.heads, self.head_dim, qkv.shape[0]
        out = torch.empty(n, nh * hd, dtype=qkv.dtype)
        if q_lens is not None:
            q, k, v = qkv.view(n, 3, nh, hd).unbind(1)                  # each [T, nh, hd]
            prefill_attention(q, k, v, scale=scale, q_lens=q_lens, causal=False,
                              out=out.view(n, nh, hd))
        else:
            q, k, v = qkv.view(b, s, 3, nh, hd).unbind(2)               # each [B, S, nh, hd]
            prefill_attention(q, k, v, scale=scale, kv_lens=kv_lens, causal=False,
                              out=out.view(b, s, nh, hd))
        return out

    def _c_reason(self, x: torch.Tensor, m: torch.Tensor | None, lens: torch.Tensor,
                  s: int, packed: bool) -> str | None:
        """Why attention stays SDPA for this batch (None: the C kernel takes it)."""
        from atbcore.backends.cpu_kernels import torch_ops as ck
        from atbcore.backends.cpu_kernels.torch_prefill import MAX_HEAD_DIM

        why = ck.why_not(x)
        if why or self.head_dim > MAX_HEAD_DIM:
            return why or f"head_dim {self.head_dim} > {MAX_HEAD_DIM}"
        if packed or m is None:
            return None
        # padded rows: the kernel's per-row key counts mean real tokens first
        if not torch.equal(m, torch.arange(s, device=m.device)[None] < lens[:, None]):
            return "padding before the tokens in a padded batch"
        return None

    def run(self, x: torch.Tensor, m: torch.Tensor | None, lens: torch.Tensor,
            b: int, s: int, sel: torch.Tensor | None) -> torch.Tensor:
        """The layers over ``x``: padded rows [B*S, H] (``sel`` None) or packed real
        tokens [T, H] (``sel`` their flat indices in [B*S]); ``m`` bool [B, S]
        (None: no padding). Returns rows in the layout given. On the CPU attention
        is the C prefill attention over the packed or padded rows as they are
        (measured on MiniLM's batches: faster than SDPA, and packed batches need no
        re-padding), else SDPA with a key-padding mask."""
        if self._c_reason(x, m, lens, s, sel is not None) is None:
            ql = lens.tolist() if sel is not None else None
            kl = lens.tolist() if sel is None and m is not None else None
            for layer in self.layers:
                x = layer.forward(x, lambda qkv, sc=layer.scale: self._c_attend(qkv, sc, ql, kl,
                                                                                b, s))
            return x
        mask = None
        if m is not None:
            km = m
            if bool((lens == 0).any()):  # a row with no token: let it see all keys
                km = m | (lens == 0)[:, None]                            # (zeroed later)
            mask = km[:, None, None, :]                                  # [B, 1, 1, S]
        if sel is None:
            for layer in self.layers:
                x = layer.forward(x, lambda qkv, sc=layer.scale: self._sdpa(qkv, b, s, mask, sc))
            return x
        n = b * s

        def attend(qkv: torch.Tensor, sc: float) -> torch.Tensor:
            full = qkv.new_zeros(n, qkv.shape[1])
            full.index_copy_(0, sel, qkv)                                # [B*S, 3H]
            return self._sdpa(full, b, s, mask, sc).index_select(0, sel)  # [T, H]

        for layer in self.layers:
            x = layer.forward(x, lambda qkv, sc=layer.scale: attend(qkv, sc))
        return x
