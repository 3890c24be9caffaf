"""A model folder's identity by content, for the KV fingerprint: nodes whose blocks are meant to be
interchangeable must run the same weights, whatever their folders are called.

    sha256( config.json || weight index (each safetensors file's name, size and header) ||
            first and last 1 MiB of each weights file || tokenizer.json )

Headers name every tensor with its dtype, shape and offsets; the sampled bytes tell apart
checkpoints of one shape with other values (seeded test models, fine-tunes). Torch-free and cheap
(a few MiB read), so the router can check the nodes it is given.
"""

from __future__ import annotations

import hashlib
import pathlib
import struct

_SAMPLE_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors",)


def weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)


def model_digest(folder: str | pathlib.Path) -> str:
    """``sha256:<hex>`` of the folder's config, weights (index and samples) and tokenizer."""
    folder = pathlib.Path(folder)
    digest = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for path in weight_files(folder):
        digest.update(_weights_part(path))
    if (folder / "tokenizer.json").is_file():
        digest.update(b"tokenizer.json\0" + (folder / "tokenizer.json").read_bytes())
    return "sha256:" + digest.hexdigest()[:32]


def _weights_part(path: pathlib.Path) -> bytes:
    size = path.stat().st_size
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = f.read(min(header_len, size))
        head = f.read(_SAMPLE_BYTES)
        f.seek(max(0, size - _SAMPLE_BYTES))
        tail = f.read(_SAMPLE_BYTES)
    return path.name.encode() + struct.pack("<Q", size) + header + head + tail
