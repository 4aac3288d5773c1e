"""The recipe's last stages: the pair in the K2.6 on-disk format, and its evaluation as users load it.

- `export`: the kimi_k25 wrapper config, compressed-tensors INT4 routed experts, the tiktoken tokenizer and the
  DFlash drafter in drafter/ (k26jax.hf, make_tiny's writer) -> DIR/hf.
- `eval`: DIR/hf loaded with k26jax.load must give the training forward's held-out loss (same INT4 weights);
  then engine tau of chain and DDTree decoding at T=0 and T=1, and the repetition rate -> DIR/eval/DONE.json.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np

import k26jax
from k26jax import hf, ops
from k26jax.train import target as tt
from k26jax.train.rundir import RecipeError, Run
from k26jax.train.stages_drafter import repetition_rate

EXPORT_SHARD_BYTES = 15 << 20
LOSS_MATCH_NATS = 0.01  # loaded checkpoint vs training forward: bf16 noise is ~1e-3


def stage_export(run: Run) -> None:
    run.need("drafter")
    t0, out, V = time.time(), run.path("hf"), run.s.vocab
    q = jax.tree.map(np.asarray, run.quant_params())
    dparams = jax.tree.map(np.asarray, run.drafter_params())
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


def stage_eval(run: Run) -> None:
    run.need("export")
    t0, s = time.time(), run.s
    windows = run.heldout_windows(s.seq_len, s.eval_windows)
    loaded = _loaded_loss(k26jax.load(run.path("hf"), impls=ops.Impls()), windows, s.batch)
    q = run.quant_params()
    train_fwd = tt.eval_loss(tt.from_inference(jax.tree.map(jnp.asarray, q)), run.cfg, windows, s.batch)
    print(f"[eval] held-out loss: loaded checkpoint {loaded:.4f}, training forward {train_fwd:.4f}", flush=True)
    if abs(loaded - train_fwd) > LOSS_MATCH_NATS:
        raise RecipeError(
            f"eval: the loaded checkpoint's held-out loss {loaded:.4f} != the training forward's {train_fwd:.4f}"
        )
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
    """Mean next-token loss of `model` (k26jax.load's, reference kernels) over the held-out windows."""
    total = 0.0
    for start in range(0, len(windows), batch):
        ids = windows[start : start + batch]
        logits = model.logits(ids)
        total += float(jnp.sum(tt.token_losses(logits, jnp.asarray(ids))))
    return total / (len(windows) * (windows.shape[1] - 1))
