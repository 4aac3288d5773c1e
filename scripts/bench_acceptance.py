"""Acceptance of the k26-mini pair: tau, per-depth acceptance, repetition and greedy agreement on held-out prompts.

Prompts: the first --prompt-tokens ids of the first --prompts held-out corpus files that have that many
(`k26jax.train.corpus.heldout_prompts`; the record says how many qualify), decoded in batches of --batch.
--prompts-from RUN takes them from a train_mini run's tokenizer stage instead (RUN/tokens: made where the stdlib is
the committed list's), for a machine whose Python has another stdlib (the GPU machine).
For each temperature: AR (tau 1 by construction, the baseline), chain (depth block-1), DDTree at each budget, and
budget="auto" (k26jax.autobudget: each step's candidate chosen by expected tokens a second; --no-auto drops it).
Per run it records, from `Result.stats["accept_lens"]` (tokens emitted per target pass, active steps only):
  tau                     mean accept length over all steps of all prompts (= generate's own tau)
  accept_hist             steps with accept length 1 .. depth+1
  depth_accept[d-1]       P(accept length >= d+1): the draft token at depth d was accepted, d = 1 .. depth
  depth_conditional[d-1]  P(accept length >= d+1 | accept length >= d)
  distinct4               per prompt, distinct 4-grams / 4-grams of its continuation (loops inflate tau);
                          "nonlooping" repeats the statistics over prompts whose ratio is >= --loop-threshold
  target                  AR rows: the target's mean top-1 probability and entropy at its continuations
  greedy_vs_ar            at T = 0: prompts whose tokens equal AR's exactly, each one's first divergence and
                          the target's float32 top-1/top-2 logit margin there (a near-tie, or a real mismatch)
--speed (GPU): tokens/s of AR, chain and DDTree (--speed-budgets) at --concurrency C = 1, 4, 8 with the real
acceptance, at T = 0: a decode is the first max(C, --speed-prompts) held-out prompts in batches of C (one prompt's
tau is noise); medians over --repeats decodes after a warm-up (compile excluded; decode only, the prefill's seconds
recorded beside), step time = decode seconds / steps, speed-up over AR measured in the same run.
The fixed methods decode in one lax.while_loop; auto needs the host between steps, so it runs the Python loop
(each row says which): auto over the best fixed budget is its end-to-end gain with its host cost included.
Both parts live in one JSON file (--out) as the sections "acceptance" and "speed"; a run replaces its own section.
Results are written after every configuration; --resume continues a section whose settings match.

CPU smoke:  python scripts/bench_acceptance.py --ckpt /work/mini_smoke/hf --prompts 4 --new-tokens 16 \\
                --budgets 4 32 --batch 4 --out /tmp/acc.json
GPU:        python scripts/bench_acceptance.py --deadline-min 8 [--resume]      then      ... --speed --resume
Print the markdown of a record:  python scripts/bench_acceptance.py --print [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import harness
import jax
import numpy as np

import k26jax
from k26jax.train import corpus

DEFAULT_CKPT = "checkpoints/mini"
DEFAULT_OUT = "bench/results/acceptance_mini.json"
BUDGETS = (2, 4, 8, 16, 32, 64, 128, 256)
NGRAM = 4
SUMMED = ("decode_s", "prefill_s", "compile_s", "steps", "new_tokens")  # decode's stats summed over its batches
START = time.time()  # --deadline-min counts from here


# ---- statistics --------------------------------------------------------------------------------------------
def distinct_ngram_ratio(tokens, n: int = NGRAM) -> float:
    """Distinct n-grams / n-grams of one continuation (1.0: nothing repeats; near 0: a loop); 1.0 when shorter
    than n."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def first_divergence(a, b) -> int | None:
    """The first index where two token lists differ (a shorter list differs at its end); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def accept_summary(lens, depth: int) -> dict:
    """tau, the accept-length histogram and the per-depth rates of a list of accept lengths (1 .. depth+1)."""
    lens = np.asarray(lens, np.int64)
    hist = np.bincount(lens, minlength=depth + 2)[1 : depth + 2] if lens.size else np.zeros(depth + 1, np.int64)
    at_least = np.array([(lens >= k).sum() for k in range(1, depth + 2)], np.float64)  # k = d + 1, d = 0..depth
    return {
        "tau": float(lens.mean()) if lens.size else 0.0,
        "steps": int(lens.size),
        "accept_hist": hist.tolist(),
        "depth_accept": (at_least[1:] / max(lens.size, 1)).round(4).tolist(),
        "depth_conditional": [round(float(a / b), 4) if b else None for a, b in zip(at_least[1:], at_least[:-1])],
    }


# ---- decoding ----------------------------------------------------------------------------------------------
def depth_of(model, method: str) -> int:
    return 0 if method == "ar" else model.drafter_cfg.block_size - 1


def decode(model, prompts: np.ndarray, *, method, budget, temperature, new_tokens, batch, seed, loop=None):
    """(tokens per prompt, active accept lengths per prompt, stats) of `generate` over `prompts` in batches of
    `batch` (the last one padded by repeating its last prompt, so one program serves all; a batch starting at
    prompt s uses seed + s). stats: the last batch's, with seconds, steps and tokens summed over the batches."""
    tokens, lens, stats, total = [], [], {}, dict.fromkeys(SUMMED, 0)
    kw = {} if loop is None else {"loop": loop}
    for start in range(0, len(prompts), batch):
        rows = prompts[start : start + batch].tolist()
        real = len(rows)
        rows += [rows[-1]] * (batch - real)
        res = k26jax.generate(
            model,
            rows,
            max_new_tokens=new_tokens,
            method=method,
            budget=budget,
            temperature=temperature,
            seed=seed + start,
            **kw,
        )
        acc = np.asarray(res.stats["accept_lens"], np.int64).reshape(-1, batch)
        tokens += res.tokens[:real]
        lens += [acc[:, c][acc[:, c] > 0].tolist() for c in range(real)]
        stats = res.stats
        total = {k: total[k] + stats[k] for k in SUMMED}
    return tokens, lens, stats | total | {"tokens_per_s": total["new_tokens"] / max(total["decode_s"], 1e-9)}


def run_specs(budgets, temperatures, chain_budget: int, auto: bool = True):
    """(method, budget, temperature) in run order: per temperature AR first (the greedy check needs it); budget
    "auto" last."""
    fixed = [("ar", 0), ("chain", chain_budget)] + [("ddtree", b) for b in budgets]
    return [(m, b, t) for t in temperatures for m, b in fixed + ([("ddtree", "auto")] if auto else [])]


def budget_arg(budget):
    """generate's budget for a row's: "auto" as is, AR's 0 as 1 (unused)."""
    return budget if budget == "auto" else max(budget, 1)


def measure_run(model, prompts, spec, args, ar_greedy) -> tuple[dict, list]:
    method, budget, temperature = spec
    t0 = time.time()
    tokens, lens, stats = decode(
        model,
        prompts,
        method=method,
        budget=budget_arg(budget),
        temperature=temperature,
        new_tokens=args.new_tokens,
        batch=args.batch,
        seed=args.seed,
    )
    depth = depth_of(model, method)
    ratios = [round(distinct_ngram_ratio(t), 4) for t in tokens]
    keep = [i for i, r in enumerate(ratios) if r >= args.loop_threshold]
    row = {"method": method, "budget": budget, "temperature": temperature}
    row.update(accept_summary([x for seq in lens for x in seq], depth))
    row["nonlooping"] = dict(prompts=len(keep), **accept_summary([x for i in keep for x in lens[i]], depth))
    row.update(
        new_tokens=sum(map(len, tokens)),
        distinct4=ratios,
        distinct4_mean=round(float(np.mean(ratios)), 4),
        looping_prompts=[i for i, r in enumerate(ratios) if r < args.loop_threshold],
    )
    if temperature == 0 and method != "ar" and ar_greedy is not None:
        div = [first_divergence(a, b) for a, b in zip(tokens, ar_greedy)]
        margins = [
            None if d is None or d >= len(ar) else ar_margin(model, p, ar, d)
            for p, ar, d in zip(prompts, ar_greedy, div)
        ]
        row["greedy_vs_ar"] = {
            "equal": sum(d is None for d in div),
            "prompts": len(div),
            "first_divergence": div,
            "ar_margin_at_divergence": margins,
        }
    if method == "ar":
        row["target"] = target_confidence(model, prompts, tokens, keep)
    if budget == "auto":
        row["auto"] = stats["auto"]  # the last batch's choices, measured step times and calibration
    row["seconds"] = round(time.time() - t0, 1)
    return row, tokens


def target_confidence(model, prompts, tokens, keep) -> dict:
    """The target's mean top-1 probability and entropy (nats) at the positions of its own continuations, over all
    prompts and the non-looping ones: how predictable the text a drafter must guess is."""
    per = []
    for p, t in zip(prompts, tokens):
        logits = np.asarray(model.logits(np.array([list(p) + list(t)])))[0, len(p) - 1 : -1].astype(np.float64)
        logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
        per.append((np.exp(logp.max(-1)), -(np.exp(logp) * logp).sum(-1)))
    pick = lambda idx: {
        "top1_prob": round(float(np.concatenate([per[i][0] for i in idx]).mean()), 4) if idx else None,
        "entropy": round(float(np.concatenate([per[i][1] for i in idx]).mean()), 4) if idx else None,
    }
    return dict(pick(list(range(len(per)))), nonlooping=pick(keep))


@functools.cache
def float32_model(path: str):
    return k26jax.load(path, dtype="float32")


def ar_margin(model, prompt, ar_tokens, i: int) -> float:
    """The target's top-1 minus top-2 logit in float32 (the model reloaded so: a bf16 forward's own rounding
    would blur the margin) where AR emitted its token i. A near-tie explains a greedy divergence: bf16 verify and
    AR may round the two apart."""
    exact = float32_model(model.path) if model.dtype != np.float32 else model
    logits = np.asarray(exact.logits(np.array([list(prompt) + list(ar_tokens)])))[0, len(prompt) - 1 + i]
    top2 = np.sort(logits)[-2:]
    return float(top2[1] - top2[0])


def label(method: str, budget: int, temperature: float) -> str:
    return f"{method}{'' if method == 'ar' else f' B={budget}'} T={temperature:g}"


# ---- the record ----------------------------------------------------------------------------------------------
def sha256_file(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def load_prompts(model, args) -> tuple[np.ndarray, dict]:
    if args.prompts_from:
        allq, names, source = run_prompts(model, args)
    else:
        files = corpus.corpus_files(None, args.any_python)
        held = corpus.split_files(files)[1]
        allq, names = corpus.heldout_prompts(
            model.tokenizer, n=len(held), prompt_tokens=args.prompt_tokens, files=files
        )
        source = {
            "heldout_files": len(held),
            "python_version": platform.python_version(),
            "corpus_file_list_sha256": corpus.file_list_hash(files),
        }
    prompts = allq[: args.prompts, : args.prompt_tokens]
    info = {
        "requested": args.prompts,
        "used": len(prompts),
        "heldout_files": source["heldout_files"],
        "qualifying_files": len(allq),
        "prompt_tokens": args.prompt_tokens,
        "files": names[: len(prompts)],
        "python_version": source["python_version"],
        "corpus_file_list_sha256": source["corpus_file_list_sha256"],
    }
    return prompts, info


TOKEN_FILES = (("tokens", "heldout_prompts.npy"), ("tokens", "data_manifest.json"), ("tokenizer", "tiktoken.model"))


def run_prompts(model, args) -> tuple[np.ndarray, list[str], dict]:
    """The held-out prompts that a train_mini run's tokenizer stage wrote (RUN/tokens/heldout_prompts.npy and
    data_manifest.json), so a machine whose Python has another stdlib decodes the committed list's prompts; (prompts,
    their files, the corpus they came from). The run's tokenizer (RUN/tokenizer/tiktoken.model) must be the
    checkpoint's."""
    run = args.prompts_from
    arr, man, tok = (os.path.join(run, *p) for p in TOKEN_FILES)
    for path in (arr, man, tok):
        if not os.path.isfile(path):
            sys.exit(f"error: --prompts-from: {path} is missing (run train_mini.py --out {run} --stages tokenizer)")
    if sha256_file(tok) != sha256_file(os.path.join(model.path, "tiktoken.model")):
        sys.exit(f"error: --prompts-from: {tok} is not {model.path}'s tokenizer: its prompts would be other text")
    with open(man) as f:
        manifest = json.load(f)
    allq = np.load(arr)
    if allq.shape[1] < args.prompt_tokens:
        sys.exit(f"error: --prompts-from: {arr} holds {allq.shape[1]}-token prompts, fewer than --prompt-tokens")
    source = {
        "heldout_files": manifest["num_heldout_files"],
        "python_version": manifest["python_version"],
        "corpus_file_list_sha256": manifest["file_list_sha256"],
    }
    return allq, manifest["heldout_prompt_files"], source


def read_record(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        record = json.load(f)
    return record if isinstance(record, dict) and set(record) <= {"acceptance", "speed", "synthetic"} else {}


def open_section(args, name: str, settings: dict) -> dict:
    """The section to fill: the existing one when --resume and its settings match (else an error), or a new one."""
    old = read_record(args.out).get(name)
    if args.resume and old is not None:
        if old.get("settings") != settings:
            diff = sorted(k for k in settings if old.get("settings", {}).get(k) != settings[k])
            sys.exit(f"error: --resume: {args.out}'s {name} section has other settings ({', '.join(diff)})")
        return old
    return {**harness.record_header(commit=args.commit), "settings": settings, "complete": False, "rows": []}


def save_section(args, name: str, section: dict) -> None:
    record = read_record(args.out)
    record[name] = section
    harness.write_json(record, args.out)


def common_settings(model, args, prompt_info) -> dict:
    return {
        "checkpoint": os.path.abspath(args.ckpt),
        "tokenizer_sha256": sha256_file(os.path.join(args.ckpt, "tiktoken.model")),
        "drafter_block_size": model.drafter_cfg.block_size,
        "prompts": prompt_info,
        "new_tokens": args.new_tokens,
        "seed": args.seed,
        "dtype": args.dtype,
    }


def measure_acceptance(model, prompts, args, prompt_info) -> dict:
    settings = dict(
        common_settings(model, args, prompt_info),
        batch=args.batch,
        budgets=args.budgets,
        auto=not args.no_auto,
        temperatures=args.temperatures,
        loop_threshold=args.loop_threshold,
        ngram=NGRAM,
    )
    section = open_section(args, "acceptance", settings)
    done = {(r["method"], r["budget"], r["temperature"]) for r in section["rows"]}
    specs = run_specs(args.budgets, args.temperatures, depth_of(model, "chain"), not args.no_auto)
    need_ar0 = any(s not in done and s[2] == 0 and s[0] != "ar" for s in specs)
    ar_greedy = None
    for spec in specs:
        if spec in done and not (spec == ("ar", 0, 0.0) and need_ar0):
            continue
        if time.time() - START > 60 * args.deadline_min:
            print(f"deadline of {args.deadline_min} min reached: rerun with --resume to continue", flush=True)
            return section
        row, tokens = measure_run(model, prompts, spec, args, ar_greedy)
        if spec == ("ar", 0, 0.0):
            ar_greedy = tokens
        section["rows"] = [r for r in section["rows"] if (r["method"], r["budget"], r["temperature"]) != spec]
        section["rows"].append(row)
        save_section(args, "acceptance", section)
        greedy = row.get("greedy_vs_ar")
        print(
            f"[{label(*spec)}] tau {row['tau']:.3f} (non-looping {row['nonlooping']['tau']:.3f} over "
            f"{row['nonlooping']['prompts']}/{len(prompts)} prompts), distinct-4 {row['distinct4_mean']:.3f}"
            + (f", greedy == AR {greedy['equal']}/{greedy['prompts']}" if greedy else "")
            + f", {row['seconds']}s",
            flush=True,
        )
    section["complete"] = True
    save_section(args, "acceptance", section)
    return section


def measure_speed(model, prompts, args, prompt_info) -> dict:
    settings = dict(
        common_settings(model, args, prompt_info),
        concurrency=args.concurrency,
        budgets=args.speed_budgets,
        auto=not args.no_auto,
        temperature=0.0,
        repeats=args.repeats,
        prompts_a_decode=args.speed_prompts,
        loop="while (auto: python)",
    )
    section = open_section(args, "speed", settings)
    chain = depth_of(model, "chain")
    methods = [("ar", 0), ("chain", chain)] + [("ddtree", b) for b in args.speed_budgets]
    methods += [] if args.no_auto else [("ddtree", "auto")]
    for C in args.concurrency:
        if C > len(prompts):
            sys.exit(f"error: --concurrency {C} needs at least {C} prompts, have {len(prompts)}")
        for method, budget in methods:
            if any((r["C"], r["method"], r["budget"]) == (C, method, budget) for r in section["rows"]):
                continue
            if time.time() - START > 60 * args.deadline_min:
                print(f"deadline of {args.deadline_min} min reached: rerun with --resume to continue", flush=True)
                return section
            section["rows"].append(speed_row(model, prompts, C, method, budget, args, section["rows"]))
            save_section(args, "speed", section)
            r = section["rows"][-1]
            print(
                f"[speed C={C} {label(method, budget, 0)}] {r['tokens_per_s']:.1f} tok/s, step {r['step_ms']:.3f} ms, "
                f"tau {r['tau']:.3f}, x{_f(r['speedup_over_ar'])} over AR",
                flush=True,
            )
    section["complete"] = True
    save_section(args, "speed", section)
    return section


def speed_row(model, prompts, C, method, budget, args, rows) -> dict:
    """Medians over --repeats decodes of the first max(C, --speed-prompts) prompts in batches of C (after one
    warm-up decode that compiles); the speed-up is over the AR row of the same C in `rows` (this run's, first)."""

    loop = "python" if budget == "auto" else "while"

    def once():
        return decode(
            model,
            prompts[: max(C, args.speed_prompts) // C * C],
            method=method,
            budget=budget_arg(budget),
            temperature=0.0,
            new_tokens=args.new_tokens,
            batch=C,
            seed=args.seed,
            loop=loop,
        )

    _, _, warm = once()
    runs = [once() for _ in range(args.repeats)]
    stats = [s for _, _, s in runs]
    lens = [x for _, seqs, _ in runs[:1] for seq in seqs for x in seq]
    row = {
        "C": C,
        "method": method,
        "budget": budget,
        "loop": loop,
        "tau": accept_summary(lens, depth_of(model, method))["tau"],
        "tokens_per_s": statistics.median(s["tokens_per_s"] for s in stats),
        "tokens_per_s_all": [round(s["tokens_per_s"], 2) for s in stats],
        "step_ms": 1e3 * statistics.median(s["decode_s"] / max(s["steps"], 1) for s in stats),
        "steps": stats[0]["steps"],
        "prefill_ms": 1e3 * statistics.median(s["prefill_s"] for s in stats),
        "compile_s": round(warm["compile_s"] + warm["prefill_s"], 2),
        "prompts": len(runs[0][1]),
    }
    if budget == "auto":
        row["auto"] = stats[-1]["auto"]  # the policy's choices, measured step times and calibration so far
    ar = [r["tokens_per_s"] for r in rows if (r["C"], r["method"]) == (C, "ar")]
    ar_tps = row["tokens_per_s"] if method == "ar" else (ar[-1] if ar else None)
    row["speedup_over_ar"] = row["tokens_per_s"] / ar_tps if ar_tps else None
    row["speedup_over_tau"] = row["speedup_over_ar"] / row["tau"] if row["speedup_over_ar"] and row["tau"] else None
    return row


# ---- markdown ------------------------------------------------------------------------------------------------
def _f(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(record: dict) -> str:
    out = []
    acc = record.get("acceptance")
    if acc:
        s, p = acc["settings"], acc["settings"]["prompts"]
        temps = s["temperatures"]
        rows = {(r["method"], r["budget"], r["temperature"]): r for r in acc["rows"]}
        depth = s["drafter_block_size"] - 1
        out += [
            "## Acceptance: k26-mini on held-out stdlib prompts",
            "",
            f"{p['used']} held-out prompts (each file's first {p['prompt_tokens']} tokens; {p['qualifying_files']} "
            f"of the {p['heldout_files']} held-out files are that long) x {s['new_tokens']} new tokens, decoded "
            f"{s['batch']} at a time; {acc['device']}, commit {acc['commit']}, {acc['date']}"
            + ("" if acc.get("complete") else " (incomplete run)")
            + ". tau: tokens per target pass (AR = 1). Non-looping: continuations whose distinct-4-gram ratio is "
            f">= {s['loop_threshold']} (n = how many). Depth d accepted: P(accept length >= d+1), d = 1..{depth}, "
            f"at T = {temps[0]:g}. Greedy = AR: prompts whose T = 0 tokens equal AR's exactly.",
            "",
        ]
        head = ["method", "B"]
        for t in temps:
            head += [f"tau T={t:g}", f"tau T={t:g} non-looping (n)"]
        head += ["greedy = AR", f"depth 1..{depth} accepted, T={temps[0]:g}"]
        out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        seen = []
        for m, b, _ in rows:
            if (m, b) not in seen:
                seen.append((m, b))
        for m, b in seen:
            cells = [{"ar": "AR", "chain": "chain", "ddtree": "DDTree"}[m], "–" if m == "ar" else str(b)]
            for t in temps:
                r = rows.get((m, b, t))
                cells += [
                    _f(r and r["tau"]),
                    f"{_f(r['nonlooping']['tau'])} ({r['nonlooping']['prompts']})" if r else "–",
                ]
            r0 = rows.get((m, b, temps[0]))
            g = (r0 or {}).get("greedy_vs_ar")
            cells.append(f"{g['equal']}/{g['prompts']}" if g else "–")
            cells.append(" ".join(f"{x:.2f}" for x in r0["depth_accept"]) if r0 and r0["depth_accept"] else "–")
            out.append("| " + " | ".join(cells) + " |")
        conf = [(t, rows[("ar", 0, t)]["target"]) for t in temps if "target" in rows.get(("ar", 0, t), {})]
        if conf:
            out += [
                "",
                "The target at its own continuations (how predictable the drafter's task is): "
                + "; ".join(
                    f"T = {t:g}: mean top-1 probability {c['top1_prob']:.3f}, entropy {c['entropy']:.2f} nats"
                    for t, c in conf
                )
                + ".",
            ]
    spd = record.get("speed")
    if spd:
        out += [
            "",
            "## End-to-end speed: k26-mini (T = 0, real acceptance)",
            "",
            f"{spd['device']}, commit {spd['commit']}, {spd['date']}"
            + ("" if spd.get("complete") else " (incomplete run)")
            + f". The first {spd['settings'].get('prompts_a_decode', 'C')} held-out prompts (at least C) in batches "
            f"of C x {spd['settings']['new_tokens']} new tokens; decode tokens/s "
            f"(prefill and compile excluded), median of {spd['settings']['repeats']}; step = decode time / steps; "
            "speed-up over AR at the same C, measured in the same run.",
            "",
            "| C | method | B | tau | tok/s | step ms | speed-up over AR | speed-up / tau |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in spd["rows"]:
            out.append(
                f"| {r['C']} | {r['method']} | {'–' if r['method'] == 'ar' else r['budget']} | {_f(r['tau'])} | "
                f"{r['tokens_per_s']:.1f} | {r['step_ms']:.3f} | {_f(r['speedup_over_ar'])} | "
                f"{_f(r['speedup_over_tau'])} |"
            )
    return "\n".join(out)


# ---- main ----------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default=DEFAULT_CKPT, help=f"checkpoint with drafter/ (default {DEFAULT_CKPT})")
    parser.add_argument("--prompts", type=int, default=64, help="at most this many held-out prompts (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--budgets", type=int, nargs="+", default=list(BUDGETS), help="DDTree budgets B")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--batch", type=int, default=16, help="prompts decoded together (acceptance)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop-threshold", type=float, default=0.5, help="distinct-4-gram ratio below = looping")
    parser.add_argument("--speed", action="store_true", help="measure tokens/s instead of acceptance (GPU)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="--speed: C values")
    parser.add_argument("--speed-budgets", type=int, nargs="+", default=[16, 32, 64], help="--speed: DDTree B")
    parser.add_argument("--repeats", type=int, default=3, help="--speed: timed decodes per configuration")
    parser.add_argument(
        "--speed-prompts", type=int, default=8, help="--speed: prompts a decode (in batches of C; at least C)"
    )
    parser.add_argument("--no-auto", action="store_true", help='leave out budget="auto"')
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the model's dtype")
    parser.add_argument("--deadline-min", type=float, default=float("inf"), help="start no configuration after")
    parser.add_argument("--resume", action="store_true", help="keep --out's rows of the same settings, do the rest")
    parser.add_argument("--print", action="store_true", help="print the markdown of --out and exit")
    parser.add_argument(
        "--fit-synthetic", action="store_true", help="fit k26jax.synthetic's profile to --out's T = 0 curve and exit"
    )
    parser.add_argument("--any-python", action="store_true", help="accept a stdlib that differs from data/'s list")
    parser.add_argument(
        "--prompts-from", metavar="RUN", help="a train_mini run's held-out prompts (RUN/tokens), not this stdlib's"
    )
    harness.add_record_args(parser, DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1 or args.batch < 1 or min(args.budgets) < 1:
        parser.error("--prompts, --new-tokens, --batch and --budgets must be >= 1")
    if min(args.temperatures) < 0:
        parser.error("--temperatures must be >= 0")
    return args


def fit_synthetic(args) -> dict:
    """The calibrated synthetic drafter (k26jax.synthetic, the benchmarks' acceptance model) against this record's
    measured T = 0 curve: the profile fitted to the chain's tau alone (its default Zipf tail) and the one whose tail
    is fitted to the DDTree curve as well, each one's predicted curve, and what each tail predicts at K2.6 scale
    (chain tau 5.3 at b = 8, vocabulary 163840). The model assumes a calibrated drafter, so it flatters trees."""
    from k26jax import synthetic
    from k26jax.config import ModelConfig

    acc = read_record(args.out).get("acceptance")
    if not acc:
        sys.exit(f"error: {args.out} has no acceptance section to fit (run this script without --fit-synthetic)")
    zero = [r for r in acc["rows"] if r["temperature"] == 0.0 and isinstance(r["budget"], int)]
    chain = next(r["tau"] for r in zero if r["method"] == "chain")
    measured = {r["budget"]: r["tau"] for r in zero if r["method"] == "ddtree"}
    block, vocab = acc["settings"]["drafter_block_size"], ModelConfig.from_hf_dir(args.ckpt).vocab_size
    fits = {
        "chain_only": synthetic.fit_profile(chain, block, vocab=vocab),
        "chain_and_tree": synthetic.fit_profile(chain, block, vocab=vocab, tree_tau=measured),
    }
    section = {**harness.record_header(commit=args.commit), "measured": {"chain": chain, **measured}}
    for name, profile in fits.items():
        curve = synthetic.tau_curve(profile, tuple(measured), block_size=block)
        k26 = synthetic.fit_profile(5.3, 8, vocab=163840, tail=profile.tail)
        section[name] = {
            "profile": dataclasses.asdict(profile),
            "predicted": {"chain": curve["chain"], **{b: curve[b] for b in measured}},
            "k26_chain_5.3": synthetic.tau_curve(k26, (16, 32, 64, 128)),
        }
        print(f"{name}: tail {profile.tail:.2f}; B: measured -> predicted " + ", ".join(
            f"{b}: {measured[b]:.2f} -> {curve[b]:.2f}" for b in sorted(measured)))  # fmt: skip
    return section


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.print:
        print(markdown(read_record(args.out)))
        return
    if args.fit_synthetic:
        save_section(args, "synthetic", fit_synthetic(args))
        print(f"wrote {args.out}'s synthetic section")
        return
    if not os.path.isdir(os.path.join(args.ckpt, "drafter")):
        sys.exit(f"error: {args.ckpt} is not a checkpoint with a drafter/ (train it: scripts/train_mini.py)")
    model = k26jax.load(args.ckpt, dtype=args.dtype)
    prompts, info = load_prompts(model, args)
    if not len(prompts):
        sys.exit(f"error: no held-out file has {args.prompt_tokens} tokens")
    args.batch = min(args.batch, len(prompts))
    print(
        f"{len(prompts)} prompts of {args.prompt_tokens} tokens ({info['qualifying_files']} of "
        f"{info['heldout_files']} held-out files qualify), {args.new_tokens} new tokens, {jax.devices()[0]}",
        flush=True,
    )
    section = (measure_speed if args.speed else measure_acceptance)(model, prompts, args, info)
    print(f"wrote {args.out} ({'complete' if section['complete'] else 'incomplete'})\n", flush=True)
    print(markdown({"speed" if args.speed else "acceptance": section}))


if __name__ == "__main__":
    jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "k26jax_bench_acceptance"))
    main()
