"""The recipe's first stages: the tokenizer and token arrays, target training, and INT4 quantization.

- `tokenizer`: a byte-level BPE of the stdlib corpus -> DIR/tokenizer, the corpus as token arrays -> DIR/tokens.
- `target`: next-token training, checkpointed every save_every steps so a killed run resumes -> DIR/target/params.
- `quantize`: held-out loss before and after INT4; quantization-aware steps when INT4 costs more than
  qat_threshold nats -> DIR/quant/params (model layout).
`import_target` takes both from a trained checkpoint instead (train_mini.py --target-from), so a new drafter can be
trained for a shipped target without training the target again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import hf, ops
from k26jax.api import load
from k26jax.tokenizer import Tokenizer
from k26jax.train import bpe, corpus, loop
from k26jax.train import target as tt
from k26jax.train.rundir import RecipeError, Run, stop_if_cut_short


class StepBatches:
    """batch_fn(step) over corpus.batches' stream, which depends on the seed alone: a resumed run skips the
    batches of the steps it already took, so it sees what an uninterrupted run would."""

    def __init__(self, tokens, seq_len: int, batch: int, seed: int):
        self.it, self.next = corpus.batches(tokens, seq_len, batch, seed), 0

    def __call__(self, step: int) -> dict:
        while self.next < step:
            next(self.it)
            self.next += 1
        ids = next(self.it)
        self.next += 1
        return {"ids": jnp.asarray(ids), "mask": jnp.ones(ids.shape, bool)}


def stage_tokenizer(run: Run) -> None:
    t0 = time.time()
    files = corpus.corpus_files(None, run.any_python)
    manifest = corpus.corpus_manifest(files=files)
    if run.s.files_limit:
        files = files[: run.s.files_limit]
    train_files, _ = corpus.split_files(files)
    print(f"[tokenizer] {len(files)} files ({len(train_files)} train); BPE of {run.s.vocab} ids ...", flush=True)
    ranks = bpe.train_bpe(corpus.read_texts(train_files), run.s.vocab)
    hf.write_tokenizer(run.path("tokenizer"), ranks)
    if bpe.mask_token_id(run.s.vocab) != run.dcfg.mask_token_id:
        raise RecipeError(
            f"the tokenizer's MASK id {bpe.mask_token_id(run.s.vocab)} != the drafter's {run.dcfg.mask_token_id}"
        )
    tokens = corpus.write_token_arrays(Tokenizer(run.path("tokenizer")), run.path("tokens"), files)
    corpus_record = {
        "python_version": manifest["python_version"],
        "file_list_sha256": manifest["file_list_sha256"],
        "num_files": manifest["num_files"],
        "files_used": len(files),
        "used_file_list_sha256": corpus.file_list_hash(files),
    }
    run.update_record(corpus=corpus_record)
    keys = ("train_tokens", "heldout_tokens", "heldout_prompts")
    run.mark_done("tokenizer", dict(corpus_record, **{k: tokens[k] for k in keys}), t0)


def _adamw(run: Run, params, lr: float, total_steps: int):
    """The target's optimizer: the reserved MASK embedding row is spared weight decay."""
    s = run.s
    return loop.adamw(
        lr=lr,
        total_steps=total_steps,
        warmup_frac=s.warmup_frac,
        weight_decay=s.weight_decay,
        decay_mask=tt.decay_mask(params, (run.dcfg.mask_token_id,)),
        trainable=tt.trainable_mask(params),
    )


def stage_target(run: Run) -> None:
    run.need("tokenizer")
    t0, s, cfg = time.time(), run.s, run.cfg
    train = np.load(run.path("tokens", "train.npy"))
    windows = run.heldout_windows(s.seq_len, s.eval_windows)
    params = tt.init_params(cfg, run.seed)
    opt = _adamw(run, params, s.lr, s.target_steps)
    step_fn = tt.make_train_step(cfg, opt, bias_rate=s.bias_rate)
    print(f"[target] {s.target_steps} steps of {s.batch} x {s.seq_len} tokens over {len(train):,} tokens", flush=True)

    def on_save(step, state):
        loss = tt.eval_loss(state[0], cfg, windows, s.batch)
        print(f"[target] step {step}: held-out loss {loss:.4f}", flush=True)
        return {"heldout_loss": loss}

    state, meta = loop.run(
        name="target",
        state=(params, opt.init(params)),
        step_fn=step_fn,
        batch_fn=StepBatches(train, s.seq_len, s.batch, run.seed),
        num_steps=s.target_steps,
        ckpt=loop.Checkpointer(run.path("target", "state")),
        save_every=s.save_every,
        tokens_per_step=s.batch * s.seq_len,
        log_path=run.path("target", "log.jsonl"),
        on_save=on_save,
        max_seconds=run.max_seconds,
    )
    stop_if_cut_short("target", meta)
    loop.save_tree(run.path("target", "params"), tt.cast(state[0], jnp.bfloat16), meta)
    summary = {"steps": meta["step"], "heldout_loss": meta["heldout_loss"], "time_budget_hit": meta["time_budget_hit"]}
    run.mark_done("target", summary, t0)
    shutil.rmtree(run.path("target", "state"), ignore_errors=True)


def stage_quantize(run: Run) -> None:
    run.need("target")
    t0, s, cfg = time.time(), run.s, run.cfg
    windows = run.heldout_windows(s.seq_len, s.eval_windows)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), run.target_params())
    before = tt.eval_loss(params, cfg, windows, s.batch)
    after = tt.eval_loss(tt.from_inference(tt.to_inference(params)), cfg, windows, s.batch)
    summary = {"heldout_loss_bf16": before, "heldout_loss_int4_ptq": after, "int4_cost_ptq": after - before}
    print(f"[quantize] held-out loss bf16 {before:.4f}, INT4 {after:.4f} (+{after - before:.4f} nats)", flush=True)
    if after - before > s.qat_threshold or s.force_qat:
        params = quantization_aware_steps(run, params)
        after = tt.eval_loss(tt.from_inference(tt.to_inference(params)), cfg, windows, s.batch)
        summary.update(qat_steps=s.qat_steps, heldout_loss_int4_qat=after, int4_cost_qat=after - before)
        print(f"[quantize] after {s.qat_steps} quantization-aware steps: INT4 {after:.4f}", flush=True)
    loop.save_tree(run.path("quant", "params"), tt.to_inference(params))
    run.mark_done("quantize", dict(summary, heldout_loss_int4=after), t0)
    shutil.rmtree(run.path("quant", "state"), ignore_errors=True)


def quantization_aware_steps(run: Run, params):
    """s.qat_steps of next-token training through fake-quantized experts (straight-through), low learning rate."""
    s = run.s
    opt = _adamw(run, params, s.qat_lr, s.qat_steps)
    train = np.load(run.path("tokens", "train.npy"))
    state, meta = loop.run(
        name="qat",
        state=(params, opt.init(params)),
        step_fn=tt.make_train_step(run.cfg, opt, bias_rate=s.bias_rate, fake_quant=True),
        batch_fn=StepBatches(train, s.seq_len, s.batch, run.seed + 1),
        num_steps=s.qat_steps,
        ckpt=loop.Checkpointer(run.path("quant", "state")),
        save_every=max(1, s.qat_steps // 2),
        tokens_per_step=s.batch * s.seq_len,
        log_path=run.path("quant", "log.jsonl"),
        max_seconds=run.max_seconds,
    )
    stop_if_cut_short("quantize", meta)
    return state[0]


def _sha256(paths) -> str:
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def import_target(run: Run, ckpt: str) -> None:
    """The target and quantize stages from a trained checkpoint in the K2.6 format (a run's DIR/hf, or the
    shipped checkpoints/mini): its architecture and tokenizer must be this run's. Its held-out loss is measured
    as the quantize stage measures it, and the weights' hash goes into DIR/run.json."""
    if run.done("quantize") is not None:
        return
    run.need("tokenizer")
    t0 = time.time()
    for name in ("tiktoken.model", "tokenizer_config.json"):
        theirs = os.path.join(ckpt, name)
        if not os.path.isfile(theirs):
            raise RecipeError(f"--target-from {ckpt}: no {name} there (not a K2.6-format checkpoint)")
        if _sha256([theirs]) != _sha256([run.path("tokenizer", name)]):
            raise RecipeError(f"--target-from {ckpt}: its {name} is not this run's tokenizer ({run.path('tokenizer')})")
    try:
        model = load(ckpt, drafter=False, impls=ops.Impls())
    except (OSError, ValueError) as error:
        raise RecipeError(f"--target-from {ckpt}: {error}") from None
    differs = [f.name for f in dataclasses.fields(run.cfg) if getattr(run.cfg, f.name) != getattr(model.cfg, f.name)]
    if differs:
        raise RecipeError(f"--target-from {ckpt}: its config differs from this run's in {', '.join(differs)}")
    weights = sorted(os.path.join(ckpt, f) for f in os.listdir(ckpt) if f.endswith(".safetensors"))
    source = {"imported_from": os.path.abspath(ckpt), "weights_sha256": _sha256(weights)}
    params = jax.tree.map(np.asarray, model.params)
    windows = run.heldout_windows(run.s.seq_len, run.s.eval_windows)
    loss = tt.eval_loss(tt.from_inference(jax.tree.map(jnp.asarray, params)), run.cfg, windows, run.s.batch)
    print(f"[target] imported from {ckpt}: held-out loss {loss:.4f} (INT4)", flush=True)
    loop.save_tree(run.path("quant", "params"), params)
    run.mark_done("target", source, t0)
    run.mark_done("quantize", dict(source, heldout_loss_int4=loss), t0)
    run.update_record(target_from=source)
