"""Dequantizes blocks with the `gguf` package's reference dequantizers (an implementation
nobody in this project wrote), for tests/e2e/dequant.rs.

    python3 gguf_dequant.py DIR NAME...

reads DIR/NAME.bin (raw blocks of GGML type NAME) and writes DIR/NAME.f32 (little-endian f32)."""
import sys

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

directory = sys.argv[1]
for name in sys.argv[2:]:
    raw = np.fromfile(f"{directory}/{name}.bin", dtype=np.uint8)
    values = dequantize(raw, GGMLQuantizationType[name]).astype("<f4")
    values.tofile(f"{directory}/{name}.f32")
