"""The Triton kernels compile for sm_80 (the oldest GPU they take bf16 on) with Triton's
real compiler, no GPU needed: a subprocess outside the interpreter (compile_kernels.py)."""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def test_every_kernel_compiles_to_a_cubin(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # compile for real, not from a cache
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[3]), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(HERE / "compile_kernels.py"), "80"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    assert len(lines) == 16, res.stdout
    for line in lines:
        assert int(line.split("cubin ")[1].split()[0]) > 1000, line
