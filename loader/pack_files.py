"""The pack directory's files checked against a parsed manifest: sizes, checksums, expert-file headers, blob placement.

``read_manifest`` (``loader.packed``) checks the manifest document alone; ``verify_files`` then
checks what the manifest says about the files before anything is built from them: every carried
and dense file has its recorded size, every expert file its size and the exact header bytes pack
wrote, each header's ``expert.{e}`` entry lies where the manifest's reference says, and no two
blobs of one file overlap. ``read_owned`` reads a whole file once into memory and checks its
checksum on those very bytes, so what is built from them is what was checked, whatever happens
to the file afterwards. Only regular files are read: a FIFO, device or folder where a file should
be is refused before a read could block or never end. Problems in the manifest's own claims are
``FormatError``; files whose bytes differ from what the manifest recorded are ``IntegrityError``.
Both name the file.
"""
from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from pathlib import Path
from typing import BinaryIO

from .manifest_parse import FormatError
from .shown import show
from .packed import Manifest


class IntegrityError(RuntimeError):
    """A packed file's bytes differ from what the manifest recorded (changed, truncated or corrupt)."""


def open_regular(path: Path, what: str) -> BinaryIO:
    """``path`` open for reading, refused unless it is a regular file (a FIFO there would block the
    open until a writer came, a device would never end). ``what`` names the file in errors."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting; no effect on a file
    except FileNotFoundError:
        raise IntegrityError(f"{what} {str(path)!r} is missing; re-pack") from None
    except OSError as e:
        raise IntegrityError(f"{what} {str(path)!r} cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{what} {str(path)!r} is not a regular file (a folder, FIFO or device); re-pack")
    return os.fdopen(fd, "rb")


def read_owned(root: Path, name: str, info: dict, what: str) -> bytes:
    """File ``name``'s bytes, read once and checked against ``info``'s size and CRC32."""
    path = root / name
    with open_regular(path, what) as f:
        try:
            data = f.read(info["nbytes"] + 1)
        except OSError as e:
            raise IntegrityError(f"{what} {str(path)!r} cannot be read ({e.strerror or e})") from None
    if len(data) != info["nbytes"] or zlib.crc32(data) != info["crc32"]:
        raise IntegrityError(f"{what} {str(path)!r} differs from the manifest's record "
                             f"({len(data) if len(data) <= info['nbytes'] else 'more than ' + str(info['nbytes'])} bytes, "
                             f"recorded {info['nbytes']}; or its crc32 differs): changed or truncated after packing; re-pack")
    return data


def _size(path: Path, nbytes: int, what: str) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise IntegrityError(f"{what} {str(path)!r} is missing; re-pack") from None
    except OSError as e:  # a folder on its path that is a file, a symlink loop
        raise IntegrityError(f"{what} {str(path)!r} cannot be read ({e.strerror or e}); re-pack") from None
    if size != nbytes:
        raise IntegrityError(f"{what} {str(path)!r} has {size} bytes, the manifest recorded {nbytes}: truncated or changed; re-pack")


def _expert_header(path: Path, info: dict) -> dict:
    """An expert file's safetensors header, after checking its bytes against the manifest's CRC."""
    with open_regular(path, "expert file") as f:
        head = f.read(info["header_bytes"])
    if len(head) != info["header_bytes"] or zlib.crc32(head) != info["header_crc32"]:
        raise IntegrityError(f"expert file {str(path)!r}: its header differs from the manifest's record; re-pack")
    (n,) = struct.unpack("<Q", head[:8])
    if n != len(head) - 8:
        raise FormatError(f"{path}: header length {n} disagrees with the manifest's header_bytes {info['header_bytes']}")
    try:
        header = json.loads(head[8:])
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{path}: safetensors header is not JSON ({show(str(e))})") from None
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not an object")
    return header


def _placed(path: Path, header: dict, header_bytes: int, refs: list[tuple[int, int, int]]) -> None:
    """Each (expert, offset, nbytes) lies inside its header entry, and no two blobs overlap."""
    for e, offset, nbytes in refs:
        entry = header.get(f"expert.{e}")
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 else (None, None)
        if not (isinstance(begin, int) and isinstance(end, int)) or offset != header_bytes + begin or nbytes > end - begin:
            raise FormatError(f"{path}: expert {e}: the manifest's offset {offset} (+{nbytes} bytes) is not the header's "
                              f"'expert.{e}' entry {show(entry)}")
    spans = sorted((offset, offset + nbytes, e) for e, offset, nbytes in refs)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise FormatError(f"{path}: experts {a} and {b} overlap (bytes {start}..{end})")


def verify_files(manifest: Manifest) -> dict[str, bytes]:
    """Check the pack directory's files against ``manifest`` (see the module docstring); return
    each carried file's checked bytes (config.json, tokenizer files, ...) by name."""
    root = manifest.root
    carried = {name: read_owned(root, name, info, "carried file") for name, info in manifest.carried.items()}
    for name, info in manifest.dense_files.items():
        _size(root / name, info["nbytes"], "dense weights file")
    per_file: dict[str, set[tuple[int, int, int]]] = {name: set() for name in manifest.expert_files}
    owner: dict[str, dict] = {}
    for L, entry in manifest.layers.items():
        for e, refs in enumerate(entry.experts):
            for precision, ref in refs.items():  # a promoted reference (its encoding's own blob) counts once
                per_file[ref.file].add((e, ref.offset, ref.nbytes))
                owner.setdefault(ref.file, {"format": "tiers-blob", "precision": ref.encoding or precision, "layer": str(L)})
    for name, info in manifest.expert_files.items():
        path = root / name
        _size(path, info["nbytes"], "expert file")
        refs = sorted(per_file[name])
        header = _expert_header(path, info)
        if name in owner and header.get("__metadata__") != owner[name]:  # a file no reference uses: every expert of it promoted
            raise FormatError(f"{path}: the file is {show(header.get('__metadata__'))}, but the manifest uses it as {show(owner.get(name))}")
        _placed(path, header, info["header_bytes"], refs)
        if any(offset + nbytes > info["nbytes"] for _, offset, nbytes in refs):
            raise FormatError(f"{path}: a blob runs past the file's {info['nbytes']} bytes")
    return carried
