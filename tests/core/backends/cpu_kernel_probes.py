"""Bad calls of the C-kernel wrappers, run one after another in a child process.

Each probe builds its tensors, makes one bad call and reports one JSON line:
``{"probe": name, "got": "AtbError" | "no error" | "<ExceptionType>",
"untouched": bool}`` (``untouched``: every buffer the call could have written still
holds what it held before). The line ``{"start": name}`` is printed (flushed)
before each call, so when a wrapper lets a bad call reach the C code and it
crashes, the parent sees which probe killed the process. Run as a script by
``test_cpu_kernel_probes.py``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from atbcore.backends.cpu_kernels import torch_decode as cd
from atbcore.backends.cpu_kernels import torch_ops as co
from atbcore.errors import AtbError
from cpu_kernel_probes_registry import PROBES, probe, sentinel

# ------------------------------------------------------------------ norms
@probe
def rms_norm_short_weight():  # the segfault: a 1-element weight for 2**24 columns
    return lambda: co.rms_norm(torch.randn(2, 1 << 24), torch.ones(1), 1 << 24, 1e-6), []


@probe
def rms_norm_n_not_the_trailing_extent():
    return lambda: co.rms_norm(torch.randn(3, 10), torch.ones(12), 12, 1e-6), []


@probe
def layer_norm_short_bias():
    return lambda: co.layer_norm(torch.randn(4, 64), torch.ones(64), torch.zeros(8), 64,
                                 1e-5), []


@probe
def rms_norm_residual_wrong_shape():
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6,
                               residual=torch.randn(2, 64)), []


@probe
def rms_norm_residual_other_dtype():
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6,
                               residual=torch.randn(4, 64).half()), []


@probe
def rms_norm_out_wrong_shape():
    out = sentinel(4, 32)
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6, out=out), [out]


@probe
def rms_norm_meta_out():
    out = torch.empty(4, 64, device="meta")
    return lambda: co.rms_norm(torch.randn(4, 64), torch.ones(64), 64, 1e-6, out=out), []


@probe
def rms_norm_float64():
    return lambda: co.rms_norm(torch.randn(4, 64, dtype=torch.float64), None, 64, 1e-6), []


@probe
def rms_norm_not_a_tensor():
    return lambda: co.rms_norm([[1.0, 2.0]], None, 2, 1e-6), []


@probe
def rms_norm_eps_not_a_number():
    return lambda: co.rms_norm(torch.randn(4, 64), None, 64, "small"), []


# ------------------------------------------------------------------ activations
@probe
def activation_short_up():
    return lambda: co.activation(torch.randn(8, 256), "silu", up=torch.randn(8, 16)), []


@probe
def activation_short_bias():
    return lambda: co.activation(torch.randn(8, 256), "gelu", bias=torch.randn(3)), []


@probe
def activation_short_bias_up():
    return lambda: co.activation(torch.randn(8, 256), "silu", split=True,
                                 bias_up=torch.randn(4)), []


@probe
def activation_up_other_dtype():
    return lambda: co.activation(torch.randn(8, 64), "silu",
                                 up=torch.randn(8, 64).bfloat16()), []


@probe
def activation_split_odd_width():
    return lambda: co.activation(torch.randn(8, 65), "silu", split=True), []


@probe
def activation_unknown_name():
    return lambda: co.activation(torch.randn(8, 64), "swishy"), []


@probe
def activation_out_wrong_shape():
    out = sentinel(8, 128)  # split=True gives [8, 64]
    return lambda: co.activation(torch.randn(8, 128), "silu", split=True, out=out), [out]


# ------------------------------------------------------------------ softmax
@probe
def softmax_mask_not_broadcastable():
    out = sentinel(2, 4, 8)
    return lambda: co.softmax(torch.randn(2, 4, 8), mask=torch.ones(3, 8, dtype=torch.bool),
                              out=out), [out]


@probe
def softmax_mask_int_dtype():
    return lambda: co.softmax(torch.randn(2, 8), mask=torch.ones(2, 8, dtype=torch.int32)), []


@probe
def softmax_causal_one_dim():
    return lambda: co.softmax(torch.randn(8), causal=True), []


# ------------------------------------------------------------------ linear_rows
@probe
def linear_rows_k_mismatch():
    out = sentinel(2, 64)
    return lambda: cd.linear_rows(torch.randn(2, 100), torch.randn(64, 128), out=out), [out]


@probe
def linear_rows_short_bias():
    return lambda: cd.linear_rows(torch.randn(2, 128), torch.randn(64, 128),
                                  bias=torch.randn(3)), []


@probe
def linear_rows_int8_without_scale():
    w = torch.randint(-5, 5, (64, 128), dtype=torch.int8)
    return lambda: cd.linear_rows(torch.randn(2, 128), w), []


@probe
def linear_rows_short_scale():
    w = torch.randint(-5, 5, (64, 128), dtype=torch.int8)
    return lambda: cd.linear_rows(torch.randn(2, 128), w, scale=torch.rand(2)), []


@probe
def linear_rows_short_norm_weight():
    return lambda: cd.linear_rows(torch.randn(2, 128), torch.randn(64, 128), rms_norm_eps=1e-6,
                                  rms_norm_weight=torch.ones(4)), []


@probe
def linear_rows_bound_k_mismatch():
    out = sentinel(2, 64)
    return lambda: cd.linear_rows_bound(torch.randn(2, 100), torch.randn(64, 128), out), [out]


@probe
def linear_rows_bound_short_bias():
    out = sentinel(2, 64)
    return lambda: cd.linear_rows_bound(torch.randn(2, 128), torch.randn(64, 128), out,
                                        bias=torch.randn(5)), [out]


@probe
def linear_rows_zero_threads():
    return lambda: cd.linear_rows(torch.randn(2, 128), torch.randn(64, 128), threads=-3), []


import cpu_kernel_probes_attention  # noqa: E402,F401  (registers its probes after these)


def main(names: list[str]) -> None:
    for name in names:
        print(json.dumps({"start": name}), flush=True)
        if name == "_abort":  # the harness's own test: a child that dies mid-run
            os.abort()
        call, buffers = PROBES[name]()
        before = [b.clone() for b in buffers]
        try:
            call()
            got = "no error"
        except AtbError:
            got = "AtbError"
        except Exception as e:  # the probe reports every other kind
            got = type(e).__name__
        untouched = all(torch.equal(b, a) for b, a in zip(buffers, before))
        print(json.dumps({"probe": name, "got": got, "untouched": untouched}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(PROBES))
