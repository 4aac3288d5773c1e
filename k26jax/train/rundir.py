"""The trained-mini recipe's settings and run directory.

`Settings` are the recipe's sizes and hyperparameters (`FULL` for the GPU run, `SMOKE` for a CPU run in minutes).
`open_run` creates or resumes a run directory: DIR/run.json records the seed and settings, and a resumed run must
match them. `Run` knows the directory's layout: each stage writes DIR/<stage>/ and marks itself done with
DIR/<stage>/DONE.json. A run that cannot go on raises `RecipeError`; a stage stopped by its time budget raises
`CutShort` (not done, its state kept for a resumed run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import ops
from k26jax.train import dflash, loop, mini
from k26jax.train import target as tt


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
    prompt_len: int = 256  # the longest prompt; lengths are uniform in [min_prompt_len, prompt_len]
    min_prompt_len: int = 32
    file_start_frac: float = 0.5  # prompts that are a file's first tokens; the rest are windows inside a file
    new_tokens: int = 128
    train_prompts: int = 65536  # per temperature (the shipped drafter's settings)
    heldout_data_prompts: int = 256  # per temperature, from held-out files (held-out tau)
    gen_batch: int = 4096
    # drafter
    d_batch: int = 64
    anchors: int = 64
    gamma: float = 4.0
    d_lr: float = 6e-4
    d_max_steps: int = 16000
    d_eval_every: int = 400
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
    min_prompt_len=8,
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


class RecipeError(Exception):
    """A run that cannot go on; the message says why and what to do."""


class CutShort(Exception):
    """A stage stopped by its time budget: not done, its state kept for a resumed run."""

    def __init__(self, stage: str, step: int):
        super().__init__(f"[{stage}] stopped by --max-minutes at step {step}: its state is kept; rerun with --resume")


def stop_if_cut_short(stage: str, meta: dict) -> None:
    """Raise CutShort when loop.run's `meta` says the time budget stopped the stage."""
    if meta.get("time_budget_hit"):
        raise CutShort(stage, meta["step"])


@dataclasses.dataclass
class Run:
    dir: str
    seed: int
    s: Settings
    impl: str  # engine kernels for decoding: "auto" or "reference"
    deadline: float  # time.time() past which a stage saves and ends early (one device command is 10 minutes)
    any_python: bool = False  # accept a stdlib that differs from data/'s file list

    @property
    def max_seconds(self) -> float:
        """Seconds left to this invocation: every stage after the first gets what the earlier ones left."""
        return max(self.deadline - time.time(), 0.0)

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
        """The stage's DONE.json summary, or None while it has not finished."""
        path = self.path(stage, "DONE.json")
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)

    def need(self, *stages: str) -> None:
        for stage in stages:
            if self.done(stage) is None:
                raise RecipeError(f"stage {stage!r} has not finished in {self.dir}: run --stages {stage} first")

    def mark_done(self, stage: str, summary: dict, t0: float) -> None:
        summary = dict(
            summary,
            seconds=round(time.time() - t0, 1),
            python_version=platform.python_version(),
            jax_version=jax.__version__,
            device=str(jax.devices()[0].device_kind),
        )
        write_json(self.path(stage, "DONE.json"), summary)
        print(f"[{stage}] done: {json.dumps(summary)}", flush=True)

    def impls(self) -> ops.Impls:
        return ops.Impls() if self.impl == "reference" else ops.Impls.auto()

    def update_record(self, **fields) -> None:
        """Add `fields` to DIR/run.json."""
        with open(self.path("run.json")) as f:
            record = json.load(f)
        write_json(self.path("run.json"), dict(record, **fields))

    # ---- what the stages wrote -----------------------------------------------------------------------------
    def heldout_windows(self, seq_len: int, n: int) -> np.ndarray:
        """Up to n consecutive windows of seq_len tokens from the held-out token array."""
        held = np.load(self.path("tokens", "heldout.npy"))
        count = min(n, len(held) // seq_len)
        return held[: count * seq_len].reshape(count, seq_len).astype(np.int32)

    def target_params(self):
        """The trained bf16 target (training layout)."""
        return _load(self.path("target", "params"), lambda: tt.cast(tt.init_params(self.cfg, 0), jnp.bfloat16))

    def quant_params(self):
        """The INT4 target (model layout)."""
        return _load(self.path("quant", "params"), lambda: tt.to_inference(tt.init_params(self.cfg, 0)))

    def drafter_params(self):
        """The bf16 drafter of the best held-out tau."""

        def like():
            return jax.tree.map(lambda a: a.astype(jnp.bfloat16), dflash.init_params(self.dcfg, 0))

        return _load(self.path("drafter", "params"), like)


def _load(path: str, like_fn):
    tree, _ = loop.load_tree(path, jax.eval_shape(like_fn))
    return tree


def write_json(path: str, obj) -> None:
    """Write obj as JSON atomically (a .tmp file renamed), creating the directory."""
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
            names = ", ".join(k for k in fields if k != "text_overrides")
            raise RecipeError(f"--set {pair}: use key=value with key one of {names}")
        kind = type(default) if default is not None else int
        try:
            changes[key] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
        except ValueError:
            raise RecipeError(f"--set {pair}: {value!r} is not a {kind.__name__}") from None
    return dataclasses.replace(settings, **changes)


def open_run(
    out: str,
    settings: Settings,
    *,
    seed: int,
    smoke: bool,
    resume: bool,
    overwrite: bool,
    impl: str,
    max_minutes: float,
    any_python: bool,
) -> Run:
    """The run in directory `out`: a new one (an empty or absent `out`), the one there (`resume`: its seed and
    settings must match), or a new one in place of ours (`overwrite`: only a directory holding a run.json)."""
    record = {"seed": seed, "smoke": smoke, "settings": dataclasses.asdict(settings)}
    run_json = os.path.join(out, "run.json")
    if os.path.exists(out) and not os.path.isdir(out):
        raise RecipeError(f"--out {out} is a file, not a directory")
    nonempty = os.path.isdir(out) and bool(os.listdir(out))
    if nonempty and overwrite:
        if not os.path.isfile(run_json):
            raise RecipeError(f"--overwrite: {out} holds no run.json (not a train_mini run directory); not deleting it")
        shutil.rmtree(out)
    elif nonempty and not resume:
        raise RecipeError(f"--out {out} exists and is not empty: pass --resume to continue that run, or --overwrite")
    elif nonempty:
        if not os.path.isfile(run_json):
            raise RecipeError(f"--resume: {out} holds no run.json (not a train_mini run directory)")
        with open(run_json) as f:
            saved = json.load(f)
        differs = [k for k in record if saved.get(k) != record[k]]
        if differs:
            raise RecipeError(f"--resume: {out} was started with other {', '.join(differs)} (see its run.json)")
    if not os.path.isfile(run_json):
        record.update(created=time.strftime("%Y-%m-%d %H:%M:%S"), python_version=platform.python_version())
        write_json(run_json, record)
    return Run(out, seed, settings, impl, time.time() + 60 * max_minutes, any_python)
