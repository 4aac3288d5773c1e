"""scripts/bench_auto.py's measurement path on 8 emulated CPU devices (tiny shapes; timings mean nothing): every
fixed choice, its estimate step and budget="auto" are measured per cell, and auto's row says what it chose."""

import json

import pytest


def test_bench_auto_races_auto_against_every_fixed_choice(import_script, tmp_path):
    bench = import_script("bench_auto")
    out = tmp_path / "auto.json"
    names = ["chain", "ddtree16"]  # a subset keeps the test short; the default races all of budget.CANDIDATES
    assert bench.main(["--cpu-mesh8", "--candidates", *names, "--out", str(out)]) == 0
    router, *rows = json.loads(out.read_text())["rows"]
    assert router["kind"] == "router" and router["imbalance_balanced"] < router["imbalance_random"]
    assert [r["variant"] for r in rows] == ["ar", *[v for n in names for v in (n, f"{n}+estimate")], "auto"]
    for r in rows:
        assert r["step_ms"] > 0 and r["tok_s"] > 0 and r["C"] == 2 and r["context"] == 64
        assert (r["tau_realised"] == 1.0) == (r["variant"] == "ar")
    auto = rows[-1]
    best = max((r for r in rows[:-1] if "+" not in r["variant"]), key=lambda r: r["tok_s"])
    assert auto["best_fixed"] == best["variant"]
    assert auto["vs_best_fixed"] == auto["tok_s"] / best["tok_s"]
    policy = auto["policy"]
    assert set(policy["choices"]) == set(names)  # every candidate was tried
    assert set(policy["step_ms"]) == set(names) and 0.0 <= policy["rho"] <= 1.0 and policy["switch_ms"] >= 0
    assert sum(auto["choices_timed"].values()) > 0 and auto["policy_ms_per_step"] > 0


def test_bench_auto_names_an_unknown_candidate(import_script, capsys):
    with pytest.raises(SystemExit):
        import_script("bench_auto").parse_args(["--candidates", "chain", "ddtree7"])
    assert "ddtree7" in capsys.readouterr().err
