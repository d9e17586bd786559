#!/usr/bin/env bash
# safetensors across languages: C writes -> Python (tests/py/safetensors_io.py) reads; Python
# writes -> C reads, with the header padded to 8 bytes and with an odd length (data unaligned).
# The fixture is the PORTABLE table of tests/test_safetensors.c; the copy below must agree with it
# value for value.
set -euo pipefail
BUILD=${BUILD:-build}
PYTHON=${PYTHON:-$BUILD/venv/bin/python}
TEST_TMP=${TEST_TMP:-$(mktemp -d)}
TOOL=$BUILD/tests/test_safetensors

"$TOOL" write "$TEST_TMP/from_c.safetensors"

"$PYTHON" - "$TEST_TMP" <<'EOF'
import json
import struct
import sys

import numpy as np

sys.path.insert(0, "tests/py")
import safetensors_io  # noqa: E402

tmp = sys.argv[1]
EXPECTED = {
    "f64": np.array([[0.1, -2.5, 1e300], [3.141592653589793, -0.0, 1.0 / 3.0]], np.float64),
    "f32": (np.arange(12, dtype=np.float32) * np.float32(0.25) - np.float32(1.5)).reshape(3, 4),
    "f16": np.array([1, -2, 0.5, 65504], np.float16),
    "i64": np.array([-(1 << 40), 0, (1 << 40) + 5, 2**63 - 1], np.int64),
    "i32": np.array([[-7, 0], [100000, 2**31 - 1]], np.int32),
    "i8": np.array([-128, -1, 0, 127], np.int8),
    "u8": np.array([0, 128, 255], np.uint8),
    "u16": np.array([0, 65535], np.uint16),
    "u32": np.array([1, 2**32 - 1], np.uint32),
    "scalar": np.array(3.5, np.float32),
    "empty": np.zeros((0, 3), np.float32),
    'odd "name" \\ \u00e9\t': np.array([42], np.int32),
    "x" * 300: np.array([7], np.uint8),
}
METADATA = {"format": "pt", "step": "150", "note": 'quote " and newline \n'}

# C -> Python: same names, dtypes, shapes and bytes (tobytes keeps the sign of -0.0).
tensors, metadata = safetensors_io.load(f"{tmp}/from_c.safetensors")
assert sorted(tensors) == sorted(EXPECTED), sorted(set(tensors) ^ set(EXPECTED))
for name, want in EXPECTED.items():
    got = tensors[name]
    assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
    assert got.tobytes() == want.tobytes(), (name, got, want)
assert metadata == METADATA, metadata
print(f"python read the C file: {len(tensors)} tensors and metadata as expected")

# Python -> C, written twice: padded to 8 bytes as save() does, and re-written with an odd header
# length, as a foreign writer may, so that the C reader sees unaligned data.
safetensors_io.save(f"{tmp}/saved.safetensors", EXPECTED, METADATA)
with open(f"{tmp}/saved.safetensors", "rb") as f:
    blob = f.read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + n])
assert header["scalar"]["shape"] == [], header["scalar"]  # 0-d stays 0-d
data = blob[8 + n:]
text = json.dumps(header).encode()
for name, pad in (("from_python", -len(text) % 8), ("from_python_unpadded", 1 - len(text) % 2)):
    padded = text + b" " * pad
    with open(f"{tmp}/{name}.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(padded)) + padded + data)
EOF

"$TOOL" check "$TEST_TMP/from_python.safetensors"
"$TOOL" check "$TEST_TMP/from_python_unpadded.safetensors"
echo "safetensors C <-> Python: ok"
