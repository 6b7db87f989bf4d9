"""``import atb`` is the PyTorch front-end: the same objects as ``atb_torch``, a clear
error without torch, and the seed articles' snippets that start with ``import atb`` run
exactly as far as they do with ``import atb_torch as atb`` (and, where they run to the
end, give the oracle's values)."""

import subprocess
import sys
import textwrap

import pytest
import torch

import atb
import atb_torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "core" / "cli"))
from test_cli_startup import BLOCK_TORCH  # noqa: E402


def test_import_atb_then_llm_in_a_fresh_interpreter():
    r = subprocess.run([sys.executable, "-c", "import atb; print(atb.LLM.__module__, "
                        "atb.__version__)"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["atb_torch.llm.llm", atb_torch.__version__]


def test_atb_is_atb_torch_under_another_name():
    assert atb.__all__ == atb_torch.__all__ and atb.__version__ == atb_torch.__version__
    for name in atb_torch.__all__:
        assert getattr(atb, name) is getattr(atb_torch, name), name
    from atb import LLM, compile as atb_compile  # the seeds' spelling

    assert LLM is atb_torch.LLM and atb_compile is atb_torch.compile
    ns: dict = {}
    exec("from atb import *", ns)
    assert set(ns) - {"__builtins__"} == set(atb_torch.__all__)
    with pytest.raises(AttributeError, match="module 'atb' has no attribute 'NoSuchOp'"):
        atb.NoSuchOp


def test_import_atb_without_torch_names_the_alternatives():
    r = subprocess.run([sys.executable, "-c", BLOCK_TORCH + "import atb"], capture_output=True,
                       text=True)
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: `import atb` is atb's PyTorch front-end and needs torch")
    for alternative in ("pip install torch==2.13.0", "import atb_mindspore as atb",
                        "import atb_paddle as atb", "import atbcore", "blocked by the test"):
        assert alternative in last


# ---------------------------------------------------------------- the seeds' snippets
# Copied from the seed article (001, sections 7 and 8) as written, their __main__ blocks
# left out; "npu" becomes "cpu" when they run (hardware we do not have).
SEED_INIT = '''
import os
import sys
import atb

def init_atb():
    """初始化 ATB 运行时环境"""
    init_params = {
        "device_id": 0,                     # 使用第 0 块 NPU
        "log_level": "INFO",                # 日志级别：DEBUG / INFO / WARNING / ERROR
        "enable_profiling": False,          # 是否开启性能分析
        "allocator_type": "pool",           # 显存分配器：pool（池化，推荐）/ naive
        "stream_id": 0,                     # 关联的计算流
    }
    status = atb.init(**init_params)
    if status != 0:
        raise RuntimeError(f"ATB 初始化失败，错误码: {status}")
    print(f"ATB 初始化成功，版本: {atb.__version__}")
    print(f"设备信息: NPU {init_params['device_id']}")
    supported_ops = atb.list_operations()
    print(f"ATB 支持 {len(supported_ops)} 个算子")
    return init_params
'''

SEED_VERIFY_LAYER_NORM = '''
import torch
import atb
import numpy as np

def verify_layer_norm_precision(hidden_states_ref, atol=1e-3, rtol=1e-3):
    """逐算子精度校验脚本"""
    ln_ref = torch.nn.functional.layer_norm(
        hidden_states_ref,
        normalized_shape=(hidden_states_ref.shape[-1],)
    )
    ln_atb = atb.LayerNorm(normalized_shape=(hidden_states_ref.shape[-1],))
    input_desc = atb.TensorDesc(
        shape=list(hidden_states_ref.shape),
        dtype=atb.Dtype.FP16
    )
    output_desc = atb.TensorDesc(
        shape=list(hidden_states_ref.shape),
        dtype=atb.Dtype.FP16
    )
    ln_atb.execute([input_desc], [output_desc])
    max_diff = torch.max(torch.abs(ln_ref - output_desc)).item()
    mean_diff = torch.mean(torch.abs(ln_ref - output_desc)).item()
    is_close = torch.allclose(ln_ref, output_desc, atol=atol, rtol=rtol)
    return is_close
'''

SEED_NORMS = '''
import torch
import atb

class ATBLayerNorm:
    """ATB LayerNorm 封装，支持 FP16/BF16"""

    def __init__(self, normalized_shape, dtype=atb.Dtype.FP16, eps=1e-5):
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.dtype = dtype
        builder = atb.Builder()
        norm_params = {
            "normalized_shape": normalized_shape,
            "eps": eps,
            "elementwise_affine": True,    # 可学习的 gamma/beta
            "dtype": dtype,
        }
        self.norm_op = builder.build_operation("LayerNorm", norm_params)
        self.weight = torch.ones(normalized_shape, dtype=torch.float16, device="npu")
        self.bias = torch.zeros(normalized_shape, dtype=torch.float16, device="npu")

    def forward(self, input_tensor):
        """前向计算"""
        input_desc = atb.TensorDesc(shape=list(input_tensor.shape), dtype=self.dtype)
        output_desc = atb.TensorDesc(shape=list(input_tensor.shape), dtype=self.dtype)
        weight_desc = atb.TensorDesc(shape=list(self.weight.shape), dtype=self.dtype)
        bias_desc = atb.TensorDesc(shape=list(self.bias.shape), dtype=self.dtype)
        outputs = [output_desc]
        self.norm_op.execute([input_desc, weight_desc, bias_desc], outputs)
        return outputs[0]
'''

SEED_ROPE = '''
import torch
import atb
import math

def build_rope_operation(head_num, size_per_head, max_seq_len=8192, dtype=atb.Dtype.FP16):
    """构建 ATB RoPE 算子"""
    builder = atb.Builder()
    rope_params = {
        "head_num": head_num,
        "size_per_head": size_per_head,
        "max_seq_len": max_seq_len,
        "rotary_base": 10000.0,            # RoPE 旋转基数
        "rotary_type": "interleave",        # interleaved 方式（推荐）
        "dtype": dtype,
        "fuse_with_attention": True,       # 与 Attention 融合
    }
    rope_op = builder.build_operation("RoPE", rope_params)
    return rope_op

def rope_with_atb(Q, K, position_ids, rope_op):
    """使用 ATB 对 Q/K 应用 RoPE"""
    batch, seq_len, hidden_dim = Q.shape
    Q_desc = atb.TensorDesc(shape=list(Q.shape), dtype=atb.Dtype.FP16)
    pos_desc = atb.TensorDesc(shape=list(position_ids.shape), dtype=atb.Dtype.INT64)
    Q_out_desc = atb.TensorDesc(shape=list(Q.shape), dtype=atb.Dtype.FP16)
    outputs = [Q_out_desc]
    rope_op.execute([Q_desc, pos_desc], outputs)
    return outputs[0]
'''

SEED_MHA = '''
import torch
import atb
import numpy as np

def build_mha_operation(head_num=32, kv_head_num=8, size_per_head=128, is_causal=True):
    """构建 Multi-Head Attention 算子"""
    builder = atb.Builder()
    mha_params = {
        "head_num": head_num,
        "kv_head_num": kv_head_num,         # GQA: 8，支持 MQA/GQA
        "size_per_head": size_per_head,
        "scale": 1.0 / (size_per_head ** 0.5),
        "is_causal": is_causal,             # 因果掩码（自回归模型必需）
        "fuse_qkv": True,                    # 融合 QKV 投影
        "fuse_output": True,                 # 融合输出投影
        "fuse_rope": True,                   # 融合 RoPE（如使用旋转位置编码）
        "support_flash": True,               # 启用 FlashAttention 风格计算
        "enable_opt": True,                 # 启用内存优化
        "dtype": atb.Dtype.FP16,
    }
    mha_op = builder.build_operation("MhaV3", mha_params)
    return mha_op

def execute_mha(Q, K, V, attn_mask=None):
    """执行 Multi-Head Attention 计算"""
    batch_size, seq_len, hidden_size = Q.shape
    mha_op = build_mha_operation(
        head_num=32,
        kv_head_num=8,
        size_per_head=hidden_size // 32
    )
    Q_desc = atb.TensorDesc(shape=list(Q.shape), dtype=atb.Dtype.FP16)
    K_desc = atb.TensorDesc(shape=list(K.shape), dtype=atb.Dtype.FP16)
    V_desc = atb.TensorDesc(shape=list(V.shape), dtype=atb.Dtype.FP16)
    output_shape = list(Q.shape)
    output_desc = atb.TensorDesc(shape=output_shape, dtype=atb.Dtype.FP16)
    inputs = [Q_desc, K_desc, V_desc]
    outputs = [output_desc]
    if attn_mask is not None:
        mask_desc = atb.TensorDesc(shape=list(attn_mask.shape), dtype=atb.Dtype.FP16)
        inputs.append(mask_desc)
    mha_op.execute(inputs, outputs)
    return outputs[0]
'''

SEED_FFN = '''
import torch
import atb

class ATBFusedFFN:
    """ATB 融合 FFN（支持 SwiGLU / FusedGLU）"""

    def __init__(self, hidden_size, ffn_hidden_size=None, dtype=atb.Dtype.FP16):
        self.hidden_size = hidden_size
        self.ffn_hidden_size = ffn_hidden_size or hidden_size * 4
        self.dtype = dtype
        builder = atb.Builder()
        ffn_params = {
            "hidden_size": hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "activation_type": "swiglu",      # swiglu / gelu / relu
            "dtype": dtype,
            "fuse_gate_up": True,               # 融合 Gate+Up 投影
            "fuse_activation": True,           # 融合激活函数
            "fuse_down": True,                  # 融合 Down 投影
            "fuse_add": True,                   # 融合残差连接
            "intermediate_dtype": atb.Dtype.BF16,  # 中间结果用 BF16 省显存
        }
        self.ffn_op = builder.build_operation("FusedFeedForward", ffn_params)
        self.gate_proj = torch.randn(hidden_size, self.ffn_hidden_size,
                                     dtype=torch.float16, device="npu")
        self.up_proj = torch.randn(hidden_size, self.ffn_hidden_size,
                                   dtype=torch.float16, device="npu")
        self.down_proj = torch.randn(self.ffn_hidden_size, hidden_size,
                                     dtype=torch.float16, device="npu")

    def forward(self, hidden_states, residual=None):
        """前向计算"""
        input_desc = atb.TensorDesc(shape=list(hidden_states.shape), dtype=self.dtype)
        output_desc = atb.TensorDesc(shape=list(hidden_states.shape), dtype=self.dtype)
        gate_desc = atb.TensorDesc(shape=list(self.gate_proj.shape), dtype=self.dtype)
        up_desc = atb.TensorDesc(shape=list(self.up_proj.shape), dtype=self.dtype)
        down_desc = atb.TensorDesc(shape=list(self.down_proj.shape), dtype=self.dtype)
        inputs = [input_desc, gate_desc, up_desc, down_desc]
        outputs = [output_desc]
        self.ffn_op.execute(inputs, outputs)
        return outputs[0]
'''

SEED_LLM = '''
from atb import LLM
model = LLM("meta-llama/Llama-2-7b-hf", device="npu:0")
output = model.generate("Hello, world")
'''


def _run(snippet: str, spelling: str, then: str = "") -> tuple[dict, str | None]:
    """Run a seed snippet (then ``then``) with ``import atb`` or, for ``spelling ==
    "atb_torch"``, with ``import atb_torch as atb``; returns the namespace and the
    error it stopped at (type and message), or None when it ran to the end."""
    src = snippet.replace('"npu"', '"cpu"') + textwrap.dedent(then)
    if spelling == "atb_torch":
        src = src.replace("import atb\n", "import atb_torch as atb\n").replace(
            "from atb import", "from atb_torch import")
    ns: dict = {"__name__": "seed_snippet"}
    try:
        exec(compile(src, f"<seed snippet, {spelling}>", "exec"), ns)
    except Exception as e:  # the outcome compared between the two spellings
        return ns, f"{type(e).__name__}: {e}"
    return ns, None


def _same_outcome(snippet: str, then: str = "") -> tuple[dict, str | None]:
    torch.manual_seed(0)
    ns, err = _run(snippet, "atb", then)
    torch.manual_seed(0)
    ref_ns, ref_err = _run(snippet, "atb_torch", then)
    assert err == ref_err
    if "atb" in ns:
        assert ns["atb"] is atb and ref_ns["atb"] is atb_torch
    if "LLM" in ns:
        assert ns["LLM"] is ref_ns["LLM"] is atb_torch.LLM
    return ns, err


def test_seed_init_runs_to_the_end_the_same(capsys):
    try:
        ns, err = _same_outcome(SEED_INIT, "result = init_atb()")
    finally:
        atb.init()  # the snippet set log level INFO for the process
    assert err is None
    assert ns["result"]["device_id"] == 0
    out = capsys.readouterr().out
    assert out.count(f"ATB 初始化成功，版本: {atb.__version__}") == 2
    assert out.count(f"ATB 支持 {len(atb_torch.list_operations())} 个算子") == 2


def test_seed_version_check_prints_the_version():
    r = subprocess.run([sys.executable, "-c", "import atb; print(atb.__version__)"],
                       capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip()) == (0, atb_torch.__version__)


@pytest.mark.parametrize("snippet, then, stops_at", [
    # atb_torch's LayerNorm is an nn.Module: the seed's .execute on it does not exist
    (SEED_VERIFY_LAYER_NORM, "verify_layer_norm_precision(torch.randn(2, 8, 64).half())",
     "AttributeError: 'LayerNorm' object has no attribute 'execute'"),
    # descriptors in, descriptors out: no data to compute on, refused by name
    (SEED_NORMS, "ATBLayerNorm(64).forward(torch.randn(2, 8, 64).half())",
     "InputError: LayerNorm: input 0 has no data"),
    (SEED_ROPE, """
        Q = torch.randn(2, 6, 4 * 16, dtype=torch.float16)
        pos = torch.arange(6).unsqueeze(0).expand(2, -1)
        rope_with_atb(Q, None, pos, build_rope_operation(4, 16))
    """, "InputError: RoPE: input 0 has no data"),
    (SEED_MHA, """
        Q, K, V = (torch.randn(2, 8, 256, dtype=torch.float16) for _ in range(3))
        execute_mha(Q, K, V)
    """, "InputError: FlashAttention: input 0 has no data"),
    (SEED_FFN, "ATBFusedFFN(64).forward(torch.randn(2, 8, 64).half())",
     "InputError: FusedFeedForward: input 0 has no data"),
    # a hub id on an NPU: the device is refused before anything is loaded or fetched
    (SEED_LLM, "", "DeviceError: LLM: device 'npu' needs torch_npu"),
])
def test_seed_snippets_stop_at_the_same_place_with_the_same_error(snippet, then, stops_at):
    ns, err = _same_outcome(snippet, then)
    assert err is not None and err.startswith(stops_at), err


@pytest.mark.parametrize("spelling", ["atb", "atb_torch"])
def test_seed_ops_built_by_import_atb_give_the_oracle_values(spelling):
    """With tensors in place of the descriptors, the ops the snippets build compute
    torch's LayerNorm and the seed's own RoPE formula."""
    then = """
        x = torch.randn(2, 8, 64).half()
        ln = ATBLayerNorm(64)
        ln_out, = ln.norm_op.execute([x, ln.weight, ln.bias])
        Q = torch.randn(2, 6, 4 * 16, dtype=torch.float16)
        pos = torch.arange(6).unsqueeze(0).expand(2, -1).contiguous()
        q_out, = build_rope_operation(4, 16).execute([Q, pos])
    """
    ns, err = _run(SEED_NORMS + SEED_ROPE, spelling, then)
    assert err is None
    ref = torch.nn.functional.layer_norm(ns["x"].float(), (64,), eps=1e-5)
    atb_torch.assert_close(ns["ln_out"], ref.half(), "fp16", "seed LayerNorm vs torch")
    q, pos = ns["Q"].float().view(2, 6, 4, 16), ns["pos"].float()
    inv = 10000.0 ** (-torch.arange(0, 16, 2).float() / 16)
    ang = (pos[..., None] * inv)[:, :, None, :]  # [B, S, 1, D/2]: the seed's interleaved pairs
    want = torch.empty_like(q)
    want[..., 0::2] = q[..., 0::2] * ang.cos() - q[..., 1::2] * ang.sin()
    want[..., 1::2] = q[..., 1::2] * ang.cos() + q[..., 0::2] * ang.sin()
    atb_torch.assert_close(ns["q_out"], want.reshape(2, 6, 64).half(), "fp16",
                           "seed RoPE vs its formula per head")
