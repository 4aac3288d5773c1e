"""Hugging Face K2 / K2.5 / K2.6 safetensors -> the k26jax parameter tree (numpy), one tensor at a time.

Names: K2.5/K2.6 files prefix the text model with `language_model.` (stripped here) and carry `vision_tower.*` /
`mm_projector.*` tensors (skipped and counted); K2 / K2-Thinking have no prefix; `rotary_emb.inv_freq` buffers are
skipped. Shards are found through `model.safetensors.index.json` (or a lone `model.safetensors`), never by name.

A linear is INT4 when `weight_packed` / `weight_scale` / `weight_shape` are present (compressed-tensors
pack-quantized, group 32), else a float `weight`. Routed experts must be INT4 and stay packed: their relayout is a
transpose of the word matrix (HF [out, in/8] -> [in/8, out]); the words are not re-encoded. Any other packed linear
is dequantized to bf16 exactly as compressed-tensors does, bf16(q * scale).

The tree (stacked per layer kind, [in, out] layout) is documented in `param_shapes`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

from k26jax.config import ModelConfig

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WRAPPER_PREFIX = "language_model."
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq",)
PACK, GROUP = 8, 32  # INT4 values per int32 word, input rows per scale
RELEASE_EVERY = 16  # experts read between unmapping the shards

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {"bfloat16": BF16, "float32": np.dtype(np.float32)}
_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}  # safetensors dtype tag -> bytes
FLOATS = ("BF16", "F16", "F32")


class CheckpointError(ValueError):
    """A checkpoint directory that does not hold what its config implies."""


class HFCheckpoint:
    """The tensors of a HF checkpoint directory by canonical name (`model.layers.3.mlp.gate.weight`, `lm_head.weight`).

    Headers are parsed up front (shape, dtype, and a truncation check per shard); data is read one tensor (or row
    block) at a time through memory-mapped `safe_open` handles, which `release()` unmaps.
    """

    def __init__(self, hf_dir: str | os.PathLike):
        self.dir = os.fspath(hf_dir)
        self.entries: dict[str, dict[str, Any]] = {}  # name -> {file, disk_name, shape, dtype, nbytes, offset}
        self.skipped: dict[str, list[int]] = {}  # skipped group -> [tensors, bytes]
        self._handles: dict[str, Any] = {}
        weight_map = self._weight_map()
        headers = {
            f: self._header(f, sorted(n for n, g in weight_map.items() if g == f))
            for f in sorted(set(weight_map.values()))
        }
        for disk_name, file in weight_map.items():
            header, data_start = headers[file]
            info = header.get(disk_name)
            if info is None:
                raise CheckpointError(
                    f"{self._path(file)}: {INDEX_FILE} lists tensor {disk_name!r} in this shard, "
                    f"but the shard does not contain it"
                )
            dtype, shape = info["dtype"], tuple(info["shape"])
            nbytes = int(np.prod(shape, dtype=np.int64)) * _ITEMSIZE.get(dtype, 1)
            name = disk_name[len(WRAPPER_PREFIX) :] if disk_name.startswith(WRAPPER_PREFIX) else disk_name
            group = next((p.rstrip(".") for p in SKIPPED_PREFIXES if name.startswith(p)), None)
            group = group or next((s.lstrip(".") for s in SKIPPED_SUFFIXES if name.endswith(s)), None)
            if group:
                count = self.skipped.setdefault(group, [0, 0])
                count[0], count[1] = count[0] + 1, count[1] + nbytes
                continue
            if name in self.entries:
                raise CheckpointError(
                    f"{self._path(file)}: tensor {disk_name!r} maps to {name!r}, which "
                    f"{self.entries[name]['disk_name']!r} in {self.entries[name]['file']} also does"
                )
            self.entries[name] = dict(
                file=file,
                disk_name=disk_name,
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                offset=data_start + info["data_offsets"][0],
            )

    # ---- index and headers --------------------------------------------------------------------------------
    def _path(self, file: str) -> str:
        return os.path.join(self.dir, file)

    def _weight_map(self) -> dict[str, str]:
        index_path = self._path(INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_path}: not a safetensors index with a 'weight_map' ({e!r})") from e
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index_path}: 'weight_map' is empty or not an object")
            return weight_map
        if os.path.isfile(self._path(SINGLE_FILE)):
            return {name: SINGLE_FILE for name in _read_header(self._path(SINGLE_FILE))[0]}
        raise CheckpointError(f"{self.dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")

    def _header(self, file: str, names: list[str]) -> tuple[dict[str, Any], int]:
        path = self._path(file)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"{path}: shard is missing; {INDEX_FILE} maps {len(names)} tensor(s) to it, e.g. {names[0]!r}"
            )
        header, data_start = _read_header(path)
        data_end = max((max(v["data_offsets"]) for v in header.values()), default=0)
        size = os.path.getsize(path)
        if size < data_start + data_end:
            raise CheckpointError(
                f"{path}: shard is truncated: its header needs {data_start + data_end} bytes, the file has {size}"
            )
        return header, data_start

    # ---- reading ------------------------------------------------------------------------------------------
    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def _handle(self, name: str):
        entry = self.entries[name]
        if entry["file"] not in self._handles:
            self._handles[entry["file"]] = safe_open(self._path(entry["file"]), framework="numpy")
        return self._handles[entry["file"]], entry["disk_name"]

    def read(self, name: str) -> np.ndarray:
        """The whole tensor, copied out of the mapped shard."""
        handle, disk_name = self._handle(name)
        return handle.get_tensor(disk_name)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor (leading axis), reading only those bytes."""
        handle, disk_name = self._handle(name)
        return handle.get_slice(disk_name)[start:stop]

    def read_columns(self, name: str, start: int, stop: int) -> np.ndarray:
        """Columns [start, stop) of a 2-D tensor (strided read of the mapped shard)."""
        handle, disk_name = self._handle(name)
        return handle.get_slice(disk_name)[:, start:stop]

    def prefetch(self, prefix: str) -> None:
        """Asks the OS to start reading every tensor whose name starts with `prefix` (POSIX_FADV_WILLNEED), so the
        disk works ahead while the current layer is assembled."""
        by_file: dict[str, list[tuple[int, int]]] = {}
        for name, entry in self.entries.items():
            if name.startswith(prefix):
                by_file.setdefault(entry["file"], []).append((entry["offset"], entry["nbytes"]))
        for file, ranges in by_file.items():
            fd = os.open(self._path(file), os.O_RDONLY)
            try:
                for offset, nbytes in ranges:
                    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def release(self) -> None:
        """Unmaps the shards opened so far (mapped pages count towards resident memory)."""
        self._handles.clear()

    def skipped_summary(self) -> str:
        return ", ".join(f"{group}: {n} tensors, {b / 1e6:.1f} MB" for group, (n, b) in sorted(self.skipped.items()))

    def where(self, name: str) -> str:
        entry = self.entries[name]
        return f"{entry['file']}: {entry['disk_name']}"


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    """(tensor name -> {dtype, shape, data_offsets}, byte offset of the data) from a safetensors file."""
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CheckpointError(f"{path}: shard is truncated (shorter than the 8-byte header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        raw = f.read(header_len)
    if len(raw) < header_len:
        raise CheckpointError(f"{path}: shard is truncated inside its {header_len}-byte header")
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON: {e})") from e
    header.pop("__metadata__", None)
    return header, 8 + header_len


# ---- expected tensors --------------------------------------------------------------------------------------
def _linear(specs: dict, hf: HFCheckpoint, prefix: str, out_dim: int, in_dim: int, *, routed: bool = False) -> None:
    """Adds the tensors of one nn.Linear [out, in]: INT4 (packed words, bf16 scales, shape) or one float weight."""
    quantized = routed or any(f"{prefix}.{s}" in hf for s in ("weight_packed", "weight_scale", "weight_shape"))
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
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    Dq, Dv, R, Dr = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    specs: dict = {"model.embed_tokens.weight": ((V, D), FLOATS), "model.norm.weight": ((D,), FLOATS)}
    if not cfg.tie_word_embeddings or "lm_head.weight" in hf:
        specs["lm_head.weight"] = ((V, D), FLOATS)
    for layer, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{layer}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            specs[f"{p}{norm}.weight"] = ((D,), FLOATS)
        a = p + "self_attn."
        if cfg.q_lora_rank is None:
            _linear(specs, hf, a + "q_proj", H * Dq, D)
        else:
            _linear(specs, hf, a + "q_a_proj", cfg.q_lora_rank, D)
            specs[a + "q_a_layernorm.weight"] = ((cfg.q_lora_rank,), FLOATS)
            _linear(specs, hf, a + "q_b_proj", H * Dq, cfg.q_lora_rank)
        _linear(specs, hf, a + "kv_a_proj_with_mqa", R + Dr, D)
        specs[a + "kv_a_layernorm.weight"] = ((R,), FLOATS)
        _linear(specs, hf, a + "kv_b_proj", H * (cfg.qk_nope_head_dim + Dv), R)
        _linear(specs, hf, a + "o_proj", D, H * Dv)
        m = p + "mlp."
        if kind == "dense":
            _swiglu(specs, hf, m, D, cfg.intermediate_size)
            continue
        E = cfg.n_routed_experts
        specs[m + "gate.weight"] = ((E, D), FLOATS)
        specs[m + "gate.e_score_correction_bias"] = ((E,), FLOATS)
        if cfg.n_shared_experts:
            _swiglu(specs, hf, m + "shared_experts.", D, cfg.moe_intermediate_size * cfg.n_shared_experts)
        for e in range(E):
            _swiglu(specs, hf, f"{m}experts.{e}.", D, cfg.moe_intermediate_size, routed=True)
    return specs


def _swiglu(specs, hf, prefix, D, I, routed=False):
    _linear(specs, hf, prefix + "gate_proj", I, D, routed=routed)
    _linear(specs, hf, prefix + "up_proj", I, D, routed=routed)
    _linear(specs, hf, prefix + "down_proj", D, I, routed=routed)


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


# ---- the tree ----------------------------------------------------------------------------------------------
def param_shapes(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
    """The parameter tree as nested dicts of (shape, numpy dtype); layer leaves lead with the layer count."""
    f = DTYPES[dtype]
    D, V, H = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    Dn, Dr, Dv, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    E, Im = cfg.n_routed_experts, cfg.moe_intermediate_size
    tree: dict = {"embed": ((V, D), f), "final_norm": ((D,), f), "lm_head": ((D, V), f)}
    for kind, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers)):
        if not n:
            continue
        attn = {
            "kv_a": ((D, R + Dr), f),
            "kv_a_norm": ((R,), f),
            "w_uk": ((H, Dn, R), f),
            "w_uv": ((H, Dv, R), f),
            "o": ((H, Dv, D), f),
        }
        if cfg.q_lora_rank is None:
            attn["q"] = ((D, H, Dn + Dr), f)
        else:
            Rq = cfg.q_lora_rank
            attn.update(q_a=((D, Rq), f), q_a_norm=((Rq,), f), q_b=((Rq, H, Dn + Dr), f))
        if kind == "dense":
            mlp = _swiglu_shapes(D, cfg.intermediate_size, f)
        else:
            mlp = {
                "router_kernel": ((D, E), f),
                "router_bias": ((E,), np.dtype(np.float32)),
                "w13_packed": ((E, D // PACK, 2, Im), np.dtype(np.int32)),
                "w13_scale": ((E, D // GROUP, 2, Im), BF16),
                "w2_packed": ((E, Im // PACK, D), np.dtype(np.int32)),
                "w2_scale": ((E, Im // GROUP, D), BF16),
            }
            if cfg.n_shared_experts:
                mlp["shared"] = _swiglu_shapes(D, Im * cfg.n_shared_experts, f)
        layer = {"input_norm": ((D,), f), "post_attn_norm": ((D,), f), "attn": attn, "mlp": mlp}
        tree[kind] = _map_shapes(lambda s, n=n: ((n, *s[0]), s[1]), layer)
    return tree


def _swiglu_shapes(D, I, f):
    return {"gate_up": ((D, 2, I), f), "down": ((I, D), f)}


def _map_shapes(fn, tree):
    return {k: _map_shapes(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _float(hf: HFCheckpoint, name: str, dtype: np.dtype) -> np.ndarray:
    return hf.read(name).astype(dtype, copy=False)


def _linear_weight(hf: HFCheckpoint, prefix: str, dtype: np.dtype) -> np.ndarray:
    """nn.Linear weight [out, in] as `dtype`; packed INT4 linears are dequantized as bf16(q * scale)."""
    if f"{prefix}.weight" in hf:
        return _float(hf, f"{prefix}.weight", dtype)
    packed, scale = hf.read(f"{prefix}.weight_packed"), hf.read(f"{prefix}.weight_scale")
    q = unpack_int4_rows(packed.T).T  # [out, in]
    w = q.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=1)
    return w.astype(BF16).astype(dtype, copy=False)


def transpose(a: np.ndarray, out: np.ndarray | None = None, tile: int = 256) -> np.ndarray:
    """a [R, C] -> a.T [C, R] written into `out` (new C-contiguous array by default), in cache-sized tiles:
    several times faster than numpy's own transposing copy for large 2-byte matrices."""
    rows, cols = a.shape
    out = np.empty((cols, rows), a.dtype) if out is None else out
    for i in range(0, rows, tile):
        for j in range(0, cols, tile):
            out[j : j + tile, i : i + tile] = a[i : i + tile, j : j + tile].T
    return out


def unpack_int4_rows(packed: np.ndarray) -> np.ndarray:
    """int32 words [K/8, ...] -> int8 values [K, ...]: row 8j+k is nibble k of word j, value = nibble - 8."""
    shifts = (4 * np.arange(PACK, dtype=np.int32)).reshape(1, PACK, *([1] * (packed.ndim - 1)))
    nibbles = (packed[:, None] >> shifts) & 0xF
    return (nibbles - 8).astype(np.int8).reshape(packed.shape[0] * PACK, *packed.shape[1:])


def _swiglu_pieces(hf: HFCheckpoint, prefix: str, dtype: np.dtype) -> Iterator:
    gate = _linear_weight(hf, prefix + "gate_proj", dtype)
    gate_up = np.empty((gate.shape[1], 2, gate.shape[0]), dtype)  # [D, 2, I]
    transpose(gate, out=gate_up[:, 0])
    del gate
    transpose(_linear_weight(hf, prefix + "up_proj", dtype), out=gate_up[:, 1])
    yield ("gate_up",), gate_up
    del gate_up
    yield ("down",), transpose(_linear_weight(hf, prefix + "down_proj", dtype))


def _expert_pieces(hf: HFCheckpoint, cfg: ModelConfig, prefix: str) -> Iterator:
    """w13/w2 packed words and scales for all experts of one layer, one leaf at a time."""
    E, D, Im = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    for suffix, group, dtype in (("packed", PACK, np.int32), ("scale", GROUP, BF16)):
        w13 = np.empty((E, D // group, 2, Im), dtype)
        for e in range(E):
            if e % RELEASE_EVERY == 0:
                hf.release()  # bounds the mapped (resident) source pages to a few experts
            for j, proj in enumerate(("gate_proj", "up_proj")):
                transpose(hf.read(f"{prefix}{e}.{proj}.weight_{suffix}"), out=w13[e, :, j])  # [Im, D/g] -> [D/g, Im]
        yield (f"w13_{suffix}",), w13
        del w13
    for suffix, group, dtype in (("packed", PACK, np.int32), ("scale", GROUP, BF16)):
        w2 = np.empty((E, Im // group, D), dtype)
        for e in range(E):
            if e % RELEASE_EVERY == 0:
                hf.release()
            transpose(hf.read(f"{prefix}{e}.down_proj.weight_{suffix}"), out=w2[e])  # [D, Im/g] -> [Im/g, D]
        yield (f"w2_{suffix}",), w2
        del w2


def layer_pieces(hf: HFCheckpoint, cfg: ModelConfig, layer: int, dtype: str = "bfloat16") -> Iterator:
    """Yields (path within the layer subtree, array) for decoder layer `layer`, one leaf at a time."""
    f = DTYPES[dtype]
    D, H = cfg.hidden_size, cfg.num_attention_heads
    Dn, Dv, R, Dq = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_head_dim
    p = f"model.layers.{layer}."
    yield ("input_norm",), _float(hf, p + "input_layernorm.weight", f)
    yield ("post_attn_norm",), _float(hf, p + "post_attention_layernorm.weight", f)
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        yield ("attn", "q"), transpose(_linear_weight(hf, a + "q_proj", f)).reshape(D, H, Dq)
    else:
        yield ("attn", "q_a"), transpose(_linear_weight(hf, a + "q_a_proj", f))
        yield ("attn", "q_a_norm"), _float(hf, a + "q_a_layernorm.weight", f)
        yield ("attn", "q_b"), transpose(_linear_weight(hf, a + "q_b_proj", f)).reshape(cfg.q_lora_rank, H, Dq)
    yield ("attn", "kv_a"), transpose(_linear_weight(hf, a + "kv_a_proj_with_mqa", f))
    yield ("attn", "kv_a_norm"), _float(hf, a + "kv_a_layernorm.weight", f)
    kv_b = _linear_weight(hf, a + "kv_b_proj", f).reshape(H, Dn + Dv, R)
    yield ("attn", "w_uk"), np.ascontiguousarray(kv_b[:, :Dn])
    yield ("attn", "w_uv"), np.ascontiguousarray(kv_b[:, Dn:])
    del kv_b
    yield ("attn", "o"), transpose(_linear_weight(hf, a + "o_proj", f)).reshape(H, Dv, D)
    m = p + "mlp."
    if not cfg.is_moe_layer(layer):
        for path, arr in _swiglu_pieces(hf, m, f):
            yield ("mlp", *path), arr
        return
    yield ("mlp", "router_kernel"), transpose(_float(hf, m + "gate.weight", f))
    yield ("mlp", "router_bias"), _float(hf, m + "gate.e_score_correction_bias", np.dtype(np.float32))
    if cfg.n_shared_experts:
        for path, arr in _swiglu_pieces(hf, m + "shared_experts.", f):
            yield ("mlp", "shared", *path), arr
    for path, arr in _expert_pieces(hf, cfg, m + "experts."):
        yield ("mlp", *path), arr


def top_pieces(
    hf: HFCheckpoint,
    cfg: ModelConfig,
    dtype: str = "bfloat16",
    embed_rows: int | None = None,
    head_rows: int | None = None,
) -> Iterator:
    """Yields (path, index, array) for final_norm, embed [V, D] in blocks of `embed_rows` rows, and lm_head [D, V]
    in blocks of `head_rows` rows (each read as a column block of HF's [V, D]); blocks come in C order."""
    f, V, D = DTYPES[dtype], cfg.vocab_size, cfg.hidden_size
    yield ("final_norm",), (), _float(hf, "model.norm.weight", f)
    embed = "model.embed_tokens.weight"
    for start in range(0, V, embed_rows or V):
        rows = slice(start, min(start + (embed_rows or V), V))
        yield ("embed",), (rows,), hf.read_rows(embed, rows.start, rows.stop).astype(f, copy=False)
    head = embed if cfg.tie_word_embeddings else "lm_head.weight"
    for start in range(0, D, head_rows or D):
        rows = slice(start, min(start + (head_rows or D), D))
        yield ("lm_head",), (rows,), transpose(hf.read_columns(head, rows.start, rows.stop).astype(f, copy=False))


def kind_index(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """(layer kind, position of `layer` within that kind's stack)."""
    kinds = cfg.layer_kinds
    return kinds[layer], kinds[:layer].count(kinds[layer])


def read_hf_params(hf_dir: str | os.PathLike, cfg: ModelConfig, *, dtype: str = "bfloat16") -> dict:
    """The whole parameter tree as numpy arrays (float leaves in `dtype`; packed ints and bf16 scales as stored)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {tuple(DTYPES)}")
    hf = HFCheckpoint(hf_dir)
    validate(hf, cfg)
    tree = _map_shapes(lambda s: np.empty(*s), param_shapes(cfg, dtype))
    for path, index, arr in top_pieces(hf, cfg, dtype):
        _leaf(tree, path)[index] = arr
    for layer in range(cfg.num_hidden_layers):
        kind, i = kind_index(cfg, layer)
        for path, arr in layer_pieces(hf, cfg, layer, dtype):
            _leaf(tree[kind], path)[i] = arr
    hf.release()
    return tree


def _leaf(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
