"""The `atb` command: info, ops; runtime init and compatibility."""

import json
import subprocess
import sys

import pytest

import atbcore as atb
from atbcore.cli.main import main


def test_info_json_reports_versions_backends_and_compatibility(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["atb"] == atb.__version__
    import numpy
    import torch

    assert data["packages"]["numpy"] == numpy.__version__
    assert data["packages"]["torch"] == torch.__version__
    assert data["packages"]["torch_npu"] == "not installed"
    by_name = {b["backend"]: b for b in data["backends"]}
    assert by_name["numpy"]["usable"] and by_name["torch"]["usable"]
    assert "cpu" in by_name["torch"]["devices"]
    assert data["compatibility"]["compatible"] is True
    from atbcore.backends.cpu_kernels import bindings
    from atbcore.memory import hugepages

    cpu = data["cpu"]
    assert cpu["c_kernels"] == (bindings.unavailable_reason() is None)
    assert cpu["c_kernels_detail"] == (bindings.build_info().isa if cpu["c_kernels"]
                                       else bindings.unavailable_reason())
    assert cpu["huge_pages"] == (hugepages.available() is None)


def test_info_table_and_console_script():
    out = subprocess.run(["atb", "info"], capture_output=True, text=True, check=True).stdout
    assert "torch_npu" in out and "not installed" in out and "check_compatibility" in out
    assert "CPU C kernels:" in out and "CPU huge pages:" in out


def test_ops_lists_every_op_with_backends(capsys):
    assert main(["ops", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in rows] == atb.list_operations()
    rms = next(r for r in rows if r["op"] == "RmsNorm")
    bks = rms["backends"]
    assert "torch" in bks and bks[-1] == "numpy" and "RMSNorm" in rms["aliases"]


def test_init_returns_zero_and_validates():
    assert atb.init(device_id=0, log_level="INFO", enable_profiling=True, allocator_type="pool",
                    stream_id=0) == 0
    cfg = atb.get_config()
    assert cfg.enable_profiling and cfg.log_level == "INFO"
    with pytest.raises(atb.ParamsError, match="allocator_type"):
        atb.init(allocator_type="magic")
    atb.init()


def test_check_compatibility_flags_mismatched_torch_npu(monkeypatch):
    from atbcore.runtime import config

    real = config.package_version
    monkeypatch.setattr(config, "package_version",
                        lambda d: "2.1.0" if d == "torch_npu" else real(d))
    res = atb.check_compatibility()
    assert not res["compatible"] and any("torch_npu" in p for p in res["problems"])


def test_front_ends_reexport_the_core_api():
    code = ("import atb_torch, atb_mindspore, atb_paddle\n"
            "for m in (atb_torch, atb_mindspore, atb_paddle):\n"
            "    for n in ('Builder','Dtype','TensorDesc','list_operations','AtbError','init','__version__'):\n"
            "        assert hasattr(m, n), (m, n)\n"
            "print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
