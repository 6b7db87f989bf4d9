"""Stand-in backends for executor tests, registered for one test and removed after.

* ``picky``: highest priority, refuses every RmsNorm call with a reason (so dispatch
  falls back and the plan records why);
* ``numpy_rms``: a NumPy-native RmsNorm ahead of torch (so a plan mixes natives);
* ``even``: an RmsNorm that only takes an even number of rows (so a bucket's plan
  can be refused at an exact shape);
* ``arena``: a torch LayerNorm kernel that declares ``writes_out`` and writes into
  the views the executor hands it (the path no built-in kernel uses yet).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import atbcore.backends as backends_mod
from atbcore.backends.base import Backend, Kernel
from atbcore.ops.registry import get_op


@dataclass(frozen=True)
class OutKernel(Kernel):
    writes_out: bool = True


@dataclass
class FakeBackend(Backend):
    kernels: dict = field(default_factory=dict)

    def load(self) -> None:
        pass


def _picky() -> FakeBackend:
    k = Kernel("RmsNorm", fn=lambda p, ins: [], impl="picky rms",
               check=lambda p, ins: [f"hidden {ins['x'].shape[-1]} is not a multiple of 128"])
    return FakeBackend(name="picky", priority=0, native="torch", kernels={"RmsNorm": k})


def _numpy_rms() -> FakeBackend:
    ref = get_op("RmsNorm").reference
    k = Kernel("RmsNorm", fn=lambda p, ins: ref(p, ins), impl="numpy rms (test)", launches=3)
    return FakeBackend(name="numpy_rms", priority=0, native="numpy", kernels={"RmsNorm": k})


def _arena(calls: list) -> FakeBackend:
    import torch.nn.functional as F

    def fn(p, ins, out=None):
        x = ins["x"]
        y = F.layer_norm(x, [x.shape[-1]], ins["weight"], ins["bias"], p.eps)
        calls.append(out)
        if out is None or out[0] is None:
            return [y]
        out[0].copy_(y)
        return [out[0]]

    k = OutKernel("LayerNorm", fn=fn, impl="layer_norm into arena (test)")
    return FakeBackend(name="arena", priority=0, native="torch", kernels={"LayerNorm": k})


def _even() -> FakeBackend:
    import torch.nn.functional as F

    def fn(p, ins):
        x = ins["x"]
        return [F.rms_norm(x, [x.shape[-1]], ins["weight"], p.eps)]

    def check(p, ins):
        s = ins["x"].shape[-2]
        return [] if s % 2 == 0 else [f"rows {s} is odd"]

    k = Kernel("RmsNorm", fn=fn, check=check, impl="rms for even row counts (test)")
    return FakeBackend(name="even", priority=0, native="torch", kernels={"RmsNorm": k})


MAKERS = {"picky": _picky, "numpy_rms": _numpy_rms, "even": _even}


@contextlib.contextmanager
def installed(name: str, *args):
    be = _arena(*args) if name == "arena" else MAKERS[name]()
    backends_mod.register_backend(be)
    try:
        yield be
    finally:
        backends_mod._BACKENDS.pop(be.name, None)
