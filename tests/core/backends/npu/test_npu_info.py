"""``atb info`` reports torch_npu, CANN, the SoC and NNAL when torch_npu is importable
(here: the conformance double), and says why not when it is not."""

import json

from atbcore.backends.npu import use_npu_module
from atbcore.cli.info_npu import npu_runtime
from atbcore.cli.main import main
from npu_double import NpuDouble


def test_info_without_torch_npu_says_why(capsys):
    assert npu_runtime() == {"available": False, "reason": "torch_npu is not installed"}
    assert main(["info"]) == 0
    assert "NPU (torch_npu): no (torch_npu is not installed)" in capsys.readouterr().out


def test_info_reports_torch_npu_cann_and_soc(capsys, monkeypatch):
    monkeypatch.delenv("ATB_HOME_PATH", raising=False)
    with use_npu_module(NpuDouble("A3", nnal=None)):
        assert main(["info", "--json"]) == 0
        npu = json.loads(capsys.readouterr().out)["npu"]
        assert npu == {"available": True, "torch_npu": "2.10.0.post4+double", "cann": "9.1.0",
                       "soc_version": 253, "soc_family": "A3", "device_name": "Ascend910_9392",
                       "device_count": 1, "nnal": False, "nnal_detail": npu["nnal_detail"]}
        assert "ATB_HOME_PATH is not set" in npu["nnal_detail"]
        assert main(["info"]) == 0
        out = capsys.readouterr().out
    assert "NPU (torch_npu 2.10.0.post4+double): CANN 9.1.0, SoC Ascend910_9392 (A3, " \
           "soc_version 253), 1 device(s); NNAL ATB ops: no" in out.replace("\n", " ").replace("  ", " ")


def test_a_failing_query_is_reported_not_raised():
    double = NpuDouble("310P")

    def broken(module="CANN"):
        raise RuntimeError("libascendcl.so not found")
    double.npu.utils.get_cann_version = broken
    with use_npu_module(double):
        info = npu_runtime()
    assert info["cann"] == "unknown (RuntimeError: libascendcl.so not found)"
    assert info["soc_family"] == "310P" and info["nnal"] is True
