"""Loading a local Hugging Face checkpoint: safetensors weights and the tokenizer from a
directory, never from a hub and never through pickle."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from atbcore.errors import InputError

__all__ = ["check_checkpoint_dir", "load_checkpoint", "load_tokenizer"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


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


def load_tokenizer(d: Path, who: str = "LLM") -> Any:
    """The tokenizer of checkpoint directory ``d`` (local files only)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(who, f"tokenizer of {d}", "tokenizer files (tokenizer.json or "
                         "tokenizer_config.json + vocab) in the checkpoint directory",
                         f"{type(e).__name__}: {e}") from e


def load_checkpoint(path: str | os.PathLike, dtype: Any = None, device: str = "cpu",
                    who: str = "LLM") -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local causal-LM checkpoint: weights through
    ``from_pretrained(local_files_only=True, use_safetensors=True)``, the tokenizer
    through ``AutoTokenizer`` (local files only). A 4-bit GPTQ/AWQ checkpoint loads
    through :func:`atb_torch.models.gptq_load.load_quantized`."""
    import json

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
