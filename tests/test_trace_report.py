"""scripts/trace_report.py on a real CPU trace: kernels charged to the named scopes of their HLO op_name,
control flow not counted twice, executions cut by the trace's edges left out, and clear errors."""

import os

import jax
import jax.numpy as jnp
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tr(import_script):
    return import_script("trace_report")


def layer_stack(x, ws):
    def body(h, w):
        with jax.named_scope("attention"):
            h = jnp.tanh(h @ w)
        h = jax.lax.optimization_barrier(h)
        with jax.named_scope("moe"):
            h = jax.nn.relu(h @ w.T) + 1.0
        return h, None

    with jax.named_scope("verify"):
        return jax.lax.scan(body, x, ws)[0].sum()


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    x, ws = jnp.ones((64, 128)), 0.01 * jnp.ones((3, 128, 128))
    compiled = jax.jit(layer_stack).lower(x, ws).compile()
    jax.block_until_ready(compiled(x, ws))
    where = str(tmp_path_factory.mktemp("trace"))
    with jax.profiler.trace(where):
        for _ in range(3):
            jax.block_until_ready(compiled(x, ws))
    return where, compiled.as_text()


def test_kernels_are_charged_to_their_scopes(tr, traced):
    where, hlo = traced
    r = tr.analyse(where, hlo, layers=3)
    assert r["executions"] == 3
    assert {"verify/attention", "verify/moe"} <= set(r["phases"])
    assert r["phases"]["verify/attention"]["launches"] >= 3  # once a layer, 3 layers
    assert 0 < r["busy_ms"] <= r["span_ms"] and r["gap_ms"] == pytest.approx(r["span_ms"] - r["busy_ms"])
    assert r["launches_per_layer"] == pytest.approx(r["launches"] / 3)
    assert sum(p["share"] for p in r["phases"].values()) == pytest.approx(1.0)
    md = tr.markdown(r)
    assert "| verify/attention |" in md and "3 execution(s)" in md


def test_control_flow_is_not_counted_twice(tr, traced):
    where, hlo = traced
    module, names, control = tr.hlo_op_names(hlo)
    assert any(n.startswith("while") for n in control)  # the scan's loop encloses its body's kernels on a CPU
    kept = tr.kernels(tr.find_xplane(where), module, control)
    assert kept and not any(e["hlo_op"] in control for e in kept)
    every = tr.kernels(tr.find_xplane(where), module)
    assert len(every) > len(kept)


def test_a_partial_execution_is_left_out(tr, traced):
    where, hlo = traced
    module, names, control = tr.hlo_op_names(hlo)
    events = tr.kernels(tr.find_xplane(where), module, control)
    first_run = events[0]["run"]
    cut = [e for e in events if e["run"] != first_run] + [e for e in events if e["run"] == first_run][1:]
    assert tr.report(cut, names)["executions"] == 2


def test_bad_input_names_what_is_wrong(tr, traced, tmp_path, capsys):
    where, hlo = traced
    with pytest.raises(ValueError, match="HloModule"):
        tr.hlo_op_names("not hlo")
    with pytest.raises(FileNotFoundError, match="no .xplane.pb"):
        tr.find_xplane(str(tmp_path))
    with pytest.raises(ValueError, match="no kernel of the program"):
        tr.report([], {})
    hlo_file = tmp_path / "p.hlo.txt"
    hlo_file.write_text(hlo)
    assert tr.main([str(tmp_path / "nothing"), "--hlo", str(hlo_file)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert tr.main([where, "--hlo", str(hlo_file), "--json", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r.json").stat().st_size > 0


def _instr(name, call, op_name):
    return f'  %{name} = f32[8]{{0}} {call}, metadata={{op_name="jit(run)/verify/{op_name}"}}\n'


GPU_HLO = "HloModule jit_run_steps, is_scheduled=true\n" + "".join(
    [
        _instr("loop_add_fusion.3", "fusion(%p), kind=kLoop", "norm/add"),
        _instr(
            "pallas_call.30",
            'custom-call(%a), custom_call_target="__gpu$xla.gpu.triton"',
            "attention/jit(tree_mla_attention)/tree_mla_prefix/pallas_call",
        ),
        _instr("custom-call.7", 'custom-call(%b), custom_call_target="mosaic_gpu_v2"', "moe/jit(fused_moe_mosaic)/x"),
        _instr("custom-call.8", 'custom-call(%c), custom_call_target="__cublas$lt$matmul"', "mla_in/dot_general"),
    ]
)


def test_gpu_command_buffer_kernels_are_charged_by_their_own_names(tr):
    """On a GPU the events name their command buffer: fusions, Pallas and Mosaic kernels are found by name, cuBLAS
    kernels (which name no instruction) are counted as such."""
    module, names, _ = tr.hlo_op_names(GPU_HLO)
    assert module == "jit_run_steps"
    cases = {
        "loop_add_fusion_3": "verify/norm",
        "tree_mla_prefix": "verify/attention",
        "anonymous_mosaic_gpu_kernel (grid 132,1,1)": "verify/moe",
        "nvjet_sm90_tss_64x8_64x16_4x1_v_bz_NNT": tr.CUBLAS,
        "memcpy32_post": "other",
    }
    for kernel, phase in cases.items():
        assert tr.phase_of(names.op_name("command_buffer_3", kernel)) == phase, kernel
    assert tr.phase_of(names.op_name("loop_add_fusion.3", "anything")) == "verify/norm"  # a CPU event names its op
    mosaic_attention = _instr("custom-call.9", 'custom-call(%d), custom_call_target="mosaic_gpu_v2"', "attention/x")
    two = tr.hlo_op_names(GPU_HLO + mosaic_attention)[1]
    assert tr.phase_of(two.op_name("command_buffer_1", "anonymous_mosaic_gpu_kernel")) == "verify/attention|verify/moe"
    events = [dict(name=k, hlo_op="command_buffer_3", run=0, start=10 * i, dur=5 + i) for i, k in enumerate(cases)]
    r = tr.report(events, names)
    assert r["executions"] == 1 and set(r["phases"]) == set(cases.values())
    assert r["busy_ms"] == pytest.approx(sum(5 + i for i in range(5)) / 1e6)
