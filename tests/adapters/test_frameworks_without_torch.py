"""atb_mindspore and atb_paddle with torch hidden from import (as if not installed):
each front-end, in a process of its own, loads a checkpoint, generates greedy and
seeded text and runs a GraphOp, without importing torch or another front-end; the
tokens equal those of the same LLM in this process.

The plugin loader imports every installed front-end's ``atb`` entry point by design
(``atb_paddle.plugin`` registers the Paddle backend without importing Paddle); the
other front-end's entry point is disabled in the child (``ATB_DISABLE_PLUGINS``) to
show that the front-end under test needs nothing of it."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "torch" / "llm"))
from llm_checkpoint import build_checkpoint  # noqa: E402

# Every finder answers "no such module" for torch (a finder that raised instead would
# break importlib.util.find_spec, which libraries use to probe for torch).
_CHILD = r"""
import importlib, json, sys

class Hidden:
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            return None
        find = getattr(self.inner, "find_spec", None)
        return None if find is None else find(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)

sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
try:
    import torch  # noqa: F401
    raise SystemExit("torch was importable")
except ImportError:
    pass
fw, ckpt = sys.argv[1], sys.argv[2]
import numpy as np
atb = importlib.import_module(f"atb_{fw}")
framework = importlib.import_module(fw)
llm = atb.LLM(ckpt)
greedy = [o.token_ids for o in llm.generate_outputs(["hello world", "a"], max_new_tokens=6)]
sampled = llm.generate_outputs("hello world", max_new_tokens=6, temperature=0.8, seed=3)
mlp = atb.GraphOp([atb.RmsNorm(eps=1e-6), atb.Linear(out_features=8), atb.SiLU()])
from atbcore.tensor import convert
y = mlp(convert(np.ones((2, 16), np.float32), fw))
loaded = sorted(m for m in ("torch", "atb_torch", "atb_mindspore", "atb_paddle", "mindspore",
                            "paddle") if m in sys.modules)
print(json.dumps({"greedy": greedy, "sampled": sampled[0].token_ids,
                  "mlp_shape": list(y.shape), "loaded": loaded}))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("tiny-notorch"))


@pytest.mark.parametrize("fw", ["mindspore", "paddle"])
def test_front_end_runs_with_torch_hidden_and_imports_no_other_front_end(fw, ckpt):
    pytest.importorskip(fw)
    other = {"mindspore": "atb_paddle", "paddle": "atb_mindspore"}[fw]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), ATB_DISABLE_PLUGINS=other)
    run = subprocess.run([sys.executable, "-c", _CHILD, fw, str(ckpt)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["loaded"] == sorted([f"atb_{fw}", fw])  # no torch, no other front-end
    assert got["mlp_shape"] == [2, 8]
    llm = importlib.import_module(f"atb_{fw}").LLM(ckpt)
    assert got["greedy"] == [o.token_ids for o in llm.generate_outputs(["hello world", "a"],
                                                                       max_new_tokens=6)]
    assert got["sampled"] == llm.generate_outputs("hello world", max_new_tokens=6,
                                                  temperature=0.8, seed=3)[0].token_ids
