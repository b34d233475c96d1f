# Shared by the GPU benchmark scripts (sourced).

# size_bytes SIZE: bytes of "1GiB", "512MiB", "64KiB" or a plain number.
size_bytes() {
  python3 -c "import sys; s=sys.argv[1]; u={'KiB':10,'MiB':20,'GiB':30}; print(int(s[:-3])<<u[s[-3:]] if s[-3:] in u else int(s))" "$1"
}

# python_site BUILD: builds refit's Python extension with the CUDA data path into BUILD and
# assembles an importable package under BUILD/site (the lent GPU machine has Python, nanobind and
# PyTorch, but cannot pip install refit); prints nothing else. Put BUILD/site on PYTHONPATH.
python_site() {
  local build="$1" site="$1/site"
  mkdir -p "$site"
  export PATH="${CUDA_HOME:-/usr/local/cuda}/bin:$PATH"
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DREFIT_WITH_CUDA=ON -DREFIT_BUILD_PYTHON=ON \
    -DREFIT_BUILD_TESTS=OFF -DREFIT_BUILD_BENCH=OFF -DPython_EXECUTABLE="$(command -v python3)" >/dev/null
  cmake --build "$build" -j "$(nproc)" --target _refit >/dev/null
  rm -rf "$site/refit" && cp -r python/refit "$site/refit"
  cp "$(find "$build" -name "_refit*.so" | head -n 1)" "$site/refit/"
}
