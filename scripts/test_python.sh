#!/usr/bin/env bash
# The Python package's test suite: installs what it needs (Debian build packages if missing), makes
# its own virtual environment build/venv (Debian's system Python refuses pip installs, PEP 668),
# installs the Python build and test dependencies there with pip, builds and installs the package
# (`pip install .`, incremental: the CMake build folder build/py/ is kept), and runs pytest on
# python/tests. Exits with pytest's status; "no tests collected" (pytest's 5) is a failure.
#
# Usage: scripts/test_python.sh [pytest arguments]     e.g. scripts/test_python.sh -k ray -x
# Environment: PYTHON (default python3) makes the virtual environment; REFIT_VENV (default
# build/venv) is where it lives; NIXL's nixl-cu12 is installed without its dependencies (test_nixl.py);
# REFIT_TEST_TORCH=1 also installs PyTorch from PyPI (large: its
# default wheels bring CUDA libraries) so that the torch tests run instead of skipping.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE_PYTHON="${PYTHON:-python3}"
VENV="${REFIT_VENV:-build/venv}"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
start=$SECONDS

# C++ build dependencies (the same packages scripts/setup.sh installs), only those missing.
# python3-venv and python3-dev: Debian's Python makes no virtual environment and builds no
# extension without them.
packages=(build-essential cmake ninja-build pkg-config libucx-dev libyaml-cpp-dev nlohmann-json3-dev
          libcli11-dev libspdlog-dev libfmt-dev libxxhash-dev python3-venv python3-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "test_python: installing ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi

# The virtual environment, made once (a broken one, e.g. left by an interrupted run, is made anew).
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
  echo "=== test_python: making the virtual environment $VENV ($BASE_PYTHON)"
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
fi
PYTHON="$VENV/bin/python"

# Python build and test dependencies (pip leaves those already satisfied alone); matplotlib for
# refit.timeline's charts.
deps=("scikit-build-core>=0.10" "nanobind>=2.4" "pytest" "numpy" "ml-dtypes" "ray" "matplotlib")
[ "${REFIT_TEST_TORCH:-0}" = "1" ] && deps+=("torch")
echo "=== test_python: pip install ${deps[*]}"
"$PYTHON" -m pip install -q "${deps[@]}"

# NIXL's Python package for the backend_name NIXL tests (test_nixl.py), without its PyTorch
# dependency (NIXL imports torch only when given torch tensors). Optional: where PyPI has no wheel
# for this Python, those tests skip and say why.
if ! "$PYTHON" -c 'import nixl_cu12' 2>/dev/null; then
  echo "=== test_python: pip install --no-deps nixl-cu12"
  "$PYTHON" -m pip install -q --no-deps "nixl-cu12" || echo "test_python: nixl-cu12 could not be installed; the NIXL tests will skip"
fi

# Build and install the package. --no-build-isolation reuses the build dependencies above and the
# persistent CMake folder build/py/<wheel tag>, so a rebuild compiles only what changed.
echo "=== test_python: pip install . (build log: build/py/pip-install.log)"
mkdir -p build/py
if ! "$PYTHON" -m pip install --no-build-isolation -v . >build/py/pip-install.log 2>&1; then
  tail -n 60 build/py/pip-install.log
  echo "test_python: building the package failed (full log: build/py/pip-install.log)" >&2
  exit 1
fi
echo "=== test_python: built and installed in $((SECONDS - start)) s"

# The tests import the installed package (python/tests has no refit/ beside it).
set +e
"$PYTHON" -m pytest -p no:cacheprovider -ra python/tests "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "test_python: pytest collected no tests" >&2
  exit 1
fi
echo "=== test_python: pytest exited with $status after $((SECONDS - start)) s"
exit "$status"
