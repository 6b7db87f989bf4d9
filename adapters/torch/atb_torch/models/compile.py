"""``compile(model, ...)``: make a model faster and keep its answers.

    import atb_torch as atb
    fast = atb.compile(hf_model, opt_level=2)             # LlamaForCausalLM, GPT2LMHeadModel, ...
    out = fast(input_ids, attention_mask=mask)            # same outputs as hf_model
    ids = fast.generate(input_ids, max_new_tokens=64)     # same tokens

Accepted: Hugging Face ``transformers`` models of the families in :mod:`.arch`
(``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MixtralForCausalLM``, ``GPT2LMHeadModel``, their base models,
``BertModel``; more through the ``atb_model_architecture`` plugin hook), a
sentence-transformers model wrapping one of them, and models built from atb GraphOps
(:mod:`.graph_model`). The original model is not modified.

``opt_level``: 0 = op by op (atb kernels, nothing fused); 1 = standard fusion (merged
QKV and gate|up weights, norms inside the matmuls, residual adds in their epilogues,
RoPE with the KV-cache write, MoE); 2 = + atb's own ``generate`` loop (on the hand-written
runner, which still serves CUDA and quantized NPU decoders: + its prebuilt
decode plan); 3 = + device-graph capture (CUDA graphs; elsewhere it runs as 2,
logged). Decoders on the CPU (and NPU) run on the core engine at every level
(:mod:`.core_runner`: the model lowered to one GraphOp, bound once per shape bucket
over planned memory and a preallocated KV cache); encoders run on it everywhere
(:mod:`.lower_encoder`).
``dtype``: compute/weight dtype (default: the model's). ``quantize="w8"``: weight-only
int8 per output channel for every Linear; ``"w4"``: 4-bit codes with an fp16 scale per
group of 32 inputs (or a GPTQ/AWQ checkpoint's own codes, see :mod:`.gptq_load`), run by
the C w4 matmul. ``kv_cache_dtype="int8"``: the KV cache stored as int8 with an fp16 scale per token
and KV head (about half a bf16 cache's bytes; attention reads the int8 rows in place).
``enable_prefix_caching``: batch-1
``generate`` calls reuse the KV of a prompt prefix shared with the previous call.
``enable_speculative``: greedy batch-1 ``generate`` uses prompt-lookup decoding.
``progress``: a display of the layers' weights being prepared, on stderr when it is a
terminal and the compile runs past a second (None); False: never, True: on any
stream. ``ATB_PROGRESS=0`` turns it off everywhere (:mod:`atbcore.progress`).
``tensor_parallel=N`` (N > 1, inside a process group of N ranks): a Llama-family
decoder sharded Megatron-style, each rank's share one core GraphOp
(:mod:`.compile_tp`).
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from typing import Any

import torch

from atbcore.dtypes import Dtype
from atbcore.errors import CapabilityError, ParamsError
from atbcore.log import logger
from atbcore.progress import progress as progress_display

__all__ = ["compile", "OPT_LEVELS"]

# seconds a compile runs before its progress display appears (no flicker for small models)
PROGRESS_AFTER_S = 1.0

OPT_LEVELS = {0: "op-by-op atb kernels", 1: "standard fusion",
              2: "fusion + memory planning and plan caching",
              3: "fusion + planning + device-graph capture"}


def _dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None:
        return None
    try:
        t = Dtype.of(dtype).torch
    except (ValueError, TypeError, KeyError) as e:
        raise ParamsError("compile", "dtype", "a float dtype (torch.float32, 'bf16', ...)",
                          repr(dtype)) from e
    if t not in (torch.float32, torch.float16, torch.bfloat16):
        raise ParamsError("compile", "dtype", "float32, float16 or bfloat16", repr(dtype))
    return t


def _check(mode: str, opt_level: Any, quantize: Any, kv_cache_dtype: Any = None) -> None:
    if mode != "infer":
        raise CapabilityError("compile", "mode", "'infer' (compiled models are inference-only)",
                              repr(mode))
    if isinstance(opt_level, bool) or opt_level not in OPT_LEVELS:
        raise ParamsError("compile", "opt_level", "0, 1, 2 or 3", repr(opt_level))
    if quantize not in (None, "w8", "w4", "w8a8"):
        raise ParamsError("compile", "quantize", "None, 'w8', 'w4' or 'w8a8'", repr(quantize))
    if kv_cache_dtype not in (None, "int8"):
        raise ParamsError("compile", "kv_cache_dtype", "None or 'int8'", repr(kv_cache_dtype))


def compile(model: Any, mode: str = "infer", opt_level: int = 2,
            enable_prefix_caching: bool = False, enable_speculative: bool = False,
            dtype: Any = None, quantize: str | None = None,
            progress: bool | None = None, tensor_parallel: int | None = None,
            kv_cache_dtype: str | None = None) -> Any:
    """Compile ``model`` for inference; see the module docstring. Unsupported
    architectures and config options raise CapabilityError naming them."""
    _check(mode, opt_level, quantize, kv_cache_dtype)
    tdtype = _dtype(dtype)
    options = {"opt_level": opt_level, "enable_prefix_caching": bool(enable_prefix_caching),
               "enable_speculative": bool(enable_speculative), "dtype": tdtype,
               "quantize": quantize, "progress": progress, "kv_cache_dtype": kv_cache_dtype}
    if tensor_parallel is not None and (isinstance(tensor_parallel, bool) or not isinstance(
            tensor_parallel, int) or tensor_parallel < 1):
        raise ParamsError("compile", "tensor_parallel", "None or an int >= 1",
                          repr(tensor_parallel))
    if tensor_parallel is not None and tensor_parallel > 1:
        if not (hasattr(model, "config") and hasattr(model.config, "model_type")):
            raise CapabilityError("compile", "tensor_parallel for this model",
                                  "a Hugging Face decoder", type(model).__name__)
        from .compile_tp import compile_tensor_parallel

        return compile_tensor_parallel(model, tensor_parallel, options)
    if _is_sentence_transformer(model):
        return _compile_st(model, options)
    if hasattr(model, "config") and hasattr(model.config, "model_type"):
        return _compile_hf(model, options)
    from .graph_model import compile_graph_model, is_graph_model

    if is_graph_model(model):
        if kv_cache_dtype is not None:
            raise CapabilityError("compile", "kv_cache_dtype for a GraphOp model", "None (its "
                                  "KVCache is the model's own)", repr(kv_cache_dtype))
        return compile_graph_model(model, options)
    raise CapabilityError("compile", "model type", "a Hugging Face transformers model, a "
                          "sentence-transformers model or a model built from atb GraphOps",
                          type(model).__name__)


def _device_of(model: Any) -> torch.device:
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError):
        return torch.device("cpu")


def _compile_hf(model: Any, options: dict) -> Any:
    from .arch import resolve_architecture
    from .hf_model import wrap_hf
    from atbcore.backends.npu import kernel_device

    from .core_runner import CoreRunner, why_not_core
    from .lower_encoder import CoreEncoder
    from .runner import ModelRunner

    opt = options["opt_level"]
    dev = _device_of(model)
    if opt == 3 and dev.type != "cuda":
        logger.info("compile: opt_level 3 captures CUDA graphs; on %s it runs as opt_level 2",
                    dev.type)
    # ModelRunner.from_hf's steps, with the layers counted as the runner prepares them
    arch = resolve_architecture(model.config)
    spec = arch.describe(model.config)
    with progress_display(f"atb: compiling {type(model).__name__}", PROGRESS_AFTER_S,
                          total=spec.num_layers, enabled=options["progress"]) as advance:
        weights = arch.extract(model, spec)
        weights.layers = _CountedLayers(weights.layers, advance)
        kind = CoreEncoder if spec.kind == "encoder" else ModelRunner
        # the core engine on the CPU and NPU kernels (a test double's stand-in included);
        # CUDA keeps the runner's device plans until the core plan is checked on a GPU,
        # quantized NPU models until the core's fp32 w8 scales reach npu_weight_quant_*
        where = kernel_device(dev.type)
        if (where == "cpu" or (where == "npu" and options["quantize"] is None)) \
                and not why_not_core(
                spec, options["quantize"], options.get("kv_cache_dtype")) \
                and os.environ.get("ATB_ENGINE") != "runner":
            kind = CoreRunner
        runner = kind(spec, weights, opt_level=opt, dtype=options["dtype"],
                      quantize=options["quantize"], device=dev,
                      kv_cache_dtype=options.get("kv_cache_dtype"))
    if kind is ModelRunner:  # the core engine runs the plugin points as GraphOps do
        _warn_points(runner.spec.arch)
    logger.debug("compile: %s as %s, opt_level %d (%s), dtype %s, quantize %s",
                 type(model).__name__, runner.spec.arch, opt, OPT_LEVELS[opt], runner.dtype,
                 options["quantize"])
    return wrap_hf(model, runner, options)


def _warn_points(arch: str) -> None:
    """Say so when plugins implement execution points that a model compiled onto the
    hand-written runner does not run (quantized, GPT-2/Qwen3 and device models still
    are; the core engine, GraphOps and ``lower_decoder`` graphs run them)."""
    from atbcore.plugin.manager import EXECUTION_HOOKS, get_plugin_manager

    pm = get_plugin_manager()
    if not pm.execution_hooks_active():
        return
    names = sorted({i.plugin_name for h in EXECUTION_HOOKS
                    for i in getattr(pm.hook, h).get_hookimpls()})
    logger.warning("compile: %s runs its hand-written decode plan, which does not call the "
                   "plugin points (atb_preprocess / atb_postprocess / atb_rope) of %s; "
                   "GraphOps and atb_torch.models.lower.lower_decoder(model) run them",
                   arch, ", ".join(names))


class _CountedLayers(list):
    """A model's per-layer weights that count a step each time the runner, having
    prepared one layer, takes the next (and after the last)."""

    def __init__(self, layers: Any, advance: Any) -> None:
        super().__init__(layers)
        self.advance = advance

    def __iter__(self) -> Any:
        for layer in super().__iter__():
            yield layer
            self.advance()


# ----------------------------------------------------------------------------- sentence-transformers
def _is_sentence_transformer(model: Any) -> bool:
    return type(model).__module__.startswith("sentence_transformers") and \
        isinstance(model, torch.nn.Module)


def _compile_st(model: Any, options: dict) -> Any:
    """A copy of the SentenceTransformer whose Transformer module runs the compiled
    Hugging Face model (pooling, normalisation and ``encode`` are its own)."""
    new = copy.copy(model)
    new.__dict__["_modules"] = OrderedDict(model._modules)
    done = 0
    for name, mod in model._modules.items():
        inner = mod._modules.get("model") if mod is not None else None
        if inner is not None and hasattr(inner, "config") and hasattr(inner.config, "model_type"):
            m2 = copy.copy(mod)
            m2.__dict__["_modules"] = OrderedDict(mod._modules)
            m2._modules["model"] = _compile_hf(inner, options)
            new._modules[name] = m2
            done += 1
    if not done:
        raise CapabilityError("compile", "sentence-transformers model", "a Transformer module "
                              "wrapping a Hugging Face model", type(model).__name__)
    return new
