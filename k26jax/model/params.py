"""Every parameter of the target and of the DFlash drafter, declared once.

A table is a nested dict shaped like the parameter tree; its leaves are `Param`s: one layer's shape, dtype, init,
mesh axes and Hugging Face source. A `Stack` holds the leaves of a run of layers: each gets a leading [n] axis whose
slice i is HF layer `hf_layers[i]`. Derived from the tables:
  the NNX modules' Params (`build`, used by target.K2Model and drafter.DFlashDrafter), hence init and abstract params;
  PartitionSpecs (`partition_specs`: sharding.param_partition_specs, drafter.drafter_partition_specs);
  numpy shapes (`shapes`: the converter's zarr arrays); the HF names, shapes, reading and writing (k26jax/hf.py).
Table order is the init order (random draws follow it) and, within a layer, the HF checkpoint's order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from k26jax.config import DrafterConfig, ModelConfig

DATA, MODEL = "data", "model"  # mesh axes: batch, tensor parallelism
PACK, GROUP = 8, 32  # INT4 values per int32 word, input rows per scale

# Routed experts, the leaves the MoE kernels read (after the layer axis): "ep" splits the experts E, "tp" the
# intermediate dim Im (w13 [E, D/g, 2, Im] on Im, so gate/up pairs stay together; w2 [E, Im/g, D] on Im/g).
# "ep_global" splits the experts over both mesh axes, ("data", "model"): on a multi-host mesh (one "data" row per
# host) every device of every host holds E / (hosts * devices per host) whole experts; on one host ("data" of
# size 1) it is "ep" (sharding.fit_spec drops the size-1 axis).
EP_GLOBAL = (DATA, MODEL)
EXPERT_AXES = {
    "ep": {
        "w13_packed": (MODEL, None, None, None),
        "w13_scale": (MODEL, None, None, None),
        "w2_packed": (MODEL, None, None),
        "w2_scale": (MODEL, None, None),
    },
    "tp": {
        "w13_packed": (None, None, None, MODEL),
        "w13_scale": (None, None, None, MODEL),
        "w2_packed": (None, MODEL, None),
        "w2_scale": (None, MODEL, None),
    },
    "ep_global": {
        "w13_packed": (EP_GLOBAL, None, None, None),
        "w13_scale": (EP_GLOBAL, None, None, None),
        "w2_packed": (EP_GLOBAL, None, None),
        "w2_scale": (EP_GLOBAL, None, None),
    },
}


@dataclasses.dataclass(frozen=True)
class HF:
    """Where a leaf lives in a HF checkpoint. `name` is relative to the scope (a stack's `model.layers.{i}.`):
    the tensor's name for "tensor", a module's (`.weight` or the INT4 triple follows) or a prefix otherwise.
      tensor   the tensor is the leaf
      linear   nn.Linear weight [out, in] = the leaf reshaped to [in, out], transposed; the leaf's first `n_in` dims
               are the input. int4: the weight may be stored pack-quantized (dequantized on read)
      gate_up  linears `{name}gate_proj` and `{name}up_proj` [I, D] -> leaf [D, 2, I]
      kv_b     the linear viewed as [H, rows[2], R]; the leaf holds rows [rows[0], rows[1]) of each head
      experts  routed experts, INT4: `{name}{e}.{proj}.weight_{part}` [out, in/g] -> leaf [E, in/g, (2,) out]
               (the `projs` on the leaf's pair axis, or one proj)
    """

    name: str
    kind: str = "tensor"
    n_in: int = 1
    int4: bool = False
    rows: tuple[int, int, int] | None = None
    projs: tuple[str, ...] = ()
    part: str = ""


@dataclasses.dataclass(frozen=True)
class Param:
    """One leaf: `shape` of one layer's slice, mesh `axes` per dim of it ({expert_mode: axes} for routed experts),
    init "normal" (std `value`) | "ones" | "bits" (uniform random int32 words) | "const" (`value`), a fixed `dtype`
    (None: the model's float dtype) and its HF source."""

    shape: tuple[int, ...]
    axes: tuple | dict
    init: str
    value: float = 0.0
    dtype: str | None = None
    hf: HF | None = None

    def spec(self, expert_mode: str = "ep", stacked: bool = False) -> P:
        axes = self.axes[expert_mode] if isinstance(self.axes, dict) else self.axes
        return P(None, *axes) if stacked else P(*axes)

    def dtype_or(self, dtype):
        return jnp.dtype(self.dtype or dtype)


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers of one kind: `params` (a nested dict of Param) stacked over a leading axis, slice i holding HF layer
    `hf_layers[i]` under the name scope `hf_scope.format(hf_layers[i])`."""

    params: dict
    hf_layers: tuple[int, ...]
    hf_scope: str = "model.layers.{}."

    def scope(self, i: int) -> str:
        return self.hf_scope.format(self.hf_layers[i])


def _w(shape, axes, std, hf: HF, dtype=None) -> Param:
    return Param(tuple(shape), tuple(axes), "normal", std, dtype, hf)


def _norm(dim: int, name: str) -> Param:
    return Param((dim,), (None,), "ones", hf=HF(name))


def _swiglu(D: int, I: int, prefix: str, axis=MODEL, int4: bool = False) -> dict:
    return {
        "gate_up": _w((D, 2, I), (None, None, axis), D**-0.5, HF(prefix, "gate_up", int4=int4)),
        "down": _w((I, D), (axis, None), I**-0.5, HF(prefix + "down_proj", "linear", int4=int4)),
    }


# ---- the target ------------------------------------------------------------------------------------------
def target_table(cfg: ModelConfig) -> dict:
    """The K2 target ([in, out] matmul layout; n = layers of that kind):
    embed [V, D], final_norm [D], lm_head [D, V]
    dense | moe: input_norm [n, D], post_attn_norm [n, D],
      attn: q_a [n, D, Rq], q_a_norm [n, Rq], q_b [n, Rq, H, Dn+Dr]   (q_lora_rank null: q [n, D, H, Dn+Dr])
            kv_a [n, D, R+Dr], kv_a_norm [n, R], w_uk [n, H, Dn, R], w_uv [n, H, Dv, R], o [n, H, Dv, D]
      mlp (dense): gate_up [n, D, 2, I], down [n, I, D]
      mlp (moe):   router_kernel [n, D, E], router_bias [n, E] f32, shared {gate_up [n, D, 2, Is], down [n, Is, D]},
                   w13_packed [n, E, D/8, 2, Im] int32, w13_scale [n, E, D/32, 2, Im] bf16,
                   w2_packed [n, E, Im/8, D] int32, w2_scale [n, E, Im/32, D] bf16
    """
    D, V = cfg.hidden_size, cfg.vocab_size
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    table = {
        "embed": _w((V, D), (MODEL, None), 1.0, HF("model.embed_tokens.weight")),
        "final_norm": _norm(D, "model.norm.weight"),
        "lm_head": _w((D, V), (None, MODEL), D**-0.5, HF(head, "linear")),
    }
    for kind in ("dense", "moe"):
        layers = tuple(i for i, k in enumerate(cfg.layer_kinds) if k == kind)
        if layers:
            table[kind] = Stack(_decoder_layer(cfg, kind), layers)
    return table


def _decoder_layer(cfg: ModelConfig, kind: str) -> dict:
    D = cfg.hidden_size
    mlp = _swiglu(D, cfg.intermediate_size, "mlp.", int4=True) if kind == "dense" else _moe(cfg)
    return {
        "input_norm": _norm(D, "input_layernorm.weight"),
        "attn": _mla(cfg),
        "post_attn_norm": _norm(D, "post_attention_layernorm.weight"),
        "mlp": mlp,
    }


def _mla(cfg: ModelConfig) -> dict:
    D, H, R, Rq = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    Dn, Dv, Dq = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim

    def linear(name, n_in=1):
        return HF("self_attn." + name, "linear", n_in=n_in, int4=True)

    if Rq is None:
        attn = {"q": _w((D, H, Dq), (None, MODEL, None), D**-0.5, linear("q_proj"))}
    else:
        attn = {
            "q_a": _w((D, Rq), (None, None), D**-0.5, linear("q_a_proj")),
            "q_a_norm": _norm(Rq, "self_attn.q_a_layernorm.weight"),
            "q_b": _w((Rq, H, Dq), (None, MODEL, None), Rq**-0.5, linear("q_b_proj")),
        }
    kv_b = "self_attn.kv_b_proj"
    return attn | {
        "kv_a": _w((D, R + cfg.qk_rope_head_dim), (None, None), D**-0.5, linear("kv_a_proj_with_mqa")),
        "kv_a_norm": _norm(R, "self_attn.kv_a_layernorm.weight"),
        "w_uk": _w((H, Dn, R), (MODEL, None, None), R**-0.5, HF(kv_b, "kv_b", int4=True, rows=(0, Dn, Dn + Dv))),
        "w_uv": _w((H, Dv, R), (MODEL, None, None), R**-0.5, HF(kv_b, "kv_b", int4=True, rows=(Dn, Dn + Dv, Dn + Dv))),
        "o": _w((H, Dv, D), (MODEL, None, None), (H * Dv) ** -0.5, linear("o_proj", n_in=2)),
    }


def _moe(cfg: ModelConfig) -> dict:
    D, E, Im = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    g = cfg.quant.group_size if cfg.quant else GROUP
    mlp = {
        "router_kernel": _w((D, E), (None, None), D**-0.5, HF("mlp.gate", "linear")),
        "router_bias": _w((E,), (None,), 0.01, HF("mlp.gate.e_score_correction_bias"), dtype="float32"),
    }
    if cfg.n_shared_experts:
        mlp["shared"] = _swiglu(D, Im * cfg.n_shared_experts, "mlp.shared_experts.", int4=True)

    def experts(key, shape, init, value, dtype, projs, part):
        axes = {mode: EXPERT_AXES[mode][key] for mode in EXPERT_AXES}
        return Param(shape, axes, init, value, dtype, HF("mlp.experts.", "experts", projs=projs, part=part))

    # Uniform random INT4 values have std ~4.6: scales 1/(4.6 sqrt(fan_in)) keep activations O(1).
    gate_up, down = ("gate_proj", "up_proj"), ("down_proj",)
    return mlp | {
        "w13_packed": experts("w13_packed", (E, D // PACK, 2, Im), "bits", 0.0, "int32", gate_up, "packed"),
        "w13_scale": experts(
            "w13_scale", (E, D // g, 2, Im), "const", 1 / (4.6 * D**0.5), "bfloat16", gate_up, "scale"
        ),
        "w2_packed": experts("w2_packed", (E, Im // PACK, D), "bits", 0.0, "int32", down, "packed"),
        "w2_scale": experts("w2_scale", (E, Im // g, D), "const", 1 / (4.6 * Im**0.5), "bfloat16", down, "scale"),
    }


# ---- the DFlash drafter ----------------------------------------------------------------------------------
def drafter_heads_split(cfg: DrafterConfig, model_axis_size: int) -> bool:
    """Attention is split over "model" only when both q and kv heads divide, so each shard holds whole groups."""
    return cfg.num_attention_heads % model_axis_size == 0 and cfg.num_key_value_heads % model_axis_size == 0


def drafter_table(cfg: DrafterConfig, model_axis_size: int = 1) -> dict:
    """The DFlash drafter, z-lab's `DFlashDraftModel` ([in, out] layout; n = num_hidden_layers, D hidden,
    F = len(target_layer_ids) * D, Hq/Hkv heads, K head_dim, I intermediate):
    fc [F, D], hidden_norm [D], final_norm [D]
    layers: input_norm [n, D], post_attn_norm [n, D],
            attn: q [n, D, Hq, K], k [n, D, Hkv, K], v [n, D, Hkv, K], o [n, Hq, K, D], q_norm [n, K], k_norm [n, K]
            mlp:  gate_up [n, D, 2, I], down [n, I, D]
    Axes for a "model" mesh axis of `model_axis_size` devices: heads, the MLP intermediate and fc's input split where
    they divide, replicated otherwise."""
    if model_axis_size < 1:
        raise ValueError(f"model_axis_size: must be >= 1, got {model_axis_size}")
    n, D, K, I, F = cfg.num_hidden_layers, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.context_dim
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    heads = MODEL if drafter_heads_split(cfg, model_axis_size) else None
    inter = MODEL if I % model_axis_size == 0 else None
    fc_in = MODEL if F % model_axis_size == 0 else None

    def proj(name, shape, axes, std, n_in=1):
        return _w(shape, axes, std, HF(f"self_attn.{name}_proj", "linear", n_in=n_in))

    layer = {
        "input_norm": _norm(D, "input_layernorm.weight"),
        "post_attn_norm": _norm(D, "post_attention_layernorm.weight"),
        "attn": {
            "q": proj("q", (D, Hq, K), (None, heads, None), D**-0.5),
            "k": proj("k", (D, Hkv, K), (None, heads, None), D**-0.5),
            "v": proj("v", (D, Hkv, K), (None, heads, None), D**-0.5),
            "o": proj("o", (Hq, K, D), (heads, None, None), (Hq * K) ** -0.5, n_in=2),
            "q_norm": _norm(K, "self_attn.q_norm.weight"),
            "k_norm": _norm(K, "self_attn.k_norm.weight"),
        },
        "mlp": _swiglu(D, I, "mlp.", axis=inter),
    }
    return {
        "fc": _w((F, D), (fc_in, None), F**-0.5, HF("fc", "linear")),
        "hidden_norm": _norm(D, "hidden_norm.weight"),
        "final_norm": _norm(D, "norm.weight"),
        "layers": Stack(layer, tuple(range(n)), "layers.{}."),
    }


# ---- derived ---------------------------------------------------------------------------------------------
def walk(table: dict, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Param, Stack | None]]:
    """(path, Param, the Stack it belongs to or None) for every leaf, in table order."""
    for key, node in table.items():
        if isinstance(node, Stack):
            for sub, param, _ in walk(node.params, (*path, key)):
                yield sub, param, node
        elif isinstance(node, dict):
            yield from walk(node, (*path, key))
        else:
            yield (*path, key), node, None


def _map(table: dict, fn) -> dict:
    """The table's tree with each leaf replaced by fn(Param, layer count or None)."""
    out = {}
    for key, node in table.items():
        if isinstance(node, Stack):
            out[key] = _map(node.params, lambda p, _, n=len(node.hf_layers): fn(p, n))
        elif isinstance(node, dict):
            out[key] = _map(node, fn)
        else:
            out[key] = fn(node, None)
    return out


def shard_table(table: dict, model_axis_size: int, expert_mode: str = "ep") -> dict:
    """The table of what one device of a `model_axis_size`-wide "model" axis holds: each dim split over "model"
    divided by it (routed experts as `expert_mode` lays them out). One GPU's share of a tensor-parallel model, for
    running that share alone (scripts/bench_share.py)."""

    def local(p: Param) -> Param:
        axes = p.axes[expert_mode] if isinstance(p.axes, dict) else p.axes
        shape = []
        for dim, axis in zip(p.shape, axes):
            if axis == EP_GLOBAL:
                raise ValueError("shard_table: ep_global spans hosts; use 'ep' or 'tp'")
            if axis == MODEL and dim % model_axis_size:
                raise ValueError(f"shard_table: dim {dim} of a {p.shape} leaf does not split {model_axis_size} ways")
            shape.append(dim // model_axis_size if axis == MODEL else dim)
        return dataclasses.replace(p, shape=tuple(shape), axes=tuple(None for _ in axes))

    out = {}
    for key, node in table.items():
        if isinstance(node, Stack):
            out[key] = dataclasses.replace(node, params=shard_table(node.params, model_axis_size, expert_mode))
        elif isinstance(node, dict):
            out[key] = shard_table(node, model_axis_size, expert_mode)
        else:
            out[key] = local(node)
    return out


def full_shape(param: Param, n: int | None) -> tuple[int, ...]:
    return param.shape if n is None else (n, *param.shape)


def partition_specs(table: dict, expert_mode: str = "ep") -> dict:
    """PartitionSpecs mirroring the tree (a stack's layer axis is never split)."""
    return _map(table, lambda p, n: p.spec(expert_mode, stacked=n is not None))


def shapes(table: dict, dtype="bfloat16") -> dict:
    """The tree as (shape, numpy dtype) leaves; float leaves without a fixed dtype in `dtype`."""
    return _map(table, lambda p, n: (full_shape(p, n), np.dtype(p.dtype_or(dtype))))


def fixed_dtype_leaves(table: dict) -> set[tuple[str, ...]]:
    """Paths of the leaves whose dtype never follows the model's (INT4 words, bf16 scales, fp32 router bias)."""
    return {path for path, p, _ in walk(table) if p.dtype is not None}


def _init_value(p: Param, shape: tuple[int, ...], dtype, rngs: nnx.Rngs):
    dtype = p.dtype_or(dtype)
    if p.init == "ones":
        return jnp.ones(shape, dtype)
    if p.init == "const":
        return jnp.full(shape, p.value, dtype)
    if p.init == "bits":
        return jax.random.bits(rngs.params(), shape, jnp.uint32).view(jnp.int32)
    if p.init == "normal":
        return (p.value * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    raise ValueError(f"unknown init {p.init!r}")


class Group(nnx.Module):
    """One level of a table as an NNX module: an nnx.Param per leaf, a Group per sub-dict or stack."""

    def __init__(self, table: dict, dtype, rngs: nnx.Rngs, n: int | None = None):
        build(self, table, dtype, rngs, n)


def build(module: nnx.Module, table: dict, dtype, rngs: nnx.Rngs, n: int | None = None) -> None:
    """Sets the table's parameters on `module`, initialised in table order (n: the enclosing stack's layers)."""
    for key, node in table.items():
        if isinstance(node, Stack):
            setattr(module, key, Group(node.params, dtype, rngs, len(node.hf_layers)))
        elif isinstance(node, dict):
            setattr(module, key, Group(node, dtype, rngs, n))
        else:
            setattr(module, key, nnx.Param(_init_value(node, full_shape(node, n), dtype, rngs)))


def init_tree(table: dict, seed: int = 0, dtype=jnp.bfloat16) -> dict:
    """A plain parameter tree initialised from `table` alone (no model class: e.g. a `shard_table`)."""
    return pure_params(Group(table, dtype, nnx.Rngs(seed)))


def pure_params(module: nnx.Module) -> dict:
    """The module's parameter tree as a plain nested dict of arrays (what the jitted forwards take)."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def load_into(module: nnx.Module, tree: dict) -> None:
    """Replaces the module's parameter values with those of a plain tree (e.g. read from a checkpoint)."""
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, tree)
    nnx.update(module, state)
