"""The trained-mini recipe: k26-mini and its DFlash drafter trained on the Python standard library's source.

Seven stages run in order, each resumable and marked done by DIR/<stage>/DONE.json (rundir.Run):
tokenizer, target, quantize (stages_target), data, drafter (stages_drafter), export, eval (stages_export).
scripts/train_mini.py is the command line.
"""

from __future__ import annotations

import os

from k26jax.train import stages_drafter, stages_export, stages_target
from k26jax.train.rundir import RecipeError, Run

MAX_FILE_BYTES = 16 << 20  # no file of a run directory may be larger (the repository's limit)

RUNNERS = {
    "tokenizer": stages_target.stage_tokenizer,
    "target": stages_target.stage_target,
    "quantize": stages_target.stage_quantize,
    "data": stages_drafter.stage_data,
    "drafter": stages_drafter.stage_drafter,
    "export": stages_export.stage_export,
    "eval": stages_export.stage_eval,
}
STAGES = tuple(RUNNERS)


def run_stages(run: Run, stages) -> None:
    """Run `stages` in recipe order, skipping those already done; after each, check the file size limit."""
    for stage in STAGES:
        if stage not in stages:
            continue
        if run.done(stage) is not None:
            print(f"[{stage}] already done ({run.path(stage, 'DONE.json')})", flush=True)
            continue
        print(f"[{stage}] starting", flush=True)
        RUNNERS[stage](run)
        too_big = [
            os.path.join(d, f)
            for d, _, fs in os.walk(run.dir)
            for f in fs
            if os.path.getsize(os.path.join(d, f)) > MAX_FILE_BYTES
        ]
        if too_big:
            raise RecipeError(f"[{stage}] wrote files over 16 MiB: {too_big}")
