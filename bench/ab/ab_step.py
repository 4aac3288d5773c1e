"""Same-machine A/B of one speculative step, before (a git archive of the base commit) against after (this tree).

One harness times both trees: K2.6 width at depth N, random weights, a synthetic 8K-context state, AR and DDTree
B = 32 at C = 1 and 8; each variant's compile time and the median per-step time of `steps`-step fori_loops.
The base tree's step is jitted as its callers did (engine.step + ops.COMPILER_OPTIONS); this tree's through
engine.Decoder.run. Run once per tree (a tree's package shadows the other's), alternating:
  python bench/ab/ab_step.py --tree .ab/base --version base --out base1.json
  python bench/ab/ab_step.py --tree . --version new --out new1.json
"""

import argparse
import json
import os
import statistics
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", required=True)
    ap.add_argument("--version", required=True, choices=("base", "new"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.tree))
    t_start = time.perf_counter()
    import abconfig
    import jax
    import jax.numpy as jnp

    from k26jax import cache as kc
    from k26jax import engine, ops
    from k26jax.config import preset
    from k26jax.model import drafter, target

    cfg = preset("tiny") if args.tiny else preset(f"k26-depth{args.layers}")
    dcfg = abconfig.kimi_drafter(cfg, tiny=args.tiny)
    # jitted: an eager init holds each INT4 stack twice (random bits, then their int32 view)
    params = jax.jit(lambda: target.init_params(cfg, 0, jnp.bfloat16))()
    dparams = jax.jit(lambda: drafter.init_params(dcfg, 0, jnp.bfloat16))()
    jax.block_until_ready((params, dparams))
    t_init = time.perf_counter() - t_start
    print(f"[{args.version}] params ready in {t_init:.1f}s", flush=True)
    impls = ops.Impls.auto()
    S = args.context + 1024
    rows_out = []

    def state_for(sc, C, key):
        k_rows, k_ck, k_cv, k_root, k_state = jax.random.split(key, 5)
        rows = jax.random.normal(k_rows, (cfg.num_hidden_layers, C, S, cfg.latent_dim), jnp.bfloat16)
        lengths = jnp.full((C,), args.context, jnp.int32)
        if sc.method == "ar":
            ck, cv = jnp.zeros((0, C, 0, 0, 0), jnp.bfloat16), jnp.zeros((0, C, 0, 0, 1), jnp.bfloat16)[..., :0]
        else:
            shape = (dcfg.num_hidden_layers, C, dcfg.num_key_value_heads, S, dcfg.head_dim)
            ck, cv = jax.random.normal(k_ck, shape, jnp.bfloat16), jax.random.normal(k_cv, shape, jnp.bfloat16)
        fields = dict(
            cache=kc.KVCache(rows, lengths),
            ctx_k=ck,
            ctx_v=cv,
            ctx_len=jnp.full((C,), args.context, jnp.int32),
            root=jax.random.randint(k_root, (C,), 0, cfg.vocab_size // 2, jnp.int32),
            done=jnp.zeros((C,), bool),
        )
        if hasattr(engine, "empty_state"):  # per-slot sampling values and limits (after the server's engine)
            empty = engine.empty_state(cfg=cfg, dcfg=None, sc=sc, batch=C, max_len=1, dtype=jnp.bfloat16)
            return empty.replace(
                key=engine.slot_keys(k_state, C), max_new=jnp.full((C,), sc.max_new_tokens, jnp.int32), **fields
            )
        return engine.DecodeState(
            out=jnp.zeros((C, sc.max_new_tokens + sc.depth + 1), jnp.int32),
            num_out=jnp.zeros((C,), jnp.int32),
            key=k_state,
            step=jnp.zeros((), jnp.int32),
            accept_lens=jnp.zeros((engine.max_steps(sc), C), jnp.int32),
            **fields,
        )

    for method, budget in (("ar", 1), ("ddtree", 32)):
        for C in (1, 8):
            sc = engine.StepConfig(method=method, budget=budget, max_new_tokens=2048, block_size=8)
            d = dcfg if method != "ar" else None
            dp = dparams if method != "ar" else None
            state = state_for(sc, C, jax.random.key(1))
            t0 = time.perf_counter()
            if args.version == "base":
                import functools

                def run(p, dd, s, sc=sc, d=d):
                    body = lambda _, s: engine.step(p, dd, s, cfg=cfg, dcfg=d, sc=sc, impls=impls)
                    return jax.lax.fori_loop(0, args.steps, body, s)

                exe = (
                    jax.jit(run, donate_argnums=2, compiler_options=ops.COMPILER_OPTIONS)
                    .lower(params, dp, state)
                    .compile()
                )
                call = functools.partial(exe, params, dp)
            else:
                dec = engine.Decoder(cfg, d, sc, impls)
                exe = dec.compile("run", params, dp, state, num_steps=args.steps)
                call = lambda s, exe=exe, dp=dp: exe(params, dp, s)
            compile_s = time.perf_counter() - t0
            state = call(state)
            jax.block_until_ready(state)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                state = call(state)
                jax.block_until_ready(state)
                times.append((time.perf_counter() - t) / args.steps * 1e3)
            row = dict(
                version=args.version,
                method=method,
                budget=budget if method == "ddtree" else 0,
                C=C,
                context=args.context,
                layers=args.layers,
                compile_s=round(compile_s, 2),
                step_ms=round(statistics.median(times), 4),
                step_ms_all=[round(x, 4) for x in times],
            )
            print(json.dumps(row), flush=True)
            rows_out.append(row)
            del state
    rec = dict(
        device=str(jax.devices()[0].device_kind),
        version=args.version,
        init_s=round(t_init, 1),
        total_s=round(time.perf_counter() - t_start, 1),
        rows=rows_out,
    )
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
