"""Safe extraction of uploaded .zip/.tar bundles (a model plus its external-data files), security.md T11.

Accepted: regular files only, flat (no directories: depth 0), names matching ``SAFE_NAME`` (the T1 rule for
external-data locations), at most ``MAX_MEMBERS`` members, no duplicate names, uncompressed total at most
``max_total_bytes`` and at most ``MAX_RATIO`` times the archive's size, and exactly one ``*.onnx``. Bytes are
counted while streaming, so a header that lies about sizes cannot get more through. Anything else raises
``InvalidModelError(code="ARCHIVE_INVALID")`` and leaves nothing behind but what the caller's directory
already held. Files are created with ``O_EXCL | O_NOFOLLOW``: the server writes every file itself (T2).

This module does not parse ONNX; it runs in the worker before the child starts.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path
from typing import IO

from core.errors import InvalidModelError

SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_MEMBERS = 64
MAX_RATIO = 100
_CHUNK = 1 << 20
_ZIP_LOCAL_HEADER = 30


def _invalid(message: str) -> InvalidModelError:
    return InvalidModelError(message, code="ARCHIVE_INVALID")


def check_name(name: str) -> None:
    if not SAFE_NAME.fullmatch(name) or name in {".", ".."}:
        raise _invalid(
            f"archive member {name[:200]!r} is not a plain file name "
            "(letters, digits, '.', '_', '-'; no folders, no leading dot)"
        )


def _copy_counted(src: IO[bytes], dest: Path, declared: int, budget: int) -> int:
    """Stream ``src`` into a new file ``dest``; stop once it exceeds ``declared`` or ``budget`` bytes."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    written = 0
    with os.fdopen(fd, "wb") as out:
        while chunk := src.read(_CHUNK):
            written += len(chunk)
            if written > declared:
                raise _invalid(f"archive member {dest.name!r} holds more bytes than its header declares")
            if written > budget:
                raise _invalid("archive unpacks to more than the allowed total size")
            out.write(chunk)
    if written != declared:
        raise _invalid(f"archive member {dest.name!r} is shorter than its header declares")
    return written


def _check_plan(names: list[str], sizes: list[int], archive_size: int, max_total_bytes: int) -> None:
    if len(set(names)) != len(names):
        raise _invalid("archive holds two members with the same name")
    models = [n for n in names if n.endswith(".onnx")]
    if len(models) != 1:
        raise _invalid(f"archive must hold exactly one .onnx file, found {len(models)}")
    total = sum(sizes)
    if total > max_total_bytes:
        raise _invalid(f"archive unpacks to {total} bytes, above the limit of {max_total_bytes}")
    if total > MAX_RATIO * max(archive_size, 1):
        raise _invalid(f"archive compression ratio is above {MAX_RATIO}")


def _zip_members(zf: zipfile.ZipFile) -> list[zipfile.ZipInfo]:
    infos = zf.infolist()
    if len(infos) > MAX_MEMBERS:
        raise _invalid(f"archive has more than {MAX_MEMBERS} members")
    for info in infos:
        check_name(info.filename)
        mode = info.external_attr >> 16
        file_type = stat.S_IFMT(mode)
        if info.is_dir() or (file_type and file_type != stat.S_IFREG):
            raise _invalid(f"archive member {info.filename!r} is not a regular file")
        if info.flag_bits & 0x1:
            raise _invalid(f"archive member {info.filename!r} is encrypted")
        if info.file_size > MAX_RATIO * max(info.compress_size, 1):
            raise _invalid(f"archive member {info.filename!r} has a compression ratio above {MAX_RATIO}")
    # Overlapping entries (CVE-2024-0450): each member's data must end before the next header starts.
    ordered = sorted(infos, key=lambda i: i.header_offset)
    for a, b in itertools.pairwise(ordered):
        end = a.header_offset + _ZIP_LOCAL_HEADER + len(a.orig_filename.encode()) + a.compress_size
        if end > b.header_offset:
            raise _invalid("archive members overlap")
    return infos


def _extract_zip(archive: Path, dest: Path, max_total_bytes: int) -> list[Path]:
    try:
        with zipfile.ZipFile(archive) as zf:
            infos = _zip_members(zf)
            _check_plan(
                [i.filename for i in infos],
                [i.file_size for i in infos],
                archive.stat().st_size,
                max_total_bytes,
            )
            budget = max_total_bytes
            out = []
            for info in infos:
                target = dest / info.filename
                with zf.open(info) as src:
                    budget -= _copy_counted(src, target, info.file_size, budget)
                out.append(target)
            return out
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, NotImplementedError, RuntimeError) as exc:
        raise _invalid(f"not a readable zip archive ({exc})") from exc


def _tar_members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    for count, member in enumerate(tf, start=1):  # lazily: a 10k-member archive stops at 65
        if count > MAX_MEMBERS:
            raise _invalid(f"archive has more than {MAX_MEMBERS} members")
        check_name(member.name)
        if member.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or member.issparse():
            raise _invalid(f"archive member {member.name!r} is not a regular file")
        yield member


def _extract_tar(archive: Path, dest: Path, max_total_bytes: int) -> list[Path]:
    try:
        with tarfile.open(archive, mode="r:*") as tf:
            members = list(_tar_members(tf))
            _check_plan([m.name for m in members], [m.size for m in members], archive.stat().st_size, max_total_bytes)
            budget = max_total_bytes
            out = []
            for member in members:
                src = tf.extractfile(member)
                if src is None:
                    raise _invalid(f"archive member {member.name!r} is not a regular file")
                target = dest / member.name
                with src:
                    budget -= _copy_counted(src, target, member.size, budget)
                out.append(target)
            return out
    except (tarfile.TarError, EOFError, OSError) as exc:
        if isinstance(exc, FileExistsError):
            raise _invalid("archive holds two members with the same name") from exc
        raise _invalid(f"not a readable tar archive ({exc})") from exc


def extract_archive(archive: Path, dest: Path, fmt: str, max_total_bytes: int) -> Path:
    """Extract ``archive`` (``fmt`` "zip" or "tar") into the existing empty folder ``dest``.

    Returns the path of the one .onnx file. On any rejection the files written so far are removed.
    """
    if fmt == "zip":
        extract = _extract_zip
    elif fmt == "tar":
        extract = _extract_tar
    else:
        raise _invalid(f"unknown archive format {fmt!r}")
    before = set(dest.iterdir())
    try:
        files = extract(archive, dest, max_total_bytes)
    except BaseException:
        for path in set(dest.iterdir()) - before:
            with suppress(OSError):
                path.unlink()
        raise
    return next(p for p in files if p.name.endswith(".onnx"))
