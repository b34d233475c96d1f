#!/usr/bin/env bash
# Makes what scripts/gpu_nixl.sh needs on the GPU machine, which cannot download, in
# .device/nixl-slim: NIXL's nixl-cu13 wheel for Python 3.12 cut down to its Python API, its UCX
# plugin and what those load (readelf's NEEDED closure, plus UCX's modules), as an xz tarball of
# about 10 MB (the wheel is 59 MB, over what a device call carries beside the tree), and the
# wheels the tests import there (pytest and its dependencies, ml_dtypes).
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device/nixl-slim
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out/wheels"
pip download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
  -d "$work" nixl-cu13
pip download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux_2_28_x86_64 \
  --platform manylinux2014_x86_64 -d "$out/wheels" pytest pluggy iniconfig packaging ml_dtypes
(cd "$work" && unzip -q nixl_cu13-*.whl)
python3 - "$work" > "$work/files.txt" <<'PY'
import glob, os, re, subprocess, sys
os.chdir(sys.argv[1])
libs = {}
for d in ("nixl_cu13.libs", "nixl_cu13.libs/ucx", ".nixl_cu13.mesonpy.libs", ".nixl_cu13.mesonpy.libs/plugins"):
    for f in os.listdir(d):
        if os.path.isfile(os.path.join(d, f)):
            libs.setdefault(f, os.path.join(d, f))
todo = glob.glob("nixl_cu13/*.so") + [".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"] + \
       glob.glob("nixl_cu13.libs/ucx/*.so*")
keep = set()
while todo:
    path = todo.pop()
    if path in keep:
        continue
    keep.add(path)
    dynamic = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, check=True).stdout
    todo += [libs[n] for n in re.findall(r"\(NEEDED\).*\[(.*)\]", dynamic) if n in libs]
keep |= set(glob.glob("nixl_cu13/*.py")) | set(glob.glob("nixl_cu13.libs/ucx/*.la"))  # UCX finds modules by .la
print("\n".join(sorted(keep)))
PY
tar -cJf "$out/nixl_cu13-slim.tar.xz" -C "$work" -T "$work/files.txt"
ls -l "$out" "$out/wheels"
