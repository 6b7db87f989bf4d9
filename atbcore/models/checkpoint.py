"""A local Hugging Face checkpoint without torch: ``config.json`` (through
``transformers.AutoConfig``, which needs no torch), the tokenizer, and the
``*.safetensors`` weights read straight into NumPy arrays (memory-mapped, zero-copy;
bf16 as ``ml_dtypes.bfloat16``), then sorted into a :class:`~.arch.ModelWeights`
by their Hugging Face names. Nothing is fetched from a hub; pickle weights are refused.

    d = check_checkpoint_dir("path/to/ckpt")
    config, tokenizer = load_config(d), load_tokenizer(d)
    spec = resolve_architecture(config).describe(config)
    weights = weights_from_tensors(spec, load_tensors(d), config)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..dtypes import Dtype
from ..errors import CapabilityError, InputError
from .arch import LayerWeights, ModelSpec, ModelWeights

__all__ = ["check_checkpoint_dir", "load_config", "load_tokenizer", "load_tensors",
           "weights_from_tensors", "eos_token_ids"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# safetensors dtype names -> ours
_ST_DTYPES = {"F64": Dtype.FP64, "F32": Dtype.FP32, "F16": Dtype.FP16, "BF16": Dtype.BF16,
              "I64": Dtype.INT64, "I32": Dtype.INT32, "I8": Dtype.INT8, "BOOL": Dtype.BOOL}


def check_checkpoint_dir(path: str | os.PathLike, who: str = "LLM") -> Path:
    """The directory, after checking it holds ``config.json`` and safetensors weights.

    A missing directory, a missing config or pickle-only weights (``.bin``) raise an
    :class:`~atbcore.errors.InputError` naming what was found: pickle files can run
    code when loaded, so they are refused rather than loaded."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise InputError(who, "checkpoint", "a local directory with config.json and "
                         "*.safetensors (hub names are not fetched)", str(path))
    if not (d / "config.json").is_file():
        raise InputError(who, f"checkpoint {d}", "a config.json", sorted(p.name for p in d.iterdir()))
    names = sorted(p.name for p in d.iterdir() if p.is_file())
    if not any(n.endswith(".safetensors") for n in names):
        pickles = [n for n in names if n.endswith(_PICKLE_SUFFIXES)]
        given = f"only pickle weights {pickles}" if pickles else f"no weights ({names})"
        raise InputError(who, f"checkpoint {d} weights",
                         "safetensors files (convert .bin with save_pretrained("
                         "safe_serialization=True); pickle is never loaded)", given)
    return d


def load_config(d: Path, who: str = "LLM") -> Any:
    """The checkpoint's Hugging Face config (local files only)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(who, f"config of {d}", "a config.json transformers can read",
                         f"{type(e).__name__}: {e}") from e


def load_tokenizer(d: Path, who: str = "LLM") -> Any:
    """The checkpoint's tokenizer through ``AutoTokenizer`` (local files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(who, f"tokenizer of {d}", "tokenizer files (tokenizer.json or "
                         "tokenizer_config.json + vocab) in the checkpoint directory",
                         f"{type(e).__name__}: {e}") from e


def eos_token_ids(d: Path, config: Any) -> frozenset[int]:
    """End-of-sequence ids of ``generation_config.json`` and of the config."""
    ids: set[int] = set()
    found = [getattr(config, "eos_token_id", None)]
    gen = d / "generation_config.json"
    if gen.is_file():
        found.append(json.loads(gen.read_text()).get("eos_token_id"))
    for e in found:
        if e is not None:
            ids.update([e] if isinstance(e, int) else e)
    return frozenset(ids)


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one file as a read-only memory-mapped array (no copy)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise InputError("load_tensors", f"{path.name}: {name} dtype",
                             sorted(_ST_DTYPES), info["dtype"])
        a, b = info["data_offsets"]
        out[name] = raw[8 + n + a:8 + n + b].view(dt.numpy).reshape(info["shape"])
    return out


def load_tensors(d: Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint's ``*.safetensors`` files, by name."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(_read_safetensors(f))
    return out


def weights_from_tensors(spec: ModelSpec, tensors: Mapping[str, Any], config: Any,
                         who: str = "LLM") -> ModelWeights:
    """The Llama-family weights (Llama, Mistral, Qwen2) of a checkpoint's tensors, by
    their Hugging Face names; a tied LM head reads the embedding."""
    if spec.arch not in ("llama", "mistral", "qwen2") or spec.moe is not None:
        raise CapabilityError(who, f"checkpoint weights of a {spec.arch} model",
                              "a Llama, Mistral or Qwen2 checkpoint", spec.arch)
    pre = "model." if any(k.startswith("model.") for k in tensors) else ""

    def get(name: str, required: bool = True) -> Any:
        t = tensors.get(pre + name, tensors.get(name))
        if t is None and required:
            raise InputError(who, "checkpoint tensor", name, "missing")
        return t

    layers = []
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        lw = LayerWeights(
            q=get(p + "self_attn.q_proj.weight"), k=get(p + "self_attn.k_proj.weight"),
            v=get(p + "self_attn.v_proj.weight"), o=get(p + "self_attn.o_proj.weight"),
            attn_norm=get(p + "input_layernorm.weight"),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            gate=get(p + "mlp.gate_proj.weight"), up=get(p + "mlp.up_proj.weight"),
            down=get(p + "mlp.down_proj.weight"))
        for proj in "qkvo":
            setattr(lw, f"{proj}_b", get(p + f"self_attn.{proj}_proj.bias", False))
        for proj in ("gate", "up", "down"):  # Llama's mlp_bias
            setattr(lw, f"{proj}_b", get(p + f"mlp.{proj}_proj.bias", False))
        layers.append(lw)
    embed = get("embed_tokens.weight")
    head = tensors.get("lm_head.weight")
    if head is None and getattr(config, "tie_word_embeddings", False):
        head = embed
    if head is None:
        raise InputError(who, "checkpoint tensor", "lm_head.weight (or tied embeddings)",
                         "missing")
    return ModelWeights(embed=embed, layers=layers, final_norm=get("norm.weight"), lm_head=head)
