"""Loading a local Hugging Face checkpoint: safetensors weights and the tokenizer from a
directory, never from a hub and never through pickle."""

from __future__ import annotations

import os
from typing import Any

from atbcore.errors import InputError
from atbcore.models.checkpoint import check_checkpoint_dir

__all__ = ["check_checkpoint_dir", "load_checkpoint"]

def load_checkpoint(path: str | os.PathLike, dtype: Any = None, device: str = "cpu",
                    who: str = "LLM") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local causal-LM checkpoint: weights through
    ``from_pretrained(local_files_only=True, use_safetensors=True)``, the tokenizer
    through ``AutoTokenizer`` (local files only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = check_checkpoint_dir(path, who)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(who, f"tokenizer of {d}", "tokenizer files (tokenizer.json or "
                         "tokenizer_config.json + vocab) in the checkpoint directory",
                         f"{type(e).__name__}: {e}") from e
    kw: dict[str, Any] = {"local_files_only": True, "use_safetensors": True}
    if dtype is not None:
        kw["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(d), **kw)
    except ValueError as e:  # unknown architecture or config option, said by transformers
        raise InputError(who, f"model of {d}", "a causal LM transformers can build",
                         str(e)) from e
    return model.to(device).eval(), tokenizer
