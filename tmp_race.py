import functools, json, os
import jax
from scripts import bench_verify_attn as b
from pallas_kernels import mla_prefix_mosaic as mp
from pallas_kernels.tree_mla_attention import tree_mla_attention
orig = mp.mla_prefix_attention
out = {"rows": []}
ceil = b.measure_ceilings()
out["ceilings"] = ceil
print("ceilings", ceil, flush=True)
for point in [(8, 32768, 65, 64), (8, 32768, 1, 64), (1, 8192, 65, 64), (8, 32768, 65, 8), (8, 65536, 1, 64), (16, 4096, 33, 64)]:
  sets = b.make_input_sets(*point, b.num_sets_for(*point))
  ref = b.reference_output(sets[0]) if point[1] * point[2] <= 32768 * 33 else None
  for overlap in (True, False):
    mp.mla_prefix_attention = functools.partial(orig, overlap=overlap)
    k = b.compile_all({0: (functools.partial(tree_mla_attention, scale=b.SCALE, prefix_kernel="mosaic"), point)})[0]
    row = b.time_row(point, sets, ceil, k, dict(prefix_kernel="mosaic", overlap=overlap), reference=ref)
    print(b.fmt(row), "rel_err", row.get("rel_err"), flush=True)
    out["rows"].append(row)
    json.dump(out, open(os.environ["OUT"] + "/mosaic_overlap_race.json", "w"), indent=1)
