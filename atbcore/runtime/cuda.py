"""CUDA-only execution: independent branches on separate streams, and plans
captured as CUDA graphs (one replay = one launch). torch is imported lazily; none
of this runs on a CPU-only machine (callers check the plan's device first).

Stream ordering: every side stream first waits for the work already queued on the
caller's stream (the inputs); a node waits for the event recorded after each of
its producers that ran on another stream; at the end the caller's stream waits for
every side stream. A tensor read on a stream other than the one that made it is
``record_stream``-ed there so the caching allocator does not hand its memory out
while that stream may still read it.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import CapabilityError
from ..tensor import TensorDesc

__all__ = ["StreamRunner", "CapturedPlan", "cuda_graph_unavailable_reason", "capture_or_none"]


def _slots(v: Any) -> tuple[str, ...]:
    return v if isinstance(v, tuple) else (v,)


class StreamRunner:
    """Runs one plan's calls over ``plan.num_streams`` streams (see module doc)."""

    def __init__(self, plan: Any) -> None:
        import torch

        self.torch = torch
        self.main = torch.cuda.current_stream()
        cached = getattr(plan, "_side_streams", None)
        if cached is None or len(cached) != plan.num_streams - 1:
            cached = [torch.cuda.Stream() for _ in range(plan.num_streams - 1)]
            plan._side_streams = cached
        self.streams = [self.main, *cached]
        start = torch.cuda.Event()
        start.record(self.main)
        for s in self.streams[1:]:
            s.wait_event(start)
        self.ready: dict[str, tuple[int, Any]] = {}

    def run(self, c: Any, env: dict, fn: Callable[[], list]) -> list:
        s = self.streams[c.stream]
        waited: set[int] = set()
        for _, v, _ in c.ins:
            for t in _slots(v):
                info = self.ready.get(t)
                if info is None or info[0] == c.stream:
                    continue
                if id(info[1]) not in waited:
                    s.wait_event(info[1])
                    waited.add(id(info[1]))
                env[t].record_stream(s)
        with self.torch.cuda.stream(s):
            results = fn()
        ev = self.torch.cuda.Event()
        ev.record(s)
        for o in c.outs:
            self.ready[o] = (c.stream, ev)
        return results

    def join(self) -> None:
        for s in self.streams[1:]:
            ev = self.torch.cuda.Event()
            ev.record(s)
            self.main.wait_event(ev)

    def adopt(self, outputs: list) -> None:
        """Outputs made on side streams are handed to the caller's stream."""
        for t in outputs:
            if hasattr(t, "record_stream"):
                t.record_stream(self.main)


def cuda_graph_unavailable_reason(plan: Any) -> str | None:
    """Why ``plan`` cannot be captured as a CUDA graph (None = it can)."""
    if not plan.device.startswith("cuda"):
        return f"CUDA graphs need a CUDA device; this plan runs on {plan.device}"
    if any(c.native != "torch" for c in plan.calls):
        bad = next(c.node for c in plan.calls if c.native != "torch")
        return f"node {bad} runs on a non-torch backend"
    return None


class CapturedPlan:
    """A plan captured for one exact input signature.

    Inputs are copied into static buffers before each replay and outputs are cloned
    after it so callers own them: ``staging`` counts those copies, ``launches`` (1)
    the graph replay itself. Data-dependent checks (ids in range) of ops reading
    graph inputs run on the host before each replay; checks on intermediates ran
    in the warm-up only (inside a graph they would need a host sync).
    """

    launches = 1

    def __init__(self, plan: Any, inputs: Mapping[str, Any], descs: Mapping[str, TensorDesc],
                 warmup: int = 2, by_reference: frozenset[str] = frozenset()) -> None:
        """``by_reference``: inputs captured where they are (a KV cache the plan writes
        in place, the feeder's index tensors updated in place), not copied; a replay
        with any of them at another address returns None (capture again)."""
        why = cuda_graph_unavailable_reason(plan)
        if why:
            raise CapabilityError(plan.graph.name, "CUDA graph capture", "a CUDA torch plan", why)
        import torch

        self.plan = plan
        # Checks of ops fed by graph inputs run on the host before each replay; the
        # warm-up runs every check once on the example inputs; checks of
        # intermediates cannot run inside a graph (they need a host sync).
        self.host_checks = [c for c in plan.calls if c.check and all(
            s in inputs or s in plan.weights_env for _, v, _ in c.ins for s in _slots(v))]
        self.static_in = {k: v if k in by_reference else v.clone() for k, v in inputs.items()}
        self.at = {k: v.data_ptr() for k, v in inputs.items() if k in by_reference}
        self.descs = dict(descs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up allocates workspaces outside the capture
            for _ in range(warmup):
                plan.run(self.static_in, descs=descs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        plan.skip_checks = True
        try:
            with torch.no_grad(), torch.cuda.graph(self.graph):
                self.static_out = plan._run(self.static_in, descs, None, None)
        finally:
            plan.skip_checks = False
        self.staging = len(self.static_in) + len(self.static_out)

    def replay(self, inputs: Mapping[str, Any]) -> list | None:
        """Copy ``inputs`` in, replay, return fresh copies of the outputs (None: an
        input captured by reference has moved)."""
        if any(inputs[k].data_ptr() != ptr for k, ptr in self.at.items()):
            return None
        env = {**self.plan.weights_env, **inputs}
        for c in self.host_checks:
            ins = dict.fromkeys(c.names)
            for name, v, _ in c.ins:
                ins[name] = env[v] if isinstance(v, str) else [env[s] for s in v]
            c.opdef.check_values(c.params, ins)
        for k, v in inputs.items():
            if k not in self.at:
                self.static_in[k].copy_(v)
        self.graph.replay()
        return [o.clone() for o in self.static_out]


def capture_or_none(op: Any, plan: Any, exact: Mapping[str, TensorDesc],
                    native: Mapping[str, Any]) -> list | None:
    """Run ``plan`` of GraphOp ``op`` (``cuda_graph=True``) as its captured CUDA graph
    for this exact signature (captured on first use); None where it is not captured.

    An in-place cache form (``op._cache_form``) captures its decode steps only (one
    token per row: the shape every step repeats; a prompt's length rarely does), with
    the cache and the feeder's index tensors (``op._trusted``) by reference: the plan
    writes the cache where it is. When the cache grows (new storage) the step is
    captured again."""
    if op._cache_form is not None:
        rows = next((d for k, d in exact.items() if k.endswith("q_seq_lens")), None)
        tokens = exact[plan.graph.inputs[0]]
        if rows is None or tokens.shape[:1] != rows.shape[:1]:
            return None
    sig = tuple(sorted((k, exact[k]) for k in native))
    cap = op._captured.get(sig)
    # a graph captured before the GraphOp's shared arena grew writes the old block
    fresh = cap is not None and getattr(cap, "arena_block", None) is plan.arena_block
    out = cap.replay(native) if fresh else None
    if out is None:
        op._captured[sig] = cap = CapturedPlan(plan, native, exact, by_reference=op._trusted)
        cap.arena_block = plan.arena_block
        out = cap.replay(native)
    op.last_launches = cap.launches
    return out
