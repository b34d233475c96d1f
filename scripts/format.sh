#!/usr/bin/env bash
# Formats the tree's C++ and CUDA sources with clang-format (style: .clang-format), or with
# --check only reports the files that differ from it and fails. Installs clang-format (Debian's
# clang-format-14, the version the tree was formatted with) when it is missing.
# Usage: scripts/format.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
format=""
for candidate in clang-format-14 clang-format; do
  if command -v "$candidate" >/dev/null 2>&1; then format="$candidate"; break; fi
done
if [ -z "$format" ]; then
  scripts/install_packages.sh format clang-format-14
  format=clang-format-14
fi
mapfile -t files < <(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do
    "$format" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "format: ${#bad[@]} file(s) differ from .clang-format (scripts/format.sh fixes them):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files follow .clang-format"
else
  "$format" -i "${files[@]}"
fi
