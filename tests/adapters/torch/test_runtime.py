"""atb.init / list_operations / __version__ / check_compatibility, profiling export,
and devices: CPU runs, CUDA runs when present (skipped honestly here), NPU refused
with an AtbError naming the missing capability (faked device / monkeypatched
torch_npu; never a crash)."""

import json

import pytest
import torch

import atb_torch as atb
import atbcore
from atb_torch import devices


@pytest.fixture
def profiling_on():
    atb.init(enable_profiling=True)
    atb.clear_profiles()
    yield
    atb.init()
    atb.clear_profiles()


def test_design_api_names_exist():
    for name in ["LayerNorm", "RmsNorm", "AddLayerNorm", "AddRmsNorm", "Linear", "MatMul", "RoPE",
                 "FlashAttention", "SelfAttention", "MhaV2", "MhaV3", "PagedAttention",
                 "ReshapeAndCache", "Softmax", "ScaledMaskedSoftmax", "Gelu", "QuickGelu", "SiLU",
                 "SwiGLU", "FusedFeedForward", "ResidualAdd", "Elewise", "Transpose", "Reshape",
                 "Split", "Concat", "Gather", "Embedding", "MoE", "TopkToppSampling", "AllReduce",
                 "LinearParallel", "GraphOp", "GraphBuilder", "Builder", "Operation", "TensorDesc",
                 "Dtype", "MemoryPoolConfig", "init_memory_pool", "memory_stats", "KVCache",
                 "PagedKVCache", "init", "list_operations", "__version__", "check_compatibility",
                 "AtbError", "ShapeError", "DtypeError", "DeviceError", "ParamsError",
                 "CapabilityError", "PoolExhaustedError", "PluginError", "Plugin"]:
        assert hasattr(atb, name), name
    assert issubclass(atb.Linear, torch.nn.Module) and issubclass(atb.GraphOp, torch.nn.Module)
    assert atb.compile.__module__.startswith("atb_torch.models")


def test_init_version_operations_compatibility():
    assert atb.__version__ == atbcore.__version__
    assert atb.init(device_id=0, log_level="INFO") == 0
    assert atbcore.get_config().log_level == "INFO"
    atb.init()
    ops = atb.list_operations()
    assert {"RmsNorm", "FlashAttention", "MoE", "TopkToppSampling"} <= set(ops)
    rep = atb.check_compatibility()
    assert rep["compatible"] is True
    assert rep["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    t = rep["torch"]
    assert t["version"] == torch.__version__ and t["cuda_available"] == torch.cuda.is_available()
    assert "atb::rms_norm" in t["custom_ops"] and "atb::graph_op" in t["custom_ops"]
    assert t["devices"][0] == "cpu" and t["npu_kernels"] is False
    with pytest.raises(atb.ParamsError, match="allocator_type"):
        atb.init(allocator_type="magic")


def test_profiling_records_graph_nodes_and_module_calls(tmp_path, profiling_on):
    g = atb.GraphOp([atb.RmsNorm(16), atb.Linear(16, 8), atb.SiLU()], name="prof_block")
    norm = atb.RmsNorm("final_norm", hidden_size=8)
    x = torch.randn(2, 16)
    with torch.no_grad():
        for _ in range(2):
            norm(g(x))
    nodes = {e.name for e in g.profiler.events}
    assert set(n.name for n in g.graph.nodes) <= nodes  # one event per node per run
    assert all(e.dur_ns >= 0 for e in g.profiler.events)
    assert sum(e.name == "final_norm" for _, e in atb.profiling.events()) == 2
    path = atb.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(open(path).read())["traceEvents"]
    procs = {e["args"]["name"] for e in trace if e["ph"] == "M"}
    assert "prof_block" in procs
    assert any(e["ph"] == "X" and e["name"] == "final_norm" for e in trace)
    assert "final_norm" in atb.profile_table()


def test_profiling_off_records_nothing():
    atb.init()
    atb.clear_profiles()
    g = atb.GraphOp([atb.Linear(4, 4)])
    with torch.no_grad():
        atb.SiLU()(g(torch.randn(1, 4)))
    assert not atb.profiling.events()


def test_exporting_a_trace_with_profiling_off_warns_and_writes_a_valid_empty_trace(tmp_path):
    atb.init()
    atb.clear_profiles()
    with torch.no_grad():
        atb.SiLU()(torch.randn(1, 4))
    with pytest.warns(atb.profiling.EmptyTraceWarning,
                      match=r"trace is empty: profiling is off; call "
                            r"atb.init\(enable_profiling=True\)"):
        path = atb.export_chrome_trace(tmp_path / "off.json")
    trace = json.loads(open(path).read())["traceEvents"]
    assert [e for e in trace if e["ph"] == "X"] == []


def test_exporting_before_anything_ran_says_so(tmp_path, profiling_on):
    with pytest.warns(atb.profiling.EmptyTraceWarning, match="nothing ran since profiling"):
        atb.export_chrome_trace(tmp_path / "early.json")


def test_exporting_a_recorded_trace_does_not_warn(tmp_path, profiling_on):
    import warnings

    with torch.no_grad():
        atb.SiLU()(torch.randn(1, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error", atb.profiling.EmptyTraceWarning)
        path = atb.export_chrome_trace(tmp_path / "on.json")
    assert any(e["ph"] == "X" for e in json.loads(open(path).read())["traceEvents"])


def test_info_log_names_backend_and_kernel_once_per_signature(caplog):
    """ATB_LOG_LEVEL=INFO: each op's backend and kernel when a call signature (or a
    plan) is first dispatched; repeated calls and plan replays add no lines."""
    from atbcore.backends import get_backend

    kernel = get_backend("torch").kernel("RmsNorm").impl
    op = atb.Builder().build_operation("RmsNorm", {"eps": 1e-6})
    x, w = torch.randn(3, 37), torch.ones(37)  # a shape no other test dispatches
    with caplog.at_level("INFO", logger="atb"):
        for _ in range(3):
            op.execute([x, w])
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"RmsNorm: backend torch, kernel {kernel}"]
    caplog.clear()
    g = atb.GraphOp([atb.RmsNorm(eps=1e-6), atb.Linear(out_features=41), atb.SiLU()])
    with caplog.at_level("INFO", logger="atb"), torch.no_grad():
        g(torch.randn(2, 3, 39))
        built = [r.getMessage() for r in caplog.records]
        caplog.clear()
        for _ in range(3):
            g(torch.randn(2, 3, 39))
    # RmsNorm read only by the Linear is fused into it (norm_linear)
    assert any(m.startswith("RmsNormLinear: backend torch, kernel ") for m in built), built
    assert any(": backend torch, kernel " in m and "Linear" in m for m in built), built
    assert [r.getMessage() for r in caplog.records] == []


def test_npu_is_refused_with_clear_errors(monkeypatch):
    x = torch.randn(2, 4)
    # a tensor reported as living on npu: ops with a torch_npu kernel take it, the
    # others (and hand-built GraphOps) name the missing capability
    devices.check_devices("RmsNorm", [x], ("cpu", "cuda", "npu"), device_of=lambda t: "npu")
    with pytest.raises(atb.CapabilityError, match="an NPU kernel for Concat"):
        devices.check_devices("Concat", [x], device_of=lambda t: "npu")
    with pytest.raises(atb.DeviceError, match="mps"):
        devices.check_devices("RmsNorm", [x], device_of=lambda t: "mps")
    # no torch_npu: asking for the device is a DeviceError, not a torch crash
    monkeypatch.setattr(devices, "torch_npu_importable", lambda: False)
    with pytest.raises(atb.DeviceError, match="torch_npu"):
        atb.Linear(4, 4).to("npu")
    with pytest.raises(atb.DeviceError, match="torch_npu"):
        atb.GraphOp([atb.Linear(4, 4)]).to(device="npu:0")
    with pytest.raises(atb.DeviceError, match="torch_npu"):
        atb.init(device="npu:0")
    with pytest.raises(atb.DeviceError, match="torch_npu"):
        atb.KVCache(1, 1, 4, 1, 4, device="npu")
    # torch_npu importable (faked): init takes the device (its ops' NPU kernels exist)
    import atb_torch.runtime as rt

    class FakeNpu:  # what resolve_device returns once torch_npu registered the device
        type, index = "npu", 0

    monkeypatch.setattr(rt, "resolve_device", lambda d, op="": FakeNpu())
    assert atb.init(device="npu:0") == 0


def test_mixed_devices_and_bad_device_ids():
    kinds = iter(["cpu", "cuda"])
    with pytest.raises(atb.DeviceError, match="one device"):
        devices.check_devices("Linear", [torch.randn(2), torch.randn(2)],
                              device_of=lambda t: next(kinds))
    if not torch.cuda.is_available():
        with pytest.raises(atb.DeviceError, match="device_id"):
            atb.init(device_id=3)
        with pytest.raises(atb.DeviceError, match="CUDA"):
            atb.Linear(4, 4).to("cuda")
    atb.init()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_modules_and_graph_op_match_cpu():
    torch.manual_seed(0)
    g = atb.GraphOp([atb.LayerNorm(32), atb.FlashAttention(num_heads=4, causal=True, kv_cache=True,
                                                            hidden_size=32),
                     atb.Linear(32, 32), atb.ResidualAdd()])
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        want, kv = g(x, kv_cache=None)
        step, _ = g(x[:, :1], kv_cache=kv)
        g = g.cuda()
        got, kv = g(x.cuda(), kv_cache=None)
        got_step, _ = g(x[:, :1].cuda(), kv_cache=kv)
        assert got.is_cuda and g.core._bound["layer_norm.weight"].data_ptr() == \
            g.layers["layer_norm"].weight.data_ptr()
        atb.assert_close(got.cpu(), want, "fp32", "GraphOp on CUDA vs CPU")
        atb.assert_close(got_step.cpu(), step, "fp32", "cached decode on CUDA vs CPU")
        lin = atb.Linear(32, 8).cuda()
        atb.assert_close(lin(x.cuda()).cpu(), lin.cpu()(x), "fp32", "Linear on CUDA vs CPU")
        with pytest.raises(atb.DeviceError):
            g(x)  # cpu input, cuda parameters
