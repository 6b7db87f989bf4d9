"""Loading 4-bit GPTQ / AWQ (GEMM) safetensors checkpoints for ``quantize="w4"``.

A checkpoint whose ``config.json`` has ``quantization_config.quant_method`` "gptq" or
"awq" (bits 4) is built as the plain float model of its config, every quantized
Linear's weight set to what its codes dequantize to, ``s (q - z)``, so the model runs
as a float reference; the exact codes, scales and zero points are registered with
that weight (:data:`.weight_w4.PREQUANTIZED`), and ``compile(model, quantize="w4")``
packs them as they are instead of quantizing the float weight again.

Formats (int32 words, 8 codes each, lowest nibble first):

* GPTQ: ``qweight`` [K/8, N] packs 8 consecutive inputs; ``qzeros`` [K/G, N/8] packs 8
  outputs, each stored minus one (``checkpoint_format`` "gptq"; "gptq_v2" stores z);
  ``scales`` fp16 [K/G, N]; ``g_idx`` [K] the group of each input (only ``k // G``, in
  order, is taken: ``desc_act`` checkpoints with a permuted order are refused).
* AWQ (``version`` "gemm"): ``qweight`` [K, N/8] and ``qzeros`` [K/G, N/8] pack 8
  outputs in the order 0 2 4 6 1 3 5 7; zero points as they are; ``scales`` fp16 [K/G, N].
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from atbcore.errors import CapabilityError, InputError

from atbcore.models.quant import PREQUANTIZED, W4Codes

__all__ = ["quantization_method", "load_quantized", "unpack_gptq", "unpack_awq"]

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)   # packed slot i holds output _AWQ_ORDER[i]


def quantization_method(config: dict) -> str | None:
    """"gptq" or "awq" when the config's ``quantization_config`` says so, else None."""
    qc = config.get("quantization_config") or {}
    method = str(qc.get("quant_method", "")).lower()
    return method if method in ("gptq", "awq") else None


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W * 8], the lowest nibble first."""
    return ((words.unsqueeze(-1) >> _SHIFTS) & 15).to(torch.uint8).flatten(-2)


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                v2: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ tensors -> codes uint8 [N, K], scales fp16 [N, K/G], zeros uint8 [N, K/G]."""
    codes = _nibbles(qweight.t().contiguous())                  # [N, K]
    zeros = _nibbles(qzeros)                                     # [K/G, N]
    if not v2:
        zeros = (zeros + 1) & 15
    return codes, scales.t().contiguous().half(), zeros.t().contiguous()


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors -> codes uint8 [N, K], scales fp16 [N, K/G], zeros uint8 [N, K/G]."""
    inv = torch.tensor(_AWQ_ORDER).argsort()                     # output j sits in slot inv[j]

    def outputs(words: torch.Tensor) -> torch.Tensor:
        v = _nibbles(words).view(words.shape[0], -1, 8)          # [rows, N/8, slot]
        return v[..., inv].flatten(-2)                          # [rows, N]

    return (outputs(qweight).t().contiguous(), scales.t().contiguous().half(),
            outputs(qzeros).t().contiguous())


def _read(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def load_quantized(d: str | Path, dtype: torch.dtype | None = None, who: str = "LLM") -> Any:
    """The float causal LM of a GPTQ/AWQ checkpoint directory ``d`` with its codes
    registered for ``quantize="w4"`` (see the module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    d = Path(d)
    raw = json.loads((d / "config.json").read_text())
    method = quantization_method(raw)
    qc = raw.get("quantization_config") or {}
    if method is None or int(qc.get("bits", 0)) != 4:
        raise CapabilityError(who, "quantization_config", "4-bit GPTQ or AWQ",
                              f"{qc.get('quant_method')} bits {qc.get('bits')}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise CapabilityError(who, "AWQ version", "'gemm'", qc.get("version"))
    cfg = AutoConfig.from_pretrained(str(d), local_files_only=True)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.float32)
    tensors = _read(d)
    prefixes = sorted(k[:-len(".qweight")] for k in tensors if k.endswith(".qweight"))
    modules = dict(model.named_modules())
    plain = {k: v for k, v in tensors.items()
             if not k.endswith((".qweight", ".qzeros", ".scales", ".g_idx"))}
    for p in prefixes:
        if p not in modules:
            raise InputError(who, f"quantized tensor {p}.qweight", "a Linear of the model",
                             "no such module")
        codes, scales, zeros = (unpack_awq if method == "awq" else _unpack_gptq_checked)(
            *[tensors[f"{p}.{n}"] for n in ("qweight", "qzeros", "scales")],
            **({} if method == "awq" else {"g_idx": tensors.get(f"{p}.g_idx"),
                                            "v2": qc.get("checkpoint_format") == "gptq_v2",
                                            "who": who, "name": p}))
        n, k = codes.shape
        group = k // scales.shape[1]
        lin = modules[p]
        if tuple(lin.weight.shape) != (n, k):
            raise InputError(who, f"{p}.qweight", f"codes of a {list(lin.weight.shape)} weight",
                             [n, k])
        rep = lambda t: t.float().repeat_interleave(group, 1)  # noqa: E731
        w = (codes.float() - rep(zeros)) * rep(scales)
        with torch.no_grad():
            lin.weight.copy_(w.to(lin.weight.dtype))
        if group % 32 == 0:  # the w4 kernel's groups are whole blocks of 32 inputs
            sym = bool((zeros == 8).all())  # symmetric (sym=True): the kernel's z = 8 form
            PREQUANTIZED.register(lin.weight, W4Codes(codes, scales, None if sym else zeros,
                                                      group))
    missing, unexpected = model.load_state_dict(plain, strict=False)
    quantized = {f"{p}.weight" for p in prefixes}
    left = [m for m in missing if m not in quantized and "rotary" not in m]
    if getattr(cfg, "tie_word_embeddings", False):
        left = [m for m in left if m != "lm_head.weight"]
        model.tie_weights()
    if left or unexpected:
        raise InputError(who, f"weights of {d}", "every tensor of the model, no others",
                         f"missing {left[:5]}, unexpected {unexpected[:5]}")
    return model.eval()


def _unpack_gptq_checked(qweight, qzeros, scales, g_idx, v2, who, name):
    k = qweight.shape[0] * 8
    group = k // scales.shape[0]
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64),
                                             torch.arange(k) // group):
        raise CapabilityError(who, f"{name}.g_idx", "groups of consecutive inputs "
                              "(desc_act=False)", "a permuted act-order")
    return unpack_gptq(qweight, qzeros, scales, v2)
