"""The Hugging Face checkpoint layout of the target and of the DFlash drafter: reading and writing it.

Target (K2 / K2.5 / K2.6): config.json is the K2.5/K2.6 `kimi_k25` wrapper (text config under `text_config`, text
tensors prefixed `language_model.`) or a plain `kimi_k2` / `deepseek_v3` text config; the directory's files are read
and written by k26jax/hf_files.py. Routed experts are compressed-tensors pack-quantized INT4 (weight_packed int32
[out, in/8], weight_scale bf16 [out, in/32], weight_shape [2]) and stay packed: our [in/8, out] words are a
transpose of theirs, never re-encoded. Any other linear stored packed is dequantized to bf16(q * scale) on read, as
compressed-tensors does. Drafter (z-lab DFlash): config.json plus model.safetensors (or shards), names as
`DFlashDraftModel.state_dict()`. Every name, shape and relayout comes from the tables of k26jax/model/params.py
(each leaf's `HF` source); `target_modules` lists a config's HF tensors in checkpoint order.

  read_target(path, cfg, *, dtype="bfloat16") -> params           the target's tree (numpy), validated first
  write_target(out_dir, text_config, params, *, shard_bytes=2 << 30, wrapper=True, dtype="bfloat16",
               generation_config=None, extra_tensors=(), split_after=None) -> ModelConfig
      config.json, generation_config.json, shards and index from our tree (float routed experts, the training
      layout, are quantized first)
  read_drafter(path) -> (DrafterConfig, params)
  write_drafter(out_dir, cfg, params, *, dtype=None)              config.json + model.safetensors
  write_tokenizer(out_dir, ranks, specials=None)                  tiktoken.model + tokenizer_config.json
The converter streams with validate, param_shapes, kind_index, top_pieces and layer_pieces; make_tiny draws its
synthetic tensors over target_modules and writes them with hf_files.write_shards.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from k26jax.config import QUANT_CONFIG, DrafterConfig, ModelConfig
from k26jax.hf_files import (
    SINGLE_FILE,
    WRAPPER_PREFIX,
    CheckpointError,
    HFCheckpoint,
    TensorFiles,
    dump_json,
    write_shards,
)
from k26jax.model import params as param_table
from k26jax.model.params import GROUP, PACK, Param, Stack

CONFIG_FILE, GENERATION_CONFIG_FILE = "config.json", "generation_config.json"
TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE = "tiktoken.model", "tokenizer_config.json"
RELEASE_EVERY = 16  # experts read between unmapping the shards
FIRST_MODULES = ("model.embed_tokens.",)  # top-level tensors written before the decoder layers (then the others)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bfloat16": BF16, "float32": np.dtype(np.float32)}
FLOATS = ("BF16", "F16", "F32")


# ---- INT4 --------------------------------------------------------------------------------------------------
def pack_int4(q: np.ndarray) -> np.ndarray:
    """int values [out, in] in [-8, 7] -> int32 words [out, in/8], compressed-tensors pack-quantized:
    offset-binary nibbles (q + 8), input column 8j+k in nibble k of word j (LSB first)."""
    q = np.asarray(q)
    if q.ndim != 2 or q.shape[1] % PACK:
        raise ValueError(f"q must be [out, in] with in a multiple of {PACK}, got shape {q.shape}")
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"q values must lie in [-8, 7], got [{q.min()}, {q.max()}]")
    nibbles = (q.astype(np.int64) + 8).astype(np.uint32).reshape(q.shape[0], -1, PACK)
    words = np.zeros(nibbles.shape[:2], np.uint32)
    for k in range(PACK):
        words |= nibbles[:, :, k] << np.uint32(4 * k)
    return words.view(np.int32)


def unpack_int4_rows(packed: np.ndarray) -> np.ndarray:
    """int32 words [K/8, ...] -> int8 values [K, ...]: row 8j+k is nibble k of word j, value = nibble - 8."""
    shifts = (4 * np.arange(PACK, dtype=np.int32)).reshape(1, PACK, *([1] * (packed.ndim - 1)))
    nibbles = (packed[:, None] >> shifts) & 0xF
    return (nibbles - 8).astype(np.int8).reshape(packed.shape[0] * PACK, *packed.shape[1:])


def transpose(a: np.ndarray, out: np.ndarray | None = None, tile: int = 256) -> np.ndarray:
    """a [R, C] -> a.T [C, R] written into `out` (new C-contiguous array by default), in cache-sized tiles:
    several times faster than numpy's own transposing copy for large 2-byte matrices."""
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype) if out is None else out
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[j : j + tile, i : i + tile] = a[i : i + tile, j : j + tile].T
    return out


# ---- the HF modules of a table, in checkpoint order --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Part:
    """Where (some of) a module's values live in the tree: leaf `path`, layer `index` of its stack (None for a
    top-level leaf), and the position within that layer's slice (`at`)."""

    path: tuple[str, ...]
    param: Param
    index: int | None
    at: tuple = ()


@dataclasses.dataclass
class Module:
    """One HF tensor ("tensor") or linear: "linear" (a float `.weight`, or pack-quantized where `int4` allows) or
    "int4" (a routed expert, always pack-quantized). name: without the wrapper prefix (a linear's without `.weight`);
    shape: the tensor's, or the linear's [out, in]; layer: its HF decoder layer (None outside the layers)."""

    name: str
    kind: str
    shape: tuple[int, ...]
    layer: int | None
    int4: bool
    parts: list[Part]

    @property
    def dtype(self) -> str | None:
        return self.parts[0].param.dtype


def target_modules(cfg: ModelConfig) -> list[Module]:
    return _modules(param_table.target_table(cfg))


def drafter_modules(cfg: DrafterConfig) -> list[Module]:
    return _modules(param_table.drafter_table(cfg))


def _modules(table: dict) -> list[Module]:
    """The embedding, every decoder layer in order, then the other top-level tensors."""
    top = _group(
        m for path, p, stack in param_table.walk(table) if stack is None for m in _leaf_modules(path, p, None, "")
    )
    first = [m for m in top if m.name.startswith(FIRST_MODULES)]
    stacks = {
        layer: (key, node, i)
        for key, node in table.items()
        if isinstance(node, Stack)
        for i, layer in enumerate(node.hf_layers)
    }
    layers = []
    for layer in sorted(stacks):
        key, stack, i = stacks[layer]
        leaves = [(path, p) for path, p, _ in param_table.walk(stack.params, (key,))]
        layers += _group(_layer_modules(leaves, stack, i))
    return first + layers + [m for m in top if m not in first]


def _layer_modules(leaves, stack: Stack, i: int) -> Iterator[Module]:
    """The modules of layer i of a stack in leaf order; routed experts expert by expert (gate, up, down of expert 0,
    then of expert 1, ...) where the first expert leaf stands."""
    experts = [(path, p) for path, p in leaves if p.hf.kind == "experts"]
    for path, p in leaves:
        if p.hf.kind != "experts":
            yield from _leaf_modules(path, p, i, stack.scope(i), stack.hf_layers[i])
        elif path == experts[0][0]:
            yield from _expert_modules(experts, i, stack.scope(i), stack.hf_layers[i])


def _leaf_modules(path, p: Param, i: int | None, scope: str, layer: int | None = None) -> Iterator[Module]:
    src, name = p.hf, scope + p.hf.name
    if src.kind == "tensor":
        yield Module(name, "tensor", p.shape, layer, False, [Part(path, p, i)])
    elif src.kind == "linear":
        shape = (math.prod(p.shape[src.n_in :]), math.prod(p.shape[: src.n_in]))
        yield Module(name, "linear", shape, layer, src.int4, [Part(path, p, i)])
    elif src.kind == "gate_up":
        D, _, I = p.shape
        for j, proj in enumerate(("gate_proj", "up_proj")):
            yield Module(name + proj, "linear", (I, D), layer, src.int4, [Part(path, p, i, (slice(None), j))])
    elif src.kind == "kv_b":
        H, _, R = p.shape
        yield Module(name, "linear", (H * src.rows[2], R), layer, src.int4, [Part(path, p, i)])
    else:
        raise ValueError(f"{'/'.join(path)}: unknown HF source kind {src.kind!r}")


def _expert_modules(experts, i: int, scope: str, layer: int) -> Iterator[Module]:
    projs = list(dict.fromkeys(proj for _, p in experts for proj in p.hf.projs))
    for e in range(experts[0][1].shape[0]):
        for proj in projs:
            parts = [
                Part(path, p, i, (e, slice(None), p.hf.projs.index(proj)) if len(p.hf.projs) > 1 else (e,))
                for path, p in experts
                if proj in p.hf.projs
            ]
            packed = next(part.param for part in parts if part.param.hf.part == "packed")
            shape = (packed.shape[-1], packed.shape[1] * PACK)
            yield Module(f"{scope}{experts[0][1].hf.name}{e}.{proj}", "int4", shape, layer, True, parts)


def _group(modules: Iterable[Module]) -> list[Module]:
    """Merges the modules two leaves share (kv_b_proj holds w_uk and w_uv) at the first one's place."""
    out: dict[str, Module] = {}
    for m in modules:
        if m.name in out:
            out[m.name].parts += m.parts
        else:
            out[m.name] = m
    return list(out.values())


# ---- expected tensors --------------------------------------------------------------------------------------
def _linear(specs: dict, hf: HFCheckpoint, m: Module) -> None:
    """Adds the tensors of one nn.Linear [out, in]: INT4 (packed words, bf16 scales, shape) or one float weight."""
    (out_dim, in_dim), prefix, routed = m.shape, m.name, m.kind == "int4"
    quantized = routed or (
        m.int4 and any(f"{prefix}.{s}" in hf for s in ("weight_packed", "weight_scale", "weight_shape"))
    )
    if routed and f"{prefix}.weight" in hf:
        raise CheckpointError(
            f"{hf.where(prefix + '.weight')}: routed experts stored unquantized are not "
            f"supported; k26jax keeps routed experts INT4 (compressed-tensors pack-quantized)"
        )
    if quantized:
        specs[f"{prefix}.weight_packed"] = ((out_dim, in_dim // PACK), ("I32",))
        specs[f"{prefix}.weight_scale"] = ((out_dim, in_dim // GROUP), ("BF16",))
        specs[f"{prefix}.weight_shape"] = ((2,), ("I32", "I64"))
    else:
        specs[f"{prefix}.weight"] = ((out_dim, in_dim), FLOATS)


def expected_tensors(cfg: ModelConfig, hf: HFCheckpoint) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Canonical name -> (shape, allowed safetensors dtypes) for every tensor the config implies."""
    specs: dict = {}
    for m in target_modules(cfg):
        if m.kind == "tensor":
            specs[m.name] = (m.shape, FLOATS)
        else:
            _linear(specs, hf, m)
    if cfg.tie_word_embeddings and "lm_head.weight" in hf:  # present but unused: the embedding is the head
        specs["lm_head.weight"] = ((cfg.vocab_size, cfg.hidden_size), FLOATS)
    return specs


def validate(hf: HFCheckpoint, cfg: ModelConfig, max_listed: int = 20) -> None:
    """Every expected tensor present with the config's shape and an allowed dtype, and nothing else."""
    specs = expected_tensors(cfg, hf)
    problems = [f"missing: {name!r} (not in the index of {hf.dir})" for name in specs if name not in hf]
    for name, entry in hf.entries.items():
        where = f"{entry['file']}: {entry['disk_name']!r}"
        if name not in specs:
            problems.append(f"unexpected: {where} (the config implies no such tensor)")
            continue
        shape, dtypes = specs[name]
        if entry["shape"] != shape:
            problems.append(f"wrong shape: {where} is {list(entry['shape'])}, the config implies {list(shape)}")
        elif entry["dtype"] not in dtypes:
            problems.append(f"wrong dtype: {where} is {entry['dtype']}, expected one of {list(dtypes)}")
    packed = [n for n in hf.entries if n.endswith(".weight_packed")]
    if packed and cfg.quant is None:
        problems.append(f"{hf.where(packed[0])} is pack-quantized but config.json has no quantization_config")
    if problems:
        more = f"\n  ... and {len(problems) - max_listed} more" if len(problems) > max_listed else ""
        raise CheckpointError(
            f"{hf.dir}: checkpoint does not match its config ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:max_listed])
            + more
        )
    for name in packed:  # weight_shape must agree with the packed tensor (cheap: 2 ints each)
        want = (specs[name][0][0], specs[name][0][1] * PACK)
        got = tuple(int(v) for v in hf.read(name[: -len("packed")] + "shape"))
        if got != want:
            raise CheckpointError(f"{hf.where(name[: -len('packed')] + 'shape')} is {list(got)}, expected {list(want)}")


# ---- reading -----------------------------------------------------------------------------------------------
def param_shapes(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """The target's tree as nested dicts of (shape, numpy dtype); layer leaves lead with the layer count."""
    return param_table.shapes(param_table.target_table(cfg), DTYPES[dtype])


def kind_index(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """(layer kind, position of `layer` within that kind's stack)."""
    for key, node in param_table.target_table(cfg).items():
        if isinstance(node, Stack) and layer in node.hf_layers:
            return key, node.hf_layers.index(layer)
    raise ValueError(f"layer {layer}: the config has {cfg.num_hidden_layers} layers")


def _cast(a: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    return a if dtype is None else a.astype(dtype, copy=False)


def _linear_weight(hf, prefix: str, dtype: np.dtype | None) -> np.ndarray:
    """nn.Linear weight [out, in] as `dtype` (None: as stored); packed INT4 ones dequantized as bf16(q * scale)."""
    if f"{prefix}.weight" in hf:
        return _cast(hf.read(f"{prefix}.weight"), dtype)
    packed, scale = hf.read(f"{prefix}.weight_packed"), hf.read(f"{prefix}.weight_scale")
    q = unpack_int4_rows(packed.T).T  # [out, in]
    w = q.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=1)
    return _cast(w.astype(BF16), dtype)


def _read_leaf(hf, p: Param, scope: str, dtype: np.dtype | None, cache: dict) -> np.ndarray:
    """One layer's slice of a leaf (or a top-level leaf) from its HF tensors. dtype: float leaves' dtype (None: as
    stored); a leaf's fixed dtype wins. cache holds a tensor two leaves share until the second one is read."""
    src, name = p.hf, scope + p.hf.name
    dtype = dtype if dtype is None or p.dtype is None else _np_dtype(p.dtype)
    if src.kind == "tensor":
        return _cast(hf.read(name), dtype)
    if src.kind == "linear":
        return transpose(_linear_weight(hf, name, dtype)).reshape(p.shape)
    if src.kind == "gate_up":
        gate = _linear_weight(hf, name + "gate_proj", dtype)
        gate_up = np.empty((gate.shape[1], 2, gate.shape[0]), gate.dtype)  # [D, 2, I]
        transpose(gate, out=gate_up[:, 0])
        del gate
        transpose(_linear_weight(hf, name + "up_proj", dtype), out=gate_up[:, 1])
        return gate_up
    if src.kind == "kv_b":
        lo, hi, total = src.rows
        w = cache.pop(name, None)
        w = _linear_weight(hf, name, dtype) if w is None else w
        if hi < total:
            cache[name] = w
        return np.ascontiguousarray(w.reshape(p.shape[0], total, p.shape[2])[:, lo:hi])
    out = np.empty(p.shape, _np_dtype(p.dtype))  # routed experts: [E, in/g, (2,) out], one expert at a time
    for e in range(p.shape[0]):
        if e % RELEASE_EVERY == 0:
            hf.release()  # bounds the mapped (resident) source pages to a few experts
        for j, proj in enumerate(src.projs):
            dst = out[e, :, j] if len(src.projs) > 1 else out[e]
            transpose(hf.read(f"{name}{e}.{proj}.weight_{src.part}"), out=dst)  # [out, in/g] -> [in/g, out]
    return out


def _stack_pieces(hf, stack: Stack, i: int, dtype: np.dtype | None) -> Iterator:
    cache: dict = {}
    for path, p, _ in param_table.walk(stack.params):
        yield path, _read_leaf(hf, p, stack.scope(i), dtype, cache)


def layer_pieces(hf: HFCheckpoint, cfg: ModelConfig, layer: int, dtype: str = "bfloat16") -> Iterator:
    """Yields (path within the layer subtree, array) for decoder layer `layer`, one leaf at a time."""
    kind, i = kind_index(cfg, layer)
    yield from _stack_pieces(hf, param_table.target_table(cfg)[kind], i, DTYPES[dtype])


def top_pieces(hf: HFCheckpoint, cfg: ModelConfig, dtype: str = "bfloat16", rows: dict | None = None) -> Iterator:
    """Yields (path, index, array) for the top-level leaves, a 2-D leaf in blocks of rows[name] rows when given (embed
    [V, D] as row blocks, lm_head [D, V] as column blocks of HF's [V, D]), the others whole; blocks in C order."""
    f, rows = DTYPES[dtype], rows or {}
    for path, p, stack in param_table.walk(param_table.target_table(cfg)):
        if stack is not None:
            continue
        block = rows.get(".".join(path))
        if block is None or len(p.shape) != 2 or p.hf.kind not in ("tensor", "linear"):
            yield path, (), _read_leaf(hf, p, "", f, {})
            continue
        for start in range(0, p.shape[0], block):
            at = slice(start, min(start + block, p.shape[0]))
            if p.hf.kind == "tensor":
                arr = hf.read_rows(p.hf.name, at.start, at.stop)
            else:
                arr = transpose(hf.read_columns(p.hf.name + ".weight", at.start, at.stop))
            yield path, (at,), arr.astype(f, copy=False)


def read_target(hf_dir: str | os.PathLike, cfg: ModelConfig, *, dtype: str = "bfloat16") -> dict:
    """The whole target tree as numpy arrays (float leaves in `dtype`; packed ints and bf16 scales as stored)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {tuple(DTYPES)}")
    hf = HFCheckpoint(hf_dir)
    validate(hf, cfg)
    tree = _map_leaves(lambda s: np.empty(*s), param_shapes(cfg, dtype))
    for path, index, arr in top_pieces(hf, cfg, dtype):
        _leaf(tree, path)[index] = arr
    for layer in range(cfg.num_hidden_layers):
        kind, i = kind_index(cfg, layer)
        for path, arr in layer_pieces(hf, cfg, layer, dtype):
            _leaf(tree[kind], path)[i] = arr
    hf.release()
    return tree


def _map_leaves(fn, tree):
    return {k: _map_leaves(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _leaf(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


# ---- the drafter -------------------------------------------------------------------------------------------
def drafter_tensor_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of a DFlash drafter on disk with its shape."""
    return {m.name + (".weight" if m.kind == "linear" else ""): m.shape for m in drafter_modules(cfg)}


def read_drafter_params(path: str | os.PathLike, cfg: DrafterConfig) -> dict:
    """The drafter's stacked numpy tree, in the checkpoint's dtype (bf16 as ml_dtypes.bfloat16)."""
    path, expected = os.fspath(path), drafter_tensor_shapes(cfg)
    with contextlib.ExitStack() as stack:
        files = TensorFiles(path, expected, stack)
        missing = [n for n in expected if n not in files]
        if missing:
            raise ValueError(f"{path}: missing tensors {missing[:6]}{' ...' if len(missing) > 6 else ''}")
        unknown = sorted(set(files.files) - set(expected))
        if unknown:
            raise ValueError(
                f"{path}: tensors a DFlashDraftModel does not have: {unknown[:6]} (a DFlash2 drafter "
                f"or another architecture?)"
            )
        table, tree = param_table.drafter_table(cfg), {}
        for key, node in table.items():
            if isinstance(node, Stack):
                tree[key] = _read_stack(files, node)
            else:
                tree[key] = _read_leaf(files, node, "", None, {})
        return tree


def _read_stack(hf, stack: Stack) -> dict:
    """A stack's leaves filled layer by layer into preallocated [n, ...] arrays (one copy of the weights)."""
    tree, n = {}, len(stack.hf_layers)
    for i in range(n):
        for path, arr in _stack_pieces(hf, stack, i, None):
            parent = tree
            for key in path[:-1]:
                parent = parent.setdefault(key, {})
            if path[-1] not in parent:
                parent[path[-1]] = np.empty((n, *arr.shape), arr.dtype)
            parent[path[-1]][i] = arr
    return tree


def read_drafter(path: str | os.PathLike) -> tuple[DrafterConfig, dict]:
    """(DrafterConfig, numpy parameter tree) from a z-lab drafter directory."""
    cfg = DrafterConfig.from_hf_dir(path)
    return cfg, read_drafter_params(path, cfg)


def write_drafter(path: str | os.PathLike, cfg: DrafterConfig, params: dict, *, dtype=None) -> None:
    """config.json + model.safetensors in z-lab's layout (loadable by dflash's DFlashDraftModel).

    dtype: the tensors' dtype on disk (e.g. "bfloat16", "float32"); None keeps the parameters' dtype."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tree = _host_tree(param_table.drafter_table(cfg), params)
    tensors = dict(_tensors(drafter_modules(cfg), tree, None if dtype is None else _np_dtype(dtype)))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    save_file(tensors, os.path.join(path, SINGLE_FILE), metadata={"format": "pt"})


# ---- writing -----------------------------------------------------------------------------------------------
def _np_dtype(name) -> np.dtype:
    return BF16 if str(name) == "bfloat16" else np.dtype(name)


def _host_tree(table: dict, params: dict) -> dict:
    """`params` as numpy arrays, checked leaf by leaf against the table's shapes."""
    out = {}
    for path, p, stack in param_table.walk(table):
        want = param_table.full_shape(p, None if stack is None else len(stack.hf_layers))
        try:
            leaf = _leaf(params, path)
        except (KeyError, TypeError):
            raise ValueError(f"params: missing leaf {'/'.join(path)}") from None
        if tuple(np.shape(leaf)) != want:
            raise ValueError(f"params: {'/'.join(path)} has shape {tuple(np.shape(leaf))}, expected {want}")
        parent = out
        for key in path[:-1]:
            parent = parent.setdefault(key, {})
        parent[path[-1]] = np.asarray(leaf)
    return out


def _value(tree: dict, part: Part) -> np.ndarray:
    leaf = _leaf(tree, part.path)
    return (leaf if part.index is None else leaf[part.index])[part.at]


def _tensors(modules: list[Module], tree: dict, dtype: np.dtype | None) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, array) of every module, in order, from our tree. dtype: float tensors' dtype (None: the
    parameters'); leaves of a fixed dtype keep theirs."""

    def host(a, part):
        want = _np_dtype(part.param.dtype) if part.param.dtype else dtype
        return np.ascontiguousarray(a if want is None else a.astype(want))

    seen = set()
    for m in modules:
        if m.kind == "int4":
            got = {part.param.hf.part: host(_value(tree, part).T, part) for part in m.parts}
            for suffix, arr in (("packed", got["packed"]), ("scale", got["scale"])):
                yield f"{m.name}.weight_{suffix}", arr
            yield f"{m.name}.weight_shape", np.array(m.shape, np.int32)
            continue
        part = m.parts[0]
        if m.kind == "tensor":
            name, arr = m.name, _value(tree, part)
        elif part.param.hf.kind == "kv_b":  # [H, rows, R] pieces, concatenated along rows
            parts = sorted(m.parts, key=lambda q: q.param.hf.rows[0])
            name, arr = m.name + ".weight", np.concatenate([_value(tree, q) for q in parts], axis=1).reshape(m.shape)
        else:
            name, arr = m.name + ".weight", _value(tree, part).reshape(m.shape[1], m.shape[0]).T
        if name not in seen:  # tied embeddings: the head is the embedding
            seen.add(name)
            yield name, host(arr, part)


def target_tensors(cfg: ModelConfig, params: dict, dtype: str = "bfloat16") -> Iterator[tuple[str, np.ndarray]]:
    """(HF name without the wrapper prefix, array) of every target tensor, in checkpoint order, from our tree."""
    tree = _host_tree(param_table.target_table(cfg), _packed_experts(params))
    return _tensors(target_modules(cfg), tree, _np_dtype(dtype))


def _packed_experts(params: dict) -> dict:
    """The tree with float routed experts (the training layout: moe.mlp.w13 [n, E, D, 2, Im], w2 [n, E, Im, D])
    quantized to the four packed leaves."""
    mlp = params.get("moe", {}).get("mlp", {})
    if "w13" not in mlp:
        return params
    from k26jax import quant

    packed = {k: v for k, v in mlp.items() if k not in ("w13", "w2")} | quant.quantize_experts(mlp["w13"], mlp["w2"])
    return params | {"moe": params["moe"] | {"mlp": packed}}


def text_config_json(text: dict) -> dict:
    """A K2 text config.json (DeepseekV3ForCausalLM, compressed-tensors INT4 experts) around a text config dict."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModel": "modeling_deepseek.DeepseekV3Model",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
        **text,
        "aux_loss_alpha": 0.001,
        "ep_size": 1,
        "num_nextn_predict_layers": 0,
        "seq_aux": True,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "quantization_config": QUANT_CONFIG,
    }


def vision_tensor_shapes(text_hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """The few vision-tower and projector tensors a small kimi_k25 checkpoint carries beside its text model, under
    K2.5's names, at the sizes `wrapper_config`'s vision config states (our loaders skip them)."""
    return [
        ("vision_tower.patch_embed.proj.weight", (32, 3, 14, 14)),
        ("vision_tower.encoder.blocks.0.wqkv.weight", (96, 32)),
        ("vision_tower.encoder.blocks.0.wo.weight", (32, 32)),
        ("vision_tower.encoder.final_layernorm.weight", (32,)),
        ("mm_projector.pre_norm.weight", (32,)),
        ("mm_projector.proj.0.weight", (128, 128)),
        ("mm_projector.proj.2.weight", (text_hidden, 128)),
    ]


def vision_tensors(text_hidden: int, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """`vision_tensor_shapes` filled with bf16 normal(0, 0.02) values."""
    rng = np.random.default_rng(seed)
    return [(n, (0.02 * rng.standard_normal(shape)).astype(BF16)) for n, shape in vision_tensor_shapes(text_hidden)]


def wrapper_config(text: dict, media_placeholder_token_id: int | None = None) -> dict:
    """The kimi_k25 wrapper config.json around a text config dict, with a small vision config. The media
    placeholder defaults to <|media_pad|> at K2's offset from the top of the vocabulary."""
    V = text["vocab_size"]
    text = text_config_json(text)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_kimi_k25.KimiK25Config",
            "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
        },
        "model_type": "kimi_k25",
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "media_placeholder_token_id": (
            MEDIA_PLACEHOLDER - K2_VOCAB + V if media_placeholder_token_id is None else media_placeholder_token_id
        ),
        "use_unified_vision_chunk": True,
        "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "text_config": text,
        "vision_config": {
            "patch_size": 14,
            "init_pos_emb_height": 64,
            "init_pos_emb_width": 64,
            "init_pos_emb_time": 4,
            "pos_emb_type": "divided_fixed",
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 1,
            "vt_hidden_size": 32,
            "vt_intermediate_size": 64,
            "merge_kernel_size": [2, 2],
            "merge_type": "sd2_tpool",
            "mm_projector_type": "patchmerger",
            "mm_hidden_size": 128,
            "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5,
            "text_hidden_size": text["hidden_size"],
        },
    }


def write_target(
    out_dir: str | os.PathLike,
    text_config: dict,
    params: dict,
    *,
    shard_bytes: int = 2 << 30,
    wrapper: bool = True,
    dtype: str = "bfloat16",
    generation_config: dict | None = None,
    extra_tensors: Iterable[tuple[str, np.ndarray]] = (),
    split_after: str | None = None,
) -> ModelConfig:
    """Writes a HF checkpoint of the target from our tree into the directory `out_dir`: config.json (the kimi_k25
    wrapper with `language_model.` names, or with wrapper=False the plain text config), generation_config.json when
    given, the shards and their index. params: the model's tree (packed experts), or the training layout with float
    experts `moe.mlp.w13` / `w2`, quantized here (k26jax.quant). Float tensors are written in `dtype`;
    extra_tensors (full names, e.g. vision tensors) follow the text model's. Returns the checkpoint's config."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    config = wrapper_config(text_config) if wrapper else text_config_json(text_config)
    dump_json(os.path.join(out_dir, CONFIG_FILE), config)
    if generation_config is not None:
        dump_json(os.path.join(out_dir, GENERATION_CONFIG_FILE), generation_config)
    cfg = ModelConfig.from_hf_dir(out_dir)
    prefix = WRAPPER_PREFIX if wrapper else ""
    named = ((prefix + name, arr) for name, arr in target_tensors(cfg, params, dtype))
    write_shards(out_dir, itertools.chain(named, extra_tensors), shard_bytes, split_after)
    return cfg


# ---- tokenizer files ---------------------------------------------------------------------------------------
K2_VOCAB = 163840
K2_SPECIAL_TOKENS = {  # K2 / K2.5 ids; a smaller vocabulary keeps each one's offset from the top
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
NUM_SPECIAL = 256
MEDIA_PLACEHOLDER = 163605

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- if message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "<think>{{ message.get('reasoning_content', '') }}</think>"
    "{%- else -%}<|im_system|>{{ message['role'] }}<|im_middle|>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def special_tokens(vocab_size: int) -> dict[int, str]:
    """id -> token for the top 256 ids: K2's named specials at K2's offsets, `<|reserved_token_i|>` otherwise."""
    first = vocab_size - NUM_SPECIAL
    names = {i - K2_VOCAB + vocab_size: t for i, t in K2_SPECIAL_TOKENS.items()}
    return {i: names.get(i, f"<|reserved_token_{i}|>") for i in range(first, vocab_size)}


def tokenizer_config(specials: dict[int, str]) -> dict:
    """tokenizer_config.json of a K2.6 checkpoint: the added (special) tokens, role tokens and chat template."""
    return {
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, t in sorted(specials.items())
        },
        "additional_special_tokens": [t for t in K2_SPECIAL_TOKENS.values() if not t.startswith("[")],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }


def write_tokenizer(out_dir: str, ranks: dict[bytes, int], specials: dict[int, str] | None = None) -> None:
    """out_dir/tiktoken.model (`base64(token bytes) rank` lines in rank order) and out_dir/tokenizer_config.json;
    specials default to K2's 256 at the top of a vocabulary of len(ranks) + 256 ids."""
    specials = special_tokens(len(ranks) + NUM_SPECIAL) if specials is None else specials
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError("ranks must be exactly 0..len(ranks)-1")
    if min(specials) < len(ranks):
        raise ValueError(f"special id {min(specials)} collides with the {len(ranks)} BPE ranks")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, TIKTOKEN_FILE), "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    dump_json(os.path.join(out_dir, TOKENIZER_CONFIG_FILE), tokenizer_config(specials))
