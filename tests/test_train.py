"""k26jax.train: the DFlash objective against hand computation and the inference drafter, the target's training
forward against the inference model, INT4 packing against k26jax's layout, the router-bias rule, a few training
steps of each model, resumable checkpoints and the NaN stop."""

import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from k26jax import hf, ops, quant
from k26jax.hf import pack_int4
from k26jax.model import drafter as drafter_lib
from k26jax.model import target as model_target
from k26jax.train import dflash, loop, mini, recipe, rundir
from k26jax.train import target as tt
from pallas_kernels.int4_moe_gemm import dequantize_int4

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=64,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_hidden_layers=3,  # one dense layer, then a scan over two MoE layers
)
LAYER_IDS = (0, 2)


@pytest.fixture(scope="module")
def cfgs():
    text = mini.text_config(SMALL)
    return mini.model_config(text), mini.drafter_config(text, intermediate_size=96, layer_ids=LAYER_IDS)


@pytest.fixture(scope="module")
def drafter_setup(cfgs):
    _, dcfg = cfgs
    V, D = 512, 64
    params = dflash.init_params(dcfg, 0)
    embed = jax.random.normal(jax.random.key(1), (V, D))
    lm_head = 0.2 * jax.random.normal(jax.random.key(2), (D, V))
    return params, embed, lm_head


# ---- the DFlash objective --------------------------------------------------------------------------------
def test_block_forward_equals_inference_drafter(cfgs, drafter_setup):
    """Each block of the many-block training pass == the inference drafter's block over a context cache that
    holds the rows before its anchor (drafter.context_kv + draft_block, the engine's path): the mask hides later
    context and the other blocks, and slot 0 holds the anchor token."""
    _, dcfg = cfgs
    params, embed, lm_head = drafter_setup
    B, T = 2, 20
    feats = jax.random.normal(jax.random.key(3), (B, T, dcfg.context_dim))
    ids = jax.random.randint(jax.random.key(4), (B, T), 0, 500)
    anchors = jnp.array([[3, 7, 12], [1, 5, 19]])
    got = dflash.draft_logits(params, dcfg, embed, lm_head, feats, ids, anchors)
    rows, a = jnp.repeat(jnp.arange(B), 3), anchors.reshape(-1)
    k, v = drafter_lib.context_kv(params, dcfg, feats[rows], jnp.broadcast_to(jnp.arange(T), (rows.size, T)))
    want = drafter_lib.draft_block(params, dcfg, embed, lm_head, k, v, a, ids[rows, a], a)
    np.testing.assert_allclose(got.reshape(want.shape), want, atol=2e-5, rtol=1e-5)


def test_objective_equals_hand_computed_loss(cfgs, drafter_setup):
    """Anchors near the end lose their labels past the sequence; slot 0 carries no loss; slot k >= 1 is weighted
    exp(-(k-1)/4); the sum is normalised by the weights of the labels present."""
    _, dcfg = cfgs
    params, embed, lm_head = drafter_setup
    b, gamma = dcfg.block_size, 4.0
    T, length = 14, 12  # positions 12, 13 are padding
    ids = jax.random.randint(jax.random.key(5), (1, T), 0, 500)
    feats = jax.random.normal(jax.random.key(6), (1, T, dcfg.context_dim))
    anchors = jnp.array([[2, 6, 9]])
    ok = jnp.array([[True, True, False]])  # the third anchor is padding: no loss at all
    loss, metrics = dflash.objective(
        params, dcfg, embed, lm_head, feats, ids, jnp.array([length]), (anchors, ok), gamma
    )
    num = den = 0.0
    for a in (2, 6):
        logits = np.asarray(drafter_lib.draft_logits(params, dcfg, embed, lm_head, feats[:, :a], ids[:, a]))[0]
        for k in range(1, b):
            if a + k >= length:
                continue
            w = math.exp(-(k - 1) / gamma)
            row = logits[k - 1].astype(np.float64)
            ce = np.log(np.sum(np.exp(row - row.max()))) + row.max() - row[int(ids[0, a + k])]
            num += w * ce
            den += w
    np.testing.assert_allclose(float(loss), num / den, rtol=1e-5)
    assert float(metrics["blocks"]) == 1.0  # only anchor 2 has its whole block inside the sequence


def test_slot_weights_and_block_labels():
    w = np.asarray(dflash.slot_weights(8, 4.0))
    assert w[0] == 0.0 and w[1] == 1.0
    np.testing.assert_allclose(w[2:], np.exp(-np.arange(1, 7) / 4.0), rtol=1e-6)
    ids = jnp.arange(10)[None] + 100
    labels, present = dflash.block_labels(ids, jnp.array([9]), jnp.array([[0, 6]]), jnp.array([[True, True]]), 4)
    np.testing.assert_array_equal(labels[0, 0], [100, 101, 102, 103])
    np.testing.assert_array_equal(present[0, 1], [True, True, True, False])  # 6 + 3 = 9 is past the length


def test_sample_anchors_respects_candidates():
    ok = dflash.can_anchor(jnp.array([20, 8]), jnp.array([10, 0]), 24)
    anchors, valid = dflash.sample_anchors(jax.random.key(0), ok, 6)
    for b in range(2):
        got = np.asarray(anchors[b])[np.asarray(valid[b])]
        assert len(set(got)) == len(got) and np.all(np.diff(got) > 0)
        assert all(ok[b, a] for a in got)
    assert int(valid[1].sum()) == 6 and int(valid[0].sum()) == 6
    few, few_ok = dflash.sample_anchors(jax.random.key(1), dflash.can_anchor(jnp.array([5]), jnp.array([2]), 24), 6)
    np.testing.assert_array_equal(np.asarray(few)[np.asarray(few_ok)], [2, 3])  # only a = 2, 3 have a+1 < 5


# ---- the target --------------------------------------------------------------------------------------------
def test_training_forward_equals_inference_model(cfgs):
    """With INT4 experts dequantized, the training forward is the inference model's prefill (float32)."""
    cfg, _ = cfgs
    params = tt.init_params(cfg, 0)
    params["moe"]["mlp"]["router_bias"] = 0.1 * jax.random.normal(jax.random.key(7), (cfg.num_moe_layers, 16))
    inference = tt.to_inference(params, jnp.float32)
    ids = jax.random.randint(jax.random.key(8), (2, 16), 0, 500)
    train_fwd = jax.jit(
        lambda p: tt.forward(tt.from_inference(p), cfg, ids, hidden_layer_ids=LAYER_IDS, dtype=jnp.float32)
    )
    logits, feats, loads = train_fwd(inference)
    prefill = jax.jit(lambda p: model_target.forward_prefill(p, cfg, ids, jnp.array([16, 16]), ops.Impls(), LAYER_IDS))
    want, _, want_feats = prefill(inference)
    np.testing.assert_allclose(logits, want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(feats, want_feats, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(loads.sum(-1), 2 * 16 * cfg.num_experts_per_tok)


def test_bias_update_sign_rule():
    bias = jnp.array([[0.5, 0.0, -0.2, 0.1]])
    load = jnp.array([[10.0, 2.0, 4.0, 4.0]])  # mean 5: expert 0 overloaded, 1-3 underloaded
    np.testing.assert_allclose(tt.bias_update(bias, load, 0.01), [[0.49, 0.01, -0.19, 0.11]], rtol=1e-6)
    balanced = jnp.array([[3.0, 3.0, 3.0, 3.0]])
    np.testing.assert_array_equal(tt.bias_update(bias, balanced, 0.01), bias)


def test_int4_round_trip_matches_k26jax_layout():
    key = jax.random.key(9)
    E, D, I = 2, 64, 96
    w13 = jax.random.normal(key, (E, D, 2, I)) * 0.05
    w2 = jax.random.normal(jax.random.fold_in(key, 1), (E, I, D)) * 0.05
    packed = quant.quantize_experts(w13, w2)
    assert packed["w13_packed"].shape == (E, D // 8, 2, I) and packed["w13_packed"].dtype == jnp.int32
    assert packed["w13_scale"].shape == (E, D // 32, 2, I) and packed["w13_scale"].dtype == jnp.bfloat16
    assert packed["w2_packed"].shape == (E, I // 8, D) and packed["w2_scale"].shape == (E, I // 32, D)
    got13, got2 = quant.dequantize_experts(packed)
    np.testing.assert_array_equal(got13, dequantize_int4(packed["w13_packed"], packed["w13_scale"], 1, jnp.float32))
    np.testing.assert_array_equal(got2, dequantize_int4(packed["w2_packed"], packed["w2_scale"], 1, jnp.float32))
    # the words are compressed-tensors' pack-quantized words, transposed: HF [out, in/8] per (expert, gate|up)
    q13, _ = quant.quantize(w13, 1)
    for e in range(E):
        for j in range(2):
            np.testing.assert_array_equal(packed["w13_packed"][e, :, j], pack_int4(np.asarray(q13[e, :, j]).T).T)
    # error within half a step except where a group's largest value was clipped
    step = jnp.repeat(packed["w2_scale"].astype(jnp.float32), 32, axis=1)
    assert float(jnp.mean(jnp.abs(got2 - w2) <= step / 2 + 1e-6)) > 0.98
    np.testing.assert_array_equal(quant.unpack(quant.pack(q13, 1), 1), q13)


def test_fake_quant_forward_quantized_backward_identity():
    w = jax.random.normal(jax.random.key(10), (64, 8))
    q, s = quant.quantize(w, 0)
    np.testing.assert_array_equal(quant.fake_quant(w, 0), quant.dequantize(q, s, 0))
    g = jax.grad(lambda x: jnp.sum(quant.fake_quant(x, 0) * 3.0))(w)
    np.testing.assert_array_equal(g, jnp.full_like(w, 3.0))


# ---- training steps --------------------------------------------------------------------------------------
def _target_state(cfg, steps):
    params = tt.init_params(cfg, 0)
    mask_id = cfg.vocab_size - 2
    opt = loop.adamw(
        lr=3e-3,
        total_steps=steps,
        warmup_frac=0.0,
        weight_decay=0.1,
        decay_mask=tt.decay_mask(params, (mask_id,)),
        trainable=tt.trainable_mask(params),
    )
    return params, opt


def test_three_target_steps_lower_the_loss(cfgs):
    cfg, _ = cfgs
    params, opt = _target_state(cfg, 3)
    step = tt.make_train_step(cfg, opt, bias_rate=1e-2, dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(11), (4, 32), 0, 256)
    batch = {"ids": ids, "mask": jnp.ones(ids.shape, bool)}
    mask_row = np.array(params["embed"][cfg.vocab_size - 2])
    embed0, bias0 = np.array(params["embed"][0]), np.array(params["moe"]["mlp"]["router_bias"])
    loss_fn = jax.jit(lambda p: tt.lm_loss(p, cfg, ids, batch["mask"], dtype=jnp.float32))
    _, load0 = loss_fn(params)
    state, losses = (params, opt.init(params)), []
    for i in range(3):
        state, m = step(state, batch, i)
        losses.append(float(m["loss"]))
        if i == 0:  # the balancing rule on the loads this step's routing produced
            bias1 = bias0 + 1e-2 * np.sign(np.mean(load0, -1, keepdims=True) - load0)
            np.testing.assert_allclose(state[0]["moe"]["mlp"]["router_bias"], bias1, atol=1e-7)
    after, _ = loss_fn(state[0])
    assert float(after) < losses[0] and losses[2] < losses[0]
    np.testing.assert_array_equal(state[0]["embed"][cfg.vocab_size - 2], mask_row)  # no gradient, spared by decay
    assert not np.allclose(state[0]["embed"][0], embed0)


def test_three_drafter_steps_lower_the_loss(cfgs, drafter_setup):
    """The trainer takes any target through features_fn; here a fixed random feature per token id."""
    _, dcfg = cfgs
    _, embed, lm_head = drafter_setup
    table = jax.random.normal(jax.random.key(13), (512, dcfg.context_dim))
    frozen = {"target": table, "embed": embed, "lm_head": lm_head}
    features = lambda table_VF, ids_BT: table_VF[ids_BT]  # noqa: E731
    dparams = dflash.init_params(dcfg, 0)
    opt = loop.adamw(lr=3e-3, total_steps=3, warmup_frac=0.0)
    step = dflash.make_train_step(dcfg, opt, features, gamma=4.0, num_anchors=6, seed=0, dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(12), (4, 32), 0, 256)
    batch = {"ids": ids, "lengths": jnp.full((4,), 30), "supervised_from": jnp.full((4,), 8)}
    eval_step = dflash.make_eval_step(dcfg, features, gamma=4.0, num_anchors=6, dtype=jnp.float32)
    before, _ = eval_step(dparams, batch, jax.random.key(5), frozen)
    state = (dparams, opt.init(dparams))
    for i in range(3):
        state, _ = step(state, batch, i, frozen)
    after, _ = eval_step(state[0], batch, jax.random.key(5), frozen)
    assert float(after) < float(before)


# ---- the loop ----------------------------------------------------------------------------------------------
def _quadratic_run(tmp_path, num_steps, crash_at=None, nan_at=None):
    """A tiny loop.run over a quadratic; crash_at raises inside step_fn (a kill), nan_at poisons the loss."""
    target = jnp.arange(4.0)
    opt = optax.sgd(0.1)

    def step_fn(state, batch, step):
        if step == crash_at:
            raise KeyboardInterrupt("killed")
        params, opt_state = state
        loss, g = jax.value_and_grad(lambda p: jnp.sum((p - target * batch["x"]) ** 2))(params)
        updates, opt_state = opt.update(g, opt_state)
        loss = jnp.where(step == nan_at, jnp.nan, loss) if nan_at is not None else loss
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

    params = jnp.zeros(4)
    return loop.run(
        name="quad",
        state=(params, opt.init(params)),
        step_fn=step_fn,
        batch_fn=lambda s: {"x": jnp.float32(1 + s % 3)},
        num_steps=num_steps,
        ckpt=loop.Checkpointer(str(tmp_path / "ckpt")),
        save_every=2,
        log_every=100,
    )


def test_resume_after_kill_repeats_the_uninterrupted_run(tmp_path):
    whole, _ = _quadratic_run(tmp_path / "a", 7)
    with pytest.raises(KeyboardInterrupt):
        _quadratic_run(tmp_path / "b", 7, crash_at=5)
    assert loop.Checkpointer(str(tmp_path / "b" / "ckpt")).latest() == 4
    resumed, meta = _quadratic_run(tmp_path / "b", 7)
    assert meta["step"] == 7
    np.testing.assert_array_equal(resumed[0], whole[0])


def test_nan_loss_stops_naming_the_step(tmp_path):
    with pytest.raises(loop.NonFiniteLoss, match="at step 3"):
        _quadratic_run(tmp_path, 7, nan_at=3)
    assert loop.Checkpointer(str(tmp_path / "ckpt")).latest() == 2  # nothing saved after the NaN


def test_save_tree_chunks_and_round_trips(tmp_path):
    tree = {"a": np.arange(1000, dtype=np.float32), "b": {"c": jnp.ones((3, 5), jnp.bfloat16)}, "n": np.int32(7)}
    loop.save_tree(str(tmp_path / "t"), tree, {"x": 1}, max_file_bytes=1024)
    sizes = [p.stat().st_size for p in (tmp_path / "t").glob("chunk_*")]
    assert len(sizes) == 4 and max(sizes) <= 1024
    back, meta = loop.load_tree(str(tmp_path / "t"), tree)
    assert meta == {"x": 1} and back["b"]["c"].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, back, jax.tree.map(np.asarray, tree))


def test_sample_prompts_mixes_file_starts_and_windows_inside_one_file():
    from k26jax.train import stages_drafter as sd

    eos = 99
    docs = [np.arange(100, 100 + n, dtype=np.int32) for n in (5, 40, 70)]  # ids tell the file and the offset
    tokens = np.concatenate([x for d in docs for x in (d, [eos])])
    starts, lengths = sd.doc_starts(tokens, eos)
    assert starts.tolist() == [0, 6, 47] and lengths.tolist() == [5, 40, 70]
    prompts = sd.sample_prompts(tokens, 400, min_len=8, max_len=30, file_start_frac=0.5, eos=eos, seed=0)
    assert {len(p) for p in prompts} == set(range(8, 31))
    assert all(eos not in p and np.all(np.diff(p) == 1) for p in prompts)  # one file, consecutive
    first = np.mean([p[0] == 100 for p in prompts])  # a file's first token (the 5-token file is too short)
    assert 0.4 < first < 0.65, first
    again = sd.sample_prompts(tokens, 400, min_len=8, max_len=30, file_start_frac=0.5, eos=eos, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(prompts, again))
    with pytest.raises(ValueError, match="no file holds more than"):
        sd.sample_prompts(tokens, 1, min_len=70, max_len=70, file_start_frac=1.0, eos=eos, seed=0)


# ---- the driver ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def driver(import_script):
    """scripts/train_mini.py as a module (scripts/ on sys.path while importing it)."""
    return import_script("train_mini")


def test_driver_refuses_an_existing_out_dir(driver, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(SystemExit):
        driver.main(["--out", str(out), "--smoke", "--stages", "target"])
    assert "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --resume needs the run's own run.json
        driver.main(["--out", str(out), "--smoke", "--resume", "--stages", "target"])
    assert "no run.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --overwrite deletes only a run directory of ours
        driver.main(["--out", str(out), "--smoke", "--overwrite", "--stages", "target"])
    assert "not a train_mini run directory); not deleting it" in capsys.readouterr().err
    assert (out / "something").exists()
    (out / "something").unlink()
    with pytest.raises(SystemExit):  # an empty dir starts a run; target then needs the tokenizer stage
        driver.main(["--out", str(out), "--smoke", "--stages", "target"])
    assert "stage 'tokenizer' has not finished" in capsys.readouterr().err
    (out / "stale").write_text("x")
    with pytest.raises(SystemExit):  # --overwrite starts our own run over
        driver.main(["--out", str(out), "--smoke", "--overwrite", "--stages", "target"])
    assert "stage 'tokenizer' has not finished" in capsys.readouterr().err
    assert not (out / "stale").exists() and (out / "run.json").is_file()
    with pytest.raises(SystemExit):  # a resumed run keeps its settings
        driver.main(["--out", str(out), "--smoke", "--resume", "--set", "target_steps=5", "--stages", "target"])
    assert "other settings" in capsys.readouterr().err


def test_a_stage_cut_short_by_max_minutes_is_not_done(driver, tmp_path, monkeypatch, capsys):
    rundir.stop_if_cut_short("target", {"time_budget_hit": False, "step": 800})  # a finished stage goes on

    def cut_short_target(run):
        rundir.stop_if_cut_short("target", {"time_budget_hit": True, "step": 312})

    monkeypatch.setitem(recipe.RUNNERS, "target", cut_short_target)
    with pytest.raises(SystemExit) as stopped:
        driver.main(["--out", str(tmp_path / "run"), "--smoke", "--stages", "target"])
    assert stopped.value.code == driver.CUT_SHORT
    assert "stopped by --max-minutes at step 312: its state is kept; rerun with --resume" in capsys.readouterr().err


def test_target_from_a_checkpoint_replaces_the_target_and_quantize_stages(driver, tmp_path, capsys):
    """--target-from: a trained checkpoint of this run's architecture and tokenizer becomes DIR/quant/params (the
    data and drafter stages' input), its held-out loss measured and its weights' hash recorded; a checkpoint of
    another tokenizer or architecture is refused, naming what differs."""
    out = tmp_path / "run"
    assert driver.main(["--out", str(out), "--smoke", "--stages", "tokenizer"]) is None
    run = rundir.open_run(str(out), rundir.SMOKE, seed=0, smoke=True, resume=True, overwrite=False,
                          impl="reference", max_minutes=5, any_python=False)  # fmt: skip
    q = jax.tree.map(np.asarray, tt.to_inference(tt.init_params(run.cfg, 7)))
    ckpt = tmp_path / "ckpt"
    hf.write_target(ckpt, run.text, q)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(run.path("tokenizer", name), ckpt / name)
    argv = ["--out", str(out), "--smoke", "--resume", "--stages", "tokenizer,target,quantize"]
    assert driver.main(argv + ["--target-from", str(ckpt)]) is None
    got = run.quant_params()
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(q)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert run.done("target")["imported_from"] == str(ckpt) and np.isfinite(run.done("quantize")["heldout_loss_int4"])
    with open(run.path("run.json")) as f:
        assert json.load(f)["target_from"]["weights_sha256"] == run.done("target")["weights_sha256"]

    other = tmp_path / "other"
    assert driver.main(["--out", str(other), "--smoke", "--stages", "tokenizer", "--set", "vocab=2048"]) is None
    with pytest.raises(SystemExit):
        driver.main(["--out", str(other), "--smoke", "--resume", "--set", "vocab=2048", "--target-from", str(ckpt)])
    assert "its tiktoken.model is not this run's tokenizer" in capsys.readouterr().err
    shutil.copy(run.path("tokenizer", "tiktoken.model"), other / "tokenizer" / "tiktoken.model")
    shutil.copy(run.path("tokenizer", "tokenizer_config.json"), other / "tokenizer" / "tokenizer_config.json")
    with pytest.raises(SystemExit):
        driver.main(["--out", str(other), "--smoke", "--resume", "--set", "vocab=2048", "--target-from", str(ckpt)])
    assert "its config differs from this run's in vocab_size" in capsys.readouterr().err
