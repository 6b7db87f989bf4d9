"""The README's Python blocks run as written (each in a fresh interpreter).

The OpenAI-client block talks to a running ``atb serve`` and is left to the serving
tests; every other ``python`` block of README.md runs here and must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
RUNNABLE = [b for b in BLOCKS if "127.0.0.1" not in b]


def test_the_readme_has_its_blocks() -> None:
    assert len(BLOCKS) == len(RUNNABLE) + 1 and len(RUNNABLE) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("code", RUNNABLE, ids=[b.splitlines()[0][:40] for b in RUNNABLE])
def test_readme_block_runs(code: str, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    script = tmp_path / "block.py"  # a file, as a reader would save it (spawned ranks import it)
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), "every block prints what it made"
