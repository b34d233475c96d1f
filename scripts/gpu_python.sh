#!/usr/bin/env bash
# The Python package's GPU tests on the lent GPU machine (PyTorch with CUDA there): builds the
# extension with the CUDA data path (python_site in scripts/gpu_common.sh) and runs pytest on the
# given test files of python/tests (default: test_cuda.py test_parameter_loader.py).
#   eval "$(scripts/device_deps.sh)"; scripts/gpu_python.sh [TEST_FILE...]
# Carry: .device/debs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_common.sh
build="${BUILD_DIR:-build/gpupy}"
python_site "$build"
export PYTHONPATH="$PWD/$build/site${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import refit; print("refit", refit.__version__, "cuda_built", refit.cuda_built())'
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(test_cuda.py test_parameter_loader.py)
cd python/tests && python3 -m pytest -q -p no:cacheprovider -rs "${tests[@]}"
