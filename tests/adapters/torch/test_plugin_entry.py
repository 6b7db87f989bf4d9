"""atb_torch registers through the atb entry-point group like third-party plugins."""

import subprocess
import sys


def test_atb_torch_is_an_entry_point_plugin_that_registers_torch_ops():
    code = (
        "import torch, sys\n"
        "from atbcore.plugin import get_plugin_manager\n"
        "pm = get_plugin_manager()\n"
        "assert pm.records['atb_torch'].status == 'loaded'\n"
        "assert 'atb_torch.library' in sys.modules, 'torch ops not registered'\n"
        "print(hasattr(torch.ops.atb, 'rms_norm'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_loading_the_plugin_without_torch_imports_no_torch():
    code = ("import sys\nfrom atbcore.plugin import get_plugin_manager\nget_plugin_manager()\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
