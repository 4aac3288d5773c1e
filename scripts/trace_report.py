"""Where a profiled program's device time goes: per named scope and per kernel, launches, and idle gaps.

    python scripts/trace_report.py TRACE_DIR --hlo FILE [--layers N] [--top 15] [--json OUT]

TRACE_DIR: a `jax.profiler.trace` directory (its .xplane.pb is found below it). FILE: the profiled program's
compiled text (`compiled.as_text()`; `bench_e2e.py --profile` writes it beside each trace as program.hlo.txt).
A kernel is a device event of that program (`hlo_module`): the GPU planes' stream events, or on a CPU the host's
XLA op events. Each kernel is charged to the k26jax named scopes in its HLO instruction's op_name (`PHASES`, e.g.
"verify/attention"; fusions carry their root's). On a GPU most kernels run inside command buffers, whose events
name the buffer ("command_buffer_3"), not the instruction: `Instructions.op_name` then finds it from the kernel's
own name (a fusion's name; a Pallas kernel's name in its op_name path; a Mosaic GPU kernel by its custom call)
and leaves cuBLAS kernels, which name no instruction, as "gemm (cuBLAS)". A GPU trace's events carry no execution
id, so all of one program's kernels are one execution (profile one call). Busy time is the union of the kernel
intervals of one execution, its gaps the rest of the span from its first kernel's start to its last kernel's end:
launch latency and host waits the kernels do not cover.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys

import jax

# the named scopes of k26jax's step (engine phases, then a layer's parts), in reading order
PHASES = (
    "draft",
    "tree_build",
    "verify",
    "accept",
    "commit",
    "norm",
    "mla_in",
    "attention",
    "mla_out",
    "dense_mlp",
    "router",
    "moe",
    "shared_expert",
    "lm_head",
)
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*op_name=\"([^\"]*)\"", re.M)
_CONTROL = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=[^\n]*?\s(?:while|conditional|call)\(", re.M)
_MOSAIC = re.compile(r"custom_call_target=\"mosaic_gpu[^\"]*\".*?op_name=\"([^\"]*)\"")
_CUBLAS = re.compile(r"nvjet|cutlass|gemm|xmma|cublas", re.I)
CUBLAS = "gemm (cuBLAS)"


class Instructions(dict):
    """{instruction name: metadata op_name} of a compiled program, with what a GPU kernel's name resolves to."""

    def __init__(self, hlo_text: str):
        super().__init__(_INSTR.findall(hlo_text))
        self.by_kernel = {name.replace(".", "_").replace("-", "_"): op for name, op in self.items()}
        for op in self.values():  # a Pallas kernel is named by the path component before its pallas_call
            parts = op.split("/")
            for before, part in zip(parts, parts[1:]):
                if part == "pallas_call":
                    self.by_kernel.setdefault(before, op)
        self.mosaic = sorted({phase_of(op) for op in _MOSAIC.findall(hlo_text)})

    def op_name(self, hlo_op: str, kernel: str) -> str:
        """The op_name to charge a kernel event to ("" when nothing names it)."""
        if hlo_op in self and not hlo_op.startswith("command_buffer"):
            return self[hlo_op]
        if kernel in self.by_kernel:
            return self.by_kernel[kernel]
        if "mosaic" in kernel:  # anonymous: one phase if the program's Mosaic calls share one
            return self.mosaic[0] if len(self.mosaic) == 1 else "|".join(self.mosaic)
        return CUBLAS if _CUBLAS.search(kernel) else ""


def hlo_op_names(hlo_text: str) -> tuple[str, Instructions, set[str]]:
    """(the module's name, its `Instructions`, the control-flow instructions: while, conditional and call, whose
    events on a CPU enclose their bodies' kernels) of a compiled program's text."""
    m = re.search(r"^HloModule\s+([\w.\-]+)", hlo_text, re.M)
    if m is None:
        raise ValueError("not an HLO module's text: no 'HloModule' line")
    return m.group(1), Instructions(hlo_text), set(_CONTROL.findall(hlo_text))


def phase_of(op_name: str) -> str:
    """The PHASES named in an op_name path, joined with '/' ("verify/attention"); "other" when none is."""
    if op_name == CUBLAS or "|" in op_name:  # not one instruction's: cuBLAS, or Mosaic kernels of several phases
        return op_name
    parts = [p for p in op_name.split("/") if p in PHASES]
    return "/".join(dict.fromkeys(parts)) or "other"


def find_xplane(trace_dir: str) -> str:
    found = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not found:
        raise FileNotFoundError(f"{trace_dir}: no .xplane.pb below it (is it a jax.profiler.trace directory?)")
    return found[-1]


def kernels(xplane_path: str, module: str, skip: set[str] = frozenset()) -> list[dict]:
    """Every device event of `module` that names an HLO instruction not in `skip`: name, hlo_op, run (execution
    id), start and duration in ns. GPU planes when the trace has any, else the host plane (a CPU run)."""
    data = jax.profiler.ProfileData.from_file(xplane_path)
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")]
    planes = planes or [p for p in data.planes if p.name == "/host:CPU"]
    out = []
    for plane in planes:
        for line in plane.lines:
            if plane.name.startswith("/device:") and not line.name.startswith("Stream"):
                continue  # the derived "XLA Ops" / "XLA Modules" lines repeat the stream events
            for e in line.events:
                stats = dict(e.stats)
                if "hlo_op" not in stats or stats.get("hlo_module") != module or stats["hlo_op"] in skip:
                    continue
                gpu = plane.name.startswith("/device:")
                run = stats.get("run_id", 0 if gpu else stats.get("correlation_id", 0))
                name = e.name
                grid = re.search(r"grid:([\d,]+)", str(stats.get("kernel_details", "")))
                if "mosaic" in name and grid:  # anonymous kernels told apart by their launch grid
                    name = f"{name} (grid {grid.group(1)})"
                out.append(dict(name=name, hlo_op=stats["hlo_op"], run=run, start=e.start_ns, dur=e.duration_ns))
    return out


def _busy(intervals) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def report(events: list[dict], op_names: Instructions, *, layers: int | None = None, top: int = 15) -> dict:
    """Per execution (medians over the complete executions, those with the most kernels): span, busy and gap ms,
    kernel launches (and per layer); per phase: ms and launches; the `top` kernels by time: ms, launches, phase."""
    if not events:
        raise ValueError("no kernel of the program in the trace (was it run under the profiler?)")
    runs = collections.defaultdict(list)
    for e in events:
        runs[e["run"]].append(e)
    most = max(map(len, runs.values()))
    runs = {r: evs for r, evs in runs.items() if len(evs) == most}  # an execution cut by the trace's edges: out
    events = [e for evs in runs.values() for e in evs]
    per_run = []
    for evs in runs.values():
        span = max(e["start"] + e["dur"] for e in evs) - min(e["start"] for e in evs)
        busy = _busy((e["start"], e["start"] + e["dur"]) for e in evs)
        per_run.append((span, busy, len(evs)))
    per_run.sort()
    span, busy, launches = per_run[len(per_run) // 2]
    n = len(runs)
    phases = collections.defaultdict(lambda: [0.0, 0])
    by_kernel = collections.defaultdict(lambda: [0.0, 0, ""])
    for e in events:
        ph = phase_of(op_names.op_name(e["hlo_op"], e["name"]))
        phases[ph][0] += e["dur"] / n
        phases[ph][1] += 1 / n
        k = by_kernel[e["name"]]
        k[0] += e["dur"] / n
        k[1] += 1 / n
        k[2] = ph
    total = sum(v[0] for v in phases.values())
    out = {
        "executions": n,
        "span_ms": span / 1e6,
        "busy_ms": busy / 1e6,
        "gap_ms": (span - busy) / 1e6,
        "launches": launches,
        "phases": {
            p: {"ms": v[0] / 1e6, "launches": round(v[1], 1), "share": v[0] / total if total else 0.0}
            for p, v in sorted(phases.items(), key=lambda kv: -kv[1][0])
        },
        "top_kernels": [
            {"name": name, "ms": v[0] / 1e6, "launches": round(v[1], 1), "phase": v[2]}
            for name, v in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:top]
        ],
    }
    if layers:
        out["launches_per_layer"] = launches / layers
    return out


def markdown(r: dict) -> str:
    lines = [
        f"{r['executions']} execution(s); per execution: span {r['span_ms']:.3f} ms, kernels busy "
        f"{r['busy_ms']:.3f} ms, gaps {r['gap_ms']:.3f} ms, {r['launches']} launches"
        + (f" ({r['launches_per_layer']:.1f} a layer)" if "launches_per_layer" in r else ""),
        "",
        "| phase | ms | launches | share |",
        "|---|---|---|---|",
    ]
    lines += [f"| {p} | {v['ms']:.3f} | {v['launches']:g} | {100 * v['share']:.1f}% |" for p, v in r["phases"].items()]
    lines += ["", "| kernel | phase | ms | launches |", "|---|---|---|---|"]
    lines += [f"| `{k['name'][:60]}` | {k['phase']} | {k['ms']:.3f} | {k['launches']:g} |" for k in r["top_kernels"]]
    return "\n".join(lines)


def analyse(trace_dir: str, hlo_text: str, *, layers: int | None = None, top: int = 15) -> dict:
    module, names, control = hlo_op_names(hlo_text)
    return report(kernels(find_xplane(trace_dir), module, control), names, layers=layers, top=top)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--hlo", required=True, help="the profiled program's compiled text")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers of the program (launches per layer)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", default=None, help="also write the report here")
    args = ap.parse_args(argv)
    try:
        with open(args.hlo) as f:
            r = analyse(args.trace_dir, f.read(), layers=args.layers, top=args.top)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(markdown(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
