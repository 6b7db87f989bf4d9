"""Compile the Triton kernels for an NVIDIA target without a GPU (Triton's own
front end, LLVM and the ptxas it ships): the interpreter accepts programs the compiler
rejects, so this catches what only a GPU run would. Run as a script (not under
``TRITON_INTERPRET``); prints one line per kernel and the cubin size."""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from atbcore.backends.triton import (activation, norm, paged, paged_prefill, prefill,  # noqa: E402
                                    rope_cache)

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int32: "i32"}


def compile_kernel(fn, args, constexprs, arch, num_warps=4):
    """cubin bytes of ``fn`` for pointer/int/float ``args`` (a dtype stands for a pointer)."""
    sig = {}
    for name, a in zip([n for n in fn.arg_names if n not in constexprs], args):
        sig[name] = ("*" + _TYPES[a] if isinstance(a, torch.dtype)
                     else "fp32" if isinstance(a, float) else "i32")
    sig.update({n: "constexpr" for n in constexprs})
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return len(k.asm["cubin"])


def cases(bf=torch.bfloat16, f32=torch.float32, i32=torch.int32):
    yield "rms_norm", norm._rms_norm_kernel, [bf] * 5 + [4096, 1e-6, 0.0], \
        {"HAS_RESIDUAL": False, "BLOCK": 4096}, 8
    yield "add_rms_norm", norm._rms_norm_kernel, [bf] * 5 + [4096, 1e-6, 0.0], \
        {"HAS_RESIDUAL": True, "BLOCK": 4096}, 8
    for act in (0, 1, 2):
        yield f"gated act {act}", activation._gated_kernel, [bf] * 3 + [11008, 22016, 22016], \
            {"ACT": act, "BLOCK": 1024}, 4
    rope_args = [bf] * 6 + [f32, f32, i32, i32] + [7, 32, 128, 4096, 4096] + [100] * 19
    yield "rope_kv_cache", rope_cache._rope_kv_cache_kernel, rope_args, \
        {"HALF": 64, "BLOCK_D": 128, "HAS_V": True}, 4
    yield "rope", rope_cache._rope_kv_cache_kernel, rope_args, \
        {"HALF": 64, "BLOCK_D": 128, "HAS_V": False}, 4
    dec = [bf, bf, bf, i32, i32, bf, f32, f32] + [100] * 11 + [0.1, 0, 16, 4, 128, 512, 32]
    base = {"G_PAD": 16, "BLOCK_D": 128, "BLOCK_N": 32}
    yield "paged decode", paged._decode_kernel, dec, \
        {**base, "SPLIT": False, "HAS_WINDOW": False, "IEEE": False}, 4
    yield "paged decode split+window", paged._decode_kernel, dec, \
        {**base, "SPLIT": True, "HAS_WINDOW": True, "IEEE": False}, 4
    yield "paged decode fp32", paged._decode_kernel, [f32 if a is bf else a for a in dec], \
        {**base, "SPLIT": False, "HAS_WINDOW": False, "IEEE": True}, 4
    yield "paged merge", paged._merge_kernel, [f32, f32, bf, 100, 100, 32, 8, 128], \
        {"S_PAD": 8, "BLOCK_D": 128}, 4
    pre = [bf, bf, bf, bf, i32] + [100] * 12 + [512, 512, 32, 4, 128, 0.1, 0]
    pbase = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 128}
    yield "prefill causal", prefill._prefill_kernel, pre, \
        {**pbase, "CAUSAL": True, "HAS_WINDOW": False, "HAS_LENS": False, "IEEE": False}, 4
    yield "prefill window+lens", prefill._prefill_kernel, pre, \
        {**pbase, "CAUSAL": True, "HAS_WINDOW": True, "HAS_LENS": True, "IEEE": False}, 4
    yield "prefill fp32 full", prefill._prefill_kernel, [f32 if a is bf else a for a in pre], \
        {**pbase, "CAUSAL": False, "HAS_WINDOW": False, "HAS_LENS": False, "IEEE": True}, 4

    ppre = [bf] * 4 + [i32] * 4 + [100] * 11 + [16, 32, 4, 128, 0.1, 0]
    yield "paged prefill causal", paged_prefill._paged_prefill_kernel, ppre, \
        {**pbase, "CAUSAL": True, "HAS_WINDOW": False, "IEEE": False}, 4
    yield "paged prefill fp32 window", paged_prefill._paged_prefill_kernel, \
        [f32 if a is bf else a for a in ppre], \
        {**pbase, "CAUSAL": True, "HAS_WINDOW": True, "IEEE": True}, 4


if __name__ == "__main__":
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 80
    for name, fn, args, consts, warps in cases():
        print(f"{name}: sm_{arch} cubin {compile_kernel(fn, args, consts, arch, warps)} bytes")
