"""Command line: stream DDTree / chain / AR decoding of a prompt with a checkpoint's tokenizer.

python -m k26jax.generate --prompt "Hello" [--ckpt DIR] [--drafter DIR] [--chat] [--method ddtree|chain|ar]
                          [--budget B] [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S]
"""

from __future__ import annotations

import argparse
import sys

import jax

from k26jax import engine
from k26jax.api import load
from k26jax.generation import DEFAULT_CKPT, generate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k26jax.generate", description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", default=DEFAULT_CKPT, help="HF or converted checkpoint dir (default: tiny)")
    ap.add_argument("--drafter", default=None, help="DFlash drafter dir (default: CKPT/drafter)")
    ap.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the K2 chat template")
    ap.add_argument("--method", default="ddtree", choices=engine.METHODS)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args(argv)
    model = load(args.ckpt, drafter=args.drafter, dtype=args.dtype)
    tok = model.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}]) if args.chat else tok.encode(p) for p in args.prompt
    ]
    print(
        f"[k26jax] {args.ckpt}: {model.cfg.num_hidden_layers} layers, method={args.method}, "
        f"budget={args.budget}, backend={jax.default_backend()}",
        file=sys.stderr,
    )
    single = len(prompts) == 1

    def stream(i, new_ids):
        text = tok.decode(new_ids)
        print(text if single else f"[{i}] {text}", end="" if single else "\n", flush=True)

    result = generate(
        model,
        prompts,
        max_new_tokens=args.max_new_tokens,
        method=args.method,
        budget=args.budget,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        on_tokens=stream,
    )
    s = result.stats
    print(
        f"\n[k26jax] {s['new_tokens']} tokens in {s['steps']} steps, tau={s['tau']:.2f}, "
        f"{s['tokens_per_s']:.1f} tok/s decode, prefill {s['prefill_s']:.2f}s, step compile {s['compile_s']:.2f}s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
