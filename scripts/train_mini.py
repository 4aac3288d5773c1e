"""Train k26-mini (the K2.6 architecture, small) and its DFlash drafter on the Python standard library's source.

    python scripts/train_mini.py --out DIR [--stages all | tokenizer,target,...] [--resume | --overwrite]
                                 [--smoke] [--seed 0] [--set KEY=VALUE ...] [--impl auto|reference]
                                 [--max-minutes 8] [--any-python]

Stages, in order; each is resumable, marked done by DIR/<stage>/DONE.json, and fits one device command:
  tokenizer  (CPU) byte-level BPE of 4096 ids and the corpus token arrays      -> DIR/tokenizer, DIR/tokens
  target     next-token training; checkpoints every N steps, resumes after kill -9 -> DIR/target/params (bf16)
  quantize   held-out loss before / after INT4; quantization-aware steps if INT4 costs > 0.05 nats
                                                                                -> DIR/quant/params (model layout)
  data       the INT4 target's own continuations of training-file prompts, T=0 and T=1 (engine AR) -> DIR/data
  drafter    DFlash (block 8, gamma 4) on that data until held-out tau stops rising -> DIR/drafter/params
  export     the checkpoint in the K2.6 on-disk format (k26jax.hf, make_tiny's writer) -> DIR/hf
  eval       DIR/hf loaded with k26jax.load: its held-out loss must equal the training forward's (same INT4
             weights); engine tau (chain and DDTree, T=0 and T=1), repetition rate -> DIR/eval/DONE.json
An existing non-empty DIR is refused unless --resume (continue it; its settings must match) or --overwrite.
DIR/run.json records the seed, the settings, the Python version and the corpus file list's hash. Files written
are at most 16 MiB. --smoke shrinks every stage so the whole recipe runs on a CPU in minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from k26jax.train import dflash, loop, mini  # noqa: E402
from k26jax.train import target as tt  # noqa: E402

STAGES = ("tokenizer", "target", "quantize", "data", "drafter", "export", "eval")
MAX_FILE_BYTES = 16 << 20
EXPORT_SHARD_BYTES = 15 << 20
LOSS_MATCH_NATS = 0.01  # loaded checkpoint vs training forward: bf16 noise is ~1e-3


@dataclasses.dataclass(frozen=True)
class Settings:
    vocab: int = 4096
    text_overrides: dict = dataclasses.field(default_factory=dict)
    drafter_intermediate: int = 768
    files_limit: int | None = None  # first N corpus files (smoke)
    # target
    seq_len: int = 512
    batch: int = 64
    target_steps: int = 800
    lr: float = 2e-3
    weight_decay: float = 0.1
    warmup_frac: float = 0.05
    bias_rate: float = 1e-3
    save_every: int = 200
    eval_windows: int = 512
    # quantize
    qat_threshold: float = 0.05
    qat_steps: int = 200
    qat_lr: float = 2e-4
    force_qat: bool = False
    # data
    prompt_len: int = 64
    new_tokens: int = 192
    train_prompts: int = 4096  # per temperature
    heldout_data_prompts: int = 256  # per temperature, from held-out files (held-out tau)
    gen_batch: int = 4096
    # drafter
    d_batch: int = 64
    anchors: int = 64
    gamma: float = 4.0
    d_lr: float = 6e-4
    d_max_steps: int = 2400
    d_eval_every: int = 200
    patience: int = 3
    min_delta: float = 0.01
    # eval
    eval_prompts: int = 64
    eval_prompt_len: int = 128
    eval_new_tokens: int = 128
    budget: int = 32


FULL = Settings()
SMOKE = Settings(
    files_limit=60,
    seq_len=64,
    batch=8,
    target_steps=16,
    save_every=8,
    eval_windows=16,
    qat_steps=2,
    force_qat=True,
    prompt_len=16,
    new_tokens=24,
    train_prompts=16,
    heldout_data_prompts=16,  # = train_prompts: the held-out generation reuses the compiled programs
    gen_batch=16,
    d_batch=8,
    anchors=8,
    d_max_steps=16,
    d_eval_every=8,
    patience=2,
    eval_prompts=4,
    eval_prompt_len=16,
    eval_new_tokens=16,
    budget=8,
)


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


CUT_SHORT = 3  # exit code: a stage stopped by --max-minutes; its state is kept for --resume


def stop_if_cut_short(stage: str, meta: dict) -> None:
    """A stage that --max-minutes stopped is not done: keep its state, mark nothing, and stop the run."""
    if meta.get("time_budget_hit"):
        print(
            f"[{stage}] stopped by --max-minutes at step {meta['step']}: its state is kept; rerun with --resume",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(CUT_SHORT)


# ---- the run directory -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    dir: str
    seed: int
    s: Settings
    impl: str
    max_seconds: float  # a training stage saves and ends early past this (one device command is 10 minutes)

    def path(self, *parts) -> str:
        return os.path.join(self.dir, *parts)

    @property
    def text(self) -> dict:
        return mini.text_config(dict(self.s.text_overrides, vocab_size=self.s.vocab))

    @property
    def cfg(self):
        return mini.model_config(self.text)

    @property
    def dcfg(self):
        return mini.drafter_config(self.text, intermediate_size=self.s.drafter_intermediate)

    def done(self, stage: str) -> dict | None:
        path = self.path(stage, "DONE.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def need(self, *stages: str) -> None:
        for stage in stages:
            if self.done(stage) is None:
                die(f"stage {stage!r} has not finished in {self.dir}: run --stages {stage} first")

    def mark_done(self, stage: str, summary: dict, t0: float) -> None:
        summary = dict(
            summary,
            seconds=round(time.time() - t0, 1),
            python_version=platform.python_version(),
            jax_version=jax.__version__,
            device=str(jax.devices()[0].device_kind),
        )
        _write_json(self.path(stage, "DONE.json"), summary)
        print(f"[{stage}] done: {json.dumps(summary)}", flush=True)

    def impls(self):
        from k26jax import ops

        return ops.Impls() if self.impl == "reference" else ops.Impls.auto()


def _write_json(path: str, obj) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(path + ".tmp", path)


def override(settings: Settings, pairs: list[str]) -> Settings:
    """Settings with `--set key=value` changes, each value parsed as its field's type."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    changes = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        default = getattr(settings, key, None) if key in fields else None
        if key not in fields or isinstance(default, dict) or not value:
            die(f"--set {pair}: use key=value with key one of {', '.join(k for k in fields if k != 'text_overrides')}")
        kind = type(default) if default is not None else int
        try:
            changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        except ValueError:
            die(f"--set {pair}: {value!r} is not a {kind.__name__}")
    return dataclasses.replace(settings, **changes)


def open_run(args) -> Run:
    settings = override(SMOKE if args.smoke else FULL, args.set)
    record = {"seed": args.seed, "smoke": args.smoke, "settings": dataclasses.asdict(settings)}
    run_json = os.path.join(args.out, "run.json")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        die(f"--out {args.out} is a file, not a directory")
    nonempty = os.path.isdir(args.out) and bool(os.listdir(args.out))
    if nonempty and args.overwrite:
        if not os.path.isfile(run_json):
            die(f"--overwrite: {args.out} holds no run.json (not a train_mini run directory); not deleting it")
        shutil.rmtree(args.out)
    elif nonempty and not args.resume:
        die(f"--out {args.out} exists and is not empty: pass --resume to continue that run, or --overwrite")
    elif nonempty:
        if not os.path.isfile(run_json):
            die(f"--resume: {args.out} holds no run.json (not a train_mini run directory)")
        with open(run_json) as f:
            saved = json.load(f)
        differs = [k for k in record if saved.get(k) != record[k]]
        if differs:
            die(f"--resume: {args.out} was started with other {', '.join(differs)} (see its run.json)")
    if not os.path.isfile(run_json):
        record.update(created=time.strftime("%Y-%m-%d %H:%M:%S"), python_version=platform.python_version())
        _write_json(run_json, record)
    return Run(args.out, args.seed, settings, args.impl, 60 * args.max_minutes)


def _update_run_json(run: Run, **fields) -> None:
    with open(run.path("run.json")) as f:
        record = json.load(f)
    _write_json(run.path("run.json"), dict(record, **fields))


# ---- data helpers ----------------------------------------------------------------------------------------
def heldout_windows(run: Run, seq_len: int, n: int) -> np.ndarray:
    held = np.load(run.path("tokens", "heldout.npy"))
    count = min(n, len(held) // seq_len)
    return held[: count * seq_len].reshape(count, seq_len).astype(np.int32)


class StepBatches:
    """batch_fn(step) over corpus.batches' stream, which depends on the seed alone: a resumed run skips the
    batches of the steps it already took, so it sees what an uninterrupted run would."""

    def __init__(self, tokens, seq_len: int, batch: int, seed: int):
        from k26jax.train import corpus

        self.it, self.next = corpus.batches(tokens, seq_len, batch, seed), 0

    def __call__(self, step: int) -> dict:
        while self.next < step:
            next(self.it)
            self.next += 1
        ids = next(self.it)
        self.next += 1
        return {"ids": jnp.asarray(ids), "mask": jnp.ones(ids.shape, bool)}


def load_params(path: str, like_fn):
    like = jax.eval_shape(like_fn)
    tree, _ = loop.load_tree(path, like)
    return tree


def target_like(run: Run):
    return lambda: tt.cast(tt.init_params(run.cfg, 0), jnp.bfloat16)


def quant_like(run: Run):
    return lambda: tt.to_inference(tt.init_params(run.cfg, 0))


# ---- stages ----------------------------------------------------------------------------------------------
def stage_tokenizer(run: Run, args) -> None:
    from k26jax import hf
    from k26jax.tokenizer import Tokenizer
    from k26jax.train import bpe, corpus

    t0 = time.time()
    files = corpus.corpus_files(None, args.any_python)
    manifest = corpus.corpus_manifest(files=files)
    if run.s.files_limit:
        files = files[: run.s.files_limit]
    train_files, _ = corpus.split_files(files)
    print(f"[tokenizer] {len(files)} files ({len(train_files)} train); BPE of {run.s.vocab} ids ...", flush=True)
    ranks = bpe.train_bpe(corpus.read_texts(train_files), run.s.vocab)
    hf.write_tokenizer(run.path("tokenizer"), ranks)
    if bpe.mask_token_id(run.s.vocab) != run.dcfg.mask_token_id:
        die(f"the tokenizer's MASK id {bpe.mask_token_id(run.s.vocab)} != the drafter's {run.dcfg.mask_token_id}")
    tokens = corpus.write_token_arrays(Tokenizer(run.path("tokenizer")), run.path("tokens"), files)
    corpus_record = {
        "python_version": manifest["python_version"],
        "file_list_sha256": manifest["file_list_sha256"],
        "num_files": manifest["num_files"],
        "files_used": len(files),
        "used_file_list_sha256": corpus.file_list_hash(files),
    }
    _update_run_json(run, corpus=corpus_record)
    keys = ("train_tokens", "heldout_tokens", "heldout_prompts")
    run.mark_done("tokenizer", dict(corpus_record, **{k: tokens[k] for k in keys}), t0)


def stage_target(run: Run, args) -> None:
    run.need("tokenizer")
    t0, s, cfg = time.time(), run.s, run.cfg
    train = np.load(run.path("tokens", "train.npy"))
    windows = heldout_windows(run, s.seq_len, s.eval_windows)
    params = tt.init_params(cfg, run.seed)
    opt = loop.adamw(
        lr=s.lr,
        total_steps=s.target_steps,
        warmup_frac=s.warmup_frac,
        weight_decay=s.weight_decay,
        decay_mask=tt.decay_mask(params, (run.dcfg.mask_token_id,)),
        trainable=tt.trainable_mask(params),
    )
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


def stage_quantize(run: Run, args) -> None:
    run.need("target")
    t0, s, cfg = time.time(), run.s, run.cfg
    windows = heldout_windows(run, s.seq_len, s.eval_windows)
    params = jax.tree.map(
        lambda a: jnp.asarray(a, jnp.float32), load_params(run.path("target", "params"), target_like(run))
    )
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
    opt = loop.adamw(
        lr=s.qat_lr,
        total_steps=s.qat_steps,
        warmup_frac=s.warmup_frac,
        weight_decay=s.weight_decay,
        decay_mask=tt.decay_mask(params, (run.dcfg.mask_token_id,)),
        trainable=tt.trainable_mask(params),
    )
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


def _model(run: Run, qparams, drafter=None):
    from k26jax.api import Model

    dcfg, dparams = (run.dcfg, drafter) if drafter is not None else (None, None)
    params = jax.tree.map(jnp.asarray, qparams)
    return Model(cfg=run.cfg, params=params, impls=run.impls(), drafter_cfg=dcfg, drafter_params=dparams)


def continuations(run: Run, model, prompts: np.ndarray, temperature: float, seed: int) -> dict:
    """The target's own continuations of `prompts` (engine AR, batches of gen_batch): ids [N, P+new] (padded
    with the pad id), lengths [N], supervised_from [N] (= P)."""
    import k26jax

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


def stage_data(run: Run, args) -> None:
    run.need("quantize")
    t0, s = time.time(), run.s
    model = _model(run, load_params(run.path("quant", "params"), quant_like(run)))
    eos = run.cfg.eos_token_ids[0]
    summary = {}
    for split, n, seed in (("train", s.train_prompts, run.seed + 2), ("heldout", s.heldout_data_prompts, run.seed + 3)):
        tokens = np.load(run.path("tokens", f"{split}.npy"))
        prompts = sample_prompts(tokens, 2 * n, s.prompt_len, eos, seed)
        parts = [
            continuations(run, model, prompts[i * n : (i + 1) * n], t, seed + 10 * i) for i, t in enumerate((0.0, 1.0))
        ]
        data = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        data["temperature"] = np.repeat(np.array([0.0, 1.0], np.float32), n)
        loop.save_tree(run.path("data", split), data)
        for i, t in enumerate((0.0, 1.0)):
            rows = [r[s.prompt_len : L] for r, L in zip(parts[i]["ids"], parts[i]["lengths"])]
            summary[f"{split}_T{t:g}_repetition"] = round(repetition_rate(rows), 4)
        summary[f"{split}_sequences"] = int(len(data["ids"]))
        summary[f"{split}_new_tokens"] = int((data["lengths"] - data["supervised_from"]).sum())
    run.mark_done("data", summary, t0)


def data_like(n: int, T: int):
    return {
        "ids": jax.ShapeDtypeStruct((n, T), jnp.int32),
        "lengths": jax.ShapeDtypeStruct((n,), jnp.int32),
        "supervised_from": jax.ShapeDtypeStruct((n,), jnp.int32),
        "temperature": jax.ShapeDtypeStruct((n,), jnp.float32),
    }


def load_data(run: Run, split: str) -> dict:
    n = 2 * (run.s.train_prompts if split == "train" else run.s.heldout_data_prompts)
    tree, _ = loop.load_tree(run.path("data", split), data_like(n, run.s.prompt_len + run.s.new_tokens))
    return tree


def _batch(data: dict, idx) -> dict:
    return {k: jnp.asarray(data[k][idx]) for k in ("ids", "lengths", "supervised_from")}


def stage_drafter(run: Run, args) -> None:
    run.need("data")
    t0, s, dcfg = time.time(), run.s, run.dcfg
    q = load_params(run.path("quant", "params"), quant_like(run))
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


def drafter_like(run: Run):
    return lambda: jax.tree.map(lambda a: a.astype(jnp.bfloat16), dflash.init_params(run.dcfg, 0))


def stage_export(run: Run, args) -> None:
    """The checkpoint in the K2.6 on-disk format: the kimi_k25 wrapper config, compressed-tensors INT4 routed
    experts, the tiktoken tokenizer, the DFlash drafter in drafter/ (k26jax.hf, make_tiny's writer)."""
    from k26jax import hf

    run.need("drafter")
    t0, out, V = time.time(), run.path("hf"), run.s.vocab
    q = jax.tree.map(np.asarray, load_params(run.path("quant", "params"), quant_like(run)))
    dparams = jax.tree.map(np.asarray, load_params(run.path("drafter", "params"), drafter_like(run)))
    shutil.rmtree(out, ignore_errors=True)
    hf.write_target(
        out,
        run.text,
        q,
        shard_bytes=EXPORT_SHARD_BYTES,
        generation_config={"bos_token_id": V - 256, "eos_token_id": V - 255, "pad_token_id": V - 1, "do_sample": False},
        extra_tensors=hf.vision_tensors(run.text["hidden_size"], seed=run.seed),
    )
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(run.path("tokenizer", name), os.path.join(out, name))
    hf.write_drafter(os.path.join(out, "drafter"), run.dcfg, dparams, dtype="bfloat16")
    sizes = {
        os.path.relpath(os.path.join(d, f), out): os.path.getsize(os.path.join(d, f))
        for d, _, fs in os.walk(out)
        for f in fs
    }
    run.mark_done("export", {"total_bytes": sum(sizes.values()), "files": sizes}, t0)


def stage_eval(run: Run, args) -> None:
    """On the exported checkpoint, loaded as users load it: its held-out loss (reference kernels) must equal the
    training forward's with the same INT4 weights; then tau of chain and DDTree decoding at T=0 and T=1."""
    import k26jax
    from k26jax import ops

    run.need("export")
    t0, s = time.time(), run.s
    windows = heldout_windows(run, s.seq_len, s.eval_windows)
    loaded = _loaded_loss(k26jax.load(run.path("hf"), impls=ops.Impls()), windows, s.batch)
    q = load_params(run.path("quant", "params"), quant_like(run))
    train_fwd = tt.eval_loss(tt.from_inference(jax.tree.map(jnp.asarray, q)), run.cfg, windows, s.batch)
    print(f"[eval] held-out loss: loaded checkpoint {loaded:.4f}, training forward {train_fwd:.4f}", flush=True)
    if abs(loaded - train_fwd) > LOSS_MATCH_NATS:
        die(f"eval: the loaded checkpoint's held-out loss {loaded:.4f} != the training forward's {train_fwd:.4f}")
    out = {
        "heldout_loss_loaded": loaded,
        "heldout_loss_training_forward": train_fwd,
        "heldout_loss_bf16_before_int4": run.done("quantize")["heldout_loss_bf16"],
        "teacher_forced_tau": run.done("drafter")["best_tau"],
    }
    model = k26jax.load(run.path("hf"), impls=run.impls())
    prompts = np.load(run.path("tokens", "heldout_prompts.npy"))[: s.eval_prompts, : s.eval_prompt_len].tolist()
    greedy, chain = {}, run.dcfg.block_size - 1
    for method, budget, temperatures in (
        ("ar", 1, (0.0,)),
        ("chain", chain, (0.0, 1.0)),
        ("ddtree", s.budget, (0.0, 1.0)),
    ):
        for t in temperatures:
            res = k26jax.generate(
                model,
                prompts,
                max_new_tokens=s.eval_new_tokens,
                method=method,
                budget=budget,
                temperature=t,
                seed=run.seed,
                loop="while",
            )
            if t == 0.0:
                greedy[method] = res.tokens
            row = {
                "tau": res.stats["tau"],
                "tokens_per_s": res.stats["tokens_per_s"],
                "repetition": repetition_rate(res.tokens),
            }
            out[f"{method}_T{t:g}"] = row
            print(f"[eval] {method} T={t:g}: {row}", flush=True)
    out["greedy_equals_ar"] = {m: greedy[m] == greedy["ar"] for m in ("chain", "ddtree")}
    run.mark_done("eval", out, t0)


def _loaded_loss(model, windows: np.ndarray, batch: int) -> float:
    total = 0.0
    for start in range(0, len(windows), batch):
        ids = windows[start : start + batch]
        logits = model.logits(ids)
        total += float(jnp.sum(tt.token_losses(logits, jnp.asarray(ids))))
    return total / (len(windows) * (windows.shape[1] - 1))


RUNNERS = {
    "tokenizer": stage_tokenizer,
    "target": stage_target,
    "quantize": stage_quantize,
    "data": stage_data,
    "drafter": stage_drafter,
    "export": stage_export,
    "eval": stage_eval,
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the run directory")
    parser.add_argument("--stages", default="all", help=f"'all' or a comma list of {', '.join(STAGES)}")
    parser.add_argument("--resume", action="store_true", help="continue the run in an existing --out")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing --out and start over")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and steps: the whole recipe on a CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change one setting")
    parser.add_argument("--impl", choices=("auto", "reference"), default="auto", help="engine kernels for decoding")
    parser.add_argument(
        "--max-minutes", type=float, default=8.0, help="a training stage saves and stops after this long (default 8)"
    )
    parser.add_argument("--any-python", action="store_true", help="accept a stdlib that differs from data/'s list")
    args = parser.parse_args(argv)
    stages = STAGES if args.stages == "all" else tuple(x.strip() for x in args.stages.split(","))
    unknown = [x for x in stages if x not in STAGES]
    if unknown:
        die(f"--stages: unknown stage(s) {unknown}; use {', '.join(STAGES)}")
    if args.resume and args.overwrite:
        die("--resume and --overwrite exclude each other")
    run = open_run(args)
    for stage in STAGES:
        if stage not in stages:
            continue
        if run.done(stage) is not None:
            print(f"[{stage}] already done ({run.path(stage, 'DONE.json')})", flush=True)
            continue
        print(f"[{stage}] starting", flush=True)
        try:
            RUNNERS[stage](run, args)
        except loop.NonFiniteLoss as e:
            die(str(e))
        too_big = [
            os.path.join(d, f)
            for d, _, fs in os.walk(run.dir)
            for f in fs
            if os.path.getsize(os.path.join(d, f)) > MAX_FILE_BYTES
        ]
        if too_big:
            die(f"[{stage}] wrote files over 16 MiB: {too_big}")


if __name__ == "__main__":
    # compiled programs persist across stages and resumed runs (the data and eval stages compile the engine)
    jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "k26jax_train_mini_cache"))
    main()
