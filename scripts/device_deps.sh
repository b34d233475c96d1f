#!/usr/bin/env bash
# On a machine that lacks refit's build dependencies and cannot download (the lent GPU machine):
# unpacks the Debian packages fetched beforehand into .device/debs (`apt-get download libucx0
# libucx-dev libxxhash-dev libxxhash0 libnuma1 libibverbs1 librdmacm1`) into a private prefix,
# points their pkg-config files at it, and prints the environment to build and run with:
#   eval "$(scripts/device_deps.sh)"
set -euo pipefail
cd "$(dirname "$0")/.."
prefix="$PWD/.device/prefix"
if [ ! -d "$prefix/usr" ]; then
  mkdir -p "$prefix"
  for deb in .device/debs/*.deb; do dpkg -x "$deb" "$prefix"; done
  for pc in "$prefix"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
    sed -i -E "s|^prefix *= */usr\$|prefix=$prefix/usr|" "$pc"
  done
fi
lib="$prefix/usr/lib/x86_64-linux-gnu"
echo "export PKG_CONFIG_PATH=$lib/pkgconfig\${PKG_CONFIG_PATH:+:\$PKG_CONFIG_PATH}"
echo "export LD_LIBRARY_PATH=$lib:$lib/ucx\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
echo "export UCX_MODULE_DIR=$lib/ucx"
echo "export CPATH=$prefix/usr/include\${CPATH:+:\$CPATH}"
