"""The conformance double's attention, paged-cache and w8 matmul ops (a mixin of
:class:`npu_double.NpuDouble`). Each checks the documented constraints first
(``reference/torch_npu.md``, op-plugin's docs) and raises ``ContractViolation``;
the math is plain fp32 torch on the CPU, independent of atb's kernels."""

from __future__ import annotations

import torch

_HALF = (torch.float16, torch.bfloat16)
_ALL = (torch.float16, torch.bfloat16, torch.float32)
_BIG = 2147483647


class ContractViolation(AssertionError):
    """A call torch_npu documents as invalid."""


def require(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise ContractViolation(f"{op}: {what}")


def _to_bnsd(x: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSH":
        x = x.unflatten(-1, (heads, -1))
    return x.transpose(1, 2)


def _from_bnsd(o: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return o
    o = o.transpose(1, 2)
    return o.flatten(-2) if layout == "BSH" else o


def _attend(q, k, v, masked, scale):
    """fp32 softmax attention, q [B, N, Sq, D], k/v [B, Nkv, Skv, D], ``masked`` bool
    broadcastable to [B, N, Sq, Skv] (True = hidden) or None."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = q.float() @ k.transpose(-1, -2) * scale
    if masked is not None:
        s = s.masked_fill(masked, float("-inf"))
    p = torch.softmax(s, -1)  # a fully hidden row: NaN (no row-invalid correction asked for)
    return p @ v


class AttentionOps:
    """npu_fusion_attention, npu_fused_infer_attention_score, _npu_reshape_and_cache,
    _npu_paged_attention and npu_weight_quant_batchmatmul."""

    soc: str
    calls: list
    nnal: bool

    def _atb(self, op: str) -> None:
        require(self.nnal is not False, op, "libatb.so (NNAL) is not loaded: the ATB op is missing")

    def _mask_shape(self, op, m, b, n, sq, skv, allowed):
        require(m.dtype == torch.bool or m.dtype in (torch.uint8, torch.int8), op,
                f"atten_mask dtype {m.dtype}")
        ok = any(len(a) == m.dim() and all(x in (y,) for x, y in zip(m.shape, a)) for a in allowed)
        require(ok, op, f"atten_mask shape {list(m.shape)} not one of {allowed}")

    # ------------------------------------------------------------------ prefill
    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None,
                             padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                             pre_tockens=_BIG, next_tockens=_BIG, inner_precise=0, prefix=None,
                             actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                             gen_mask_parallel=True, sync=False):
        op = "npu_fusion_attention"
        self.calls.append(op)
        require(self.soc in ("A2", "A3"), op, f"not supported on {self.soc}")
        require(input_layout in ("BSH", "SBH", "BSND", "BNSD"), op, f"layout {input_layout!r}")
        for name, t in (("query", query), ("key", key), ("value", value)):
            require(isinstance(t, torch.Tensor) and t.dtype in _ALL, op, f"{name} dtype")
            require(t.dim() == (3 if input_layout == "BSH" else 4), op, f"{name} rank")
        require(query.dtype == key.dtype == value.dtype, op, "q/k/v dtypes differ")
        require(key.shape == value.shape, op, "key and value shapes differ")
        require(padding_mask is None and pse is None and prefix is None, op,
                "padding_mask is not supported (pse/prefix not modelled here)")
        require(keep_prob == 1.0, op, "dropout in inference")
        require(isinstance(head_num, int) and 1 <= head_num <= 256, op, f"head_num {head_num}")
        q = _to_bnsd(query, input_layout, head_num)
        n, d = q.shape[1], q.shape[-1]
        require(n == head_num, op, f"head_num {head_num} differs from q's {n} heads")
        kv_heads = key.shape[-1] // d if input_layout == "BSH" else _to_bnsd(key, input_layout, 1).shape[1]
        k, v = _to_bnsd(key, input_layout, kv_heads), _to_bnsd(value, input_layout, kv_heads)
        require(k.shape[-1] == d and 1 <= d <= 768, op, f"head dim {d}")
        require(n % kv_heads == 0, op, f"Nq {n} % Nkv {kv_heads} != 0")
        b, sq, skv = q.shape[0], q.shape[2], k.shape[2]
        require(isinstance(scale, float), op, f"scale must be a float, given {scale!r}")
        masked = None
        if sparse_mode == 0:
            if atten_mask is not None:
                self._mask_shape(op, atten_mask, b, n, sq, skv,
                                 [(b, n, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv), (sq, skv)])
                masked = atten_mask.bool()
        elif sparse_mode == 3:  # rightDownCausal with the compressed mask
            require(atten_mask is not None and tuple(atten_mask.shape) == (2048, 2048), op,
                    "sparse_mode 3 needs the 2048x2048 compressed mask")
            require(torch.equal(atten_mask.bool(), torch.triu(torch.ones(2048, 2048,
                                                                          dtype=torch.bool), 1)),
                    op, "the compressed mask must be the strict upper triangle")
            i, j = torch.arange(sq)[:, None], torch.arange(skv)[None]
            masked = j > i + (skv - sq)
        else:
            raise ContractViolation(f"{op}: sparse_mode {sparse_mode} not modelled by the double")
        o = _attend(q, k, v, masked, scale).to(query.dtype)
        return (_from_bnsd(o, input_layout), None, None, None, 0, 0, 0)

    # ------------------------------------------------------------------ inference
    def npu_fused_infer_attention_score(self, query, key, value, *, pse_shift=None,
                                        atten_mask=None, actual_seq_lengths=None,
                                        actual_seq_lengths_kv=None, block_table=None,
                                        num_heads=1, scale=1.0, pre_tokens=_BIG,
                                        next_tokens=_BIG, input_layout="BSH",
                                        num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                                        block_size=0, softmax_lse_flag=False):
        op = "npu_fused_infer_attention_score"
        self.calls.append(op)
        require(self.soc in ("A2", "A3"), op, f"not supported on {self.soc}")
        require(query.dtype in _HALF, op, f"query dtype {query.dtype} (fp16/bf16 only)")
        require(key.dtype == value.dtype == query.dtype, op, "key/value dtype differs from query")
        for name, t in (("query", query), ("key", key), ("value", value)):
            require(t.is_contiguous(), op, f"{name} must be contiguous")
        require(input_layout in ("BSH", "BSND", "BNSD"), op, f"layout {input_layout!r}")
        nkv = num_key_value_heads or num_heads
        require(num_heads % nkv == 0 and num_heads // nkv <= 64, op, "num_heads / kv heads")
        q = _to_bnsd(query, input_layout, num_heads)
        b, n, sq, d = q.shape
        require(n == num_heads and b <= 65536 and n <= 256 and d <= 512, op, "B/N/D limits")
        require(pse_shift is None and actual_seq_lengths is None, op, "not modelled")
        if block_table is not None:  # page attention
            require(sq == 1, op, "the double models paged decode (Q_S = 1) only")
            require(block_table.dtype == torch.int32 and block_table.dim() == 2
                    and block_table.shape[0] == b, op, "block_table must be int32 [B, maxBlocks]")
            require(input_layout in ("BSH", "BSND") and key.dim() == 3, op,
                    "BSH/BSND queries read caches laid out (blocknum, blocksize, H)")
            require(block_size > 0 and block_size % 16 == 0 and key.shape[1] == block_size, op,
                    f"block_size {block_size} must be a 16-multiple and the caches' dim 1")
            require(key.shape[2] == nkv * d, op, "cache H must be Nkv * D")
            require(isinstance(actual_seq_lengths_kv, list) and len(actual_seq_lengths_kv) == b,
                    op, "actual_seq_lengths_kv: one host int per batch")
            out = torch.empty(b, n, 1, d)
            for i, length in enumerate(actual_seq_lengths_kv):
                nblk = -(-length // block_size)
                require(block_table.shape[1] >= nblk, op, "block_table too narrow")
                rows = key[block_table[i, :nblk].long()].reshape(-1, nkv, d)[:length]
                vrows = value[block_table[i, :nblk].long()].reshape(-1, nkv, d)[:length]
                out[i] = _attend(q[i:i + 1], rows.transpose(0, 1)[None], vrows.transpose(0, 1)[None],
                                 None, scale)[0]
            return _from_bnsd(out.to(query.dtype), input_layout), torch.zeros(1)
        k, v = _to_bnsd(key, input_layout, nkv), _to_bnsd(value, input_layout, nkv)
        skv = k.shape[2]
        masked = None
        if atten_mask is not None:
            allowed = ([(b, skv), (b, 1, skv), (b, 1, 1, skv)] if sq == 1 else
                       [(sq, skv), (b, sq, skv), (1, sq, skv), (b, 1, sq, skv), (1, 1, sq, skv)])
            self._mask_shape(op, atten_mask, b, n, sq, skv, allowed)
            m = atten_mask.bool()
            masked = m.reshape(b, 1, 1, skv) if sq == 1 else m.reshape((1,) * (4 - m.dim()) + m.shape)
        if actual_seq_lengths_kv is not None:
            lens = actual_seq_lengths_kv
            require(isinstance(lens, list) and all(type(n) is int and 0 <= n <= skv for n in lens)
                    and (len(lens) == 1 or len(lens) >= b), op,
                    f"actual_seq_lengths_kv: host ints in 0..{skv}, one or >= B of them")
            lens = lens * b if len(lens) == 1 else lens[:b]
            past = torch.arange(skv)[None] >= torch.tensor(lens)[:, None]
            masked = past[:, None, None] if masked is None else masked | past[:, None, None]
        o = _attend(q, k, v, masked, scale).to(query.dtype)
        return _from_bnsd(o, input_layout), torch.zeros(1)

    def npu_incre_flash_attention(self, query, key, value, *, padding_mask=None, pse_shift=None,
                                  atten_mask=None, actual_seq_lengths=None, block_table=None,
                                  num_heads=1, scale_value=1.0, input_layout="BSH",
                                  num_key_value_heads=0, block_size=0, inner_precise=1):
        op = "npu_incre_flash_attention"
        self.calls.append(op)
        require(self.soc in ("A2", "310P"), op, f"not supported on {self.soc}")
        allowed = (torch.float16,) if self.soc == "310P" else _HALF
        require(query.dtype in allowed and key.dtype == value.dtype == query.dtype, op,
                f"dtypes {query.dtype}/{key.dtype} on {self.soc}")
        require(input_layout == ("BSH" if query.dim() == 3 else input_layout)
                and input_layout in ("BSH", "BNSD", "BSND"), op, f"layout {input_layout!r}")
        require(key.shape == value.shape and key.dim() == query.dim(), op, "k/v shapes")
        require(padding_mask is None and pse_shift is None and block_table is None, op,
                "not modelled")
        nkv = num_key_value_heads or num_heads
        require(num_heads % nkv == 0 and num_heads // nkv <= 64, op, "num_heads / kv heads")
        q = _to_bnsd(query, input_layout, num_heads)
        b, n, sq, d = q.shape
        limit_b = 256 if self.soc == "310P" else 65535
        require(sq == 1 and n == num_heads and b <= limit_b and n <= 256 and d <= 512, op,
                "Q_S 1, B/N/D limits")
        k, v = _to_bnsd(key, input_layout, nkv), _to_bnsd(value, input_layout, nkv)
        skv = k.shape[2]
        masked = None
        if atten_mask is not None:
            self._mask_shape(op, atten_mask, b, n, 1, skv, [(b, skv), (b, 1, skv), (b, 1, 1, skv)])
            masked = atten_mask.bool().reshape(b, 1, 1, skv)
        if actual_seq_lengths is not None:
            lens = actual_seq_lengths
            require(isinstance(lens, list) and all(type(x) is int and 0 <= x <= skv for x in lens)
                    and len(lens) in (1, b), op, "actual_seq_lengths: host ints, 1 or B of them")
            past = torch.arange(skv)[None] >= torch.tensor(lens * b if len(lens) == 1 else lens)[:, None]
            masked = past[:, None, None] if masked is None else masked | past[:, None, None]
        return _from_bnsd(_attend(q, k, v, masked, scale_value).to(query.dtype), input_layout)

    # ------------------------------------------------------------------ ATB ops (NNAL)
    def _npu_reshape_and_cache(self, key, value, key_cache, value_cache, slot_indices):
        op = "_npu_reshape_and_cache"
        self.calls.append(op)
        self._atb(op)
        require(key.dim() == 3 and value.shape == key.shape, op, "key/value must be [T, Nkv, D]")
        require(key_cache.dim() == 4 and key_cache.shape[2:] == key.shape[1:], op,
                "caches must be [nblk, bs, Nkv, D]")
        require(key.dtype == key_cache.dtype == value_cache.dtype, op, "dtypes differ")
        require(slot_indices.dtype == torch.int32 and slot_indices.shape == (key.shape[0],), op,
                "slot_indices must be int32 [T]")
        require(bool((slot_indices >= 0).all()), op, "negative slots are not documented")
        bs = key_cache.shape[1]
        s = slot_indices.long()
        key_cache[s // bs, s % bs] = key
        value_cache[s // bs, s % bs] = value

    def _npu_paged_attention(self, query, key_cache, value_cache, num_kv_heads, num_heads,
                             scale_value, block_table, context_lens, out, *, workspace=None):
        op = "_npu_paged_attention"
        self.calls.append(op)
        self._atb(op)
        require(query.dim() == 3 and query.shape[1] == num_heads, op, "query must be [T, N, D]")
        require(query.dtype in _HALF, op, f"query dtype {query.dtype}")
        require(key_cache.shape[2] == num_kv_heads, op, "cache heads")
        require(block_table.dtype == torch.int32, op, "block_table must be int32")
        require(context_lens.dtype == torch.int32 and context_lens.device.type == "cpu", op,
                "context_lens must be an int32 host tensor")
        require(out.shape == query.shape and out.dtype == query.dtype, op, "out shape/dtype")
        bs, d = key_cache.shape[1], query.shape[2]
        for i, length in enumerate(context_lens.tolist()):
            blocks = block_table[i, :-(-length // bs)].long()
            k = key_cache[blocks].reshape(-1, num_kv_heads, d)[:length].transpose(0, 1)[None]
            v = value_cache[blocks].reshape(-1, num_kv_heads, d)[:length].transpose(0, 1)[None]
            out[i] = _attend(query[i][None, :, None], k, v, None, scale_value)[0, :, 0].to(out.dtype)

    # ------------------------------------------------------------------ w8 matmul
    def npu_weight_quant_batchmatmul(self, x, weight, antiquant_scale, antiquant_offset=None,
                                     quant_scale=None, quant_offset=None, bias=None,
                                     antiquant_group_size=0, inner_precise=0):
        op = "npu_weight_quant_batchmatmul"
        self.calls.append(op)
        require(self.soc in ("A2", "A3", "310P"), op, f"not supported on {self.soc}")
        require(x.dtype in _HALF and x.dim() == 2, op, "x must be fp16/bf16 (M, K)")
        require(weight.dtype == torch.int8 and weight.dim() == 2 and weight.shape[0] == x.shape[1],
                op, f"weight must be int8 (K, N); given {weight.dtype} {list(weight.shape)}")
        n = weight.shape[1]
        require(antiquant_scale.dtype == x.dtype, op, "antiquant_scale must have x's dtype")
        require(tuple(antiquant_scale.shape) in ((1,), (n,), (1, n)), op,
                f"antiquant_scale shape {list(antiquant_scale.shape)}")
        require(antiquant_group_size == 0 and quant_scale is None, op, "not modelled")
        if bias is not None:
            require(bias.dtype in (torch.float16, torch.float32) and bias.is_contiguous()
                    and tuple(bias.shape) in ((n,), (1, n)), op,
                    f"bias must be a contiguous fp16/fp32 (N,); given {bias.dtype}")
        w = weight.float() * antiquant_scale.float().reshape(1, -1)
        if antiquant_offset is not None:
            w = w + antiquant_offset.float().reshape(1, -1)
        y = x.float() @ w
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
