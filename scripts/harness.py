"""What every benchmark in scripts/ shares: the two ceilings, one timer, parallel compiles and the JSON record.

Timing follows DESIGN.md's performance contract: many back-to-back calls between two `block_until_ready`s (the
calls rotate over input sets that together exceed L2, or loop inside one jit), the median over repeats. The
ceilings are measured with that timer in the same run as the kernel: XLA's `x + 1` over 4 GiB of float32 (bytes
read and written) and a bf16 8192^3 matmul. Every record starts with device, date, commit and command.

Benchmarks import this as `import harness` (scripts/ is sys.path[0] when a script runs).
"""

import concurrent.futures
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

L2_BYTES = 60 << 20  # H100 / H200
DESIGN_COPY_BYTES_PER_S = 4.0e12  # DESIGN.md's floors: what XLA reached on the H200
DESIGN_MATMUL_FLOPS = 620e12


# ---- timing ----------------------------------------------------------------------------------------------------
def time_calls(call, *, calls=None, repeats=5, per_call=1, min_calls=1, target_s=0.05, warmup=True) -> list[float]:
    """Seconds per unit of work in each of `repeats` rounds. A round makes `calls` back-to-back calls call(0),
    call(1), ... and waits for the last output (calls run in order on one stream, so it finishes last); its time
    is divided by calls * per_call (per_call: units one call runs, e.g. the steps of a fori_loop inside it).
    call(i) should rotate its inputs by i. calls=None: enough to fill target_s (at least min_calls, at most 500),
    sized from one timed call after the warm-up."""
    if warmup:
        jax.block_until_ready(call(0))
    if calls is None:
        start = time.perf_counter()
        jax.block_until_ready(call(1))
        calls = int(min(500, max(min_calls, target_s / max(time.perf_counter() - start, 1e-6))))
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(calls):
            out = call(i)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / (calls * per_call))
        del out
    return rounds


def median_seconds(call, **kwargs) -> float:
    """The median of `time_calls` (same arguments)."""
    return statistics.median(time_calls(call, **kwargs))


def rotating(fn, arg_sets):
    """call(i) for `time_calls`: fn on the (i mod n)-th argument tuple."""
    return lambda i: fn(*arg_sets[i % len(arg_sets)])


def num_sets(set_bytes, low=2, high=16) -> int:
    """How many input sets of set_bytes each to rotate over so that together they exceed 2x L2."""
    return int(min(high, max(low, math.ceil(2 * L2_BYTES / set_bytes))))


# ---- ceilings ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul rate measured on this device."""

    copy_bytes_per_s: float
    matmul_flops: float
    copy_bytes: int
    matmul_dim: int

    def floor_s(self, nbytes, flops) -> float:
        return max(nbytes / self.copy_bytes_per_s, flops / self.matmul_flops)

    def record(self) -> dict:
        return {
            "copy_TBps": self.copy_bytes_per_s / 1e12,
            "copy_bytes": self.copy_bytes,
            "matmul_bf16_TFLOPs": self.matmul_flops / 1e12,
            "matmul_dim": self.matmul_dim,
        }


def measure_ceilings(small=False) -> Ceilings:
    """XLA's x + 1 over 4 GiB float32 and a bf16 8192^3 matmul on random operands (small: 4 MiB and 256^3, for CPU
    smoke runs), each timed by `time_calls`."""
    n = 1 << (20 if small else 30)
    x = jnp.zeros((n,), jnp.float32)
    add = jax.jit(lambda x: x + 1)
    copy_s = median_seconds(rotating(add, [(x,)]), calls=10 if small else 20)
    del x  # 4 GiB
    m = 256 if small else 8192
    a = [jax.random.normal(jax.random.key(i), (m, m), jnp.bfloat16) for i in range(2)]
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    dot_s = median_seconds(rotating(dot, [(a[0], a[1]), (a[1], a[0])]), calls=10 if small else 20)
    return Ceilings(copy_bytes_per_s=2 * 4 * n / copy_s, matmul_flops=2 * m**3 / dot_s, copy_bytes=8 * n, matmul_dim=m)


# ---- compiling -----------------------------------------------------------------------------------------------------
def compile_all(jobs: dict, workers=12) -> dict:
    """{key: thunk} -> {key: the thunk's result, or the exception it raised} (a kernel that does not compile at a
    shape is a result, not the end of the run), run in parallel threads. Compiling everything before timing
    anything keeps XLA's autotuning on the GPU away from the timed calls."""

    def run(thunk):
        try:
            return thunk()
        except Exception as error:  # noqa: BLE001 -- recorded by the caller
            return error

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {key: pool.submit(run, thunk) for key, thunk in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


def error_text(error: Exception, limit=300) -> str:
    return f"{type(error).__name__}: {str(error)[:limit]}"


# ---- records -----------------------------------------------------------------------------------------------------
def git_commit() -> str:
    """HEAD's short hash, "+uncommitted" when tracked files differ from it, "unknown" outside a checkout."""

    def git(*args):
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__))
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return (head + ("+uncommitted" if git("status", "--porcelain", "--untracked-files=no") else "")) or "unknown"
    except OSError:
        return "unknown"


def record_header(commit=None, device=None, **fields) -> dict:
    """A record's first fields: device, date, commit (default `git_commit()`; a device's copy of the tree may carry
    stale git metadata, so scripts take --commit) and the exact command, XLA_FLAGS included; then `fields`."""
    flags = os.environ.get("XLA_FLAGS")
    return {
        "device": device or f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit or git_commit(),
        "command": " ".join(["python", *sys.argv]),
        **({"xla_flags": flags} if flags else {}),
        **fields,
    }


def add_record_args(parser, out: str):
    """--out (default `out`) and --commit, which every benchmark takes."""
    parser.add_argument("--out", default=out, help=f"JSON record (default: {out})")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")


def write_json(record: dict, path: str):
    """Writes the record atomically (a run stopped mid-write keeps the previous version)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
