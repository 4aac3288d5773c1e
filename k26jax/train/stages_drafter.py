"""The recipe's drafter stages: the INT4 target's own continuations as data, then DFlash training on them.

- `data`: continuations of prompts from the training and held-out files, at T=0 and T=1 (engine AR decoding of
  the quantized target, the model the drafter will serve) -> DIR/data/{train,heldout}/T<t>_<j>. Half the prompts
  are a file's first tokens, the shape of the evaluation's prompts.
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
from k26jax.train.rundir import CutShort, Run, stop_if_cut_short

TEMPERATURES = (0.0, 1.0)


def repetition_rate(rows, n: int = 4) -> float:
    """1 - distinct n-grams / n-grams over the continuations (0: no repeated n-gram; near 1: loops)."""
    total = distinct = 0
    for r in rows:
        grams = [tuple(r[i : i + n]) for i in range(len(r) - n + 1)]
        total += len(grams)
        distinct += len(set(grams))
    return 1.0 - distinct / max(total, 1)


def doc_starts(tokens: np.ndarray, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(start [F], length [F]) of every document in an [EOS]-separated token array."""
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1]) if len(ends) else np.zeros(0, np.int64)
    return starts, ends - starts


def sample_prompts(
    tokens: np.ndarray, n: int, *, min_len: int, max_len: int, file_start_frac: float, eos: int, seed: int
):
    """n prompts (int32 arrays) of lengths uniform in [min_len, max_len]: a `file_start_frac` share are a file's
    first tokens (the shape of the evaluation's prompts), the rest windows at random starts inside one file."""
    rng = np.random.default_rng(seed)
    starts, lengths = doc_starts(tokens, eos)
    sizes = rng.integers(min_len, max_len + 1, size=n)
    from_start = rng.random(n) < file_start_frac
    out = []
    for size, first in zip(sizes, from_start):
        docs = np.flatnonzero(lengths > size)
        if len(docs) == 0:
            raise ValueError(f"no file holds more than {size} tokens: lower prompt_len")
        d = rng.choice(docs)
        offset = 0 if first else rng.integers(0, lengths[d] - size)
        out.append(np.asarray(tokens[starts[d] + offset : starts[d] + offset + size], np.int32))
    return out


def continuations(run: Run, model: Model, prompts: list, temperature: float, seed: int) -> dict:
    """The target's own continuations of `prompts` (engine AR, one batch): ids [N, prompt_len + new_tokens]
    (prompt, continuation, then the pad id), lengths [N], supervised_from [N] (each prompt's length)."""
    s, N = run.s, len(prompts)
    ids = np.full((N, s.prompt_len + s.new_tokens), run.cfg.pad_token_id, np.int32)
    lengths, sup = np.zeros(N, np.int32), np.array([len(p) for p in prompts], np.int32)
    res = k26jax.generate(
        model,
        [p.tolist() for p in prompts],
        max_new_tokens=s.new_tokens,
        method="ar",
        temperature=temperature,
        seed=seed,
        loop="while",
    )
    for i, (p, toks) in enumerate(zip(prompts, res.tokens)):
        row = np.concatenate([p, np.asarray(toks[: s.new_tokens], np.int32)])
        ids[i, : len(row)] = row
        lengths[i] = len(row)
    return {"ids": ids, "lengths": lengths, "supervised_from": sup}


def _parts(run: Run, split: str) -> list[tuple[float, int, str]]:
    """(temperature, batch index j, directory DIR/data/<split>/T<t>_<j>) of every part of a split."""
    n = run.s.train_prompts if split == "train" else run.s.heldout_data_prompts
    return [
        (t, j, run.path("data", split, f"T{t:g}_{j:03d}"))
        for t in TEMPERATURES
        for j in range(-(-n // run.s.gen_batch))
    ]


def stage_data(run: Run) -> None:
    """Generate every part DIR/data/<split>/T<t>_<j> not yet written (one gen_batch of prompts each), so a
    killed or time-cut run resumes at the next part; then summarise."""
    run.need("quantize")
    t0, s = time.time(), run.s
    params = jax.tree.map(jnp.asarray, run.quant_params())
    model = Model(cfg=run.cfg, params=params, impls=run.impls())
    eos = run.cfg.eos_token_ids[0]
    done_parts = 0
    for split, n, seed in (("train", s.train_prompts, run.seed + 2), ("heldout", s.heldout_data_prompts, run.seed + 3)):
        tokens = np.load(run.path("tokens", f"{split}.npy"))
        kw = dict(min_len=s.min_prompt_len, max_len=s.prompt_len, file_start_frac=s.file_start_frac, eos=eos)
        prompts = sample_prompts(tokens, 2 * n, seed=seed, **kw)
        for t, j, part in _parts(run, split):
            if os.path.isdir(part):
                continue
            if run.max_seconds <= 0:
                raise CutShort("data", done_parts)
            i = TEMPERATURES.index(t)
            rows = prompts[i * n + j * s.gen_batch : i * n + min((j + 1) * s.gen_batch, n)]
            t1 = time.time()
            data = continuations(run, model, rows, t, seed + 10 * i + 1000 * j)
            os.makedirs(os.path.dirname(part), exist_ok=True)
            loop.save_tree(part, data, meta={"sequences": len(rows)})
            done_parts += 1
            print(f"[data] {split} T={t:g}: {len(rows)} prompts in {time.time() - t1:.1f}s", flush=True)
    summary = {}
    for split in ("train", "heldout"):
        data = load_data(run, split)
        for t in TEMPERATURES:
            sel = data["temperature"] == t
            rows = [r[f:L] for r, f, L in zip(data["ids"][sel], data["supervised_from"][sel], data["lengths"][sel])]
            summary[f"{split}_T{t:g}_repetition"] = round(repetition_rate(rows), 4)
        summary[f"{split}_sequences"] = int(len(data["ids"]))
        summary[f"{split}_new_tokens"] = int((data["lengths"] - data["supervised_from"]).sum())
        summary[f"{split}_prompt_tokens_mean"] = round(float(data["supervised_from"].mean()), 1)
    run.mark_done("data", summary, t0)


def load_data(run: Run, split: str) -> dict:
    """DIR/data/<split>: ids, lengths, supervised_from and temperature of every sequence, over its parts."""
    T = run.s.prompt_len + run.s.new_tokens
    out = []
    for t, _, part in _parts(run, split):
        n = loop.read_meta(part)["sequences"]
        like = {
            "ids": jax.ShapeDtypeStruct((n, T), jnp.int32),
            "lengths": jax.ShapeDtypeStruct((n,), jnp.int32),
            "supervised_from": jax.ShapeDtypeStruct((n,), jnp.int32),
        }
        tree, _ = loop.load_tree(part, like)
        out.append(dict(tree, temperature=np.full(n, t, np.float32)))
    return {k: np.concatenate([t[k] for t in out]) for k in out[0]}


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
