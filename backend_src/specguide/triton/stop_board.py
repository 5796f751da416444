"""Stop requests between the instances of one model (`instance_group` count > 1).

TensorRT-LLM's stop request (input `stop` true, the running request's id; the proxies cancel with
it too) reaches whichever instance Triton picks, and each instance is a stub process with an
engine of its own: the instance that does not hold the request posts the stop here, and every
instance takes, at its next poll, the stops of the requests it holds (also of one that arrives
after its stop). A board is a directory on tmpfs per tritonserver process and model; an entry is a
file named by a hash of the request id (ids are the client's strings); entries nobody takes
(the request had ended) expire after `STOP_TTL_S`.

The instances find the board by its name, so the name is known in advance: the board is a private
directory (mode 0700, this user's) and is used only as such. It is opened without following a
symlink (O_NOFOLLOW) and checked on the open descriptor (owner, mode, a directory), and every
entry is reached through that descriptor: a path planted there beforehand by another user (a
symlink, or a directory of theirs or open to others) is refused (`UnsafeBoardError`), never
written through, read or removed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import time
from pathlib import Path
from typing import Iterable, Optional

STOP_TTL_S = 60.0
ROOT = Path("/dev/shm")
log = logging.getLogger("specguide")


class UnsafeBoardError(PermissionError):
    """The board's path is not a private directory of this user (a symlink, another user's, open to others)."""


def _key(request_id: str) -> str:
    return hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


class StopBoard:
    """The stops posted for one model of one tritonserver process (its pid)."""

    def __init__(self, model: str, server_pid: int, root: Path = ROOT):
        self.dir = root / f"specguide-stops-{server_pid}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}"
        self._warned = False

    def _open(self, create: bool) -> Optional[int]:
        """A descriptor of the board's directory (made 0700 when `create` and missing); None when it
        does not exist. Raises UnsafeBoardError when the path is not this user's private directory."""
        created = False
        if create:
            try:
                os.mkdir(self.dir, 0o700)
                created = True
            except FileExistsError:
                pass
        try:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a symlink; ENOTDIR: a file
            raise UnsafeBoardError(f"stop board {self.dir} is not a directory of ours ({e.strerror})") from None
        st = os.fstat(fd)
        if created and st.st_uid == os.getuid():  # ours, made just now: 0700 whatever the umask
            os.fchmod(fd, 0o700)
            st = os.fstat(fd)
        if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) != 0o700:
            os.close(fd)
            raise UnsafeBoardError(f"stop board {self.dir} is not private (owner uid {st.st_uid}, mode "
                                   f"{stat.S_IMODE(st.st_mode):o}; expected uid {os.getuid()}, mode 700)")
        return fd

    def post(self, request_id: str) -> None:
        """A stop for a request this instance does not hold. Raises UnsafeBoardError (above)."""
        fd = self._open(create=True)
        assert fd is not None
        try:
            entry = os.open(_key(request_id), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                            dir_fd=fd)
            os.utime(entry)  # a stop posted again is fresh again
            os.close(entry)
        finally:
            os.close(fd)

    def take(self, request_ids: Iterable[str]) -> list[str]:
        """The ids among `request_ids` (the requests this instance holds) that have a stop posted;
        their entries are removed, and expired ones. An unsafe board is logged once and read as empty."""
        try:
            fd = self._open(create=False)
        except UnsafeBoardError as e:
            if not self._warned:
                self._warned = True
                log.error("specguide: %s: stops posted by other instances are not taken", e)
            return []
        if fd is None:
            return []
        try:
            names = os.listdir(fd)
            if not names:
                return []
            wanted = {_key(r): r for r in request_ids if r}
            taken, old = [], time.time() - STOP_TTL_S
            for name in names:
                try:
                    if name in wanted:
                        os.unlink(name, dir_fd=fd)
                        taken.append(wanted[name])
                    elif os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime < old:
                        os.unlink(name, dir_fd=fd)
                except FileNotFoundError:  # another instance took or expired it meanwhile
                    pass
            return taken
        finally:
            os.close(fd)

    def close(self) -> None:
        """The model is unloaded (all its instances go): the board goes with it (only a board of
        ours: an unsafe path is left alone)."""
        try:
            fd = self._open(create=False)
        except UnsafeBoardError:
            return
        if fd is None:
            return
        try:
            for name in os.listdir(fd):
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
        finally:
            os.close(fd)
        try:
            os.rmdir(self.dir)
        except OSError:  # another instance closed it meanwhile, or posted again
            pass
