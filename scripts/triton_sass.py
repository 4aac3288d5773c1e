"""Inspect what Triton makes of our Pallas kernels for the H200 (sm_90a), without a GPU.

Two steps, in two environments:
  dump     (project venv, jax): lowers a kernel for cuda under an abstract H200 and writes each pallas_call's
           Triton IR as DIR/<name>.w<warps>.s<stages>.ttir;
  compile  (any venv with `pip install triton`): compiles those files for sm_90a and reports registers, spills,
           shared memory and the SASS instruction mix of the innermost loop (the largest backward branch).

  python scripts/triton_sass.py dump --kernel moe --knob m=16 --dir /tmp/ttir
  /path/to/triton-venv/bin/python scripts/triton_sass.py compile /tmp/ttir/*.ttir
The Triton in the pip wheel is not the one jaxlib bundles, so the figures are a guide, not a measurement.
"""

import argparse
import collections
import dataclasses
import os
import pathlib
import re
import sys


def dump(args):
    import warnings

    import jax
    from jax._src.pallas.triton import lowering
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    warnings.filterwarnings("ignore", category=DeprecationWarning)
    out_dir = pathlib.Path(args.dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modules = []
    original = lowering.lower_jaxpr_to_triton_module

    def capture(jaxpr, *rest, **kw):
        result = original(jaxpr, *rest, **kw)
        modules.append((jaxpr.debug_info.func_name, result.module.operation.get_asm()))
        return result

    fn, operands = KERNELS[args.kernel](args)
    lowering.lower_jaxpr_to_triton_module = capture
    h200 = AbstractMesh(
        (1,), ("x",), abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
    )
    try:
        with use_abstract_mesh(h200):
            hlo = jax.jit(fn).trace(*operands).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        lowering.lower_jaxpr_to_triton_module = original
    # Each Triton custom call's backend_config names the warps and stages the wrapper chose.
    launch = re.findall(r'name = "\w+", num_stages = (\d+) : i32, num_warps = (\d+)', hlo)
    for (name, asm), (stages, warps) in zip(modules, launch, strict=True):
        path = out_dir / f"{args.kernel}_{name}.w{warps}.s{stages}.ttir"
        path.write_text(asm)
        print(path)


def moe_case(args):
    """Knobs: any `Tiling` field (m = number of tokens)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import int4_moe_gemm as moe

    e, d, i, k = 384, 7168, 2048, 8
    knobs = dict(args.knob)
    m = int(knobs.pop("m", 16))
    tiling = moe.choose_tiling(m, k)
    tiling = moe.fit_tiling(
        dataclasses.replace(
            tiling, **{key: (value if key == "dequant" else int(value)) for key, value in knobs.items()}
        ),
        d,
        i,
    )
    print(tiling, file=sys.stderr)
    s = jax.ShapeDtypeStruct
    operands = (
        s((m, d), jnp.bfloat16),
        s((m, k), jnp.int32),
        s((m, k), jnp.float32),
        s((e, d // 8, 2, i), jnp.int32),
        s((e, d // 32, 2, i), jnp.bfloat16),
        s((e, i // 8, d), jnp.int32),
        s((e, i // 32, d), jnp.bfloat16),
    )
    return (lambda *a: moe.fused_moe(*a, tiling=tiling)), operands


def attention_case(args):
    """Knobs: c, s (S_max), t, h and the wrapper's block knobs (block_m, block_k, block_r, num_warps, ...)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import tree_mla_attention as attn

    knobs = {key: int(value) for key, value in args.knob}
    c, s_max, t, h = (knobs.pop(key, default) for key, default in (("c", 8), ("s", 32768), ("t", 65), ("h", 64)))
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    operands = (
        s((c, t, h, 512), bf16),
        s((c, t, h, 64), bf16),
        s((c, s_max, 576), bf16),
        s((c,), jnp.int32),
        s((c, t, 576), bf16),
        s((c, t, t), jnp.bool_),
    )
    return (lambda *a: attn.tree_mla_attention(*a, scale=0.1, **knobs)), operands


KERNELS = {"moe": moe_case, "attention": attention_case}


def compile_files(args):
    os.environ.setdefault("TRITON_ALWAYS_COMPILE", "1")  # the cache would hide a changed pass pipeline
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    tools = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin"
    add_stages = CUDABackend.add_stages

    def add_stages_from_ttir(self, stages, options, language):
        """triton.compile skips the passes of an IR file's own stage; XLA runs them, so run them too."""
        add_stages(self, stages, options, language)
        make_ttir, make_ttgir = stages["ttir"], stages["ttgir"]
        stages["ttgir"] = lambda module, metadata: make_ttgir(make_ttir(module, metadata), metadata)

    CUDABackend.add_stages = add_stages_from_ttir
    for path in args.files:
        warps, stages = map(int, re.search(r"\.w(\d+)\.s(\d+)\.ttir$", path).groups())
        kernel = triton.compile(
            path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)
        )
        cubin = pathlib.Path(path).with_suffix(".cubin")
        cubin.write_bytes(kernel.asm["cubin"])
        run = lambda *cmd: (
            subprocess.run(
                [str(tools / cmd[0]), *cmd[1:], str(cubin)], capture_output=True, text=True, check=True
            ).stdout
        )
        usage = re.search(r"REG:(\d+) STACK:(\d+).*LOCAL:(\d+)", run("cuobjdump", "--dump-resource-usage"))
        print(
            f"== {pathlib.Path(path).name}: regs {usage[1]}, stack {usage[2]}, local {usage[3]}, "
            f"smem {kernel.metadata.shared} bytes"
        )
        report_loop(run("nvdisasm", "-c"), args.top)


def report_loop(sass, top):
    """Opcode histogram of the largest loop: the backward branch spanning the most instructions."""
    labels, lines = {}, []
    for line in sass.splitlines():
        label = re.match(r"(\.L_x_\d+):", line)
        if label:
            labels[label[1]] = len(lines)
        inst = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if inst:
            lines.append(inst[1])
    loops = [
        (labels[m[1]], end)
        for end, text in enumerate(lines)
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", text)) and labels.get(m[1], end) < end
    ]
    if not loops:
        print("  no loop")
        return
    start, end = max(loops, key=lambda loop: loop[1] - loop[0])
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", text).split()[0] for text in lines[start : end + 1]]
    for strip in (True, False):
        counts = collections.Counter(op.split(".")[0] if strip else op for op in opcodes)
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common(top)))
    print(f"  loop: {end + 1 - start} instructions")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--kernel", choices=sorted(KERNELS), required=True)
    d.add_argument("--dir", required=True)
    d.add_argument(
        "--knob",
        type=lambda kv: tuple(kv.split("=", 1)),
        action="append",
        default=[],
        help="name=value, e.g. m=16 block_m=32 (moe) or t=65 block_r=512 (attention)",
    )
    c = sub.add_parser("compile")
    c.add_argument("files", nargs="+")
    c.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    dump(args) if args.cmd == "dump" else compile_files(args)


if __name__ == "__main__":
    main()
