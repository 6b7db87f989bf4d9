"""Each tensor-parallel rank reads only its shard of a local safetensors checkpoint.

    from atb_torch.models.lower_tp import lower_decoder_tp, shard_plan
    from atb_torch.models.shard_load import load_shard
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    plan = shard_plan(config)                       # in an initialised process group
    op = lower_decoder_tp(config, weights=load_shard(path, plan))

Tensors are opened with ``safetensors.safe_open`` and read through ``get_slice``:
a rank reads the rows (or columns) :class:`~atbcore.distributed.ShardPlan` gives
it and nothing else, so no rank ever holds the full model. Replicated tensors
(norms, KV heads when fewer than ranks) are read whole. Llama-family names
(``model.layers.{i}.self_attn.q_proj.weight`` ...; Mixtral's experts too, each
expert's rows read apart: :mod:`.lower_moe`), sharded over several files or not;
tied embeddings (no ``lm_head.weight``) use the embedding table.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator

from atbcore.distributed import ShardPlan
from atbcore.errors import InputError

from .arch import LayerWeights, ModelWeights
from .lower_moe import lazy_moe_weights
from .lower_tp import shard_weights

__all__ = ["load_shard", "open_checkpoint"]


@contextlib.contextmanager
def open_checkpoint(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Tensor name -> lazy ``get_slice`` handle, over every ``*.safetensors`` file
    of the directory (files stay open inside the ``with``)."""
    import safetensors

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise InputError("load_shard", f"checkpoint {path}", "*.safetensors files",
                         sorted(p.name for p in Path(path).iterdir()) if Path(path).is_dir()
                         else "no such directory")
    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        for f in files:
            h = stack.enter_context(safetensors.safe_open(str(f), framework="pt"))
            for name in h.keys():
                handles[name] = h.get_slice(name)
        yield handles


def _lazy_weights(t: dict[str, Any], num_layers: int) -> ModelWeights:
    """The checkpoint's tensors as ModelWeights of lazy slices (nothing read yet)."""

    def get(name: str, required: bool = True) -> Any:
        if name not in t and required:
            raise InputError("load_shard", f"tensor {name!r} in the checkpoint",
                             "Llama-family tensor names", f"{len(t)} tensors, not this one")
        return t.get(name)

    layers = []
    for i in range(num_layers):
        p = f"model.layers.{i}."
        at, mlp = p + "self_attn.", p + "mlp."
        moe = lazy_moe_weights(t, get, p)
        dense = moe is None
        layers.append(LayerWeights(**(moe or {}),
            q=get(at + "q_proj.weight"), k=get(at + "k_proj.weight"),
            v=get(at + "v_proj.weight"), o=get(at + "o_proj.weight"),
            q_b=get(at + "q_proj.bias", False), k_b=get(at + "k_proj.bias", False),
            v_b=get(at + "v_proj.bias", False), o_b=get(at + "o_proj.bias", False),
            attn_norm=get(p + "input_layernorm.weight"),
            mlp_norm=get(p + "post_attention_layernorm.weight"),
            gate=get(mlp + "gate_proj.weight", dense), up=get(mlp + "up_proj.weight", dense),
            down=get(mlp + "down_proj.weight", dense)))
    embed = get("model.embed_tokens.weight")
    return ModelWeights(embed=embed, layers=layers, final_norm=get("model.norm.weight"),
                        lm_head=t.get("lm_head.weight", embed))


def load_shard(path: str | os.PathLike, plan: ShardPlan, num_layers: int | None = None
               ) -> ModelWeights:
    """This rank's sharded weights (torch tensors) read from the safetensors files in
    ``path``; ``num_layers`` defaults to the layers the checkpoint holds."""
    with open_checkpoint(path) as t:
        if num_layers is None:
            num_layers = len({n.split(".")[2] for n in t if n.startswith("model.layers.")})
        return shard_weights(_lazy_weights(t, num_layers), plan)
