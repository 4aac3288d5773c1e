"""`k26jax.generate`: batched DDTree / chain / AR decoding of prompts through the engine's Decoder."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Callable

import jax
import numpy as np

from k26jax import autobudget, distributed, engine
from k26jax.api import Model

log = logging.getLogger(__name__)

STREAM_FIELDS = ("num_out", "done", "step")


@dataclasses.dataclass
class Result:
    tokens: list[list[int]]  # new tokens only, per prompt
    stats: dict


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _prepare(model: Model, prompts, max_new_tokens: int, sc: engine.StepConfig, max_len: int | None):
    if isinstance(prompts, str):
        prompts = [prompts]
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
    budget: int | str = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    max_len: int | None = None,
    loop: str = "python",
    on_tokens: Callable[[int, list[int]], None] | None = None,
    drafter: engine.Drafter | None = None,
    auto_candidates: tuple | None = None,
) -> Result:
    """Decode a batch of prompts (token-id lists, or strings when the checkpoint has a tokenizer; one string is one
    prompt).

    loop="python" steps from Python and streams new tokens to on_tokens(index, ids); loop="while" runs every
    step inside one lax.while_loop. budget="auto" (DDTree, loop="python"): each step runs chain or DDTree at the
    budget with the most expected tokens a second (k26jax.autobudget); stats["auto"] says what it chose, among
    auto_candidates (default autobudget.CANDIDATES: chain and DDTree at 8..128; fewer compile faster).
    `drafter` replaces the model's DFlash drafter (an `engine.Drafter`, e.g. an oracle in tests).
    Prompt i samples from the PRNG stream fold_in(key(seed), i) (`engine.slot_keys`).
    stats: steps, per-step accept lengths, tau, new tokens, prefill (incl. its compile), step compile and
    decode seconds, and decode tokens/s (the tokens after the prefill's first one, compile excluded).
    """
    dcfg = model.drafter_cfg if method != "ar" else None
    if method != "ar" and dcfg is None and drafter is None:
        raise ValueError(f"method={method!r} needs a drafter: load the model with drafter=DIR")
    if loop not in ("python", "while"):
        raise ValueError(f"loop={loop!r}: use 'python' or 'while'")
    auto = budget == "auto"
    if auto and (method != "ddtree" or loop != "python"):
        raise ValueError(f"budget='auto' needs method='ddtree' and loop='python' (got {method!r}, {loop!r})")
    if auto and jax.process_count() > 1:  # each process would time its own steps and could choose differently
        raise ValueError("budget='auto' is for one process (or the server, where process 0 chooses): use a number")
    if auto_candidates is not None and not auto:
        raise ValueError(f"auto_candidates={auto_candidates}: only for budget='auto'")
    if not auto and (isinstance(budget, bool) or not isinstance(budget, int | np.integer)):
        raise ValueError(f"budget={budget!r}: use a positive integer or 'auto'")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature}, top_p={top_p}: need T >= 0 and 0 < top_p <= 1")
    sc = engine.StepConfig(
        method=method,
        budget=32 if auto else int(budget),
        max_new_tokens=max_new_tokens,
        eos_ids=tuple(model.cfg.eos_token_ids),
        block_size=dcfg.block_size if dcfg is not None else 8,
        sampling=temperature > 0,
    )
    ids, lengths, cache_len = _prepare(model, prompts, max_new_tokens, sc, max_len)
    kw = dict(drafter=drafter or engine.DFlashDraft())
    if auto:
        kw["candidates"] = tuple(auto_candidates or autobudget.CANDIDATES)
    dec = (autobudget.auto_decoder if auto else engine.Decoder)(model.cfg, dcfg, sc, model.impls, **kw)
    dparams = model.drafter_params if dcfg is not None else None
    log.info("prefill of %d prompt(s) of up to %d tokens (compiled on first use of these shapes)", *ids.shape)
    t0 = time.perf_counter()
    state = dec.prefill(
        model.params,
        dparams,
        ids,
        lengths,
        jax.random.key(seed),
        max_len=cache_len,
        temperature=temperature,
        top_p=top_p,
    )
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    log.info("compiling the %s step (first run only: then from the in-memory or persistent cache)", method)
    if auto:
        policy = dec.prepare(model.params, dparams, state, progress=log.info)
        decode, counts_before = dec.step, list(policy.counts)
    else:
        decode = dec.compile("loop" if loop == "while" else "step", model.params, dparams, state)
    t_compiled = time.perf_counter()
    lost = distributed.guard("generate", exit=False) if jax.process_count() > 1 else contextlib.nullcontext()
    with lost:  # several processes: a peer gone mid-decode is a PeerLostError, not a wait for the heartbeat
        state = _decode(decode, model.params, dparams, state, sc, dec if auto else None, on_tokens, loop)
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
        "budget": "auto" if auto else sc.tree_size,
    }
    if auto:
        used = [n - m for n, m in zip(policy.counts, counts_before)]
        stats["auto"] = dec.stats() | {
            "choices": {autobudget.label(c): n for c, n in zip(policy.candidates, used) if n}
        }
    return Result([out[i, : num_out[i]].tolist() for i in range(len(ids))], stats)


def _decode(decode, params, dparams, state, sc, auto, on_tokens, loop: str):
    """One while_loop program, or Python steps (budget="auto": chunks of steps, fed to its policy) that stream
    the tokens each one appended: one small transfer a dispatch."""
    if loop == "while":
        return decode(params, dparams, state)
    was_done, sent = None, np.zeros(state.num_out.shape, np.int64)
    while True:
        fields = {f: getattr(state, f) for f in STREAM_FIELDS + (("out",) if on_tokens else ())}
        host = jax.device_get(fields | (auto.fields(state) if auto else {}))
        num_out, done = host["num_out"], host["done"]
        if auto and was_done is not None:
            auto.observe(host, was_done)
        was_done = done
        if on_tokens is not None:
            for i in np.nonzero(num_out > sent)[0]:
                on_tokens(int(i), host["out"][i, sent[i] : num_out[i]].tolist())
        sent = num_out.astype(np.int64)
        if done.all() or host["step"] >= engine.max_steps(sc):
            return state
        state = decode(params, dparams, state)
