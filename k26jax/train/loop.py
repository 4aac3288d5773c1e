"""The training loop shared by the target and the drafter: AdamW, resumable checkpoints, progress, NaN stops.

- `adamw`: clip by global norm, Adam, decoupled weight decay under a mask (per leaf, or per row: an array mask
  broadcast against the leaf, e.g. to spare the reserved MASK embedding row), a warmup-cosine learning rate, and
  frozen leaves (their updates are zero).
- `Checkpointer`: a pytree (parameters, optimizer state, anything else) saved atomically every N steps into
  `DIR/step_XXXXXXXX/` as raw chunks of at most 16 MiB plus a manifest; written under a `.tmp` name and renamed,
  so a kill -9 leaves either the previous checkpoint or the new one. `latest()` is the last complete one.
- `run`: steps from the last checkpoint to the end, the batch of step s a pure function of s (so a resumed run
  repeats an uninterrupted one), and stops with `NonFiniteLoss` naming the first step whose loss is not finite.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

MAX_FILE_BYTES = 16 << 20
_STEP_DIR = re.compile(r"step_(\d{8})")


class NonFiniteLoss(RuntimeError):
    """A training loss that is NaN or infinite."""


# ---- optimizer -------------------------------------------------------------------------------------------
def _decay_masked(weight_decay: float, mask) -> optax.GradientTransformation:
    """updates + weight_decay * mask * params, mask a pytree of 0/1 scalars or arrays broadcast to the leaf."""

    def update(updates, state, params):
        return jax.tree.map(lambda u, p, m: u + weight_decay * m * p, updates, params, mask), state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def adamw(
    *,
    lr: float,
    total_steps: int,
    warmup_frac: float = 0.04,
    weight_decay: float = 0.0,
    decay_mask=None,
    trainable=None,
    clip: float = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
) -> optax.GradientTransformation:
    """AdamW with a warmup-cosine schedule (dflash_training.md §5). decay_mask / trainable: pytrees like the
    parameters of 0/1 scalars or arrays (None: decay everything / train everything)."""
    warmup = max(1, int(warmup_frac * total_steps))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1))
    parts = [optax.clip_by_global_norm(clip), optax.scale_by_adam(b1=b1, b2=b2)]
    if weight_decay:
        parts.append(
            _decay_masked(weight_decay, decay_mask)
            if decay_mask is not None
            else optax.add_decayed_weights(weight_decay)
        )
    parts.append(optax.scale_by_learning_rate(schedule))
    if trainable is not None:
        parts.append(
            optax.GradientTransformation(
                lambda _: optax.EmptyState(),
                lambda u, s, p=None: (jax.tree.map(lambda a, m: a * m, u, trainable), s),
            )
        )
    return optax.chain(*parts)


# ---- checkpoints -----------------------------------------------------------------------------------------
def _np_dtype(name: str):
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def save_tree(path: str, tree, meta: dict | None = None, max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Write a pytree of arrays into directory `path` (new): chunk_NNNN.bin files of at most max_file_bytes
    holding the leaves' bytes in order, and manifest.json (shapes, dtypes, offsets, `meta`). Atomic: written
    as path + '.tmp', then renamed."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    leaves, treedef = jax.tree.flatten(tree)
    specs, chunk, chunk_bytes, offset = [], None, 0, 0

    def next_chunk():
        nonlocal chunk, chunk_bytes
        if chunk is not None:
            chunk.flush()
            os.fsync(chunk.fileno())
            chunk.close()
        chunk = open(os.path.join(tmp, f"chunk_{len(os.listdir(tmp)):04d}.bin"), "wb")
        chunk_bytes = 0

    next_chunk()
    for leaf in leaves:
        a = np.asarray(leaf)
        a = a if a.flags.c_contiguous else a.copy()
        specs.append({"shape": list(a.shape), "dtype": a.dtype.name, "offset": offset, "nbytes": a.nbytes})
        data = memoryview(a.reshape(-1).view(np.uint8))
        while len(data):
            if chunk_bytes == max_file_bytes:
                next_chunk()
            n = min(len(data), max_file_bytes - chunk_bytes)
            chunk.write(data[:n])
            chunk_bytes += n
            data = data[n:]
        offset += a.nbytes
    next_chunk()  # flushes the last one (and leaves an empty file, removed below)
    chunk.close()
    os.remove(chunk.name)
    manifest = {"treedef": str(treedef), "leaves": specs, "chunk_bytes": max_file_bytes, "meta": meta or {}}
    with open(os.path.join(tmp, "manifest.json"), "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)


def load_tree(path: str, like):
    """(the pytree saved at `path`, restored into the structure of `like`, as numpy arrays; its meta)."""
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    leaves, treedef = jax.tree.flatten(like)
    if str(treedef) != manifest["treedef"] or len(leaves) != len(manifest["leaves"]):
        raise ValueError(f"{path}: saved tree does not match the expected structure")
    blob = bytearray()
    names = sorted(n for n in os.listdir(path) if n.startswith("chunk_"))
    for name in names:
        with open(os.path.join(path, name), "rb") as f:
            blob += f.read()
    out = []
    for spec, leaf in zip(manifest["leaves"], leaves):
        if tuple(spec["shape"]) != tuple(np.shape(leaf)):
            raise ValueError(f"{path}: leaf of shape {spec['shape']} where {np.shape(leaf)} is expected")
        raw = blob[spec["offset"] : spec["offset"] + spec["nbytes"]]
        out.append(np.frombuffer(raw, _np_dtype(spec["dtype"])).reshape(spec["shape"]).copy())
    return jax.tree.unflatten(treedef, out), manifest["meta"]


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)["meta"]


@dataclasses.dataclass
class Checkpointer:
    """Numbered checkpoints in `dir`, the newest `keep` kept."""

    dir: str
    keep: int = 2

    def steps(self) -> list[int]:
        if not os.path.isdir(self.dir):
            return []
        found = (_STEP_DIR.fullmatch(n) for n in os.listdir(self.dir))
        return sorted(
            int(m.group(1)) for m in found if m and os.path.isfile(os.path.join(self.dir, m.group(0), "manifest.json"))
        )

    def latest(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def path(self, step: int) -> str:
        return os.path.join(self.dir, f"step_{step:08d}")

    def save(self, step: int, tree, meta: dict | None = None) -> None:
        os.makedirs(self.dir, exist_ok=True)
        save_tree(self.path(step), tree, dict(meta or {}, step=step))
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)

    def restore(self, like, step: int | None = None):
        step = self.latest() if step is None else step
        return load_tree(self.path(step), like)


# ---- the loop --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Progress:
    """Prints step, loss, tokens/s and ETA every `every` steps (and on the last)."""

    name: str
    total: int
    tokens_per_step: int
    every: int = 10
    log_path: str | None = None

    def __post_init__(self):
        self.t0, self.s0 = time.perf_counter(), None

    def __call__(self, step: int, metrics: dict) -> None:
        if self.s0 is None:
            self.t0, self.s0 = time.perf_counter(), step
            return
        done = step + 1 - self.s0
        dt = time.perf_counter() - self.t0
        rate = done / max(dt, 1e-9)
        row = {"step": step + 1, **{k: _scalar(v) for k, v in metrics.items()}}
        row["tok_s"] = round(rate * self.tokens_per_step)
        row["eta_s"] = round((self.total - step - 1) / max(rate, 1e-9), 1)
        print(f"[{self.name}] " + " ".join(f"{k} {_fmt(v)}" for k, v in row.items()), flush=True)
        if self.log_path:
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
            with open(self.log_path, "a") as f:
                f.write(json.dumps(row) + "\n")


def _scalar(v):
    a = np.asarray(v)
    return float(a) if a.size == 1 else [round(float(x), 4) for x in a.reshape(-1)]


def _fmt(v):
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def check_finite(name: str, first_step: int, losses) -> None:
    """Raise NonFiniteLoss naming the first step (first_step + i) whose loss is NaN or infinite."""
    for i, loss in enumerate(np.asarray(jax.device_get(losses), np.float64)):
        if not math.isfinite(loss):
            raise NonFiniteLoss(f"{name}: loss is {loss} at step {first_step + i}; stopping (no checkpoint written)")


def run(
    *,
    name: str,
    state,
    step_fn: Callable,
    batch_fn: Callable[[int], dict],
    num_steps: int,
    ckpt: Checkpointer,
    save_every: int,
    log_every: int = 10,
    tokens_per_step: int = 0,
    log_path: str | None = None,
    on_save: Callable[[int, object], dict | None] | None = None,
    stop: Callable[[dict], bool] | None = None,
    max_seconds: float | None = None,
):
    """Train `state` (a pytree, e.g. (params, opt_state)) for steps [start, num_steps), start = the last
    checkpoint's step (0 when none).

    step_fn(state, batch, step) -> (state, metrics) with metrics["loss"] a scalar. Losses are checked every
    log_every steps and before every save. on_save(step, state) runs at each save (e.g. an evaluation); what it
    returns is stored in the checkpoint's meta, and `stop(meta)` True ends the run there (early stopping). After
    max_seconds of this call the run saves and ends early with meta["time_budget_hit"] True (a guard for a
    bounded device command; a later call resumes). Returns (state, meta of the last save).
    """
    t_end = None if max_seconds is None else time.perf_counter() + max_seconds
    start, meta = 0, {}
    if ckpt.latest() is not None:
        state, meta = ckpt.restore(state)
        state = jax.tree.map(jnp.asarray, state)
        start = meta["step"]
        print(f"[{name}] resumed from step {start} ({ckpt.path(start)})", flush=True)
        if stop is not None and stop(meta) or start >= num_steps:
            return state, meta
    progress = Progress(name, num_steps, tokens_per_step, log_every, log_path)
    pending, first = [], start
    for step in range(start, num_steps):
        state, metrics = step_fn(state, batch_fn(step), step)
        pending.append(metrics["loss"])
        out_of_time = t_end is not None and time.perf_counter() > t_end
        last, saving = step + 1 == num_steps or out_of_time, (step + 1) % save_every == 0
        if (step + 1) % log_every == 0 or last or saving or step == start:
            check_finite(name, first, jnp.stack(pending))
            pending, first = [], step + 1
            progress(step, metrics)
        if saving or last:
            meta = dict(meta, step=step + 1, **((on_save(step + 1, state) or {}) if on_save else {}))
            meta["time_budget_hit"] = out_of_time
            ckpt.save(step + 1, state, meta)
            if out_of_time:
                print(f"[{name}] time budget of {max_seconds:.0f}s spent: stopping at step {step + 1}", flush=True)
                break
            if stop is not None and stop(meta):
                print(f"[{name}] stopping at step {step + 1}", flush=True)
                break
    return state, meta
