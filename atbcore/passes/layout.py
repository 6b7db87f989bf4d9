"""The weight-layout pass: each weight constant in the layout its kernel reads.

After fusion, the pipeline asks the backend of the caller's framework, for every
node that reads a weight constant, in which layout its kernel reads that input at
every row count (:func:`atbcore.backends.torch.weight_layout.preferred_layout` for
torch: 32-output panels for the C matmul of Linear / RmsNormLinear and of
FusedFeedForward's projections, in fp32/bf16/fp16 and int8 ``w8``; w8a8's VNNI
panels; w4's codes, group scales and zero points, one layout of several parts). A
weight whose readers all agree is rewritten into that layout (an
:class:`~atbcore.graph.packed.PackedWeight`; the parts of a layout of several tensors
are packed together, each input holding its own part, and are packed all or none):
the graph's ``weight_map`` then holds the packed form only, and the binders take it
as it is. A weight some reader takes
as it is (a LinearActivation that oneDNN runs; a kernel with no packed
layout) stays as it is, and so does a weight held as a framework's own tensor (an
``nn.Parameter`` of an atb_torch module: the user may update it in place, and its
panels, made at binding, follow its version counter). Lowered models (``compile()``)
hold NumPy arrays (views of the checkpoint's tensors, or arrays atb made).

Packing is memoised in the GraphOp's weight memo (:func:`atbcore.passes.rewrite.
weight_memo`) by the source's identity — for a weight the pipeline concatenated, by
the concatenation's sources — so every lowering of one GraphOp (its plain graph and
its in-place cache form) shares one packed copy, and the unpacked concatenation is
freed once packed.

``ATB_LAYOUT_PASS=0`` (read when a GraphOp is lowered) leaves every weight as
stored: the binders then pack panels beside it, as before this pass (for
side-by-side measurements).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

from ..errors import AtbError
from ..graph.analysis import bind_ids, canonical_op, infer_descs
from ..graph.ir import Graph
from ..graph.packed import Layout, PackedWeight, pack
from ..ops.registry import get_op
from ..tensor import framework_of
from .rewrite import packed_once

__all__ = ["layout_weights", "CHOOSERS", "weight_table"]

# backend -> "module:function" answering (op, params, input name, descs) -> Layout | None
CHOOSERS: dict[str, str] = {
    "torch": "atbcore.backends.torch.weight_layout:preferred_layout",
    "numpy_c": "atbcore.backends.cpu_kernels.native_layout:preferred_layout",
    "mindspore": "atb_mindspore.backend.layout:preferred_layout",
    "paddle": "atb_paddle.backend.layout:preferred_layout",
}


def _chooser(backend: str) -> Callable[..., Any] | None:
    spec = CHOOSERS.get(backend)
    if spec is None:
        return None
    mod, fn = spec.split(":")
    try:
        return getattr(importlib.import_module(mod), fn)
    except ImportError:  # the framework is not installed
        return None


def _ask(opdef: Any, n: Any, named: dict, framework: str, backend: str | None
         ) -> Callable[..., Any] | None:
    """The chooser of the backend that runs node ``n`` for ``framework``'s tensors (as
    the plan will select it: ``backend`` where the GraphOp names one), or None (a
    backend with no packed layouts)."""
    from ..backends import select_backend

    try:
        b, _ = select_backend(opdef, n.params, named, prefer=backend, framework=framework)
    except AtbError:
        return None
    return _chooser(b.name)


def layout_weights(graph: Graph, framework: str | None, backend: str | None = None
                   ) -> tuple[Graph, list[str]]:
    """``graph`` with every weight its readers all read in one packed layout packed
    into it; and one line per packed weight. Each reader's layout is asked of the
    backend that runs it for ``framework``'s tensors (torch; the C kernels of NumPy,
    MindSpore and Paddle tensors; ``backend``: the one the GraphOp names); nothing
    changes without a framework."""
    wm = graph.weight_map
    if framework is None or os.environ.get("ATB_LAYOUT_PASS", "1") == "0" or not wm:
        return graph, []
    try:
        descs = infer_descs(graph, partial=True)
    except AtbError:
        return graph, []
    wanted: dict[str, Layout | None] = {}
    joint: list[dict[str, str]] = []  # per node reading a layout of several parts: part -> tid
    for n in graph.nodes:
        reads = [t for t in n.inputs if t in wm]
        if not reads:
            continue
        opdef = get_op(n.op)
        try:  # an input with no known descriptor (an undeclared shape): read as it is
            ids = bind_ids(opdef, n, descs) if all(t in descs for t in n.inputs if t) else {}
        except AtbError:
            ids = {}
        named = {nm: descs.get(v) for nm, v in ids.items() if isinstance(v, str)}
        choose = _ask(opdef, n, named, framework, backend) if ids else None
        parts: dict[str, str] = {}
        for nm, v in ids.items():
            if not isinstance(v, str) or v not in wm:
                continue
            lay = choose(canonical_op(n.op), n.params, nm, named) if choose else None
            if v in wanted and wanted[v] != lay:
                lay = None  # readers disagree: leave it as it is
            wanted[v] = lay
            if lay is not None and lay.part:
                parts[lay.part] = v
        if parts:
            joint.append(parts)
        for t in reads:  # read where the binder names no input: as it is
            if t not in ids.values():
                wanted[t] = None
    for parts in joint:  # a layout of several parts: all of them packed, or none
        if any(wanted.get(t) is None for t in parts.values()) or "weight" not in parts:
            for t in parts.values():
                wanted[t] = None
    return _packed(graph, framework, wanted, joint)


def _packed(graph: Graph, framework: str | None, wanted: dict[str, Layout | None],
            joint: list[dict[str, str]]) -> tuple[Graph, list[str]]:
    """``graph`` with its weights packed as ``wanted`` says (``joint``: the tids packed
    together, by part), and one line per packed weight."""
    from ..graph.packed import pack_joint
    from ..tensor import to_numpy
    from .rewrite import identity

    wm = graph.weight_map
    new: dict[str, Any] = {}
    for parts in joint:
        lays = {p: wanted[t] for p, t in parts.items()}
        if lays["weight"] is None or parts["weight"] in new:
            continue
        arrs = {p: wm[t] for p, t in parts.items()}
        if all(type(a) is PackedWeight and a.layout == lays[p] for p, a in arrs.items()):
            continue
        if any(type(a) is PackedWeight or framework_of(a) != "numpy" for a in arrs.values()):
            continue  # a live framework tensor (packed at binding) or a part packed otherwise

        def together(_a: Any, _lay: Any, arrs: dict = arrs, lays: dict = lays) -> dict:
            done = pack_joint(arrs, lays)
            return {identity(to_numpy(arrs[p])): w for p, w in done.items()}
        got = packed_once(arrs["weight"], tuple(sorted(lays.items())), together)
        for p, t in parts.items():
            new[t] = got[identity(to_numpy(arrs[p]))]
    lines: list[str] = []
    weights = []
    for tid, arr in graph.weights:
        lay = wanted.get(tid)
        if lay is not None and framework_of(arr) not in ("numpy", "packed"):
            lay = None  # a framework's live tensor (a Parameter): packed at binding, by version
        if tid in new:
            arr = new[tid]
            lines.append(f"{tid}: {arr.layout.describe()}, {arr.nbytes} B")
        elif lay is not None and not lay.part and \
                not (type(arr) is PackedWeight and arr.layout == lay):
            arr = packed_once(arr, lay, pack)
            lines.append(f"{tid}: {lay.describe()}, {arr.nbytes} B")
        weights.append((tid, arr))
    if not lines:
        return graph, []
    return graph.replace(weights=tuple(weights)), lines


def weight_table(graph: Graph) -> list[tuple[str, str, int]]:
    """(weight id, layout, bytes held) of every weight of ``graph``."""
    from ..tensor import describe

    out = []
    for tid, arr in graph.weights:
        if type(arr) is PackedWeight:
            out.append((tid, arr.layout.describe(), arr.nbytes))
            continue
        d = describe(arr)
        nbytes = d.dtype.itemsize
        for s in d.shape:
            nbytes *= int(s)
        out.append((tid, "as stored (" + "x".join(map(str, d.shape)) + ")", nbytes))
    return out


def share_with_layers(layers: Any, graph: Graph, memo: dict, unfused: Graph) -> Graph:
    """Give ``layers`` (a GraphOp's, lowered into ``unfused`` and then ``graph`` inside
    ``memo``) the packed form of every array they hold that ``graph`` reads only
    packed, so the unpacked array (a merged QKV, quantized codes, a cast) is freed and
    a later lowering of the same layers (the in-place cache form, a re-lowering)
    starts from the packed weight. Returns ``unfused`` holding the same packed forms
    (what ``explain()`` shows as "before fusion" keeps no unpacked copy either)."""
    import numpy as np

    from ..graph.layers_block import flat_layers
    from .rewrite import identity

    packed: dict[tuple, PackedWeight] = {}
    for key, entry in memo.items():
        if key[0] == "layout" and type(key[2][0]) is int:  # packed by the source's memory
            w, alive = entry
            if alive is not None and alive() is not None:
                if isinstance(w, dict):  # a layout of several parts: by each part's source
                    packed.update(w)
                else:
                    packed[key[2]] = w
    plain = {identity(v) for v in graph.weight_map.values() if isinstance(v, np.ndarray)}
    swap: dict[tuple, PackedWeight] = {}
    for layer in flat_layers(list(layers)):
        held = getattr(layer, "_weights", None)
        if not isinstance(held, dict):
            continue
        for k, a in list(held.items()):
            if not isinstance(a, np.ndarray):
                continue
            ident = identity(a)
            w = packed.get(ident)
            if w is not None and ident not in plain:
                held[k] = swap[ident] = w
    if not swap:
        return unfused
    weights = tuple((t, swap.get(identity(a), a) if isinstance(a, np.ndarray) else a)
                    for t, a in unfused.weights)
    return unfused.replace(weights=weights)
