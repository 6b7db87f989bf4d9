"""ONNX Runtime baseline for the encoder benchmark: the sentence-transformers model's
BERT exported to ONNX, rewritten by ``onnxruntime.transformers.optimizer`` (fused
attention, LayerNorm, GELU — what ORT users deploy), run with ORT's CPU provider.
``encode`` mirrors sentence-transformers': length-sorted batches, mean pooling over
the mask, L2 normalisation."""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["OrtEncoder"]


class OrtEncoder:
    """Build with :meth:`create` (returns a status dict instead when it cannot run)."""

    def __init__(self, st: Any, session: Any, workdir: Any) -> None:
        self.st, self.session, self._workdir = st, session, workdir
        self.tokenizer = st.tokenizer
        self.max_len = st.max_seq_length
        self.inputs = {i.name for i in session.get_inputs()}

    @classmethod
    def create(cls, st: Any, path: str, int8: bool = False) -> "OrtEncoder | dict":
        """``int8``: the optimized model then goes through ORT's dynamic quantization
        (``quantize_dynamic``: int8 weights, activations quantized at run time), the
        int8 model ORT users deploy."""
        missing = [m for m in ("onnxruntime", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return {"status": f"not installed ({', '.join(missing)})"}
        try:
            return cls._build(st, int8)
        except Exception as e:  # an export/optimizer failure is a result to report
            return {"status": f"failed: {type(e).__name__}: {str(e)[:200]}"}

    @classmethod
    def _build(cls, st: Any, int8: bool = False) -> "OrtEncoder":
        import onnxruntime as ort
        from onnxruntime.transformers import optimizer

        bert = st[0].auto_model if hasattr(st[0], "auto_model") else st[0].model
        cfg = bert.config
        work = tempfile.TemporaryDirectory(prefix="atb-ort-")
        raw, opt = Path(work.name) / "model.onnx", Path(work.name) / "model_opt.onnx"
        ids = torch.ones(2, 16, dtype=torch.long)
        mask = torch.ones(2, 16, dtype=torch.long)
        tt = torch.zeros(2, 16, dtype=torch.long)
        axes = {0: "batch", 1: "seq"}

        class Wrapped(torch.nn.Module):  # plain tensors out: the exporter needs no ModelOutput
            def __init__(self, m: Any) -> None:
                super().__init__()
                self.m = m

            def forward(self, input_ids, attention_mask, token_type_ids):  # noqa: D401
                return self.m(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state

        with warnings.catch_warnings():  # tracer warnings about HF's shape checks
            warnings.simplefilter("ignore")
            torch.onnx.export(Wrapped(bert).eval(), (ids, mask, tt), str(raw),
                              input_names=["input_ids", "attention_mask", "token_type_ids"],
                              output_names=["last_hidden_state"],
                              dynamic_axes={"input_ids": axes, "attention_mask": axes,
                                            "token_type_ids": axes, "last_hidden_state": axes},
                              opset_version=17, dynamo=False)
        model = optimizer.optimize_model(str(raw), model_type="bert",
                                         num_heads=cfg.num_attention_heads,
                                         hidden_size=cfg.hidden_size)
        model.save_model_to_file(str(opt))
        if int8:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            q8 = Path(work.name) / "model_int8.onnx"
            # the unfused export: the optimizer's com.microsoft nodes defeat its shape
            # inference; the session fuses the quantized graph itself
            # int8 MatMuls with per-channel weight scales, as atb's (quantizing the
            # embedding gathers too cost accuracy: cosine ~0.90 to fp32 here)
            quantize_dynamic(str(raw), str(q8), weight_type=QuantType.QInt8, per_channel=True,
                             op_types_to_quantize=["MatMul"])
            opt = q8
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(str(opt), so, providers=["CPUExecutionProvider"])
        return cls(st, sess, work)

    def encode(self, sentences: list[str], batch_size: int = 32) -> torch.Tensor:
        """Normalised mean-pooled embeddings ``[N, H]`` in the input order."""
        order = np.argsort([-len(s) for s in sentences], kind="stable")  # longest first, as ST
        out: list[np.ndarray] = [None] * len(sentences)  # type: ignore[list-item]
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            enc = self.tokenizer([sentences[j] for j in idx], padding=True, truncation=True,
                                 max_length=self.max_len, return_tensors="np")
            feed = {k: enc[k].astype(np.int64) for k in self.inputs if k in enc}
            if "token_type_ids" in self.inputs and "token_type_ids" not in feed:
                feed["token_type_ids"] = np.zeros_like(feed["input_ids"])
            h, = self.session.run(["last_hidden_state"], feed)              # [B, S, H]
            m = enc["attention_mask"][..., None].astype(np.float32)
            e = (h * m).sum(1) / np.clip(m.sum(1), 1e-9, None)
            e /= np.clip(np.linalg.norm(e, axis=1, keepdims=True), 1e-12, None)
            for j, row in zip(idx, e):
                out[j] = row
        return torch.from_numpy(np.stack(out)).float()
