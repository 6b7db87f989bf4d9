"""Every bad call of the C-kernel wrappers raises an AtbError before any C code runs,
and writes nothing. The calls run in a child process (``cpu_kernel_probes.py``), so
a wrapper that lets one through to a segfault fails its probe instead of ending
pytest; the child is restarted after the probe that killed it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atbcore.backends.cpu_kernels import available

pytestmark = pytest.mark.skipif(not available(), reason="no C compiler here: C kernels absent")

HERE = Path(__file__).with_name("cpu_kernel_probes.py")


def _probe_names() -> list[str]:
    sys.path.insert(0, str(HERE.parent))
    try:
        import cpu_kernel_probes
    finally:
        sys.path.pop(0)
    return list(cpu_kernel_probes.PROBES)


NAMES = _probe_names()


def run_probes(names: list[str]) -> dict[str, dict]:
    """Each probe's report; a probe during which the child died reports how it died."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    results: dict[str, dict] = {}
    todo = list(names)
    while todo:
        r = subprocess.run([sys.executable, str(HERE), *todo], capture_output=True, text=True,
                           env=env, timeout=600)
        started = None
        for line in r.stdout.splitlines():
            rec = json.loads(line)
            if "start" in rec:
                started = rec["start"]
            else:
                results[rec["probe"]] = rec
        if r.returncode == 0:
            break
        dead = started if started is not None and started not in results else todo[0]
        results[dead] = {"probe": dead, "got": f"child died (status {r.returncode}): "
                         f"{r.stderr.strip()[-300:]}", "untouched": False}
        todo = todo[todo.index(dead) + 1:]
    return results


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return run_probes(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_bad_call_raises_atb_error_and_writes_nothing(reports, name):
    rec = reports[name]
    assert rec["got"] == "AtbError", rec
    assert rec["untouched"], f"{name}: a buffer was written by the failed call"


def test_a_crashing_probe_fails_alone():
    """The harness itself: a child that dies is reported on its probe, and the probes
    after it still run in a new child."""
    res = run_probes(["rms_norm_short_weight", "_abort", "activation_short_up"])
    assert res["_abort"]["got"].startswith("child died"), res
    assert res["rms_norm_short_weight"]["got"] == "AtbError"
    assert res["activation_short_up"]["got"] == "AtbError"
