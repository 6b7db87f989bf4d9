"""Loading a local Hugging Face checkpoint: safetensors weights and the tokenizer from a
directory, never from a hub and never through pickle (the checks and the tokenizer are
the core's, :mod:`atbcore.models.checkpoint`; here the weights load as a torch model)."""

from __future__ import annotations

import json
import os
from typing import Any

from atbcore.errors import InputError
from atbcore.models.checkpoint import check_checkpoint_dir, load_tokenizer

__all__ = ["check_checkpoint_dir", "load_checkpoint", "load_tokenizer"]


def load_checkpoint(path: str | os.PathLike, dtype: Any = None, device: str = "cpu",
                    who: str = "LLM") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local causal-LM checkpoint: weights through
    ``from_pretrained(local_files_only=True, use_safetensors=True)``, the tokenizer
    through ``AutoTokenizer`` (local files only). A 4-bit GPTQ/AWQ checkpoint loads
    through :func:`atb_torch.models.gptq_load.load_quantized`."""
    from transformers import AutoModelForCausalLM

    from ..models.gptq_load import load_quantized, quantization_method

    d = check_checkpoint_dir(path, who)
    tokenizer = load_tokenizer(d, who)
    if quantization_method(json.loads((d / "config.json").read_text())):
        # GPTQ/AWQ: the float model of its codes, the codes kept for quantize="w4"
        return load_quantized(d, dtype, who).to(device), tokenizer
    kw: dict[str, Any] = {"local_files_only": True, "use_safetensors": True}
    if dtype is not None:
        kw["dtype"] = dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(d), **kw)
    except ValueError as e:  # unknown architecture or config option, said by transformers
        raise InputError(who, f"model of {d}", "a causal LM transformers can build",
                         str(e)) from e
    return model.to(device).eval(), tokenizer
