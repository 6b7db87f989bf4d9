"""llama.cpp baseline: the bench model's own weights written as GGUF (F32, BF16,
Q8_0, Q4_0) with the ``gguf`` package, run by ``llama-cpp-python`` in the same process.

The conversion follows llama.cpp's LLaMA layout: tensor names ``blk.N.attn_q`` ...,
q/k projection rows reordered from Hugging Face's rotate-half RoPE layout to
llama.cpp's interleaved one, 1-D tensors (norms) kept in F32. The vocabulary is a
synthetic SentencePiece-style table of the model's size (the bench feeds token ids,
never text), so any local LLaMA-architecture directory converts without its
tokenizer. Only batch 1 (llama-cpp-python runs one sequence)."""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .hf import DecodeRun

__all__ = ["LlamaCppDecoder", "write_gguf", "GGUF_TYPES"]

GGUF_TYPES = ("F32", "BF16", "Q8_0", "Q4_0")


def _permute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head from [first halves | second halves] to interleaved pairs."""
    out, inp = w.shape
    hd = out // n_heads
    return w.reshape(n_heads, 2, hd // 2, inp).swapaxes(1, 2).reshape(out, inp)


def _vocab(n: int, bos: int | None, eos: int | None) -> tuple[list[str], list[int]]:
    toks, types = [], []
    for i in range(n):
        if i == 0:
            toks.append("<unk>"), types.append(2)                    # UNKNOWN
        elif i in (bos, eos):
            toks.append("<s>" if i == bos else "</s>"), types.append(3)  # CONTROL
        elif 3 <= i < 259:
            toks.append(f"<0x{i - 3:02X}>"), types.append(6)         # BYTE
        else:
            toks.append(f"\u2581t{i}"), types.append(1)              # NORMAL
    return toks, types


def write_gguf(model: Any, path: str | Path, qtype: str = "F32") -> Path:
    """Write a LLaMA-architecture HF model as GGUF ``qtype`` (F32, BF16, Q8_0 or Q4_0)."""
    import gguf

    cfg = model.config
    if getattr(cfg, "model_type", None) not in ("llama", "mistral"):
        raise ValueError(f"GGUF conversion here covers LLaMA-style models, not {cfg.model_type}")
    q = {"F32": gguf.GGMLQuantizationType.F32, "BF16": gguf.GGMLQuantizationType.BF16,
         "Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
             "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[qtype]
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // nh
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("atb-bench")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get(
        "rope_theta", 10000.0)
    w.add_rope_freq_base(float(theta))
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(ftype)
    toks, types = _vocab(cfg.vocab_size, cfg.bos_token_id, cfg.eos_token_id)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * len(toks))
    w.add_token_types(types)
    if cfg.bos_token_id is not None:
        w.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_id is not None:
        w.add_eos_token_id(cfg.eos_token_id if isinstance(cfg.eos_token_id, int)
                           else cfg.eos_token_id[0])

    def put(name: str, t: torch.Tensor, rope_heads: int | None = None) -> None:
        a = t.detach().float().cpu().numpy()
        if rope_heads:
            a = _permute_rope(a, rope_heads)
        if a.ndim == 1 or q == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, np.ascontiguousarray(a, dtype=np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), q), raw_dtype=q)

    m = model.model
    put("token_embd.weight", m.embed_tokens.weight)
    for i, layer in enumerate(m.layers):
        a, f = layer.self_attn, layer.mlp
        put(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        put(f"blk.{i}.attn_q.weight", a.q_proj.weight, nh)
        put(f"blk.{i}.attn_k.weight", a.k_proj.weight, nkv)
        put(f"blk.{i}.attn_v.weight", a.v_proj.weight)
        put(f"blk.{i}.attn_output.weight", a.o_proj.weight)
        put(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        put(f"blk.{i}.ffn_gate.weight", f.gate_proj.weight)
        put(f"blk.{i}.ffn_up.weight", f.up_proj.weight)
        put(f"blk.{i}.ffn_down.weight", f.down_proj.weight)
    put("output_norm.weight", m.norm.weight)
    put("output.weight", model.lm_head.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


class LlamaCppDecoder:
    """Greedy decoding with llama.cpp on a GGUF file; see the module docstring."""

    def __init__(self, path: Path, n_ctx: int, workdir: Any, convert_s: float) -> None:
        from llama_cpp import Llama

        self.workdir, self.convert_s = workdir, convert_s
        threads = torch.get_num_threads()
        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(n_ctx, 512),
                         n_threads=threads, n_threads_batch=threads, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    @staticmethod
    def missing() -> list[str]:
        return [p for p, m in (("llama-cpp-python", "llama_cpp"), ("gguf", "gguf"))
                if importlib.util.find_spec(m) is None]

    @classmethod
    def create(cls, model: Any, qtype: str, batch: int, n_ctx: int) -> "LlamaCppDecoder | dict":
        """A decoder, or a status dict saying why there is none."""
        miss = cls.missing()
        if miss:
            return {"status": f"not installed ({', '.join(miss)})"}
        if batch != 1:
            return {"status": "batch 1 only"}
        try:
            work = tempfile.TemporaryDirectory(prefix="atb-gguf-")
            t0 = time.perf_counter()
            path = write_gguf(model, Path(work.name) / f"model-{qtype}.gguf", qtype)
            return cls(path, n_ctx, work, time.perf_counter() - t0)
        except Exception as e:  # a conversion or load failure is a result to report
            return {"status": f"failed: {type(e).__name__}: {str(e)[:200]}"}

    def _last_logits(self) -> np.ndarray:
        # eval() keeps no scores unless every position's logits are computed
        # (logits_all, which would slow the prefill): read the last row from the context
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill(self, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Prompt processing of ``ids`` [1, S] from an empty context: (CPU seconds of
        every thread, as atb's prefill is timed on a shared machine; the last position's
        logits [1, V])."""
        self.llm.reset()
        c0 = time.process_time()
        self.llm.eval([int(t) for t in ids[0]])
        return time.process_time() - c0, torch.from_numpy(self._last_logits().copy())[None]

    def greedy(self, ids: torch.Tensor, new_tokens: int, record: bool = False,
               forced: torch.Tensor | None = None) -> DecodeRun:
        """Greedy tokens; ``forced`` [1, new_tokens] feeds those tokens instead (and
        ``record`` keeps each step's logits), for accuracy along another engine's path."""
        llm = self.llm
        prompt = [int(t) for t in ids[0]]
        seen: list[torch.Tensor] = []

        def pick(i: int) -> int:
            logits = self._last_logits()
            if record:
                seen.append(torch.from_numpy(logits.copy())[None].float())
            return int(np.argmax(logits)) if forced is None else int(forced[0, i])
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        nxt = pick(0)
        toks = [nxt]
        t1 = time.perf_counter()
        for i in range(1, new_tokens):
            llm.eval([nxt])
            nxt = pick(i)
            toks.append(nxt)
        t2 = time.perf_counter()
        return DecodeRun(torch.tensor([toks]), t1 - t0, t2 - t1, seen)
