"""HF -> orbax converter and restore: round trip, per-chunk checksums, INT4 relayout vs compressed-tensors, crash +
resume, bad input, what --overwrite may replace, the drafter beside the checkpoint, 1-device -> 8-device restore."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from safetensors.numpy import load_file, save_file

from convert import converter, make_tiny
from convert.__main__ import main as convert_main
from k26jax import checkpoint, hf_files, sharding
from k26jax import hf as hf_layout
from k26jax.config import ConfigError, DrafterConfig, ModelConfig
from pallas_kernels.int4_moe_gemm import dequantize_int4, unpack_int4

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "checkpoints", "tiny")


def _convert(out, hf=TINY, log=lambda s: None, **kw):
    return converter.convert(converter.Options(hf_dir=hf, out=str(out), progress=False, **kw), log=log)


def _same_bits(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _assert_trees_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    bad = [
        jax.tree_util.keystr(p)
        for p, ok in jax.tree_util.tree_leaves_with_path(jax.tree.map(_same_bits, got, want))
        if not ok
    ]
    assert not bad, bad


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "tiny_orbax"
    _convert(out, drafter_dir=os.path.join(TINY, "drafter"))
    return str(out)


@pytest.fixture(scope="module")
def hf_tree():
    return hf_layout.read_target(TINY, ModelConfig.from_hf_dir(TINY))


def test_round_trip_equals_hf(converted, hf_tree):
    cfg, params = checkpoint.restore(converted)
    assert cfg == ModelConfig.from_hf_dir(TINY)
    _assert_trees_equal(params, hf_tree)
    manifest = checkpoint.read_manifest(converted)
    assert manifest["format"] == checkpoint.FORMAT
    flat = checkpoint.flatten_tree(hf_tree)
    for name, leaf in manifest["leaves"].items():  # one sha256 per chunk file, of that chunk of the HF tree's leaf
        files = sorted(f for f in os.listdir(os.path.join(converted, "params", name)) if not f.startswith("."))
        assert sorted(leaf["chunk_sha256"]) == files
        for key, digest in leaf["chunk_sha256"].items():
            at = tuple(slice(int(i) * c, int(i) * c + c) for i, c in zip(key.split("."), leaf["chunks"]))
            assert converter.hashlib.sha256(np.ascontiguousarray(flat[name][at]).view(np.uint8)).hexdigest() == digest
    assert manifest["skipped"]["vision_tower"]["tensors"] == 4
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(converted, name))


def test_orbax_reads_it_with_its_own_api(converted, hf_tree):
    """Plain orbax (no k26jax code) restores the params directory."""
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(os.path.join(converted, "params")).item_metadata.tree
        assert meta["moe"]["mlp"]["w13_packed"].shape == hf_tree["moe"]["mlp"]["w13_packed"].shape
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), meta)
        tree = ckptr.restore(os.path.join(converted, "params"), args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    assert _same_bits(tree["moe"]["mlp"]["w2_packed"], hf_tree["moe"]["mlp"]["w2_packed"])


def test_drafter_round_trip(converted):
    dcfg, want = hf_layout.read_drafter(os.path.join(TINY, "drafter"))
    got_cfg, got = checkpoint.restore_drafter(os.path.join(converted, "drafter"))
    assert got_cfg == dcfg
    _assert_trees_equal(got, want)


def test_float32_conversion(tmp_path):
    _convert(tmp_path / "f32", dtype="float32")
    cfg, params = checkpoint.restore(tmp_path / "f32", dtype=None)
    _assert_trees_equal(params, hf_layout.read_target(TINY, cfg, dtype="float32"))
    assert params["moe"]["mlp"]["w13_scale"].dtype == jax.numpy.bfloat16
    assert params["moe"]["mlp"]["router_bias"].dtype == np.float32


@pytest.mark.parametrize("n, mode", [(1, "ep"), (8, "ep"), (8, "tp"), (4, "tp")])
def test_restore_onto_mesh(converted, hf_tree, n, mode):
    mesh = sharding.make_mesh(n)
    _, params = checkpoint.restore(converted, mesh=mesh, expert_mode=mode)
    _assert_trees_equal(params, hf_tree)
    specs = sharding.param_partition_specs(ModelConfig.from_hf_dir(TINY), mode)
    w13 = params["moe"]["mlp"]["w13_packed"]
    assert w13.sharding.spec == sharding.fit_spec(specs["moe"]["mlp"]["w13_packed"], w13.shape, mesh)
    if n == 8 and mode == "ep":  # the chunks on disk are exactly the 8-way EP shards (per layer)
        chunks = checkpoint.read_manifest(converted)["leaves"]["moe.mlp.w13_packed"]["chunks"]
        assert w13.addressable_shards[0].data.shape[1:] == tuple(chunks[1:])
        assert params["embed"].addressable_shards[0].data.shape[0] == hf_tree["embed"].shape[0] // 8


def _hf_with_int4_fixture(tmp_path):
    """A small HF checkpoint whose expert 0 (first MoE layer) holds compressed-tensors' packed fixture:
    gate = up = fixture [out 64, in 96], down = pack(q.T) [out 96, in 64]."""
    fx = np.load(os.path.join(ROOT, "tests", "fixtures", "int4_pack.npz"))
    out = str(tmp_path / "hf_int4")
    make_tiny.make_tiny(
        out,
        drafter=False,
        overrides=dict(
            vocab_size=512,
            hidden_size=96,
            moe_intermediate_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
        ),
    )
    with open(os.path.join(out, hf_files.INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    prefix = "language_model.model.layers.1.mlp.experts.0."
    new = {prefix + f"{p}_proj.weight_packed": fx["packed"] for p in ("gate", "up")}
    new.update({prefix + f"{p}_proj.weight_scale": fx["scale"].astype(hf_layout.BF16) for p in ("gate", "up")})
    new[prefix + "down_proj.weight_packed"] = hf_layout.pack_int4(fx["q_int"].T)
    shared = "language_model.model.layers.1.mlp.shared_experts.gate_proj."  # a packed linear outside the experts
    removed = {
        shared + "weight": {
            shared + "weight_packed": fx["packed"],
            shared + "weight_scale": fx["scale"].astype(hf_layout.BF16),
            shared + "weight_shape": np.array([64, 96]),
        }
    }
    for name, value in new.items():
        _edit_shard(out, weight_map, {name: value})
    for name, replacement in removed.items():
        _edit_shard(out, weight_map, replacement, remove=name)
    return out, fx


def _edit_shard(hf_dir, weight_map, tensors, remove=None):
    """Sets `tensors` in the shard that holds `remove` (or the first of them, or else the first shard), dropping
    `remove`; rewrites the index."""
    file = weight_map.get(remove or next(iter(tensors))) or min(weight_map.values())
    shard = os.path.join(hf_dir, file)
    content = load_file(shard)
    if remove:
        del content[remove], weight_map[remove]
    content.update(tensors)
    weight_map.update({name: file for name in tensors})
    save_file(content, shard, metadata={"format": "pt"})
    with open(os.path.join(hf_dir, hf_files.INDEX_FILE), "w") as f:
        json.dump({"weight_map": weight_map}, f)


def test_int4_relayout_matches_compressed_tensors(tmp_path):
    hf_dir, fx = _hf_with_int4_fixture(tmp_path)
    _convert(tmp_path / "o", hf=hf_dir)
    _, restored = checkpoint.restore(tmp_path / "o")
    for params in (hf_layout.read_target(hf_dir, ModelConfig.from_hf_dir(hf_dir)), restored):
        mlp = params["moe"]["mlp"]
        w13, s13 = np.asarray(mlp["w13_packed"][0, 0]), np.asarray(mlp["w13_scale"][0, 0])  # [96/8, 2, 64]
        for j in (0, 1):
            np.testing.assert_array_equal(w13[:, j], fx["packed"].T)  # words moved, not re-encoded
            np.testing.assert_array_equal(np.asarray(unpack_int4(w13[:, j], axis=0)), fx["unpacked"].T)
            deq = np.asarray(dequantize_int4(w13[:, j], s13[:, j], axis=0, dtype=np.float32))
            np.testing.assert_array_equal(deq, fx["dequantized"].T)
        down = np.asarray(unpack_int4(np.asarray(mlp["w2_packed"][0, 0]), axis=0))  # [64, 96]
        np.testing.assert_array_equal(down, fx["q_int"])
        shared_gate = np.asarray(mlp["shared"]["gate_up"][0, :, 0, :]).astype(np.float32)  # dequantized on read
        np.testing.assert_array_equal(shared_gate, fx["dequantized"].T)


def test_k2_layout_inv_freq_and_int64_weight_shape(tmp_path):
    """K2 naming (no prefix, `model-1-of-2` shards, q_lora_rank null), a skipped rotary_emb.inv_freq, and
    weight_shape stored as int64 (as compressed-tensors itself writes it)."""
    hf = str(tmp_path / "k2")
    shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "parity_k2_group"), hf)
    with open(os.path.join(hf, hf_files.INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    assert not any(n.startswith("language_model.") for n in weight_map)
    name = "model.layers.2.mlp.experts.0.down_proj.weight_shape"
    shape = load_file(os.path.join(hf, weight_map[name]))[name]
    _edit_shard(hf, weight_map, {name: shape.astype(np.int64)})
    _edit_shard(hf, weight_map, {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    cfg = ModelConfig.from_hf_dir(hf)
    summary = _convert(tmp_path / "o", hf=hf)
    assert "rotary_emb.inv_freq: 1 tensors" in summary["skipped"]
    _, params = checkpoint.restore(tmp_path / "o")
    _assert_trees_equal(params, hf_layout.read_target(hf, cfg))
    assert "q" in params["moe"]["attn"] and "q_a" not in params["moe"]["attn"]


def _run_cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "convert", "--no-progress", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("kill_after, finished", [(6, []), (37, ["target:top", "target:layer 0"])])
def test_resume_after_kill(tmp_path, converted, kill_after, finished):  # killed inside "top"; inside MoE layer 1
    out = str(tmp_path / "out")
    env = dict(os.environ, **{converter.KILL_HOOK: str(kill_after)})
    run = _run_cli(["--hf", TINY, "--out", out, "--drafter", os.path.join(TINY, "drafter")], env)
    assert run.returncode == -9, run.stderr
    staging = out + converter.STAGING_SUFFIX
    assert not os.path.exists(out) and os.path.isdir(staging)
    journal = os.path.join(staging, converter.JOURNAL_FILE)
    lines = open(journal).read().split("\n")[:-1] if os.path.exists(journal) else []
    assert [json.loads(line)["step"] for line in lines] == finished
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="--resume"):
        checkpoint.restore(staging)
    with pytest.raises(FileExistsError, match=r"resume=True"):  # the Python interface's name for it
        _convert(out, drafter_dir=os.path.join(TINY, "drafter"))
    run = _run_cli(["--hf", TINY, "--out", out])
    assert run.returncode == 2 and "--resume" in run.stderr and "resume=True" not in run.stderr
    _convert(out, drafter_dir=os.path.join(TINY, "drafter"), resume=True)
    assert not os.path.exists(staging)
    for sub in ("", "drafter"):
        got, want = (checkpoint.read_manifest(os.path.join(d, sub))["leaves"] for d in (out, converted))
        assert got == want
    _, a = checkpoint.restore(out)
    _, b = checkpoint.restore(converted)
    _assert_trees_equal(a, b)


def test_resume_refuses_other_options(tmp_path):
    out = str(tmp_path / "out")
    run = _run_cli(["--hf", TINY, "--out", out], dict(os.environ, **{converter.KILL_HOOK: "3"}))
    assert run.returncode == -9
    with pytest.raises(ValueError, match="expert_mode"):
        _convert(out, resume=True, expert_mode="tp")


def _copy_tiny(tmp_path):
    dst = str(tmp_path / "hf")
    shutil.copytree(TINY, dst, ignore=shutil.ignore_patterns("drafter"))
    with open(os.path.join(dst, hf_files.INDEX_FILE)) as f:
        return dst, json.load(f)["weight_map"]


def _assert_refused(capsys, tmp_path, hf, *patterns):
    out = str(tmp_path / "out")
    assert convert_main(["--hf", hf, "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    for pattern in patterns:
        assert pattern in err, err
    assert not os.path.exists(out) and not os.path.exists(out + converter.STAGING_SUFFIX)


def test_missing_shard(tmp_path, capsys):
    hf, weight_map = _copy_tiny(tmp_path)
    shard = weight_map["language_model.model.layers.2.mlp.experts.5.up_proj.weight_packed"]
    os.remove(os.path.join(hf, shard))
    _assert_refused(capsys, tmp_path, hf, shard, "shard is missing")


def test_truncated_shard(tmp_path, capsys):
    hf, weight_map = _copy_tiny(tmp_path)
    shard = os.path.join(hf, weight_map["language_model.lm_head.weight"])
    os.truncate(shard, os.path.getsize(shard) - 100)
    _assert_refused(capsys, tmp_path, hf, os.path.basename(shard), "truncated")


@pytest.mark.parametrize("size", [1000, 200_000])  # inside the header; after it, inside the data
def test_truncated_drafter_file(tmp_path, capsys, size):
    hf = str(tmp_path / "hf")
    shutil.copytree(TINY, hf)
    os.truncate(os.path.join(hf, "drafter", hf_files.SINGLE_FILE), size)
    _assert_refused(capsys, tmp_path, hf, os.path.join("drafter", hf_files.SINGLE_FILE), "truncated")


def test_loading_a_truncated_drafter_names_the_file(tmp_path):
    path = str(tmp_path / "drafter")
    shutil.copytree(os.path.join(TINY, "drafter"), path)
    os.truncate(os.path.join(path, hf_files.SINGLE_FILE), 200_000)
    with pytest.raises(hf_files.CheckpointError, match=r"drafter/model.safetensors: shard is truncated"):
        hf_layout.read_drafter_params(path, DrafterConfig.from_hf_dir(path))


def test_wrong_shape(tmp_path, capsys):
    hf, weight_map = _copy_tiny(tmp_path)
    name = "language_model.model.layers.1.self_attn.kv_b_proj.weight"
    shard = os.path.join(hf, weight_map[name])
    tensors = load_file(shard)
    tensors[name] = tensors[name][:-8]
    save_file(tensors, shard, metadata={"format": "pt"})
    _assert_refused(capsys, tmp_path, hf, "wrong shape", os.path.basename(shard), name)


def test_missing_and_unexpected_tensors(tmp_path, capsys):
    hf, weight_map = _copy_tiny(tmp_path)
    gone, extra = "language_model.model.layers.3.mlp.experts.7.down_proj.weight_scale", "language_model.bogus.weight"
    shard = os.path.join(hf, weight_map[gone])
    tensors = load_file(shard)
    del tensors[gone]
    tensors[extra] = np.zeros(4, np.float32)
    save_file(tensors, shard, metadata={"format": "pt"})
    weight_map[extra] = weight_map.pop(gone)
    with open(os.path.join(hf, hf_files.INDEX_FILE), "w") as f:
        json.dump({"weight_map": weight_map}, f)
    _assert_refused(
        capsys,
        tmp_path,
        hf,
        "missing: 'model.layers.3.mlp.experts.7.down_proj.weight_scale'",
        f"unexpected: {os.path.basename(shard)}: '{extra}'",
    )


def test_unknown_quantization_format(tmp_path, capsys):
    hf, _ = _copy_tiny(tmp_path)
    with open(os.path.join(hf, "config.json")) as f:
        raw = json.load(f)
    raw["text_config"]["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with open(os.path.join(hf, "config.json"), "w") as f:
        json.dump(raw, f)
    _assert_refused(capsys, tmp_path, hf, "quantization_config", "FP8")
    with pytest.raises(ConfigError):
        ModelConfig.from_hf_dir(hf)


def test_existing_output_needs_overwrite(tmp_path, capsys, converted):
    out = tmp_path / "out"
    shutil.copytree(converted, out)
    (out / "params" / "embed" / "0.0").write_bytes(b"stale")
    assert convert_main(["--hf", TINY, "--out", str(out), "--no-progress"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert convert_main(["--hf", TINY, "--out", str(out), "--no-progress", "--overwrite"]) == 0
    assert checkpoint.read_manifest(out)["leaves"] == checkpoint.read_manifest(converted)["leaves"]
    checkpoint.restore(out)  # the stale chunk is gone
    capsys.readouterr()
    assert convert_main(["--hf", TINY, "--out", str(out), "--no-progress", "--resume"]) == 0
    assert "already complete" in capsys.readouterr().out


@pytest.mark.parametrize("what", ["foreign dir", "file", "foreign partial"])
def test_overwrite_refuses_what_is_not_ours(tmp_path, capsys, what):
    """--overwrite replaces only a k26jax checkpoint or a conversion of ours: a directory of other files, a file,
    or a foreign OUT.partial is refused before anything is written, and left as it was."""
    out = tmp_path / "out"
    victim = out.parent / (out.name + converter.STAGING_SUFFIX) if what == "foreign partial" else out
    if what == "file":
        out.write_text("user data")
    else:
        victim.mkdir()
        (victim / "keep.txt").write_text("user data")
        (victim / "manifest.json").write_text("{}")  # looks like a checkpoint, but has no COMPLETE of ours
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for extra in ([], ["--resume"]):
        assert convert_main(["--hf", TINY, "--out", str(out), "--no-progress", "--overwrite", *extra]) == 2
        err = capsys.readouterr().err
        assert str(victim) in err and "not a k26jax" in err, err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before
    with pytest.raises(FileExistsError, match="out="):  # the Python interface's name for it
        _convert(out, overwrite=True)


def test_empty_output_directory_is_used(tmp_path):
    (tmp_path / "out").mkdir()
    assert _convert(tmp_path / "out", drafter_dir=False)["drafter"] is False
    assert not os.path.exists(tmp_path / "out" / "drafter")
    checkpoint.read_manifest(tmp_path / "out")


def test_drafter_beside_the_checkpoint_is_converted(tmp_path, capsys, converted):
    """Without --drafter the converter takes HF/drafter and says so; --no-drafter skips it and says what that
    leaves out; each message names the flag of the interface in use."""
    out = str(tmp_path / "out")
    assert convert_main(["--hf", TINY, "--out", out, "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert os.path.join(TINY, "drafter") in said and "--no-drafter" in said
    got, want = (checkpoint.read_manifest(os.path.join(d, "drafter"))["leaves"] for d in (out, converted))
    assert got == want
    assert convert_main(["--hf", TINY, "--out", out + "2", "--no-progress", "--no-drafter"]) == 0
    assert not os.path.exists(os.path.join(out + "2", "drafter"))
    lines = []
    assert _convert(tmp_path / "py", hf=_copy_tiny(tmp_path)[0], log=lines.append)["drafter"] is False
    assert any("no drafter" in line and "drafter_dir='DIR'" in line for line in lines), lines
    lines.clear()
    _convert(tmp_path / "py2", log=lines.append)
    assert any("drafter_dir=False skips it" in line for line in lines), lines


def test_broken_drafter_beside_the_checkpoint_names_the_way_out(tmp_path, capsys):
    hf, _ = _copy_tiny(tmp_path)
    os.makedirs(os.path.join(hf, "drafter"))
    assert convert_main(["--hf", hf, "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert os.path.join(hf, "drafter") in err and "--no-drafter skips it" in err, err


def test_loader_refuses_tampered_or_partial(tmp_path, converted):
    out = tmp_path / "c"
    shutil.copytree(converted, out)
    with open(out / "manifest.json", "a") as f:
        f.write(" ")
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="does not match"):
        checkpoint.restore(out)
    os.remove(out / "COMPLETE")
    with pytest.raises(checkpoint.IncompleteCheckpointError, match="no COMPLETE marker"):
        checkpoint.restore(out)


def test_dry_run_writes_nothing(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert convert_main(["--hf", TINY, "--out", out, "--dry-run", "--drafter", os.path.join(TINY, "drafter")]) == 0
    text = capsys.readouterr().out
    assert "moe.mlp.w13_packed" in text and "vision_tower: 4 tensors" in text and "layers.mlp.gate_up" in text
    assert not os.path.exists(out) and not os.path.exists(out + converter.STAGING_SUFFIX)


def test_drafter_dims_checked_against_target(tmp_path, capsys):
    drafter = str(tmp_path / "d")
    shutil.copytree(os.path.join(TINY, "drafter"), drafter)
    with open(os.path.join(drafter, "config.json")) as f:
        raw = json.load(f)
    raw["vocab_size"] = 2048
    with open(os.path.join(drafter, "config.json"), "w") as f:
        json.dump(raw, f)
    out = str(tmp_path / "out")
    assert convert_main(["--hf", TINY, "--out", out, "--drafter", drafter, "--no-progress"]) == 2
    assert "vocab_size" in capsys.readouterr().err
    assert not os.path.exists(out)


# ---- writing the HF layout ---------------------------------------------------------------------------------
def test_write_target_reproduces_the_tiny_checkpoint(tmp_path, hf_tree):
    """Our tree, written back with make_tiny's options (shard size, vision tensors, split), is the committed
    checkpoint byte for byte: the writer is the reader's exact inverse."""
    with open(os.path.join(TINY, hf_files.INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    extra = {}
    for name, file in weight_map.items():
        if name.startswith(("vision_tower.", "mm_projector.")):
            extra[name] = load_file(os.path.join(TINY, file))[name]
    with open(os.path.join(TINY, "generation_config.json")) as f:
        generation = json.load(f)
    out = tmp_path / "w"
    cfg = hf_layout.write_target(
        out,
        make_tiny.tiny_text_config("tiny"),
        hf_tree,
        shard_bytes=2_500_000,
        generation_config=generation,
        extra_tensors=extra.items(),
        split_after="language_model.model.layers.1.mlp.experts.0.up_proj.weight_shape",
    )
    assert cfg == ModelConfig.from_hf_dir(TINY)
    names = sorted(n for n in os.listdir(TINY) if n.endswith((".json", ".safetensors")) and "tokenizer" not in n)
    assert names == sorted(os.listdir(out))
    for name in names:
        with open(os.path.join(TINY, name), "rb") as a, open(out / name, "rb") as b:
            assert a.read() == b.read(), name


def test_write_target_plain_layout_and_float_experts(tmp_path, hf_tree):
    """wrapper=False writes a plain kimi_k2 checkpoint (no prefix); float experts (the training layout) are
    quantized on the way and read back as the packed leaves quantize_experts makes."""
    quant = pytest.importorskip("k26jax.quant")
    w13, w2 = quant.dequantize_experts(
        {k: hf_tree["moe"]["mlp"][k] for k in ("w13_packed", "w13_scale", "w2_packed", "w2_scale")}
    )
    mlp = {k: v for k, v in hf_tree["moe"]["mlp"].items() if not k.startswith(("w13_", "w2_"))}
    params = dict(hf_tree, moe=dict(hf_tree["moe"], mlp=dict(mlp, w13=w13, w2=w2)))
    cfg = hf_layout.write_target(tmp_path / "p", make_tiny.tiny_text_config("tiny"), params, wrapper=False)
    with open(tmp_path / "p" / "config.json") as f:
        assert json.load(f)["model_type"] == "kimi_k2"
    assert not any(n.startswith("language_model.") for n in hf_files.HFCheckpoint(tmp_path / "p").entries)
    got = hf_layout.read_target(tmp_path / "p", cfg)
    want = dict(hf_tree, moe=dict(hf_tree["moe"], mlp=dict(mlp, **quant.quantize_experts(w13, w2))))
    _assert_trees_equal(got, jax.tree.map(np.asarray, want))


def test_write_target_rejects_a_bad_tree(tmp_path, hf_tree):
    bad = dict(hf_tree, moe=dict(hf_tree["moe"], attn=dict(hf_tree["moe"]["attn"])))
    bad["moe"]["attn"]["o"] = bad["moe"]["attn"]["o"][:, :-1]
    with pytest.raises(ValueError, match="moe/attn/o"):
        hf_layout.write_target(tmp_path / "b", make_tiny.tiny_text_config("tiny"), bad)
    del bad["moe"]["attn"]["o"]
    with pytest.raises(ValueError, match="missing leaf moe/attn/o"):
        hf_layout.write_target(tmp_path / "b", make_tiny.tiny_text_config("tiny"), bad)
