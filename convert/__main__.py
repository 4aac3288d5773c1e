"""python -m convert --hf DIR --out DIR [--expert-sharding ep|tp] [--mesh N] [--dtype bfloat16|float32]
                     [--drafter DIR | --no-drafter] [--dry-run] [--resume] [--overwrite]

Converts a Hugging Face K2 / K2.5 / K2.6 checkpoint (and the z-lab DFlash drafter in its drafter/ directory, or
the one --drafter names) into a k26jax orbax checkpoint that `k26jax.load(OUT, mesh=...)` restores straight onto a
mesh, checking every chunk it reads against the sha256 recorded here. See convert/converter.py for the streaming,
resume and atomicity design.
"""

import argparse
import os
import sys

from convert.converter import Options, convert
from k26jax.config import ConfigError
from k26jax.hf_files import CheckpointError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert", description=__doc__.split("\n\n")[1])
    p.add_argument("--hf", required=True, help="Hugging Face checkpoint directory (config.json, index, shards)")
    p.add_argument("--out", required=True, help="output directory; appears only when the conversion is complete")
    p.add_argument(
        "--expert-sharding",
        choices=("ep", "tp"),
        default="ep",
        help="routed-expert layout the chunks are cut for (restore can use either)",
    )
    p.add_argument("--mesh", type=int, default=8, help="size of the 'model' mesh axis the chunks are cut for")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="dtype of float weights (INT4 experts, their bf16 scales and the fp32 router bias keep theirs)",
    )
    drafter = p.add_mutually_exclusive_group()
    drafter.add_argument(
        "--drafter", help="z-lab DFlash drafter directory, converted into OUT/drafter (default: HF/drafter if present)"
    )
    drafter.add_argument("--no-drafter", action="store_true", help="convert no drafter, even if HF/drafter exists")
    p.add_argument("--dry-run", action="store_true", help="validate the source and print the plan; write nothing")
    p.add_argument("--resume", action="store_true", help="continue an interrupted conversion (OUT.partial)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it is a k26jax checkpoint (and discard an OUT.partial of ours); never anything else",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    opts = Options(
        hf_dir=a.hf,
        out=a.out.rstrip("/"),
        expert_mode=a.expert_sharding,
        mesh=a.mesh,
        dtype=a.dtype,
        drafter_dir=False if a.no_drafter else a.drafter,
        dry_run=a.dry_run,
        resume=a.resume,
        overwrite=a.overwrite,
        progress=not a.no_progress,
        cli=True,
    )
    try:
        convert(opts)
    except (CheckpointError, ConfigError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        partial = opts.out + ".partial"
        hint = f": {partial} keeps the finished steps; add --resume to continue" if os.path.isdir(partial) else ""
        print(f"\ninterrupted{hint}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
