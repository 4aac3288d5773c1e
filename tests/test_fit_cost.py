"""scripts/fit_cost.py: the cost model fitted per measured group and checked on held-out cells, from bench_auto
and bench_e2e records; bad input named."""

import json

import pytest

from k26jax import step_cost

VARIANTS = [("ar", ("ar", 0)), ("chain", ("chain", 0))] + [(f"ddtree{b}", ("ddtree", b)) for b in (8, 32, 128)]


def _auto_record(truth: step_cost.StepCost, machine: step_cost.Machine) -> dict:
    """A bench_auto record (two runs) whose plain steps take exactly truth's time; estimate and auto rows too."""
    runs = []
    for C in (1, 8):
        rows = []
        for ctx in (1024, 8192, 32768):
            for v, (m, b) in VARIANTS:
                row = dict(layers=6, method=m, B=b, C=C, context=ctx, skip=(), machine=machine)
                ms = step_cost.predict(truth, row)
                rows.append(dict(kind="auto_bench", variant=v, C=C, context=ctx, layers=6, step_ms=ms))
                rows.append(dict(kind="auto_bench", variant=f"{v}+estimate", C=C, context=ctx, layers=6, step_ms=9e9))
            rows.append(dict(kind="auto_bench", variant="auto", C=C, context=ctx, layers=6, step_ms=9e9))
        runs.append({"rows": rows})
    return {"runs": runs}


def test_fit_cost_holds_out_a_known_model_per_run(import_script, tmp_path):
    fit_cost = import_script("fit_cost")
    machine = step_cost.Machine(3.0, 700.0)
    coef = dict(step_cost.PRIOR, fixed=0.6, attn_layers=0.05, moe=1.3, kv=2.0, drafter=1.2)
    truth = step_cost.StepCost(tuple(coef.items()), step_cost.BUILD_PRIOR, skew=0.0)
    rec = tmp_path / "auto.json"
    rec.write_text(json.dumps(_auto_record(truth, machine)))
    out = tmp_path / "fit.json"
    argv = [str(rec), "--copy-tbps", "3.0", "--matmul-tflops", "700", "--ridge", "1e-6", "--out", str(out)]
    assert fit_cost.main(argv) == 0
    groups = json.loads(out.read_text())["groups"]
    assert [g["group"] for g in groups] == [0, 1] and all(g["rows"] == 15 for g in groups)  # plain steps only
    for g in groups:
        (fit,) = g["fits"]
        assert fit["cells"] == 15 and fit["holdout_max_abs"] < 0.02, fit["holdout_max_abs"]


def test_fit_cost_names_bad_input(import_script, tmp_path, capsys):
    fit_cost = import_script("fit_cost")
    assert fit_cost.main([str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"rows": []}))
    assert fit_cost.main([str(empty), "--out", str(tmp_path / "o.json")]) == 2
    assert "no group" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        fit_cost.main([str(empty), "--copy-tbps", "3.0"])
