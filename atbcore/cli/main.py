"""The ``atb`` command. Sub-commands register in ``COMMANDS``.

Start-up is kept to argparse: a sub-command's module (and whatever it imports: NumPy,
rich, torch) loads only when that sub-command runs, so ``atb --help`` and
``atb --version`` answer at once, and each command checks its input before it imports
anything heavy.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.util import find_spec
from typing import Any, Callable

from .._version import __version__

__all__ = ["main", "COMMANDS"]

# name -> (module path, attribute of the module or "" for the module itself, help); the
# object must have add_arguments(parser) and run(args) -> int
COMMANDS: dict[str, tuple[str, str, str]] = {
    "info": ("atbcore.cli.info", "", "versions, backends, devices and compatibility"),
    "ops": ("atbcore.cli.info", "OpsCommand", "list ops with their backends"),
    "verify": ("atbcore.cli.verify", "", "accuracy of every op against the reference"),
    "bench": ("atbcore.cli.bench", "", "benchmark the embedded default model (the main job)"),
    "generate": ("atbcore.cli.generate", "",
                 "generate text (default: the embedded model and a bundled tokenizer)"),
    "serve": ("atbcore.cli.serve", "", "an OpenAI-compatible HTTP server (default: the "
              "embedded model, 127.0.0.1:8000)"),
    "plugins": ("atbcore.cli.plugins", "", "list loaded plugins and their hooks"),
}


def _load(name: str) -> Any | None:
    """The command object of ``name``, or None when its module is not shipped."""
    module, attr, _ = COMMANDS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        return None
    return getattr(mod, attr) if attr else mod


def _chosen(argv: list[str]) -> str | None:
    """The sub-command named on the command line (the first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _available(name: str) -> bool:
    return find_spec(COMMANDS[name][0]) is not None


def main(argv: list[str] | None = None) -> int:
    """Run the ``atb`` command line with ``argv`` (default ``sys.argv[1:]``); returns the
    exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="atb", description="atb: Transformer acceleration layer")
    parser.add_argument("--version", action="version", version=f"atb {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    for name, (_, _, helptext) in COMMANDS.items():
        # only the command that runs pays for its imports; the others need only their help
        command = _load(name) if name == chosen else None
        if command is None and (name == chosen or not _available(name)):
            continue
        p = sub.add_parser(name, help=helptext, description=helptext)
        if command is not None:
            command.add_arguments(p)
            p.set_defaults(_run=command.run)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args._run
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
