"""Train k26-mini (the K2.6 architecture, small) and its DFlash drafter on the Python standard library's source.

    python scripts/train_mini.py --out DIR [--stages all | tokenizer,target,...] [--resume | --overwrite]
                                 [--smoke] [--seed 0] [--set KEY=VALUE ...] [--impl auto|reference]
                                 [--max-minutes 8] [--any-python] [--target-from CKPT]

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
--target-from CKPT takes the target and quantize stages from a trained checkpoint of this run's architecture and
tokenizer (e.g. checkpoints/mini): a new drafter for a shipped target, without training the target again.
An existing non-empty DIR is refused unless --resume (continue it; its settings must match) or --overwrite.
DIR/run.json records the seed, the settings, the Python version and the corpus file list's hash. Files written
are at most 16 MiB. --smoke shrinks every stage so the whole recipe runs on a CPU in minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402

from k26jax.train import loop, recipe, rundir, stages_target  # noqa: E402

CUT_SHORT = 3  # exit code: a stage stopped by --max-minutes; its state is kept for --resume


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the run directory")
    parser.add_argument("--stages", default="all", help=f"'all' or a comma list of {', '.join(recipe.STAGES)}")
    parser.add_argument("--resume", action="store_true", help="continue the run in an existing --out")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing --out and start over")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and steps: the whole recipe on a CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change one setting")
    parser.add_argument("--impl", choices=("auto", "reference"), default="auto", help="engine kernels for decoding")
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=8.0,
        help="the stages of this invocation save and stop after this long in all (default 8)",
    )
    parser.add_argument("--any-python", action="store_true", help="accept a stdlib that differs from data/'s list")
    parser.add_argument(
        "--target-from",
        metavar="CKPT",
        help="take the trained INT4 target from this K2.6-format checkpoint instead of the target and quantize stages",
    )
    args = parser.parse_args(argv)
    stages = recipe.STAGES if args.stages == "all" else tuple(x.strip() for x in args.stages.split(","))
    unknown = [x for x in stages if x not in recipe.STAGES]
    if unknown:
        die(f"--stages: unknown stage(s) {unknown}; use {', '.join(recipe.STAGES)}")
    if args.resume and args.overwrite:
        die("--resume and --overwrite exclude each other")
    try:
        run = rundir.open_run(
            args.out,
            rundir.override(rundir.SMOKE if args.smoke else rundir.FULL, args.set),
            seed=args.seed,
            smoke=args.smoke,
            resume=args.resume,
            overwrite=args.overwrite,
            impl=args.impl,
            max_minutes=args.max_minutes,
            any_python=args.any_python,
        )
        if args.target_from:
            recipe.run_stages(run, [s for s in stages if s == "tokenizer"])
            stages_target.import_target(run, args.target_from)
        recipe.run_stages(run, stages)
    except (rundir.RecipeError, loop.NonFiniteLoss) as e:
        die(str(e))
    except rundir.CutShort as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(CUT_SHORT)


if __name__ == "__main__":
    # compiled programs persist across stages and resumed runs (the data and eval stages compile the engine)
    jax.config.update("jax_compilation_cache_dir", os.path.join(tempfile.gettempdir(), "k26jax_train_mini_cache"))
    main()
