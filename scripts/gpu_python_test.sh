#!/usr/bin/env bash
# The Python package's GPU tests on a machine with a GPU and no network (the lent GPU machine):
# builds the extension module refit._refit with the CUDA data path straight with CMake (no pip
# build backend needed), lays it beside python/refit in a private folder, and runs pytest on the
# GPU tests (python/tests/test_cuda.py, test_dtensor_reshard.py; more with arguments). pytest and
# NumPy come from the machine, or from wheels in .device/wheels (`pip download pytest pluggy
# iniconfig packaging pygments numpy` for its Python), unpacked into that folder.
# Needs the C++ dependencies as scripts/gpu_test.sh does (eval "$(scripts/device_deps.sh)").
#
# Usage: scripts/gpu_python_test.sh [pytest arguments]   (default: the two files above)
# Environment: BUILD_DIR (default build/gpu-python), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
build="${BUILD_DIR:-build/gpu-python}"
python="${PYTHON:-python3}"
command -v nvcc >/dev/null 2>&1 || export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
cmake -S . -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DREFIT_WITH_CUDA=ON -DREFIT_BUILD_PYTHON=ON \
  -DREFIT_BUILD_TESTS=OFF -DREFIT_BUILD_BENCH=OFF -DPython_EXECUTABLE="$(command -v "$python")"
cmake --build "$build" -j "$(nproc)" --target _refit

site="$build/site"
rm -rf "$site/refit"
mkdir -p "$site/refit"
cp python/refit/*.py python/refit/py.typed "$site/refit/"
cp "$build"/python/_refit*.so "$site/refit/"
for module in pytest numpy; do
  if ! PYTHONPATH="$site" "$python" -c "import $module" 2>/dev/null; then
    ls .device/wheels/*.whl >/dev/null 2>&1 || { echo "gpu_python_test: no $module here and no wheels in .device/wheels" >&2; exit 1; }
    # A wheel is a zip of what goes into site-packages: no pip needed.
    "$python" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$site" .device/wheels/*.whl
  fi
done
PYTHONPATH="$site:python/tests" "$python" -c "import refit; print('refit', refit.__version__, 'cuda_built', refit.cuda_built(), 'GPUs', refit.cuda_device_count())"
if [ $# -eq 0 ]; then set -- python/tests/test_cuda.py python/tests/test_dtensor_reshard.py; fi
PYTHONPATH="$site:python/tests" "$python" -m pytest -p no:cacheprovider -ra "$@"
