"""Drawing graphs: Graphviz DOT, Mermaid, and PNG where Graphviz is installed.

    print(to_dot(g))             # paste into any Graphviz viewer
    print(to_mermaid(g))         # renders in GitHub / GitLab markdown
    render_png(g, "g.png")       # needs the ``graphviz`` package or the ``dot`` binary

Nodes are boxes labelled ``name`` and ``Op``; graph inputs are ellipses, outputs
double circles; edges carry the tensor id (and shape/dtype when the graph has
descriptors). Weights are folded into their reader's label (``+2 weights``)
unless ``weights=True``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

from ..errors import CapabilityError
from .ir import Graph

__all__ = ["to_dot", "to_mermaid", "render_png", "png_available"]


def _q(s: str) -> str:
    """A quoted DOT string; real newlines become DOT's ``\n`` escape."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _edge_label(graph: Graph, tid: str) -> str:
    d = graph.desc_map.get(tid)
    if d is None:
        return tid
    return f"{tid}\n{list(d.shape)} {d.dtype.name}"


def _ids(graph: Graph) -> tuple[dict[str, str], dict[str, str]]:
    """Stable short ids for nodes and for graph inputs/weights/outputs."""
    node_ids = {n.name: f"n{i}" for i, n in enumerate(graph.nodes)}
    src = {t: f"i{i}" for i, t in enumerate(graph.inputs)}
    src.update({w: f"w{i}" for i, (w, _) in enumerate(graph.weights)})
    return node_ids, src


def to_dot(graph: Graph, weights: bool = False) -> str:
    """The graph as Graphviz DOT text."""
    node_ids, src = _ids(graph)
    wset = {w for w, _ in graph.weights}
    producer = {t: n.name for n in graph.nodes for t in n.outputs}
    lines = [f"digraph {_q(graph.name)} {{", "  rankdir=TB;",
             '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8];']
    for t in graph.inputs:
        lines.append(f"  {src[t]} [label={_q(t)}, shape=ellipse, style=filled, fillcolor=lightblue];")
    if weights:
        for w in wset:
            lines.append(f"  {src[w]} [label={_q(w)}, shape=note, fontsize=8, color=gray];")
    for n in graph.nodes:
        nw = sum(1 for t in n.inputs if t in wset)
        extra = f"\n+{nw} weight{'s' if nw > 1 else ''}" if nw and not weights else ""
        label = f"{n.name}\n{n.op}{extra}"
        lines.append(f"  {node_ids[n.name]} [label={_q(label)}, shape=box, style=rounded];")
    for n in graph.nodes:
        for t in n.inputs:
            if not t or (t in wset and not weights):
                continue
            a = node_ids[producer[t]] if t in producer else src.get(t)
            if a is not None:
                lines.append(f"  {a} -> {node_ids[n.name]} [label={_q(_edge_label(graph, t))}];")
    for i, o in enumerate(graph.outputs):
        lines.append(f"  o{i} [label={_q(o)}, shape=doublecircle, style=filled, fillcolor=palegreen];")
        a = node_ids[producer[o]] if o in producer else src.get(o)
        if a is not None:
            lines.append(f"  {a} -> o{i};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _m(s: str) -> str:
    # Mermaid labels: quotes become #quot; (its entity syntax)
    return '"' + s.replace('"', "#quot;") + '"'


def to_mermaid(graph: Graph, weights: bool = False) -> str:
    """The graph as a Mermaid flowchart."""
    node_ids, src = _ids(graph)
    wset = {w for w, _ in graph.weights}
    producer = {t: n.name for n in graph.nodes for t in n.outputs}
    lines = ["flowchart TD"]
    for t in graph.inputs:
        lines.append(f"  {src[t]}([{_m(t)}])")
    if weights:
        for w in wset:
            lines.append(f"  {src[w]}[/{_m(w)}/]")
    for n in graph.nodes:
        nw = sum(1 for t in n.inputs if t in wset)
        extra = f"<br/>+{nw} weight{'s' if nw > 1 else ''}" if nw and not weights else ""
        lines.append(f"  {node_ids[n.name]}[{_m(f'{n.name}<br/>{n.op}{extra}')}]")
    for n in graph.nodes:
        for t in n.inputs:
            if not t or (t in wset and not weights):
                continue
            a = node_ids[producer[t]] if t in producer else src.get(t)
            if a is not None:
                label = _edge_label(graph, t).replace("\n", " ")
                lines.append(f"  {a} -->|{_m(label)}| {node_ids[n.name]}")
    for i, o in enumerate(graph.outputs):
        lines.append(f"  o{i}((({_m(o)})))")
        a = node_ids[producer[o]] if o in producer else src.get(o)
        if a is not None:
            lines.append(f"  {a} --> o{i}")
    return "\n".join(lines) + "\n"


def png_available() -> str | None:
    """Why a PNG cannot be rendered here, or None when it can."""
    if shutil.which("dot") is None:
        return "the Graphviz 'dot' binary is not installed (apt install graphviz)"
    return None


def render_png(graph: Graph, path: str | os.PathLike, weights: bool = False) -> str:
    """Render the graph to a PNG file with Graphviz; CapabilityError when it is
    not installed. Uses the ``graphviz`` Python package when present, else the
    ``dot`` binary directly."""
    why = png_available()
    if why is not None:
        raise CapabilityError("render_png", "PNG rendering", "Graphviz installed", why)
    src = to_dot(graph, weights=weights)
    try:
        import graphviz  # type: ignore[import-not-found]

        data: Any = graphviz.Source(src).pipe(format="png")
    except ImportError:
        data = subprocess.run(["dot", "-Tpng"], input=src.encode(), capture_output=True,
                              check=True).stdout
    with open(path, "wb") as f:
        f.write(data)
    return os.fspath(path)
