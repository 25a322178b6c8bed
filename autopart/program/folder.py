"""A program folder on disk, read and written without following a symbolic link.

Every path inside a program folder is one of autopart's own names (``NAMES``): ``plan.json``,
or ``rank{r:05d}/`` and in it ``program.json``, ``weights.pt``, ``stage{k}.pt2``,
``stage{k}.py``. Nothing else is opened, so no name from a file can point outside the folder.
Files are opened relative to a descriptor of the folder and of its rank folder, each with
``O_NOFOLLOW``: a symlinked ``plan.json``, rank folder or file is refused, not followed, and a
path cannot be swapped for a link between a check and a read. Only regular files are read (a
FIFO or device is refused without blocking), each within a size limit given by the caller, and
read once: callers check and use the same bytes.

``Program.save`` writes through the same descriptors: a rank folder that is a symlink (or not a
folder) is refused, old files are unlinked (a symlink named like one of autopart's files is
removed, never followed) and new files are created with ``O_EXCL``, so a write never lands
outside the folder. The folder you name may itself be reached through a link: it is opened once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any, cast

from autopart.errors import AutopartError

RANK_DIR = re.compile(r"rank[0-9]{5}")
RANK_FILE = re.compile(r"program\.json|weights\.pt|stage[0-9]{1,6}\.(?:pt2|py)")
NAMES = re.compile(rf"plan\.json|{RANK_DIR.pattern}/(?:{RANK_FILE.pattern})")
_FOLLOW_NOT = getattr(os, "O_NOFOLLOW", 0)
_READ = os.O_RDONLY | _FOLLOW_NOT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _FOLLOW_NOT | getattr(os, "O_CLOEXEC", 0)
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _FOLLOW_NOT | getattr(os, "O_CLOEXEC", 0)
_HINT = "use the folder Program.save() wrote, with nothing in it replaced by a link"


def rank_dir(rank: int) -> str:
    return f"rank{rank:05d}"


HASH_FIRST = 1 << 26  # bytes: a larger file is hashed in blocks before it is read whole


class ProgramFolder:
    """An open program folder (a context manager): ``read`` and ``write`` by autopart's names."""

    def __init__(self, root: str | Path, create: bool = False) -> None:
        self.root = Path(root)
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(self.root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except FileNotFoundError:
            raise AutopartError(
                f"{self.root} does not exist", hint="point at a folder written by Program.save()"
            ) from None
        except OSError as exc:
            raise AutopartError(
                f"{self.root} cannot be opened as a folder: {exc.strerror}",
                hint="point at a folder written by Program.save()",
            ) from None
        self._dirs: dict[str, int] = {}

    def __enter__(self) -> ProgramFolder:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._dirs.values():
            os.close(fd)
        self._dirs.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # ---- names ---------------------------------------------------------------------------

    def _split(self, rel: str, create: bool = False) -> tuple[int, str]:
        """The descriptor of the folder holding ``rel`` and its last name."""
        if not isinstance(rel, str) or not NAMES.fullmatch(rel):
            raise AutopartError(
                f"{self.root}: {str(rel)[:120]!r} is not a file name of a program folder",
                hint="a program folder holds only plan.json and rankNNNNN/{program.json, "
                "weights.pt, stageK.pt2, stageK.py}; nothing may point elsewhere",
            )
        if "/" not in rel:
            return self._fd, rel
        folder, name = rel.split("/")
        return self._dir(folder, create), name

    def _dir(self, folder: str, create: bool = False) -> int:
        fd = self._dirs.get(folder)
        if fd is not None:
            return fd
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(folder, 0o755, dir_fd=self._fd)
        try:
            fd = os.open(folder, _DIR, dir_fd=self._fd)
        except OSError as exc:
            raise self._error(folder, exc, "folder") from None
        self._dirs[folder] = fd
        return fd

    def _error(self, rel: str, exc: OSError, what: str = "file") -> AutopartError:
        path = self.root / rel
        if exc.errno == errno.ENOENT:
            return AutopartError(
                f"{path} is missing", hint="re-save the program, or copy the whole folder"
            )
        if exc.errno in (errno.ELOOP, errno.EMLINK) or (
            exc.errno == errno.ENOTDIR and self._is_link(rel)
        ):
            return AutopartError(
                f"{path} is a symbolic link; a program folder's {what}s are never followed "
                "through links",
                hint=_HINT,
            )
        if exc.errno == errno.ENOTDIR:
            return AutopartError(f"{path} is not a folder", hint=_HINT)
        return AutopartError(f"{path} cannot be opened: {exc.strerror}", hint=_HINT)

    def _is_link(self, rel: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(rel, dir_fd=self._fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    # ---- reading -------------------------------------------------------------------------

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` is there (as anything: ``read`` says what is wrong with it)."""
        fd, name = self._split(rel)
        try:
            os.stat(name, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def regular(self, rel: str) -> bool:
        """Whether ``rel`` is there as a regular file (not a link, a folder or a device)."""
        fd, name = self._split(rel)
        try:
            return stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
        except OSError:
            return False

    def read(self, rel: str, limit: int, sha256: str | None = None) -> bytes:
        """The bytes of ``rel``: a regular file, not a link, of at most ``limit`` bytes. With
        ``sha256``, a file of more than ``HASH_FIRST`` bytes is hashed in blocks before it is
        read whole: one that fails never takes its size in memory (a sparse 12 GiB
        ``weights.pt`` under a forged shape did, then a raw ``MemoryError``)."""
        dir_fd, name = self._split(rel)
        try:
            fd = os.open(name, _READ, dir_fd=dir_fd)
        except OSError as exc:
            raise self._error(rel, exc) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise AutopartError(f"{self.root / rel} is not a regular file", hint=_HINT)
            if info.st_size > limit:
                raise AutopartError(
                    f"{self.root / rel} is {info.st_size:,} bytes, more than the {limit:,} "
                    "this program can need",
                    hint="the file is not the one Program.save() wrote for this program; "
                    "re-save the program",
                )
            os.set_blocking(fd, True)
            if sha256 is not None and info.st_size > HASH_FIRST:
                digest = hashlib.sha256()
                while block := os.read(fd, 1 << 24):
                    digest.update(block)
                if digest.hexdigest() != sha256:
                    raise AutopartError(
                        f"{self.root / rel} does not match its checksum in plan.json: it was "
                        "changed, truncated, or comes from another program",
                        hint="re-save the program with Program.save(); never edit or mix "
                        "program folders",
                    )
                os.lseek(fd, 0, os.SEEK_SET)
            chunks, size = [], 0
            while size <= limit:
                block = os.read(fd, min(1 << 24, limit + 1 - size))
                if not block:
                    break
                chunks.append(block)
                size += len(block)
            if size > limit:
                raise AutopartError(f"{self.root / rel} grew while it was read", hint=_HINT)
            return b"".join(chunks)
        finally:
            os.close(fd)

    # ---- writing (Program.save) ----------------------------------------------------------

    def clear(self) -> None:
        """Remove what an earlier save left: ``plan.json`` and autopart's files in each rank
        folder (a rank folder left empty goes too). A rank folder that is a link or not a
        folder is refused; a link named like one of autopart's files is removed, not
        followed."""
        self._unlink(self._fd, "plan.json")
        for name in sorted(os.listdir(self._fd)):
            if not RANK_DIR.fullmatch(name):
                continue
            info = os.stat(name, dir_fd=self._fd, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                what = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a folder"
                raise AutopartError(
                    f"{self.root / name} is {what}; Program.save writes rank folders only "
                    "inside the folder it was given and never follows links",
                    hint=f"remove {self.root / name} or save into another folder",
                )
            fd = self._dir(name)
            for f in os.listdir(fd):
                if RANK_FILE.fullmatch(f):
                    self._unlink(fd, f)
            if not os.listdir(fd):
                os.close(self._dirs.pop(name))
                os.rmdir(name, dir_fd=self._fd)

    def _unlink(self, dir_fd: int, name: str) -> None:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:
            raise AutopartError(
                f"a folder named {name} is in the way of Program.save in {self.root}",
                hint="remove it or save into another folder",
            ) from None

    def write(self, rel: str, produce: Callable[[IO[bytes]], Any]) -> str:
        """Create ``rel`` afresh (never through a link), let ``produce`` write it and return
        the SHA-256 of what it wrote."""
        dir_fd, name = self._split(rel, create=True)
        self._unlink(dir_fd, name)
        try:
            fd = os.open(name, _CREATE, 0o644, dir_fd=dir_fd)
        except OSError as exc:
            raise self._error(rel, exc) from None
        with os.fdopen(fd, "wb") as f:
            out = _Hashing(f)
            produce(cast(IO[bytes], out))  # a write-only stream (torch.save streams into it)
            out.flush()
        return out.digest()

    def write_bytes(self, rel: str, data: bytes) -> str:
        """``write`` with ``data`` as the whole file."""
        return self.write(rel, lambda f: f.write(data))


class _Hashing:
    """A write-only file that hashes what passes through it (torch.save streams into it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f, self._h = f, hashlib.sha256()

    def write(self, data: Any) -> int:
        self._h.update(data)
        return self._f.write(data)

    def flush(self) -> None:
        self._f.flush()

    def digest(self) -> str:
        return self._h.hexdigest()
