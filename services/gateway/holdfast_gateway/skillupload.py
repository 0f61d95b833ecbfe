"""Reading an uploaded skill folder from a zip archive, without trusting it.

The archive may hold the folder's contents at its root (``SKILL.md``,
``scripts/…``) or the folder itself (``my-skill/SKILL.md``, ``my-skill/scripts/…``).
Nothing is extracted to disk: entries are read into memory, and refused
(:class:`~holdfast_shared.skills.format.SkillInvalid`, naming the entry) when
they are absolute, climb out with ``..``, are symbolic links (the Unix mode
bits in the entry's external attributes), devices, FIFOs or sockets, are
encrypted, compressed other than with deflate, or appear twice. Sizes are
counted while decompressing, never taken from the headers, which a zip bomb
lies in: an entry is read in
chunks and dropped as soon as it passes the per-file cap, or all of them
the total (:class:`~holdfast_shared.skills.format.SkillTooLarge`). macOS
resource forks (``__MACOSX/``, ``.DS_Store``) are left out.

Blocking (CPU-bound decompression of up to a few MiB): async callers use
``asyncio.to_thread``.
"""

from __future__ import annotations

import io
import stat
import zipfile
import zlib

from holdfast_shared.skills.format import (
    MAX_FILE_BYTES,
    MAX_FILES,
    MAX_TOTAL_BYTES,
    SKILL_FILE,
    Skill,
    SkillInvalid,
    SkillTooLarge,
    check_path,
    skill_from_folder,
)

_CHUNK = 64 * 1024
# Directory entries and left-out junk count too, so a central directory of
# millions of entries is refused before any is looked at.
_MAX_ENTRIES = 4 * MAX_FILES
_KINDS = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}


def _ignored(path: str) -> bool:
    parts = path.split("/")
    return parts[0] == "__MACOSX" or parts[-1] == ".DS_Store"


def _check_entry(info: zipfile.ZipInfo) -> str:
    """The entry's path (without a directory's trailing ``/``), if it is safe."""
    name = info.orig_filename
    if "\x00" in name:
        raise SkillInvalid(repr(name[:300]), "a NUL character in a file name")
    mode = info.external_attr >> 16
    kind = stat.S_IFMT(mode)
    if kind in _KINDS:
        raise SkillInvalid(name[:300], f"is {_KINDS[kind]}; a skill holds regular files only")
    if info.flag_bits & 0x1:
        raise SkillInvalid(name[:300], "is encrypted")
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        # bzip2 and LZMA decompress a read's input whole: their output could
        # not be bounded chunk by chunk, as deflate's is.
        raise SkillInvalid(name[:300], "is compressed with a method other than deflate")
    path = name[:-1] if name.endswith("/") else name
    return check_path(path)


def _read(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, path: str, budget: int, max_total_bytes: int
) -> bytes:
    """The entry's bytes, counted as they are decompressed."""
    if info.file_size > MAX_FILE_BYTES:  # what the header admits to: refuse at once
        raise SkillTooLarge(
            f"{path}: a file of a skill has at most {MAX_FILE_BYTES} bytes",
            limit=MAX_FILE_BYTES,
            entry=path,
        )
    data = bytearray()
    with archive.open(info) as source:
        while chunk := source.read(_CHUNK):
            data += chunk
            if len(data) > MAX_FILE_BYTES:
                raise SkillTooLarge(
                    f"{path}: a file of a skill has at most {MAX_FILE_BYTES} bytes",
                    limit=MAX_FILE_BYTES,
                    entry=path,
                )
            if len(data) > budget:
                raise SkillTooLarge(
                    f"a skill's files together have at most {max_total_bytes} bytes",
                    limit=max_total_bytes,
                    entry=path,
                )
    return bytes(data)


def read_files(data: bytes, *, max_total_bytes: int = MAX_TOTAL_BYTES) -> dict[str, bytes]:
    """The folder's files, by path relative to the folder (SKILL.md included)."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as exc:
        raise SkillInvalid("(archive)", f"not a readable zip archive: {exc}") from None
    with archive:
        infos = archive.infolist()
        if len(infos) > _MAX_ENTRIES:
            raise SkillTooLarge(
                f"a skill archive has at most {_MAX_ENTRIES} entries, this one {len(infos)}",
                limit=_MAX_ENTRIES,
            )
        wanted: list[tuple[zipfile.ZipInfo, str]] = []
        seen: set[str] = set()
        for info in infos:
            path = _check_entry(info)
            if _ignored(path):
                continue
            if path in seen:
                raise SkillInvalid(path, "appears twice in the archive")
            seen.add(path)
            if not info.is_dir():
                wanted.append((info, path))
        if len(wanted) > MAX_FILES:
            raise SkillTooLarge(
                f"a skill has at most {MAX_FILES} files (SKILL.md included), "
                f"this one {len(wanted)}",
                limit=MAX_FILES,
            )
        files: dict[str, bytes] = {}
        total = 0
        for info, path in wanted:
            try:
                content = _read(archive, info, path, max_total_bytes - total, max_total_bytes)
            except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
                raise SkillInvalid(path, f"cannot be read from the archive: {exc}") from None
            total += len(content)
            files[path] = content
    return _strip_folder(files)


def _strip_folder(files: dict[str, bytes]) -> dict[str, bytes]:
    """The folder's contents: the archive's root when SKILL.md is there, else
    its one top-level folder's."""
    if SKILL_FILE in files:
        return files
    tops = {path.split("/", 1)[0] for path in files}
    if len(tops) == 1:
        (top,) = tops
        if f"{top}/{SKILL_FILE}" in files:
            return {path[len(top) + 1 :]: content for path, content in files.items()}
    raise SkillInvalid(
        SKILL_FILE,
        "missing: the archive holds SKILL.md at its root, or one folder that holds it",
    )


def read_archive(data: bytes, *, max_total_bytes: int = MAX_TOTAL_BYTES) -> Skill:
    """The skill in a zip archive, checked (blocking); its files together within
    ``max_total_bytes`` (``HOLDFAST_SKILL_MAX_BYTES``)."""
    files = read_files(data, max_total_bytes=max_total_bytes)
    return skill_from_folder(files, max_total_bytes=max_total_bytes)
