# Shared by the GPU benchmark scripts (sourced).

# size_bytes SIZE: bytes of "1GiB", "512MiB", "64KiB" or a plain number.
size_bytes() {
  python3 -c "import sys; s=sys.argv[1]; u={'KiB':10,'MiB':20,'GiB':30}; print(int(s[:-3])<<u[s[-3:]] if s[-3:] in u else int(s))" "$1"
}
