"""A checkpoint's model identity: what the draft and the target must agree on before they pair.

identity = sha256 over config.json (parsed and re-serialized with sorted keys, so formatting does not
count) and every tensor's name, dtype and shape, read from the safetensors headers (the 8-byte header
length and the JSON after it) — never a byte of tensor data, so it costs milliseconds even for a
checkpoint of hundreds of gigabytes. Two checkpoints of one architecture and one layout with
different weight *values* (a fine-tune) share an identity; a different config or tensor set does not.
No torch here: the value travels as a string (GetInfo, the bridge's handshake).
"""
from __future__ import annotations

import functools
import hashlib
import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 << 20          # safetensors' own limit on a header


def safetensors_header(path: Path) -> dict:
    """The JSON header of one .safetensors file: name -> {dtype, shape, data_offsets}."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: safetensors header of {n} bytes is not plausible")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


@functools.lru_cache(maxsize=8)
def model_identity(model_dir: str) -> str:
    """'sha256:<16 hex>' of config.json and the tensors' names, dtypes and shapes (a random model id,
    `random:NAME:seed=S`: of the preset's config, its name and the seed; models/presets.py)."""
    from models.presets import parse_random_id, random_identity
    if parse_random_id(model_dir) is not None:
        return random_identity(model_dir)
    root = Path(model_dir)
    h = hashlib.sha256()
    config = json.loads((root / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    tensors = {}
    for f in weight_files(root):
        tensors.update(safetensors_header(f))
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"\n{name} {t['dtype']} {list(t['shape'])}".encode())
    return "sha256:" + h.hexdigest()[:16]
