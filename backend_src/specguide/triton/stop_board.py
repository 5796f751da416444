"""Stop requests between the instances of one model (`instance_group` count > 1).

TensorRT-LLM's stop request (input `stop` true, the running request's id; the proxies cancel with
it too) reaches whichever instance Triton picks, and each instance is a stub process with an
engine of its own: the instance that does not hold the request posts the stop here, and every
instance takes, at its next poll, the stops of the requests it holds (also of one that arrives
after its stop). A board is a directory on tmpfs per tritonserver process and model; an entry is a
file named by a hash of the request id (ids are the client's strings); entries nobody takes
(the request had ended) expire after `STOP_TTL_S`.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from pathlib import Path
from typing import Iterable

STOP_TTL_S = 60.0
ROOT = Path("/dev/shm")


def _key(request_id: str) -> str:
    return hashlib.sha256(request_id.encode("utf-8", "surrogatepass")).hexdigest()[:40]


class StopBoard:
    """The stops posted for one model of one tritonserver process (its pid)."""

    def __init__(self, model: str, server_pid: int, root: Path = ROOT):
        self.dir = root / f"specguide-stops-{server_pid}-{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}"

    def post(self, request_id: str) -> None:
        """A stop for a request this instance does not hold."""
        self.dir.mkdir(exist_ok=True)
        (self.dir / _key(request_id)).touch()

    def take(self, request_ids: Iterable[str]) -> list[str]:
        """The ids among `request_ids` (the requests this instance holds) that have a stop posted;
        their entries are removed, and expired ones."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        if not names:
            return []
        wanted = {_key(r): r for r in request_ids if r}
        taken, old = [], time.time() - STOP_TTL_S
        for name in names:
            path = self.dir / name
            try:
                if name in wanted:
                    path.unlink()
                    taken.append(wanted[name])
                elif path.stat().st_mtime < old:
                    path.unlink()
            except FileNotFoundError:  # another instance took or expired it meanwhile
                pass
        return taken

    def close(self) -> None:
        """The model is unloaded (all its instances go): the board goes with it."""
        shutil.rmtree(self.dir, ignore_errors=True)
