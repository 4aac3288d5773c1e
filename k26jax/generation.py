"""`k26jax.generate`: batched DDTree / chain / AR decoding (the command line is k26jax/generate.py)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from k26jax import engine, ops
from k26jax.api import Model

DEFAULT_CKPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints", "tiny")


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # new tokens only, per prompt
    stats: dict


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.partial(
    jax.jit, static_argnames=("cfg", "dcfg", "sc", "impls", "max_len"), compiler_options=ops.COMPILER_OPTIONS
)
def _prefill(params, dparams, ids, lengths, key, *, cfg, dcfg, sc, impls, max_len):
    return engine.prefill(params, dparams, ids, lengths, key, cfg=cfg, dcfg=dcfg, sc=sc, impls=impls, max_len=max_len)


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "sc", "impls", "propose"), donate_argnames=("state",))
def _step(params, dparams, state, *, cfg, dcfg, sc, impls, propose):
    return engine.step(params, dparams, state, cfg=cfg, dcfg=dcfg, sc=sc, impls=impls, propose=propose)


@functools.partial(jax.jit, static_argnames=("cfg", "dcfg", "sc", "impls", "propose"), donate_argnames=("state",))
def _loop(params, dparams, state, *, cfg, dcfg, sc, impls, propose):
    return engine.decode_loop(params, dparams, state, cfg=cfg, dcfg=dcfg, sc=sc, impls=impls, propose=propose)


def _prepare(model: Model, prompts, max_new_tokens: int, sc: engine.StepConfig, max_len: int | None):
    if not prompts:
        raise ValueError("prompts: need at least one prompt")
    rows = []
    for i, p in enumerate(prompts):
        ids = model.tokenizer.encode(p) if isinstance(p, str) else list(p)
        if not ids:
            raise ValueError(f"prompts[{i}] is empty")
        rows.append(ids)
    longest = max(map(len, rows))
    T = _round_up(longest, 16)
    ids = np.zeros((len(rows), T), np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    ids = model.check_ids(ids, "prompts")
    need = longest + max_new_tokens + sc.depth + 1
    limit = model.cfg.max_position_embeddings if max_len is None else max_len
    if need > limit:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} + draft depth {sc.depth} "
            f"+ 1 needs {need} cache rows, beyond the cache of {limit} "
            f"({'max_len' if max_len is not None else 'max_position_embeddings'})"
        )
    cache_len = max(_round_up(need, 64), T)
    return ids, np.array([len(r) for r in rows], np.int32), cache_len


def generate(
    model: Model,
    prompts,
    *,
    max_new_tokens: int,
    method: str = "ddtree",
    budget: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_len: int | None = None,
    loop: str = "python",
    on_tokens: Callable[[int, list[int]], None] | None = None,
    propose: Callable | None = None,
) -> Result:
    """Decode a batch of prompts (token-id lists, or strings when the checkpoint has a tokenizer).

    loop="python" steps from Python and streams new tokens to on_tokens(index, ids); loop="while" runs every
    step inside one lax.while_loop. `propose` replaces the DFlash drafter (tests, benchmarks).
    stats: steps, per-step accept lengths, tau, new tokens, prefill (incl. its compile), step compile and
    decode seconds, and decode tokens/s (the tokens after the prefill's first one, compile excluded).
    """
    dcfg = model.drafter_cfg if method != "ar" else None
    if method != "ar" and dcfg is None and propose is None:
        raise ValueError(f"method={method!r} needs a drafter: load the model with drafter=DIR")
    if loop not in ("python", "while"):
        raise ValueError(f"loop={loop!r}: use 'python' or 'while'")
    sc = engine.StepConfig(
        method=method,
        budget=budget,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        eos_ids=tuple(model.cfg.eos_token_ids),
        block_size=dcfg.block_size if dcfg is not None else 8,
    )
    ids, lengths, cache_len = _prepare(model, prompts, max_new_tokens, sc, max_len)
    statics = dict(cfg=model.cfg, dcfg=dcfg, sc=sc, impls=model.impls)
    dparams = model.drafter_params if dcfg is not None else None
    t0 = time.perf_counter()
    state = _prefill(model.params, dparams, ids, lengths, jax.random.key(seed), max_len=cache_len, **statics)
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    decode = (
        (_loop if loop == "while" else _step)
        .lower(model.params, dparams, state, propose=propose, **statics)
        .compile(ops.COMPILER_OPTIONS)
    )
    t_compiled = time.perf_counter()
    if loop == "while":
        state = decode(model.params, dparams, state)
    else:
        seen = np.zeros(len(ids), np.int64)
        while True:
            if on_tokens is not None:
                out, num_out = np.asarray(state.out), np.asarray(state.num_out)
                for i in np.nonzero(num_out > seen)[0]:
                    on_tokens(int(i), out[i, seen[i] : num_out[i]].tolist())
                seen = num_out
            if bool(jnp.all(state.done)) or int(state.step) >= engine.max_steps(sc):
                break
            state = decode(model.params, dparams, state)
    out, num_out = np.asarray(state.out), np.asarray(state.num_out)
    t2 = time.perf_counter()
    steps = int(state.step)
    accept = np.asarray(state.accept_lens)[:steps]
    active = accept[accept > 0]
    stats = {
        "steps": steps,
        "accept_lens": accept.tolist(),
        "tau": float(active.mean()) if active.size else 0.0,
        "new_tokens": int(num_out.sum()),
        "prefill_s": t1 - t0,
        "compile_s": t_compiled - t1,
        "decode_s": t2 - t_compiled,
        "tokens_per_s": float((num_out.sum() - len(ids)) / max(t2 - t_compiled, 1e-9)),
        "method": method,
        "budget": sc.tree_size,
    }
    return Result([out[i, : num_out[i]].tolist() for i in range(len(ids))], stats)
