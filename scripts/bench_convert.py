"""Converter benchmark on this CPU host: throughput against plain file copy, peak RSS against the largest layer.

    python scripts/bench_convert.py [--depths 2 4] [--experts 96] [--workdir /work/bench_convert_tmp]

For each depth N: writes a synthetic full-width `k26-depthN` HF checkpoint with `--experts` routed experts
(python -m convert.make_tiny), copies its files once with shutil (the copy ceiling: same bytes read and written,
same page-cache state), converts it in a fresh process, and reads that process's peak RSS from wait4. Peak RSS is
reported as a multiple of the largest decoder layer's bytes (a full-width MoE layer with 96 experts is ~2.6 GB);
the target is <= 2.5x and flat in depth. The converter's CPU seconds per GB are recorded too: on this shared 2-core
host the wall-clock rate depends on what else runs. The synthetic files are deleted afterwards.
Writes bench/results/convert_cpu.json.
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

import harness
import jax
import jax.numpy as jnp

from convert.make_tiny import hf_config, tiny_text_config
from k26jax.config import ModelConfig
from k26jax.model import target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONVERT_CHILD = """
import json, sys
from convert.converter import Options, convert
print(json.dumps(convert(Options(hf_dir=sys.argv[1], out=sys.argv[2], progress=False), log=lambda s: None)))
"""
IMPORT_CHILD = "import convert.converter, convert.zarr_tree, tqdm"


def run_child(code: str, *args) -> tuple[str, int, float]:
    """(stdout, peak RSS bytes, CPU seconds) of `python -c code args` in a fresh process."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"child failed with status {os.waitstatus_to_exitcode(status)}")
    return out, usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def layer_bytes(cfg: ModelConfig) -> int:
    """Bytes of the largest decoder layer in the converted tree (bf16; routed experts INT4 + scales)."""
    tree = target.abstract_params(cfg, jnp.bfloat16)
    return max(
        sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree[kind])) // n
        for kind, n in (("dense", cfg.num_dense_layers), ("moe", cfg.num_moe_layers))
        if n
    )


def evict(path: str) -> None:
    """Flushes and drops `path`'s files from the page cache, so the next reader starts from the disk."""
    os.sync()
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def bench_depth(depth: int, experts: int, workdir: str) -> dict:
    hf, out, copy = (os.path.join(workdir, n) for n in ("hf", "out", "copy"))
    for d in (hf, out, copy):
        shutil.rmtree(d, ignore_errors=True)
    preset = f"k26-depth{depth}"
    t = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "convert.make_tiny",
            "--out",
            hf,
            "--preset",
            preset,
            "--experts",
            str(experts),
            "--no-drafter",
        ],
        cwd=ROOT,
        check=True,
    )
    gen_s = time.perf_counter() - t
    cfg = ModelConfig.from_hf_dict(hf_config(tiny_text_config(preset, experts)))
    hf_bytes = dir_bytes(hf)

    os.makedirs(copy)
    evict(hf)
    t = time.perf_counter()
    for name in sorted(os.listdir(hf)):
        shutil.copyfile(os.path.join(hf, name), os.path.join(copy, name))
    os.sync()
    copy_s = time.perf_counter() - t
    shutil.rmtree(copy)

    _, base_rss, _ = run_child(IMPORT_CHILD)
    evict(hf)
    t = time.perf_counter()
    stdout, peak_rss, cpu_s = run_child(CONVERT_CHILD, hf, out)
    os.sync()  # as for the copy: the time includes flushing the written files
    convert_s = time.perf_counter() - t
    summary = json.loads(stdout.strip().splitlines()[-1])
    out_bytes = dir_bytes(out)
    largest = layer_bytes(cfg)
    shutil.rmtree(hf)
    shutil.rmtree(out)
    row = {
        "preset": preset,
        "n_routed_experts": experts,
        "layers": cfg.num_hidden_layers,
        "moe_layers": cfg.num_moe_layers,
        "hf_bytes": hf_bytes,
        "out_bytes": out_bytes,
        "largest_layer_bytes": largest,
        "generate_s": round(gen_s, 1),
        "copy_s": round(copy_s, 2),
        "copy_MBps": round(hf_bytes / copy_s / 1e6, 1),
        "convert_s": round(convert_s, 2),
        "in_process_s": round(summary["write_s"], 2),
        "convert_MBps": round(hf_bytes / convert_s / 1e6, 1),
        "convert_cpu_s": round(cpu_s, 1),
        "cpu_s_per_GB": round(cpu_s / (hf_bytes / 1e9), 2),
        "peak_rss_bytes": peak_rss,
        "import_rss_bytes": base_rss,
        "peak_rss_x_largest_layer": round(peak_rss / largest, 2),
        "peak_rss_minus_imports_x_largest_layer": round((peak_rss - base_rss) / largest, 2),
    }
    row["pct_of_floor"] = round(100 * row["convert_MBps"] / row["copy_MBps"], 1)
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--depths", type=int, nargs="+", default=[2, 4])
    p.add_argument("--experts", type=int, default=96)
    p.add_argument("--workdir", default=os.path.join(os.path.dirname(ROOT), "bench_convert_tmp"))
    harness.add_record_args(p, os.path.join(ROOT, "bench", "results", "convert_cpu.json"))
    a = p.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    try:
        rows = [bench_depth(d, a.experts, a.workdir) for d in a.depths]
    finally:
        shutil.rmtree(a.workdir, ignore_errors=True)
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    device = f"CPU host: {os.cpu_count()} cores, {ram_gib:.0f} GiB RAM, {platform.platform()}"
    harness.write_json(harness.record_header(a.commit, device=device, rows=rows), a.out)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
