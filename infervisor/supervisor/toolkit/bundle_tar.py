"""The bundle's tar, written by `tarfile` in one canonical shape and read back only in that shape.

Every member is a plain ustar file whose header is exactly the one `tarfile` writes for its name and size
(mode 0644, owner 0, time 0); data is padded with zeros to 512 bytes and the archive ends with zero blocks.
The reader compares each header with that canonical header, so nothing else `tarfile`'s general reader
accepts is reached: no sparse map is expanded, no PAX or GNU long-name header is read into memory, no link
or device is made; a size is checked against its cap and against what is left of the file before a byte
of the member is read, and members are streamed in chunks. A byte changed anywhere in the archive (a
header, data, padding or the end) is a header that differs, a digest that differs or a block that is
not zero.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

_BLOCK = tarfile.BLOCKSIZE
_CHUNK = 1 << 20


#: What a member of another tar type is, for the refusal.
_KINDS = {
    tarfile.GNUTYPE_SPARSE: "a sparse file",
    tarfile.SYMTYPE: "a symbolic link",
    tarfile.LNKTYPE: "a hard link",
    tarfile.DIRTYPE: "a folder",
    tarfile.XHDTYPE: "a PAX header",
    tarfile.XGLTYPE: "a global PAX header",
    tarfile.SOLARIS_XHDTYPE: "a PAX header",
    tarfile.GNUTYPE_LONGNAME: "a GNU long name",
    tarfile.GNUTYPE_LONGLINK: "a GNU long link",
    tarfile.CHRTYPE: "a device",
    tarfile.BLKTYPE: "a device",
    tarfile.FIFOTYPE: "a FIFO",
    tarfile.CONTTYPE: "a contiguous file",
}


class BundleError(Exception):
    """The bundle is refused whole; nothing of it was installed. The message says why."""


def canonical_header(name: str, size: int) -> bytes:
    """The one header a bundle member named `name` of `size` bytes may have."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, 0
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")


class CanonicalWriter:
    """Writes members in the canonical shape (tarfile's ustar, fixed owner, mode and time)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.tar = tarfile.open(fileobj=stream, mode="w", format=tarfile.USTAR_FORMAT)

    def add_bytes(self, name: str, data: bytes) -> None:
        """One member from memory (the manifest, its signature)."""
        self._add(name, len(data), io.BytesIO(data))

    def add_file(self, name: str, path: Path) -> None:
        """One member streamed from a file."""
        with path.open("rb") as source:
            self._add(name, os.fstat(source.fileno()).st_size, source)

    def _add(self, name: str, size: int, source: IO[bytes]) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, 0o644, 0
        self.tar.addfile(info, source)

    def close(self) -> None:
        """The end-of-archive blocks."""
        self.tar.close()


@dataclass(frozen=True)
class Member:
    """A member's header as read: its name and size (what the data is, `CanonicalReader` reads next)."""

    name: str
    size: int


def _name_of(header: bytes) -> str:
    """The member's name: ustar's prefix (a POSIX header only) and name fields."""
    prefix = header[345:500].rstrip(b"\0") if header[257:263] == tarfile.POSIX_MAGIC else b""
    name = header[0:100].rstrip(b"\0")
    try:
        return ((prefix + b"/" if prefix else b"") + name).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BundleError("a member's name is not UTF-8") from exc


def _size_of(header: bytes) -> int:
    field = header[124:136]
    if field[:1] and field[0] & 0x80:
        raise BundleError("a member's size is in base-256 (over 8 GiB): not a bundle member")
    try:
        return int(field.rstrip(b"\0 ").decode("ascii") or "0", 8)
    except ValueError as exc:
        raise BundleError("a member's size field is not octal") from exc


class CanonicalReader:
    """Reads a canonical archive member by member, never holding more than one chunk of a member in memory."""

    def __init__(self, stream: IO[bytes], length: int) -> None:
        self.stream = stream
        self.length = length
        self.offset = 0

    def _read(self, count: int) -> bytes:
        data = self.stream.read(count)
        if len(data) != count:
            raise BundleError(f"the archive ends inside a block at byte {self.offset + len(data)} (cut short)")
        self.offset += count
        return data

    def next_member(self, cap: int) -> Member | None:
        """The next member's header, refused unless canonical and at most `cap` bytes; None at the archive's end."""
        at = self.offset
        header = self._read(_BLOCK)
        if header == bytes(_BLOCK):
            self._check_end()
            return None
        kind = header[156:157]
        name = _name_of(header)
        if kind not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            what = _KINDS.get(kind, f"of tar type {kind!r}")
            raise BundleError(f"member {name!r} at byte {at} is {what}, not a plain file: refused")
        size = _size_of(header)
        if size > cap:
            raise BundleError(f"member {name!r} declares {size:,} bytes, over its {cap:,}-byte cap: refused")
        if at + _BLOCK + size > self.length:
            raise BundleError(f"member {name!r} declares {size:,} bytes, more than the archive holds: refused")
        try:
            canonical = canonical_header(name, size)
        except (ValueError, UnicodeError) as exc:
            raise BundleError(f"member {name!r} at byte {at} cannot be a bundle member: {exc}") from exc
        if header != canonical:
            raise BundleError(f"member {name!r} at byte {at}: its header is not the one the exporter writes")
        return Member(name, size)

    def data(self, member: Member) -> Iterator[bytes]:
        """The member's bytes in chunks, then its padding, which must be zeros."""
        left = member.size
        while left:
            chunk = self._read(min(left, _CHUNK))
            left -= len(chunk)
            yield chunk
        padding = -member.size % _BLOCK
        if padding and self._read(padding) != bytes(padding):
            raise BundleError(f"member {member.name!r}: bytes after its data are not zero")

    def read_all(self, member: Member) -> bytes:
        """A small member's bytes (the caller capped its size when it read the header)."""
        return b"".join(self.data(member))

    def copy_to(self, member: Member, handle: int) -> str:
        """Stream the member into the open file `handle`; its sha256."""
        digest = hashlib.sha256()
        for chunk in self.data(member):
            digest.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(handle, view) :]
        return digest.hexdigest()

    def _check_end(self) -> None:
        """After the first zero block: nothing but zeros to the end of the file."""
        end = self.offset - _BLOCK
        while chunk := self.stream.read(_CHUNK):
            self.offset += len(chunk)
            if chunk.count(0) != len(chunk):
                raise BundleError("bytes after the archive's end are not zero")
        if self.offset - end < 2 * _BLOCK:
            raise BundleError("the archive's end is cut short")
