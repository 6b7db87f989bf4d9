"""The ``atb`` command. Sub-commands register in ``COMMANDS``."""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from . import info

__all__ = ["main", "COMMANDS"]

# name -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS: dict[str, tuple[object, str]] = {
    "info": (info, "versions, backends, devices and compatibility"),
    "ops": (info.OpsCommand, "list ops with their backends"),
}


def _register_optional() -> None:
    import importlib

    for name, module, helptext in (
        ("verify", "atbcore.cli.verify", "accuracy of every op against the reference"),
        ("bench", "atbcore.cli.bench", "benchmark the embedded default model (the main job)"),
        ("generate", "atbcore.cli.generate", "generate text with a local checkpoint"),
        ("plugins", "atbcore.cli.plugins", "list loaded plugins and their hooks"),
    ):
        try:
            COMMANDS.setdefault(name, (importlib.import_module(module), helptext))
        except ModuleNotFoundError as e:
            if e.name != module:
                raise


def main(argv: list[str] | None = None) -> int:
    _register_optional()
    parser = argparse.ArgumentParser(prog="atb", description="atb: Transformer acceleration layer")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (mod, helptext) in COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        mod.add_arguments(p)  # type: ignore[attr-defined]
        p.set_defaults(_run=mod.run)  # type: ignore[attr-defined]
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args._run
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
