"""The recipe's drafter stages: the INT4 target's own continuations as data, then DFlash training on them.

- `data`: continuations of prompts from the training and held-out files, at T=0 and T=1 (engine AR decoding of
  the quantized target, the model the drafter will serve) -> DIR/data/{train,heldout}.
- `drafter`: DFlash training on that data, evaluated on the held-out data every d_eval_every steps; stops when
  held-out tau has not risen by min_delta for `patience` evaluations and keeps the best -> DIR/drafter/params.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

import k26jax
from k26jax.api import Model
from k26jax.train import dflash, loop
from k26jax.train import target as tt
from k26jax.train.rundir import Run, stop_if_cut_short

TEMPERATURES = (0.0, 1.0)


def repetition_rate(rows, n: int = 4) -> float:
    """1 - distinct n-grams / n-grams over the continuations (0: no repeated n-gram; near 1: loops)."""
    total = distinct = 0
    for r in rows:
        grams = [tuple(r[i : i + n]) for i in range(len(r) - n + 1)]
        total += len(grams)
        distinct += len(set(grams))
    return 1.0 - distinct / max(total, 1)


def sample_prompts(tokens: np.ndarray, n: int, length: int, eos: int, seed: int) -> np.ndarray:
    """n windows of `length` tokens at random starts that hold no [EOS] (prompts from inside one file)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        starts = rng.integers(0, len(tokens) - length, size=4 * n)
        for st in starts:
            w = tokens[st : st + length]
            if eos not in w and len(out) < n:
                out.append(w)
    return np.stack(out).astype(np.int32)


def continuations(run: Run, model: Model, prompts: np.ndarray, temperature: float, seed: int) -> dict:
    """The target's own continuations of `prompts` (engine AR, batches of gen_batch): ids [N, P+new] (padded
    with the pad id), lengths [N], supervised_from [N] (= P)."""
    s, (N, P) = run.s, prompts.shape
    ids = np.full((N, P + s.new_tokens), run.cfg.pad_token_id, np.int32)
    ids[:, :P] = prompts
    lengths = np.zeros(N, np.int32)
    for start in range(0, N, s.gen_batch):
        rows = prompts[start : start + s.gen_batch]
        t0 = time.time()
        res = k26jax.generate(
            model,
            rows.tolist(),
            max_new_tokens=s.new_tokens,
            method="ar",
            temperature=temperature,
            seed=seed + start,
            loop="while",
        )
        for i, toks in enumerate(res.tokens):
            toks = toks[: s.new_tokens]
            ids[start + i, P : P + len(toks)] = toks
            lengths[start + i] = P + len(toks)
        done = start + len(rows)
        print(f"[data] T={temperature}: {done}/{N} prompts, {time.time() - t0:.1f}s this batch", flush=True)
    return {"ids": ids, "lengths": lengths, "supervised_from": np.full(N, P, np.int32)}


def stage_data(run: Run) -> None:
    run.need("quantize")
    t0, s = time.time(), run.s
    params = jax.tree.map(jnp.asarray, run.quant_params())
    model = Model(cfg=run.cfg, params=params, impls=run.impls())
    eos = run.cfg.eos_token_ids[0]
    summary = {}
    for split, n, seed in (("train", s.train_prompts, run.seed + 2), ("heldout", s.heldout_data_prompts, run.seed + 3)):
        tokens = np.load(run.path("tokens", f"{split}.npy"))
        prompts = sample_prompts(tokens, 2 * n, s.prompt_len, eos, seed)
        parts = [
            continuations(run, model, prompts[i * n : (i + 1) * n], t, seed + 10 * i)
            for i, t in enumerate(TEMPERATURES)
        ]
        data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        data["temperature"] = np.repeat(np.array(TEMPERATURES, np.float32), n)
        loop.save_tree(run.path("data", split), data)
        for i, t in enumerate(TEMPERATURES):
            rows = [r[s.prompt_len : L] for r, L in zip(parts[i]["ids"], parts[i]["lengths"])]
            summary[f"{split}_T{t:g}_repetition"] = round(repetition_rate(rows), 4)
        summary[f"{split}_sequences"] = int(len(data["ids"]))
        summary[f"{split}_new_tokens"] = int((data["lengths"] - data["supervised_from"]).sum())
    run.mark_done("data", summary, t0)


def load_data(run: Run, split: str) -> dict:
    """DIR/data/<split>: ids, lengths, supervised_from and temperature of every sequence."""
    n = 2 * (run.s.train_prompts if split == "train" else run.s.heldout_data_prompts)
    T = run.s.prompt_len + run.s.new_tokens
    like = {
        "ids": jax.ShapeDtypeStruct((n, T), jnp.int32),
        "lengths": jax.ShapeDtypeStruct((n,), jnp.int32),
        "supervised_from": jax.ShapeDtypeStruct((n,), jnp.int32),
        "temperature": jax.ShapeDtypeStruct((n,), jnp.float32),
    }
    tree, _ = loop.load_tree(run.path("data", split), like)
    return tree


def _batch(data: dict, idx) -> dict:
    return {k: jnp.asarray(data[k][idx]) for k in ("ids", "lengths", "supervised_from")}


def stage_drafter(run: Run) -> None:
    run.need("data")
    t0, s, dcfg = time.time(), run.s, run.dcfg
    q = run.quant_params()
    frozen = {
        "target": tt.cast(jax.tree.map(jnp.asarray, tt.from_inference(q)), jnp.bfloat16),
        "embed": jnp.asarray(q["embed"]),
        "lm_head": jnp.asarray(q["lm_head"]),
    }
    train, held = load_data(run, "train"), load_data(run, "heldout")
    N = len(train["ids"])
    features = dflash.k26_features(run.cfg, dcfg.target_layer_ids)
    opt = loop.adamw(lr=s.d_lr, total_steps=s.d_max_steps, warmup_frac=0.04, weight_decay=0.0)
    step = dflash.make_train_step(dcfg, opt, features, gamma=s.gamma, num_anchors=s.anchors, seed=run.seed)
    eval_step = dflash.make_eval_step(dcfg, features, gamma=s.gamma, num_anchors=s.anchors)
    held_batches = [
        _batch(held, np.arange(i, min(i + s.d_batch, len(held["ids"])))) for i in range(0, len(held["ids"]), s.d_batch)
    ]
    held_batches = [b for b in held_batches if b["ids"].shape[0] == s.d_batch]

    def batch_fn(i):
        epoch, offset = divmod(i * s.d_batch, N)
        perm = np.random.default_rng([run.seed, epoch]).permutation(N)
        return _batch(train, perm[(offset + np.arange(s.d_batch)) % N])

    ckpt = loop.Checkpointer(run.path("drafter", "state"))
    best = dict(loop.read_meta(ckpt.path(ckpt.latest()))) if ckpt.latest() is not None else {}
    best = {k: best.get(k, v) for k, v in (("best_tau", -1.0), ("best_step", 0), ("evals_since_best", 0))}

    def on_save(i, state):
        ev = dflash.evaluate(eval_step, state[0], frozen, held_batches)
        if ev["tau"] > best["best_tau"] + s.min_delta:
            best.update(best_tau=ev["tau"], best_step=i, evals_since_best=0)
            loop.save_tree(run.path("drafter", "best"), jax.tree.map(lambda a: a.astype(jnp.bfloat16), state[0]))
        else:
            best["evals_since_best"] += 1
        print(f"[drafter] step {i}: held-out tau {ev['tau']:.3f} loss {ev['loss']:.4f} acc {ev['acc']}", flush=True)
        return dict(best, heldout_tau=ev["tau"], heldout_loss=ev["loss"], heldout_acc=ev["acc"])

    dparams = dflash.init_params(dcfg, run.seed)
    _, meta = loop.run(
        name="drafter",
        state=(dparams, opt.init(dparams)),
        step_fn=lambda state, batch, i: step(state, batch, i, frozen),
        batch_fn=batch_fn,
        num_steps=s.d_max_steps,
        ckpt=ckpt,
        save_every=s.d_eval_every,
        tokens_per_step=s.d_batch * s.anchors * dcfg.block_size,
        log_path=run.path("drafter", "log.jsonl"),
        on_save=on_save,
        stop=lambda m: m.get("evals_since_best", 0) >= s.patience,
        max_seconds=run.max_seconds,
    )
    stop_if_cut_short("drafter", meta)
    if os.path.isdir(run.path("drafter", "best")):  # absent when a kill came after this rename
        shutil.rmtree(run.path("drafter", "params"), ignore_errors=True)
        os.rename(run.path("drafter", "best"), run.path("drafter", "params"))
    keys = ("best_tau", "best_step", "heldout_tau", "heldout_loss", "heldout_acc", "time_budget_hit")
    run.mark_done("drafter", dict({k: meta[k] for k in keys}, steps=meta["step"]), t0)
    shutil.rmtree(run.path("drafter", "state"), ignore_errors=True)
