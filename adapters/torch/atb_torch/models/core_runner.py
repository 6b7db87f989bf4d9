"""``CoreRunner``: a compiled Hugging Face decoder on the core engine.

The model is lowered to ONE core GraphOp (:func:`atbcore.models.decoder.decoder_layers`
with the last-token head: embedding, per block the fused norm+QKV GEMM, RoPE with
the in-place cache write, attention over the cache rows, the output projection with
the residual in its epilogue, the fused FFN; final norm and LM head on the tokens
whose logits are wanted), fused by the one pass pipeline and bound once per shape
bucket over pool memory; every call runs it in the in-place cache form
(:func:`atbcore.graph.graph_op_kv.run_in_place`) over a :class:`.row_cache.RowKVCache`.

    runner = CoreRunner.from_hf(hf_model)
    cache = runner.new_cache(batch=2, capacity=256)   # int8 rows + scales with kv_cache_dtype="int8"
    logits = runner.prefill(ids, cache, attention_mask=mask)   # [B, V] of each row's last token
    logits = runner.decode(next_ids, cache)                     # [B, V], one token per row
    logits = runner.forward(ids, cache, position_ids=..., attention_mask=..., logits_to_keep=0)

Hugging Face semantics, on rows that hold real tokens only:

* a 2-D ``attention_mask`` ``[B, past + T]`` (1 = real token, padding anywhere): the
  padding tokens are dropped before the first layer (rows of different lengths run
  packed), and the rows keep only real tokens; the cache remembers which slots of
  the shared time axis were real. A mask that marks earlier real slots as padding
  drops them from the rows; one that revives dropped slots raises CapabilityError.
* ``position_ids`` (default: the slots of the time axis, as Hugging Face) are the
  RoPE positions of the real tokens;
* ``logits_to_keep`` (an int counts from the end, 0 = all; a tensor indexes the new
  tokens): only those tokens run the final norm and LM head. Logits at padding
  positions are zeros (Hugging Face's are undefined there).

What it does not run (the compiled model hands these to the model's own forward):
4-D masks, ``inputs_embeds``, ``token_type_ids`` (:meth:`why_not_forward`).

``stats``: ``plan_steps`` (decode steps), ``general_steps`` (other calls).
Threading: a runner and its caches serve one caller at a time.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from atbcore.errors import CapabilityError, InputError
from atbcore.graph.graph_op import GraphOp
from atbcore.graph.graph_op_kv import run_in_place
from atbcore.models.decoder import decoder_layers, why_not_lowered

from .arch import ModelSpec, ModelWeights, resolve_architecture
from .row_cache import RowKVCache

__all__ = ["CoreRunner", "why_not_core"]


def why_not_core(spec: ModelSpec, quantize: str | None = None,
                 kv_cache_dtype: str | None = None) -> str:
    """Why ``compile()`` cannot run this model on the core engine yet ("" if it can)."""
    if spec.kind != "decoder":
        return f"a {spec.kind} model"
    why = why_not_lowered(spec)
    if why:
        return why
    if kv_cache_dtype not in (None, "auto", "int8"):
        return f"kv_cache_dtype={kv_cache_dtype!r}"
    return ""


def _cast(w: ModelWeights, dtype: torch.dtype) -> ModelWeights:
    """``w`` with every float tensor in ``dtype`` (the same tensors when they are)."""
    def c(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.detach().to(dtype)
        return t

    def each(obj: Any) -> Any:
        return dataclasses.replace(obj, **{f.name: c(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj)
                                           if f.name != "layers"})
    out = each(w)
    out.layers = [each(lw) for lw in w.layers]
    if w.lm_head is w.embed:
        out.lm_head = out.embed
    return out


def _fusions(opt_level: int) -> Any:
    """opt_level 0: every node its own kernel (nothing fused); else the standard
    pipeline."""
    from atbcore.passes.pipeline import FusionConfig

    if opt_level > 0:
        return FusionConfig()
    off = {f.name: False for f in dataclasses.fields(FusionConfig) if f.type in (bool, "bool")
           and f.name.startswith("enable_") and "precision" not in f.name
           and "accumulation" not in f.name}
    return FusionConfig(fusion_level="conservative", **off)


class CoreRunner:
    """See the module docstring. ``dtype``: compute and weight dtype (None: the
    weights'); ``quantize``: None, "w8", "w8a8" or "w4" (:mod:`atbcore.models.quant`); ``opt_level`` 0 runs every node as its own kernel, 1-3 the standard
    fusions (the plan is bound over planned memory at every level)."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, *, opt_level: int = 2,
                 dtype: torch.dtype | None = None, quantize: str | None = None,
                 device: Any = None, kv_cache_dtype: str | None = None) -> None:
        why = why_not_core(spec, quantize, kv_cache_dtype)
        if why:
            raise CapabilityError("compile", f"{why} on the core engine", "a supported decoder",
                                  spec.arch)
        self.spec, self.opt_level, self.quantize = spec, int(opt_level), quantize
        self.dtype = dtype or weights.embed.dtype
        self.device = torch.device(device) if device is not None else weights.embed.device
        self.kv_cache_dtype = kv_cache_dtype
        w = _cast(weights, self.dtype)
        # opt_level 3 on CUDA: decode steps replay as captured CUDA graphs
        self.op = GraphOp(decoder_layers(spec, w, last_token=True, quantize=quantize),
                          name=spec.arch,
                          fusion_config=_fusions(self.opt_level),
                          cuda_graph=self.opt_level >= 3 and self.device.type == "cuda")
        self.lm_head = True if w.lm_head is not None else None
        self.vocab_size = int(w.embed.shape[0])
        self.stats = {"plans_built": 0, "plan_steps": 0, "general_steps": 0}
        self._ids: torch.Tensor | None = None  # decode steps' token ids (_step_ids)
        self._ids_flat: torch.Tensor | None = None  # its [B] view
        # positions past which RoPE's frequencies change (dynamic scaling; None: none)
        self._rope_limit = spec.rope.max_len if spec.rope is not None else None

    @classmethod
    def from_hf(cls, model: Any, **kw: Any) -> "CoreRunner":
        arch = resolve_architecture(model.config)
        spec = arch.describe(model.config)
        return cls(spec, arch.extract(model, spec), **kw)

    def new_cache(self, batch: int, capacity: int) -> RowKVCache:
        """An empty cache for ``batch`` rows of ``capacity`` tokens (from atb's pool)."""
        s = self.spec
        return RowKVCache(s.num_layers, batch, max(int(capacity), 1), s.num_kv_heads,
                          s.head_dim, self.dtype, self.device,
                          kv_dtype="int8" if self.kv_cache_dtype == "int8" else None)

    # ------------------------------------------------------------------ calls
    @staticmethod
    def why_not_forward(attention_mask: Any = None, inputs_embeds: Any = None,
                        token_type_ids: Any = None) -> str:
        """What of a forward call the core plan does not run ("" if it runs it all)."""
        if inputs_embeds is not None:
            return "inputs_embeds"
        if token_type_ids is not None:
            return "token_type_ids"
        if attention_mask is not None and attention_mask.dim() != 2:
            return f"a {attention_mask.dim()}-D attention_mask"
        return ""

    def _new_real(self, mask: Any, cache: RowKVCache, b: int, t: int) -> torch.Tensor | None:
        """Which new tokens are real (None: all); drops past slots the mask now pads."""
        if mask is None:
            return None
        start = cache.length
        if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < start + t:
            raise InputError("compile", "attention_mask shape", f"[{b}, >= {start + t}] (past "
                             "+ new tokens)", list(mask.shape))
        m = mask[:, :start + t].to(self.device).bool()
        if start:
            cache.repad(m[:, :start])
        new = m[:, start:]
        return None if bool(new.all()) else new

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: RowKVCache | None = None, *,
                position_ids: Any = None, attention_mask: Any = None,
                inputs_embeds: Any = None, token_type_ids: Any = None,
                logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Any number of new tokens ``[B, T]`` over ``cache`` (None: no cache kept);
        logits ``[B, K, V]`` of the kept tokens (hidden states for a base model)."""
        why = self.why_not_forward(attention_mask, inputs_embeds, token_type_ids)
        if why:
            raise CapabilityError("compile", f"{why} on the core engine", "token ids with a "
                                  "2-D mask", why)
        ids = input_ids.to(self.device)
        b, t = ids.shape
        own = cache is None
        if own:
            _refuse_packed(position_ids, attention_mask)
            cache = self.new_cache(b, t)
        elif cache.batch != b:
            raise InputError("compile", "batch rows of the cache", cache.batch, b)
        try:
            return self._forward(ids, cache, position_ids, attention_mask, logits_to_keep)
        finally:
            if own:
                cache.free()

    def _forward(self, ids: torch.Tensor, cache: RowKVCache, position_ids: Any, mask: Any,
                 logits_to_keep: Any) -> torch.Tensor:
        b, t = ids.shape
        start = cache.length
        new = self._new_real(mask, cache, b, t)
        if position_ids is None:
            position_ids = torch.arange(start, start + t, device=self.device)[None]
        pos = position_ids.to(self.device).expand(b, t)
        real = new if new is not None else torch.ones(b, t, dtype=torch.bool, device=self.device)
        self._check_positions(int(pos[real].max()) if bool(real.any()) else 0)
        q = real.sum(dim=1).cpu().numpy()
        rows = np.flatnonzero(q)
        cols = _kept(logits_to_keep, t, self.device)
        out_rows = real[:, cols]                                            # [B, K] real kept
        width = self.vocab_size if self.lm_head else self.spec.hidden_size
        result = torch.zeros(b, len(cols), width, dtype=self.dtype, device=self.device)
        if len(rows):
            cache.reserve(int((cache.real_lens() + q).max()))
            packed_at = real.reshape(-1).long().cumsum(0).reshape(b, t) - 1  # packed index
            keep = packed_at[:, cols][out_rows]
            last = keep if keep.numel() else packed_at[rows[-1], -1:]
            out = run_in_place(self.op, ids[real], cache, q_lens=q[rows], rows=rows,
                               positions=pos[real].cpu().numpy(), keep=last.cpu().numpy())
            if keep.numel():
                result[out_rows] = out.reshape(keep.numel(), -1).to(self.dtype)
        cache.extend(new, t)
        self.stats["general_steps"] += 1
        return result

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: RowKVCache,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """A prompt batch into ``cache``; logits ``[B, V]`` of each row's last token.
        With a mask (left padding), positions default to Hugging Face ``generate``'s
        ``cumsum(mask) - 1``."""
        start = cache.length
        b, t = input_ids.shape
        if attention_mask is not None:
            full = attention_mask.to(self.device).bool()
            if full.shape[1] == t and start:
                past = cache.key_mask if cache.key_mask is not None else torch.ones(
                    b, start, dtype=torch.bool, device=self.device)
                full = torch.cat([past[:, :start], full], dim=1)
            if position_ids is None:
                p = full.long().cumsum(-1) - 1
                position_ids = p.masked_fill(~full, 0)[:, start:start + t]
            attention_mask = full
        elif position_ids is None and start:
            position_ids = torch.as_tensor(cache.real_lens(), device=self.device)[:, None] + \
                torch.arange(t, device=self.device)[None]
        return self.forward(input_ids, cache, position_ids=position_ids,
                            attention_mask=attention_mask, logits_to_keep=1)[:, -1]

    def decode(self, ids: torch.Tensor, cache: RowKVCache, positions: Any = None,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One new token per row (``ids`` [B] or [B, 1]); positions default to one past
        each row's last real token. Returns logits ``[B, V]`` (the plan's buffer:
        read it before the next step)."""
        if torch.is_grad_enabled():  # (a no_grad decorator costs a step's feeding again)
            with torch.no_grad():
                return self._decode(ids, cache, positions, attention_mask)
        return self._decode(ids, cache, positions, attention_mask)

    def _decode(self, ids: torch.Tensor, cache: RowKVCache, positions: Any,
                attention_mask: torch.Tensor | None) -> torch.Tensor:
        if ids.dim() != 1:
            ids = ids.reshape(-1)
        if ids.device != self.device:
            ids = ids.to(self.device)
        b = ids.shape[0]
        if attention_mask is not None and not self._mask_adds_real(attention_mask, cache, b):
            pos = None if positions is None else positions.reshape(b, 1)
            return self.forward(ids[:, None], cache, position_ids=pos,
                                attention_mask=attention_mask, logits_to_keep=1)[:, -1]
        if cache.batch != b:
            raise InputError("compile", "batch rows of the cache", cache.batch, b)
        lens = cache.real_lens()
        top = max(lens.tolist())
        # the default positions, each row's real tokens, are its cache slots (the rows
        # hold real tokens only): the feeder's own default, which moves them in place
        pos = None if positions is None else _host_ints(positions, b)
        if self._rope_limit is not None:
            self._check_positions(top if pos is None else int(pos.max()))
        cache.reserve(top + 1)
        out = run_in_place(self.op, self._step_ids(ids), cache, positions=pos, raw=True)
        cache.extend(None, 1)
        self.stats["plan_steps"] += 1
        return out

    def _step_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [B] copied into the runner's own [B, 1] buffer: the plan then reads
        the same tensor every step (its native run is not recorded again)."""
        buf = self._ids
        if buf is None or buf.shape[0] != ids.shape[0] or buf.dtype != ids.dtype \
                or buf.device != ids.device:
            with torch.inference_mode(False):  # writable inside and outside inference mode
                buf = self._ids = torch.empty(ids.shape[0], 1, dtype=ids.dtype,
                                              device=ids.device)
                self._ids_flat = buf.view(-1)
        self._ids_flat.copy_(ids)
        return buf

    def _check_positions(self, top: int) -> None:
        """A RoPE whose frequencies change with the length (dynamic) past it: refused."""
        r = self.spec.rope
        if r is not None and r.max_len is not None and top >= r.max_len:
            raise CapabilityError("compile", f"rope_type {r.rope_type!r} past {r.max_len} "
                                  "positions (its frequencies change with the length)",
                                  f"positions < {r.max_len}", top + 1)

    @staticmethod
    def _mask_adds_real(mask: torch.Tensor, cache: RowKVCache, b: int) -> bool:
        """Whether a decode step's 2-D mask says only what the cache knows: its past
        as stored, and one real new token per row."""
        n = cache.length
        if mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < n + 1:
            return False
        m = mask[:, :n + 1].bool()
        if not bool(m[:, n].all()):
            return False
        stored = cache.key_mask
        if stored is None:
            return bool(m[:, :n].all())
        return bool(torch.equal(m[:, :n].to(stored.device), stored[:, :n]))

    # ------------------------------------------------------------------ info
    def explain(self) -> str:
        """The core plan's report (nodes before/after fusion, kernels, layouts, arena,
        launches)."""
        form = self.op._in_place  # what the calls run: the in-place cache form
        return (form or self.op).explain()

    def layouts(self) -> dict[str, str]:
        """Node -> the weight layout its kernel packed (the last call's plan; what
        ``explain()`` lists under each node)."""
        form = self.op._in_place
        plan = getattr(form, "last_plan", None) if form else None
        if plan is None:
            return {}
        return {d["node"]: "; ".join(d["layouts"].values()) for d in plan.nodes_table()
                if d["layouts"]}

    @property
    def launches(self) -> int | None:
        """Kernel launches of the last call's bound program (None before any call)."""
        form = self.op._in_place
        plan = getattr(form, "last_plan", None) if form else None
        return None if plan is None else plan.launches

    @property
    def arena_bytes(self) -> int:
        """Bytes of the planned intermediates' arena of the last call's plan (taken from
        the memory pool and kept with the plan; 0 before any call)."""
        form = self.op._in_place
        plan = getattr(form, "last_plan", None) if form else None
        return 0 if plan is None else int(plan.memory.arena_bytes)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads (all but the embedding table)."""
        graph = self.op.graph
        if graph is None:
            return 0
        embed = next((n.inputs[0] for n in graph.nodes if n.op == "Embedding"), None)
        return int(sum(getattr(a, "nbytes", 0) for k, a in graph.weight_map.items()
                       if k != embed or not self.lm_head))


def _kept(logits_to_keep: Any, t: int, device: torch.device) -> torch.Tensor:
    """The new tokens whose outputs are wanted (Hugging Face's ``logits_to_keep``)."""
    if isinstance(logits_to_keep, torch.Tensor):
        cols = logits_to_keep.to(device).long().reshape(-1)
        if cols.numel() and (int(cols.min()) < -t or int(cols.max()) >= t):
            raise InputError("compile", "logits_to_keep indices", f"in [-{t}, {t})",
                             cols.tolist())
        return cols % t
    k = int(logits_to_keep)
    if k < 0:
        raise InputError("compile", "logits_to_keep", "an int >= 0 or an index tensor", k)
    return torch.arange(t - k if 0 < k < t else 0, t, device=device)


def _refuse_packed(position_ids: Any, mask: Any) -> None:
    """Positions restarting within a row and no mask: several sequences packed in one
    row, which Hugging Face's eager attention would let see each other."""
    if mask is None and position_ids is not None and position_ids.shape[-1] > 1:
        pos = position_ids.reshape(-1, position_ids.shape[-1])
        if bool((pos.diff(dim=-1) != 1).any()):
            raise CapabilityError("compile", "packed sequences in position_ids without an "
                                  "attention mask", "consecutive positions per row", "restarts")


def _host_ints(v: Any, n: int) -> np.ndarray:
    a = v.detach().reshape(-1).cpu().numpy() if isinstance(v, torch.Tensor) else \
        np.asarray(v).reshape(-1)
    if a.size != n:
        raise InputError("compile", "decode positions", f"{n} (one per row)", a.size)
    return a.astype(np.int64, copy=False)
