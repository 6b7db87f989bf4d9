"""The x86-64-v3 (AVX2 + FMA) build of the C kernels, on any x86 CPU that runs it: its
intrinsic tiles (panel matmul at every weight dtype, w4, w8a8, the prefill attention)
against float64 NumPy, so that a machine with AVX-512 (whose default build never
compiles them) checks them too: there in one subprocess with its own kernel cache, built
with ``ATB_CPU_ISA=avx2``; on an AVX2 machine in this process. 1 and 2 threads
bit-equal."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from atbcore.backends.cpu_kernels import available, bindings
from atbcore.backends.cpu_kernels.build import isa_flags
from atbcore.numerics import assert_close
from atbcore.ops.linear_quant import act_q8

pytestmark = pytest.mark.skipif(
    not available() or "x86-64-v3" not in [isa for isa, _ in isa_flags()],
    reason="no C compiler, or a CPU without AVX2/FMA")

# the kernels' calls on the inputs d, into the outputs out (run here when this process's
# build is x86-64-v3 already, else in a subprocess that builds it)
_CALLS = r"""
from atbcore.backends.cpu_kernels.torch_linear import linear_rows, pack_panels
from atbcore.backends.cpu_kernels.torch_linear_w4 import linear_w4, pack_w4
from atbcore.backends.cpu_kernels.torch_w8a8 import linear_w8a8, pack_w8a8
from atbcore.backends.cpu_kernels.torch_prefill import prefill_attention
from atbcore.backends.cpu_kernels.torch_decode import decode_attention
out = {}
keep = torch.get_num_threads()
for th in (1, 2):
    for name, w in (("f32", d["w"]), ("bf16", d["w"].bfloat16()), ("i8", d["wq"])):
        sc = d["s"] if name == "i8" else None
        x = d["x"].bfloat16() if name == "bf16" else d["x"]
        out[f"{name}_{th}"] = linear_rows(x, w, scale=sc, panels=pack_panels(w), threads=th)
    out[f"w4_{th}"] = linear_w4(d["x"], pack_w4(*d["w4"], k=d["x"].shape[1]), threads=th)
    out[f"w8a8_{th}"] = linear_w8a8(d["x"], pack_w8a8(d["wq"]), d["s"], threads=th)
    torch.set_num_threads(th)
    out[f"attn_{th}"] = prefill_attention(d["q"], d["k"], d["v"], scale=0.125, q_lens=[37, 20])
    out[f"dec_{th}"] = decode_attention(d["dq"], d["dk"].bfloat16(), d["dv"].bfloat16(), n=700,
                                        lo=3, scale=0.125)
torch.set_num_threads(keep)
"""
_SUBPROCESS = r"""
import sys, torch
from atbcore.backends.cpu_kernels import bindings
assert bindings.build_info().isa == "x86-64-v3", bindings.build_info()
d = torch.load(sys.argv[1])
""" + _CALLS + r"""
torch.save(out, sys.argv[2])
"""


def _attention_ref(q, k, v, lens, scale):
    """float64 causal GQA attention per packed sequence."""
    q, k, v = (t.double().numpy() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    y, t0 = np.zeros_like(q), 0
    for n in lens:
        for h in range(q.shape[1]):
            s = q[t0:t0 + n, h] @ k[t0:t0 + n, h // g].T * scale
            s[np.triu(np.ones((n, n), bool), 1)] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            y[t0:t0 + n, h] = (p / p.sum(axis=1, keepdims=True)) @ v[t0:t0 + n, h // g]
        t0 += n
    return y


def test_avx2_build_kernels_against_float64(tmp_path):
    from atbcore.backends.cpu_kernels.torch_linear_w4 import quantize_w4
    from atbcore.ops.linear import quantize_w8

    g = torch.Generator().manual_seed(23)
    m, k, n = 13, 203, 75    # row tails of every tile, K and N tails
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    wq, s = quantize_w8(w)
    codes, scales, zeros, grp = quantize_w4(w, 32, False)
    q, kk, v = (torch.randn(57, h, 64, generator=g) for h in (4, 2, 2))
    dq, dk, dv = (torch.randn(*s, generator=g) for s in ((3, 6, 40), (3, 701, 2, 40),
                                                         (3, 701, 2, 40)))
    d = {"x": x, "w": w, "wq": wq, "s": s.float(), "w4": (codes, scales, zeros, grp),
         "q": q, "k": kk, "v": v, "dq": dq, "dk": dk, "dv": dv}
    if bindings.build_info().isa == "x86-64-v3":  # this process's kernels are the ones
        ns = {"torch": torch, "d": d}
        exec(_CALLS, ns)
        out = ns["out"]
    else:
        torch.save(d, tmp_path / "in.pt")
        env = dict(os.environ, ATB_CPU_ISA="avx2", ATB_CPU_KERNELS_CACHE=str(tmp_path / "cache"))
        subprocess.run([sys.executable, "-c", _SUBPROCESS, str(tmp_path / "in.pt"),
                        str(tmp_path / "out.pt")], env=env, check=True, timeout=900)
        out = torch.load(tmp_path / "out.pt")
    for name in ("f32", "bf16", "i8", "w4", "w8a8", "attn", "dec"):
        assert torch.equal(out[f"{name}_1"], out[f"{name}_2"]), name
    xd = x.double().numpy()
    assert_close(out["f32_1"], (xd @ w.double().numpy().T).astype(np.float32), "fp32", "f32")
    wb = w.bfloat16().double().numpy()
    assert_close(out["bf16_1"].float(), (x.bfloat16().double().numpy() @ wb.T).astype(np.float32),
                 "bf16", "bf16 panels")
    wd = wq.double().numpy() * s.double().numpy()[:, None]
    xq = act_q8(x.numpy())  # int8 panels read x as int8 blocks of 32 (panel_q8.c)
    assert_close(out["i8_1"], (xq @ wd.T).astype(np.float32), "fp32", "int8 panels")
    # the quantized-activation kernels: near the fp32 product (their own exact references
    # are in test_cpu_linear_w4.py / test_cpu_gemm_i8.py and run on this build's tiles
    # wherever it is the default)
    w4d = ((codes.double() - zeros.double().repeat_interleave(grp, 1)[:, :codes.shape[1]])
           * scales.double().repeat_interleave(grp, 1)[:, :codes.shape[1]]).numpy()[:, :k]
    for name, ref in (("w4", xd @ w4d.T), ("w8a8", xd @ wd.T)):
        got = out[f"{name}_1"].double().numpy()
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.02, name
    ref = _attention_ref(q, kk, v, [37, 20], 0.125)
    assert_close(out["attn_1"], ref.astype(np.float32), "fp32", "prefill attention")
    # the decode attention's tiles (attn_passes.c) over a bf16 cache: G = 3, 5 vectors
    kd, vd = (t.bfloat16().double()[:, 3:700] for t in (dk, dv))
    ref = np.zeros((3, 6, 40))
    for b in range(3):
        for h in range(6):
            z = kd[b, :, h // 3].numpy() @ dq[b, h].double().numpy() * 0.125
            p = np.exp(z - z.max())
            ref[b, h] = (p / p.sum()) @ vd[b, :, h // 3].numpy()
    assert_close(out["dec_1"], ref.astype(np.float32), "fp32", "decode attention, bf16 cache")
