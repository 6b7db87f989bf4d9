"""The two encoder engines the encoder tests run on: ``runner`` (compile()'s
hand-written ModelRunner.encode / FastEncoder) and ``core`` (the lowered core
GraphOp, :mod:`atb_torch.models.lower_encoder`), behind the same compiled model."""

from __future__ import annotations

from typing import Any

from atb_torch.models import compile
from atb_torch.models.lower_encoder import CoreEncoder, lower_encoder

ENGINES = ("runner", "core")


def on_engine(compiled: Any, original: Any, engine: str, **kw: Any) -> Any:
    """``compiled`` (compile() of the HF encoder ``original``) running ``engine``: for
    "core" its ``atb_runner`` becomes a :class:`CoreEncoder` of ``original`` (``kw``:
    ``dtype``, ``quantize``)."""
    if engine == "core":
        compiled.__dict__["atb_runner"] = lower_encoder(original, **kw)
    return compiled


def compile_on(model: Any, engine: str, **kw: Any) -> Any:
    """compile(model, **kw) running ``engine`` (the core takes dtype/quantize only)."""
    c = compile(model, **kw)
    core_kw = {k: v for k, v in kw.items() if k in ("dtype", "quantize")}
    return on_engine(c, model, engine, **core_kw)


def is_core(c: Any) -> bool:
    return isinstance(c.__dict__.get("atb_runner"), CoreEncoder)
