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
RoPE with the KV-cache write, MoE); 2 = + atb's own ``generate`` loop; 3 = + decode
steps captured as CUDA graphs (on CUDA; elsewhere it runs as 2, logged). Every model
runs on the core engine at every level and on every device: decoders through
:mod:`.core_runner`, encoders through :mod:`.lower_encoder` (the model lowered to one
GraphOp, bound once per shape bucket over planned memory and, for decoders, a
preallocated KV cache; CPU, CUDA and NPU kernels chosen per node by the backend).
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
    from .core_runner import CoreRunner
    from .lower_encoder import CoreEncoder

    opt = options["opt_level"]
    dev = _device_of(model)
    if opt == 3 and dev.type != "cuda":
        logger.info("compile: opt_level 3 captures CUDA graphs; on %s it runs as opt_level 2",
                    dev.type)
    # the layers counted as the engine prepares them
    arch = resolve_architecture(model.config)
    spec = arch.describe(model.config)
    with progress_display(f"atb: compiling {type(model).__name__}", PROGRESS_AFTER_S,
                          total=spec.num_layers, enabled=options["progress"]) as advance:
        weights = arch.extract(model, spec)
        weights.layers = _CountedLayers(weights.layers, advance)
        # every model runs on the core engine, on every device (CoreRunner and
        # CoreEncoder name what they cannot lower)
        kind = CoreEncoder if spec.kind == "encoder" else CoreRunner
        runner = kind(spec, weights, opt_level=opt, dtype=options["dtype"],
                      quantize=options["quantize"], device=dev,
                      kv_cache_dtype=options.get("kv_cache_dtype"))
    logger.debug("compile: %s as %s, opt_level %d (%s), dtype %s, quantize %s",
                 type(model).__name__, runner.spec.arch, opt, OPT_LEVELS[opt], runner.dtype,
                 options["quantize"])
    return wrap_hf(model, runner, options)


class _CountedLayers(list):
    """A model's per-layer weights that count a step each time the engine, having
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
