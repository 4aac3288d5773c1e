#!/usr/bin/env bash
# The server's and the openai client's Python packages as wheels in .whl/, for the GPU machine (no package
# registry there): the installed closure of fastapi, uvicorn, prometheus_client and openai at the versions this
# venv pins, for Python 3.12 on x86-64 Linux (a few MB). Carry .whl in the device call and install it first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
#       .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=$(.venv/bin/python - <<'PY'
import importlib.metadata as md

from packaging.requirements import Requirement

todo, seen = ["fastapi", "uvicorn", "prometheus_client", "openai"], {}
while todo:
    name = todo.pop()
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        raise SystemExit(f"{name}: not in .venv (run scripts/setup.sh: the test extra has the server's packages)")
    key = dist.metadata["Name"].lower().replace("_", "-")
    if key in seen:
        continue
    seen[key] = dist.version
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):  # this Linux / CPython 3.12, no extras
            todo.append(req.name)
print(" ".join(f"{k}=={v}" for k, v in sorted(seen.items())))
PY
)
rm -rf .whl && mkdir -p .whl
for pin in $pins; do
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$pin" 2>&1 | grep -v "is neither a file nor a directory" || true
done
for pin in $pins; do  # every pin must have its wheel
  name=${pin%%==*}
  ls .whl | grep -qi "^${name//-/[-_]}-" || { echo "no wheel for $pin" >&2; exit 2; }
done
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl: $pins"
