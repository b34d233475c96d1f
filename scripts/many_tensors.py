#!/usr/bin/env python3
"""Writes a safetensors file of many small tensors, for refit's cost per tensor:
`scripts/many_tensors.py 50000 /tmp/many-50k.safetensors` (50,000 random uint8 tensors of 1 KiB,
100 per "layer"), then `refit bench --model /tmp/many-50k.safetensors refit_cfg.nixl.bucket_bytes=16MiB`."""
import json
import os
import struct
import sys


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: many_tensors.py COUNT PATH [BYTES_PER_TENSOR (default 1024)]")
    count, path = int(sys.argv[1]), sys.argv[2]
    size = int(sys.argv[3]) if len(sys.argv) == 4 else 1024
    header = {
        f"model.layers.{i // 100}.t{i % 100}.weight": {"dtype": "U8", "shape": [size], "data_offsets": [i * size, (i + 1) * size]}
        for i in range(count)
    }
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.write(os.urandom(count * size))


if __name__ == "__main__":
    main()
