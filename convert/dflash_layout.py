"""z-lab's on-disk DFlash drafter layout <-> k26jax's stacked parameter tree (numpy).

On disk: config.json plus model.safetensors (or shards listed in model.safetensors.index.json), tensor names exactly
as `DFlashDraftModel.state_dict()` (torch Linear weights [out, in]):
  fc.weight [D, F], hidden_norm.weight [D], norm.weight [D]
  layers.{i}.input_layernorm.weight [D], layers.{i}.post_attention_layernorm.weight [D]
  layers.{i}.self_attn.{q,k,v}_proj.weight [H*K, D], layers.{i}.self_attn.o_proj.weight [D, Hq*K]
  layers.{i}.self_attn.{q,k}_norm.weight [K]
  layers.{i}.mlp.{gate,up}_proj.weight [I, D], layers.{i}.mlp.down_proj.weight [D, I]
The tree is the one documented in k26jax/model/drafter.py. Layers are filled slice by slice into preallocated
stacked arrays, so reading holds one copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from k26jax.config import DrafterConfig

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


def _layer_tensors(cfg: DrafterConfig) -> dict:
    """Per-layer HF suffix -> (HF shape, tree path, index into the layer's slice, HF -> tree, tree -> HF)."""
    D, K, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    whole, t = (), np.transpose

    def heads_in(h):  # [h*K, D] <-> [D, h, K]
        return lambda w: w.T.reshape(D, h, K), lambda x: x.reshape(D, h * K).T

    return {
        "input_layernorm.weight": ((D,), ("input_norm",), whole, _same, _same),
        "post_attention_layernorm.weight": ((D,), ("post_attn_norm",), whole, _same, _same),
        "self_attn.q_proj.weight": ((Hq * K, D), ("attn", "q"), whole, *heads_in(Hq)),
        "self_attn.k_proj.weight": ((Hkv * K, D), ("attn", "k"), whole, *heads_in(Hkv)),
        "self_attn.v_proj.weight": ((Hkv * K, D), ("attn", "v"), whole, *heads_in(Hkv)),
        "self_attn.o_proj.weight": (
            (D, Hq * K),
            ("attn", "o"),
            whole,
            lambda w: w.T.reshape(Hq, K, D),
            lambda x: x.reshape(Hq * K, D).T,
        ),
        "self_attn.q_norm.weight": ((K,), ("attn", "q_norm"), whole, _same, _same),
        "self_attn.k_norm.weight": ((K,), ("attn", "k_norm"), whole, _same, _same),
        "mlp.gate_proj.weight": ((I, D), ("mlp", "gate_up"), (slice(None), 0), t, t),
        "mlp.up_proj.weight": ((I, D), ("mlp", "gate_up"), (slice(None), 1), t, t),
        "mlp.down_proj.weight": ((D, I), ("mlp", "down"), whole, t, t),
    }


def _layer_leaf_shapes(cfg: DrafterConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Tree path -> one layer's slice shape (the stacked leaf is [n, *shape])."""
    D, K, I = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    Hq, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        ("input_norm",): (D,),
        ("post_attn_norm",): (D,),
        ("attn", "q"): (D, Hq, K),
        ("attn", "k"): (D, Hkv, K),
        ("attn", "v"): (D, Hkv, K),
        ("attn", "o"): (Hq, K, D),
        ("attn", "q_norm"): (K,),
        ("attn", "k_norm"): (K,),
        ("mlp", "gate_up"): (D, 2, I),
        ("mlp", "down"): (I, D),
    }


def _same(x):
    return x


def _top_tensors(cfg: DrafterConfig):
    """HF name -> (HF shape, tree key, HF -> tree, tree -> HF)."""
    D = cfg.hidden_size
    return {
        "fc.weight": ((D, cfg.context_dim), "fc", np.transpose, np.transpose),
        "hidden_norm.weight": ((D,), "hidden_norm", _same, _same),
        "norm.weight": ((D,), "final_norm", _same, _same),
    }


def _leaf(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def hf_tensor_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name on disk with its shape."""
    out = {name: spec[0] for name, spec in _top_tensors(cfg).items()}
    for i in range(cfg.num_hidden_layers):
        out.update({f"layers.{i}.{s}": spec[0] for s, spec in _layer_tensors(cfg).items()})
    return out


def _tensor_files(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no 'weight_map' object")
        return {name: os.path.join(path, file) for name, file in weight_map.items()}
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, framework="np") as f:
        return {name: single for name in f.keys()}


def read_drafter_params(path: str, cfg: DrafterConfig) -> dict:
    """The stacked numpy parameter tree, in the checkpoint's dtype (bf16 as ml_dtypes.bfloat16)."""
    files = _tensor_files(path)
    expected = hf_tensor_shapes(cfg)
    missing = [n for n in expected if n not in files]
    if missing:
        raise ValueError(f"{path}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
    unknown = sorted(set(files) - set(expected))
    if unknown:
        raise ValueError(
            f"{path}: tensors a DFlashDraftModel does not have: {unknown[:6]} (a DFlash2 drafter "
            f"or another architecture?)"
        )
    with contextlib.ExitStack() as stack:
        opened = {}

        def load(name):
            file = files[name]
            if file not in opened:
                if not os.path.isfile(file):
                    raise FileNotFoundError(f"{file}: listed for tensor {name!r} but missing")
                opened[file] = stack.enter_context(safe_open(file, framework="np"))
            w = opened[file].get_tensor(name)
            if w.shape != expected[name]:
                raise ValueError(f"{file}: tensor {name!r} has shape {w.shape}, expected {expected[name]}")
            return w

        return _fill_tree(cfg, load)


def _fill_tree(cfg: DrafterConfig, load: Callable[[str], np.ndarray]) -> dict:
    n = cfg.num_hidden_layers
    params = {key: to_tree(load(name)) for name, (_, key, to_tree, _) in _top_tensors(cfg).items()}
    params["layers"] = layers = {"attn": {}, "mlp": {}}
    for i in range(n):
        for suffix, (_, path_, index, to_tree, _) in _layer_tensors(cfg).items():
            w = load(f"layers.{i}.{suffix}")
            parent = _leaf(layers, path_[:-1])
            if path_[-1] not in parent:
                parent[path_[-1]] = np.empty((n, *_layer_leaf_shapes(cfg)[path_]), w.dtype)
            parent[path_[-1]][i][index] = to_tree(w)
    return params


def load_drafter_hf(path: str | os.PathLike) -> tuple[DrafterConfig, dict]:
    """(DrafterConfig, numpy parameter tree) from a z-lab drafter directory."""
    path = os.fspath(path)
    cfg = DrafterConfig.from_hf_dir(path)
    return cfg, read_drafter_params(path, cfg)


def save_drafter_hf(path: str | os.PathLike, cfg: DrafterConfig, params: dict, dtype=None) -> None:
    """Write config.json + model.safetensors in z-lab's layout (loadable by dflash's DFlashDraftModel).

    dtype: the tensors' dtype on disk (e.g. "bfloat16", "float32"); None keeps the parameters' dtype.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    out_dtype = None if dtype is None else np.dtype(ml_dtypes.bfloat16 if str(dtype) == "bfloat16" else dtype)

    def host(x):
        return np.ascontiguousarray(x if out_dtype is None else x.astype(out_dtype))

    _check_tree(cfg, params)
    tensors = {
        name: host(from_tree(np.asarray(params[key]))) for name, (_, key, _, from_tree) in _top_tensors(cfg).items()
    }
    for suffix, (_, path_, index, _, from_tree) in _layer_tensors(cfg).items():
        stacked = _leaf(params["layers"], path_)
        for i in range(cfg.num_hidden_layers):
            tensors[f"layers.{i}.{suffix}"] = host(from_tree(np.asarray(stacked[i])[index]))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})


def _check_tree(cfg: DrafterConfig, params: dict) -> None:
    want = {(key,): shape[::-1] if key == "fc" else shape for _, (shape, key, _, _) in _top_tensors(cfg).items()}
    n = cfg.num_hidden_layers
    want.update({("layers", *path): (n, *shape) for path, shape in _layer_leaf_shapes(cfg).items()})
    for path, shape in want.items():
        try:
            got = tuple(np.shape(_leaf(params, path)))
        except (KeyError, TypeError):
            raise ValueError(f"params: missing leaf {'/'.join(path)}") from None
        if got != shape:
            raise ValueError(f"params: {'/'.join(path)} has shape {got}, expected {shape}")
