"""``atb info`` and ``atb ops``."""

from __future__ import annotations

import argparse
import json
import platform

from rich.console import Console
from rich.table import Table

from .._version import __version__
from ..runtime.config import check_compatibility, package_version
from .info_npu import npu_line, npu_runtime

_FRAMEWORKS = [("numpy", "numpy"), ("torch", "torch"), ("torch_npu", "torch_npu"),
               ("mindspore", "mindspore"), ("paddle", "paddlepaddle"),
               ("transformers", "transformers")]


def collect() -> dict:
    """Everything ``atb info`` prints, as a dict (also used by tests and bench)."""
    from ..backends import backends

    info: dict = {"atb": __version__, "python": platform.python_version(), "packages": {}}
    for label, dist in _FRAMEWORKS:
        info["packages"][label] = package_version(dist) or "not installed"
    rows = []
    for b in backends():
        why = b.unavailable_reason()
        devs: list[str] = []
        if why is None:
            try:
                devs = b.devices()
            except Exception as e:  # a broken install must not break `atb info`
                why = f"device query failed: {e}"
        rows.append({"backend": b.name, "priority": b.priority, "usable": why is None,
                     "reason": why or "", "devices": devs})
    info["backends"] = rows
    info["cpu"] = _cpu_runtime()
    info["npu"] = npu_runtime()
    info["compatibility"] = check_compatibility()
    return info


def _cpu_runtime() -> dict:
    """The CPU fast paths: the C kernels (built for which ISA, or why not) and huge
    pages for the tensors decoding streams (or why not)."""
    from ..backends.cpu_kernels import bindings
    from ..memory import hugepages
    from ..progress import progress

    with progress("atb: building the CPU C kernels (first use; cached after)"):
        why = bindings.unavailable_reason()
    build = bindings.build_info()
    huge = hugepages.available()
    return {"c_kernels": why is None, "c_kernels_detail": build.isa if why is None else why,
            "c_kernels_path": str(build.path) if build.path else "",
            "huge_pages": huge is None, "huge_pages_detail": huge or "2 MiB transparent huge pages"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    con = Console()
    t = Table(title=f"atb {data['atb']} (Python {data['python']})")
    t.add_column("package")
    t.add_column("version")
    for k, v in data["packages"].items():
        t.add_row(k, v)
    con.print(t)
    bt = Table(title="backends")
    for col in ("backend", "priority", "usable", "devices / reason"):
        bt.add_column(col)
    for r in data["backends"]:
        bt.add_row(r["backend"], str(r["priority"]), "yes" if r["usable"] else "no",
                   ", ".join(r["devices"]) if r["usable"] else r["reason"])
    con.print(bt)
    cpu = data["cpu"]
    con.print(f"CPU C kernels: {'yes' if cpu['c_kernels'] else 'no'} ({cpu['c_kernels_detail']})")
    con.print(f"CPU huge pages: {'yes' if cpu['huge_pages'] else 'no'} ({cpu['huge_pages_detail']})")
    con.print(npu_line(data["npu"]))
    c = data["compatibility"]
    con.print(f"check_compatibility(): {'compatible' if c['compatible'] else 'INCOMPATIBLE'}")
    for prob in c["problems"]:
        con.print(f"  - {prob}")
    return 0


class OpsCommand:
    """``atb ops``: every op, its aliases and the backends that have a kernel for it."""

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true")

    @staticmethod
    def run(args: argparse.Namespace) -> int:
        from ..backends import backends
        from ..ops.registry import aliases_of, list_operations

        rows = []
        for name in list_operations():
            bks = [b.name for b in backends() if b.available() and b.kernel(name) is not None]
            rows.append({"op": name, "aliases": aliases_of(name), "backends": bks})
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        t = Table(title=f"{len(rows)} operations")
        for col in ("op", "aliases", "backends"):
            t.add_column(col)
        for r in rows:
            t.add_row(r["op"], ", ".join(r["aliases"]), ", ".join(r["backends"]))
        Console().print(t)
        return 0
