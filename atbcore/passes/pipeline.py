"""The pass pipeline: one ordered list, top to bottom, each pass ``Graph -> Graph``.

    g2, reports = run_pipeline(g, FusionConfig(fusion_level="standard", verify=True))
    for r in reports: print(r)        # PassReport(name, changed, detail)

Order (:data:`PIPELINE`)::

    plugin hook  atb_graph_after_build
    fold_views   views / transposes cancelled or absorbed into matmuls
    cse          duplicate computations merged
    dce          dead nodes and unused weights dropped
    fusion       every enabled FusionRule of rules.FUSION_RULES (then plugin rules),
                 in order, each until it matches nowhere (one report per rule)
    cleanup_fold_views, cleanup_cse, cleanup_dce
    plugin hook  atb_graph_before_plan

Fusion levels: ``conservative`` runs no fusion rule (clean-up only, exact);
``standard`` the numerically safe fusions (results stay within DESIGN.md §5 of the
unfused graph); ``aggressive`` adds rules that may change rounding or formulas
(``gelu_tanh``, documented in :mod:`atbcore.passes.rules_aggressive`). Each fusion
has its switch (``enable_*``); any rule can also be turned off by name
(``disable=("qkv",)``).

The precision switches ``enable_fp32_accumulation`` / ``enable_softmax_high_precision``
are carried for backends; no pass lowers precision, and today's kernels always
accumulate and compute softmax in fp32, so turning them off changes nothing yet.

With ``verify=True`` the verifier runs on the input and after every pass; a pass
that fails or produces an invalid graph raises a GraphError naming the pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from ..errors import AtbError, GraphError, ParamsError
from ..graph.ir import Graph
from ..graph.verify import verify
from .cse import common_subexpression_elimination
from .dce import dead_code_elimination
from .fold_views import fold_views
from .rewrite import LEVELS, FusionRule, apply_rule

__all__ = ["FusionConfig", "PassReport", "Pass", "PIPELINE", "run_pipeline", "enabled_rules",
           "LEVELS"]


@dataclass(frozen=True)
class FusionConfig:
    """Which fusions run; see the module docstring. Seed-style dict keys map to
    these fields one to one."""

    fusion_level: str = "standard"
    enable_qkv_fusion: bool = True
    enable_mha_fusion: bool = True
    enable_add_ln_fusion: bool = True
    enable_ffn_fusion: bool = True
    enable_rope_fusion: bool = True
    enable_fp32_accumulation: bool = True
    enable_softmax_high_precision: bool = True
    verify: bool = False
    enable_norm_fusion: bool = True
    enable_linear_act_fusion: bool = True
    disable: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        level = str(self.fusion_level).lower()
        if level not in LEVELS:
            raise ParamsError("FusionConfig", "fusion_level", " | ".join(LEVELS),
                              repr(self.fusion_level))
        object.__setattr__(self, "fusion_level", level)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type in (bool, "bool") and not isinstance(v, bool):
                raise ParamsError("FusionConfig", f.name, "True or False", repr(v))
        d = self.disable
        object.__setattr__(self, "disable", (d,) if isinstance(d, str) else tuple(d))


@dataclass(frozen=True)
class PassReport:
    """What one pass did: ``changed`` and a one-line ``detail``."""

    name: str
    changed: bool
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {'changed' if self.changed else 'no change'} ({self.detail})"


@dataclass(frozen=True)
class Pass:
    """A named ``Graph -> Graph`` function (``fn`` None marks the fusion step)."""

    name: str
    fn: Callable[[Graph], Graph] | None
    doc: str = ""


PIPELINE: tuple[Pass, ...] = (
    Pass("fold_views", fold_views, "views and transposes cancelled or absorbed"),
    Pass("cse", common_subexpression_elimination, "duplicate computations merged"),
    Pass("dce", dead_code_elimination, "dead nodes and unused weights dropped"),
    Pass("fusion", None, "the enabled fusion rules, in order"),
    Pass("cleanup_fold_views", fold_views, "views left by fusion folded"),
    Pass("cleanup_cse", common_subexpression_elimination, "duplicates left by fusion merged"),
    Pass("cleanup_dce", dead_code_elimination, "what fusion left dead dropped"),
)


def enabled_rules(config: FusionConfig) -> list[FusionRule]:
    """The rules ``config`` runs, in order (built-in, then plugin rules)."""
    from ..ops.registry import list_operations
    from .rules import all_fusion_rules

    level = LEVELS[config.fusion_level]
    ops = set(list_operations())
    out = []
    for r in all_fusion_rules():
        if level == 0 and r.level != "conservative":
            continue
        if LEVELS[r.level] > level or r.name in config.disable:
            continue
        if r.switch is not None and not getattr(config, r.switch, True):
            continue
        if not set(r.requires) <= ops:
            continue
        out.append(r)
    return out


def _summary(before: Graph, after: Graph) -> str:
    if after is before or after == before:
        return f"{len(before.nodes)} nodes"
    old = {n.name: n for n in before.nodes}
    new = {n.name: n for n in after.nodes}
    gone = [k for k in old if k not in new]
    added = [f"{k} ({n.op})" for k, n in new.items() if k not in old]
    rewired = [k for k, n in new.items() if k in old and old[k] != n]
    parts = [f"{len(before.nodes)} -> {len(after.nodes)} nodes"]
    for label, names in (("removed", gone), ("added", added), ("rewrote", rewired)):
        if names:
            parts.append(f"{label} {', '.join(names)}")
    return "; ".join(parts)


def _check(name: str, graph: Graph, config: FusionConfig) -> None:
    if not config.verify:
        return
    try:
        verify(graph)
    except AtbError as e:
        raise GraphError(f"{graph.name}: pass {name!r}", f"produced an invalid graph: {e}",
                         None, None) from e


def _run(name: str, fn: Callable[[], Graph], graph: Graph) -> Graph:
    try:
        out = fn()
    except AtbError as e:
        raise GraphError(f"{graph.name}: pass {name!r}", f"failed: {e}", None, None) from e
    except Exception as e:  # a bug in a pass or a plugin rule: name it
        raise GraphError(f"{graph.name}: pass {name!r}", f"failed: {type(e).__name__}: {e}",
                         None, None) from e
    if not isinstance(out, Graph):
        raise GraphError(f"{graph.name}: pass {name!r}", "returned no Graph", "a Graph",
                         type(out).__name__)
    return out


def _hook(name: str, graph: Graph, reports: list[PassReport]) -> Graph:
    from ..plugin import call_graph_hook

    out = call_graph_hook(name, graph)
    reports.append(PassReport(f"plugin:{name}", out != graph, _summary(graph, out)))
    return out


def run_pipeline(graph: Graph, config: FusionConfig | None = None,
                 framework: str | None = None, backend: str | None = None
                 ) -> tuple[Graph, list[PassReport]]:
    """Run :data:`PIPELINE` on ``graph``; returns the new graph (with descriptors
    of every tensor attached when the inputs have them) and one report per pass
    (one per fusion rule). With the caller's ``framework`` the last pass puts each
    weight in the layout that framework's kernels read (:mod:`.layout`)."""
    config = config if config is not None else FusionConfig()
    reports: list[PassReport] = []
    _check("input", graph, config)
    g = _hook("atb_graph_after_build", graph, reports)
    for p in PIPELINE:
        if p.fn is None:
            for rule in enabled_rules(config):
                name = f"fuse:{rule.name}"
                lines: list[str] = []

                def fuse(rule: FusionRule = rule, g0: Graph = g) -> Graph:
                    out, done = apply_rule(g0, rule, cleanup=dead_code_elimination)
                    lines.extend(done)
                    return out

                g = _run(name, fuse, g)
                _check(name, g, config)
                detail = "; ".join(lines) if lines else f"{len(g.nodes)} nodes"
                reports.append(PassReport(name, bool(lines), detail))
            continue
        before = g
        g = _run(p.name, lambda fn=p.fn, g0=g: fn(g0), g)
        _check(p.name, g, config)
        reports.append(PassReport(p.name, g != before, _summary(before, g)))
    g = _hook("atb_graph_before_plan", g, reports)
    if framework is not None:
        from .layout import layout_weights

        g, lines = layout_weights(g, framework, backend)
        reports.append(PassReport("layout:weights", bool(lines), f"{len(lines)} weights packed "
                                  "for the kernels that read them" if lines else
                                  "every weight as stored"))
    try:
        descs = verify(g)
    except AtbError as e:
        raise GraphError(f"{g.name}: pipeline", f"result fails verification: {e}", None,
                         None) from e
    return g.with_descs(descs), reports
