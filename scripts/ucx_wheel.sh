#!/usr/bin/env bash
# Builds and runs refit against the CUDA-aware UCX of PyPI's `libucx-cu13` wheel (UCX 1.22 with
# the cuda_copy/cuda_ipc transports, headers, pkg-config files, ucx_info and ucx_perftest), on a
# machine that cannot download (the lent GPU machine). Unpacks the wheel fetched beforehand into
# .device/ucx-wheel, points its pkg-config files at it, unpacks xxhash's header from the Debian
# packages in .device/debs (scripts/device_deps.sh says how to fetch them) and prints the
# environment to build and run with. Beforehand, on a machine with network:
#   pip download --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 libucx-cu13 -d .device/wheels
#   (cd .device/debs && apt-get download libxxhash-dev libxxhash0)
# Then, there:
#   eval "$(scripts/ucx_wheel.sh)"
#   BUILD_DIR=build/gpu-ucx-wheel scripts/gpu_test.sh
# It runs without a GPU too (its CUDA modules then fail to load, quietly), e.g. on a CPU machine:
#   eval "$(scripts/ucx_wheel.sh)"; cmake --preset release -B build/ucx122 && cmake --build build/ucx122
#   ctest --test-dir build/ucx122 -R Ucx
# UCX's own libraries never mix with another UCX's: no other UCX goes on the search paths.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD/.device/ucx-wheel"
wheel="$(ls .device/wheels/libucx_cu13-*.whl 2>/dev/null | sort -V | tail -n 1 || true)"
if [ -z "$wheel" ]; then
  echo "ucx_wheel: no libucx_cu13-*.whl in .device/wheels; download it first (see the top of $0)" >&2
  exit 1
fi
if [ ! -f "$root/.unpacked" ] || [ "$(cat "$root/.unpacked")" != "$(basename "$wheel")" ]; then
  rm -rf "$root"
  mkdir -p "$root"
  python3 -m zipfile -e "$wheel" "$root"
  # The wheel's .pc files name the prefix it was built in; zip keeps no execute bits.
  for pc in "$root"/libucx/lib/pkgconfig/*.pc; do
    sed -i -E "s|^prefix *= *.*\$|prefix=$root/libucx|" "$pc"
  done
  chmod +x "$root"/libucx/bin/*
  basename "$wheel" >"$root/.unpacked"
fi
xxhash="$PWD/.device/xxhash-prefix"
if [ ! -d "$xxhash/usr" ]; then
  debs=(.device/debs/libxxhash*.deb)
  if [ ! -e "${debs[0]}" ]; then
    echo "ucx_wheel: no libxxhash*.deb in .device/debs; download them first (see the top of $0)" >&2
    exit 1
  fi
  mkdir -p "$xxhash"
  for deb in "${debs[@]}"; do dpkg -x "$deb" "$xxhash"; done
  for pc in "$xxhash"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
    sed -i -E "s|^prefix *= */usr\$|prefix=$xxhash/usr|" "$pc"
  done
fi
ucx="$root/libucx"
xlib="$xxhash/usr/lib/x86_64-linux-gnu"
echo "export PKG_CONFIG_PATH=$ucx/lib/pkgconfig:$xlib/pkgconfig\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}"
echo "export LD_LIBRARY_PATH=$ucx/lib:$xlib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export UCX_MODULE_DIR=$ucx/lib/ucx"
echo "export CPATH=$xxhash/usr/include\${CPATH:+:\$CPATH}"
echo "export PATH=$ucx/bin:\$PATH"
