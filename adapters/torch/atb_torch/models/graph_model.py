"""``compile`` for models built from atb GraphOps (the seed's ``AcceleratedLLaMA``).

Such a model is already atb: its blocks are GraphOps that fuse, plan and cache their
own plans. ``compile`` wraps it so it runs without autograd and gains ``generate``;
at ``opt_level >= 1`` the plain ``nn.Linear`` layers around the GraphOps (the LM
head, typically: the largest matrix of a decode step) run as one-Linear GraphOps on
the same parameters (atb's matmul kernels and weight layouts). The model itself is
not modified: the compiled one holds a shallow copy of the module tree in which
those layers are replaced, sharing every parameter, buffer and GraphOp::

    model = atb.compile(AcceleratedLLaMA(...), mode="infer", opt_level=3)
    ids = model.generate(input_ids, max_new_tokens=100)

``generate`` expects ``forward(input_ids) -> logits [B, S, V]``. When the model keeps
its KV state in a ``kv_cache`` attribute (the seed passes it to every GraphOp as
``kv_cache=``), the state is reset, the prompt is run once and then one token per
step; otherwise every step recomputes the whole sequence. Greedy by default;
``do_sample=True`` samples with atb's seeded ``TopkToppSampling`` (``top_k``,
``top_p``, ``temperature``, ``seed``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from atbcore.errors import CapabilityError
from atbcore.log import logger

__all__ = ["is_graph_model", "compile_graph_model", "CompiledGraphModel"]


def _graph_ops(model: torch.nn.Module) -> list[Any]:
    from atbcore.graph.graph_op import GraphOp

    found = []
    for mod in model.modules():
        if type(mod).__name__ == "GraphOp":  # atb_torch.GraphOp, an nn.Module
            found.append(mod)
            continue
        found += [v for v in vars(mod).values() if isinstance(v, GraphOp)]  # core GraphOps
    return found


def is_graph_model(model: Any) -> bool:
    """True for a ``torch.nn.Module`` holding at least one atb GraphOp."""
    return isinstance(model, torch.nn.Module) and bool(_graph_ops(model))


def _lower_linears(module: torch.nn.Module) -> tuple[torch.nn.Module, int]:
    """``module``, or a shallow copy of it whose plain ``nn.Linear`` descendants
    outside GraphOps are one-Linear GraphOps on the same parameters; and how many
    were replaced."""
    from ..graph import GraphOp
    from ..modules import Linear

    swapped: dict[str, torch.nn.Module] = {}
    count = 0
    for name, child in module._modules.items():
        if child is None or isinstance(child, GraphOp):
            continue
        if type(child) is torch.nn.Linear:
            lin = Linear(child.in_features, child.out_features, bias=child.bias is not None,
                         dtype=child.weight.dtype, device="meta")  # no init: replaced
            lin.weight = child.weight  # the very Parameter: no copy, updates are seen
            if child.bias is not None:
                lin.bias = child.bias
            swapped[name] = GraphOp([lin], name=name)
            count += 1
            continue
        new, n = _lower_linears(child)
        if n:
            swapped[name], count = new, count + n
    if not swapped:
        return module, 0
    copy_ = copy.copy(module)
    copy_._modules = {**module._modules, **swapped}
    return copy_, count


class CompiledGraphModel(torch.nn.Module):
    """See the module docstring; ``.model`` is the wrapped model, ``.graph_ops`` its
    GraphOps (``explain()`` each to see fusion, kernels and launches)."""

    def __init__(self, model: torch.nn.Module, options: dict) -> None:
        super().__init__()
        self.atb_options = dict(options)
        self.graph_ops = _graph_ops(model)
        self.model, self.lowered_linears = model, 0
        self._program: Any = None  # graph_trace.StepProgram of a decode step
        self._program_refused = ""  # why the step is not one program
        if options.get("opt_level", 2) >= 1:
            self.model, self.lowered_linears = _lower_linears(model)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.model(*args, **kwargs)

    def explain(self) -> str:
        """What a decode step runs: the whole-step program's report (nodes before and
        after fusion, bound kernels, weight layouts, arena bytes, launches) once a
        ``generate`` made one, else each GraphOp's and why the step is not one program."""
        prog = self._program
        if prog is not None:
            form = prog.op._in_place or prog.op
            return f"{type(self.model).__name__}: each decode step is one program\n" + \
                form.explain()
        why = self._program_refused or "no generate() has run yet"
        parts = [f"{type(self.model).__name__}: decode runs call by call ({why})"]
        parts += [g.explain() for g in self.graph_ops]
        return "\n\n".join(parts)

    def reset_cache(self) -> bool:
        """Empty the model's ``kv_cache`` state; False when it keeps none."""
        from atbcore.graph.model_generate import reset_model_cache

        return reset_model_cache(self.model)

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step: the whole-step program when the model's step records as
        one (opt_level >= 2, :mod:`.graph_trace`), else the model's own forward."""
        prog = self._program
        if prog is not None:
            return prog(ids)
        if self.atb_options.get("opt_level", 2) < 2 or self._program_refused:
            return self.model(ids)
        from .graph_trace import StepProgram, record

        out, steps, why = record(self.model, ids)
        if steps is None:
            self._program_refused = why
            logger.info("compile: %s decodes call by call: %s", type(self.model).__name__, why)
        else:
            self._program = StepProgram(steps, ids, out.dtype)
            logger.debug("compile: %s decodes as one program of %d modules",
                         type(self.model).__name__, len(steps))
        return out

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, eos_token_id: int | None = None,
                 attention_mask: Any = None) -> torch.Tensor:
        """Prompt ``[B, S]`` -> ``[B, S + n]`` (see the module docstring)."""
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise CapabilityError("compile", "padded prompts for a GraphOp model",
                                  "prompts of equal length", "an attention mask with padding")
        sampler = None
        if do_sample:
            from ..library import call_kernel  # validated like the op, run by its torch kernel

            sampler = dict(top_k=top_k, top_p=top_p, temperature=temperature)
        from atbcore.backends.cpu_kernels.threads import parked_torch_threads

        incremental = self.reset_cache()
        cpu = input_ids.device.type == "cpu"
        seq = input_ids
        logits = self.model(seq)[:, -1]
        if self._program is not None and not self._program.current(self.model):
            self._program = None  # a GraphOp rebound changed weights in the prompt's run
        finished = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
        for i in range(max_new_tokens):
            if sampler is None:
                tok = logits.argmax(dim=-1)
            else:
                tok = call_kernel("TopkToppSampling", dict(
                    sampler, seed=None if seed is None else seed + i),
                    logits=logits.float())[0].to(seq.device)
            if eos_token_id is not None:
                tok = tok.masked_fill(finished, eos_token_id)
                finished |= tok == eos_token_id
            seq = torch.cat([seq, tok[:, None]], dim=1)
            if i == max_new_tokens - 1 or bool(finished.all()):
                break
            if incremental and cpu:  # one token a row: C kernels, torch's pool parked once
                with parked_torch_threads():
                    logits = self._step(tok[:, None])[:, -1]
            else:
                logits = (self.model(tok[:, None]) if incremental else self.model(seq))[:, -1]
        return seq


def compile_graph_model(model: torch.nn.Module, options: dict) -> CompiledGraphModel:
    """Wrap a GraphOp model (see the module docstring)."""
    if options.get("quantize"):
        raise CapabilityError("compile", "quantize for a GraphOp model", "None (quantize the "
                              "GraphOp's Linear layers themselves)", options["quantize"])
    return CompiledGraphModel(model, options)
