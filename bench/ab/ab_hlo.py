"""Lower one tree's step for CUDA on the CPU (abstract H200, Pallas impls) at K2.6 width, depth 8, 8K context:
AR and DDTree B = 32 at C = 1 and 8. Writes each program's StableHLO (no debug info) for a diff against the other
tree, and the lowering time. Usage: python bench/ab/ab_hlo.py --tree DIR --version base|new --out DIR."""

import argparse
import hashlib
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--tree", required=True)
ap.add_argument("--version", required=True)
ap.add_argument("--out", required=True)
args = ap.parse_args()
sys.path.insert(0, os.path.abspath(args.tree))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import functools  # noqa: E402

import abconfig  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh  # noqa: E402

from k26jax import cache as kc  # noqa: E402
from k26jax import engine, ops  # noqa: E402
from k26jax.config import preset  # noqa: E402
from k26jax.model import drafter, target  # noqa: E402

H200 = AbstractMesh(
    (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
)
cfg = preset("k26-depth8")
dcfg = abconfig.kimi_drafter(cfg, tiny=False)
params = target.abstract_params(cfg, jnp.bfloat16)
dparams = drafter.abstract_params(dcfg, jnp.bfloat16)
impls = ops.Impls("pallas", "pallas", "pallas", "pallas")
S, CTX = 9216, 8192
os.makedirs(args.out, exist_ok=True)
for method, budget in (("ar", 1), ("ddtree", 32)):
    for C in (1, 8):
        sc = engine.StepConfig(method=method, budget=budget, max_new_tokens=2048, block_size=8)
        d = dcfg if method != "ar" else None
        dp = dparams if method != "ar" else None
        sds = jax.ShapeDtypeStruct
        if method == "ar":
            ck = cv = sds((0, C, 0, 0, 0), jnp.bfloat16)
        else:
            ck = cv = sds((6, C, 8, S, 128), jnp.bfloat16)
        i32 = lambda *s: sds(s, jnp.int32)
        if hasattr(engine, "empty_state"):  # per-slot sampling values and limits (the server's engine)
            state = jax.eval_shape(
                lambda: engine.empty_state(cfg=cfg, dcfg=d, sc=sc, batch=C, max_len=S, dtype=jnp.bfloat16)
            )
        else:
            state = engine.DecodeState(
                cache=kc.KVCache(sds((8, C, S, 576), jnp.bfloat16), i32(C)),
                ctx_k=ck,
                ctx_v=cv,
                ctx_len=i32(C),
                root=i32(C),
                out=i32(C, 2048 + sc.depth + 1),
                num_out=i32(C),
                done=sds((C,), bool),
                key=jax.eval_shape(lambda: jax.random.key(0)),
                step=i32(),
                accept_lens=i32(engine.max_steps(sc), C),
            )
        t0 = time.perf_counter()
        with use_abstract_mesh(H200):
            if args.version == "base":
                fn = jax.jit(
                    functools.partial(engine.step, cfg=cfg, dcfg=d, sc=sc, impls=impls),
                    donate_argnums=2,
                    compiler_options=ops.COMPILER_OPTIONS,
                )
            else:
                fn = engine.Decoder(cfg, d, sc, impls)._programs["step"]
            text = fn.trace(params, dp, state).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
        dt = time.perf_counter() - t0
        name = f"{method}{budget}_C{C}"
        open(os.path.join(args.out, name + ".mlir"), "w").write(text)
        print(
            args.version,
            name,
            f"lower {dt:.1f}s",
            len(text),
            hashlib.sha256(text.encode()).hexdigest()[:16],
            flush=True,
        )
