"""``atb plugins``: the plugins found, their hooks and where they came from."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

__all__ = ["collect", "add_arguments", "run"]


def collect() -> list[dict]:
    """One dict per plugin name: name, status, source, distribution, version,
    entry-point value, error, hooks (what ``atb plugins --json`` prints)."""
    from ..plugin import get_plugin_manager

    return [asdict(r) for r in get_plugin_manager().describe()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    rows = collect()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not rows:
        con.print("no plugins found in the entry-point group 'atb'")
        return 0
    t = Table(title="atb plugins (entry-point group 'atb')")
    for col in ("plugin", "status", "source", "hooks / error"):
        t.add_column(col)
    for r in rows:
        detail = ", ".join(r["hooks"]) if r["status"] == "loaded" else (r["error"] or "")
        t.add_row(r["name"], r["status"], r["source"], detail)
    con.print(t)
    return 0
