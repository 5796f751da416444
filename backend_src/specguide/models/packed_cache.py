"""The packed linear weights of a checkpoint, cached on disk so a load after the first skips packing.

Packing (`kernels.pack_weight` / `pack_exact`: 64-wide tiles; for "auto" and the block formats the
Q4_1 / Q8_0 quantization too) was most of an engine start: ~6 s of ~11.6 s for the default model
in its served format, ~1 s of ~6.7 s in float32 (2 CPU cores). A cached load reads the packed
tensors back (`torch.load(weights_only=True)`, one sequential read: 0.04-0.1 s for the default
model as served, ~0.5 s in float32) and never touches the checkpoint's linear weights
(safetensors maps them lazily). NOTE: read, not memory-mapped: on these VMs every page fault is
costly (mapping then copying the float32 file took ~1.5 s against ~0.5 s read, and the first
forward over a mapped file paid its faults), and a mapped file's clean pages are dropped by the
kernel (here DAMON's pageout after ~60 s idle): the next request of an idle server then read
them back (0.74 s for one decode step, against 8 ms from the process's own memory).

Files: `cache_dir()/packed/<folder name>-<path hash>-<weight_dtype>[-int8act].<key>.pt`, at most
KEEP keys per checkpoint folder and format, the most recently used (a read touches its file's mtime):
a changed checkpoint or packing code leaves one older key behind, so two checkouts whose packing code
differs can share one cache without each evicting the other's file at every load. A write removes
the older keys past KEEP and every entry whose folder (recorded in `<folder name>-<path hash>.source`)
is gone. The
key holds what changes the packed bytes: each weight file's path, size and mtime, config.json,
weight_dtype, integer_dot (EngineConfig.activation_dtype resolved against the build's integer
path: it picks the integer-dot layouts), this format's VERSION, the packing code (the source of
kernels/quantize.py, kernels/bindings.py, linear.py, loader.py and this file) and the torch version.
The packed layout does not depend on the CPU: the kernels read the same 64-wide tiles on every
vector path (AVX-512, AVX2, portable C), and packing is plain torch code.

Writes go to a temporary file renamed into place, so concurrent servers never read half a file;
an unreadable or inconsistent file (shapes, dtypes, names) is logged and packed again."""
from __future__ import annotations

import functools
import glob
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO, Callable, Optional

import torch
from torch import nn

from .. import kernels
from ..config import WEIGHT_DTYPES
from ..util.paths import cache_dir
from .linear import InvariantLinear

log = logging.getLogger("specguide")
VERSION = 1  # of what a file holds (bump when the layout of the blob changes)
HERE = Path(__file__).resolve().parent
SOURCES = (HERE.parent / "kernels" / "quantize.py", HERE.parent / "kernels" / "bindings.py", HERE / "linear.py",
           HERE / "loader.py", Path(__file__).resolve())
STALE_TMP_S = 3600.0  # a temporary file this old is a crashed writer's: removed by the next save
KEEP = 2  # keys kept per checkpoint folder and format (the most recently used)
KEY_SUFFIX = len(".0123456789abcdef.pt")

Layout = tuple[tuple[int, ...], torch.dtype]


def layout(fmt: str, out_features: int, in_features: int) -> tuple[Layout, Optional[Layout]]:
    """(shape, dtype) of what `kernels.pack_weight(W [O, I], fmt)` returns: packed, aux (None: none)."""
    T, I, nb = -(-out_features // kernels.TILE), in_features, in_features // kernels.QBLK
    blocks = ((T, nb, 2, kernels.TILE), torch.float16)  # d and m (q4_1), d and sum q (q8_0_q8: int16)
    return {
        "float32": (((T, I, 64), torch.float32), None),
        "bfloat16": (((T, I, 64), torch.bfloat16), None),
        "int8": (((T, I, 64), torch.int8), ((out_features,), torch.float32)),
        "q4_1": (((T, I, 32), torch.uint8), blocks),
        "q8_0": (((T, I, 64), torch.int8), ((T, nb, 64), torch.float16)),
        "q4_1_q8": (((T, I // 4, 32, 4), torch.uint8), blocks),
        "q8_0_q8": (((T, I // 4, 64, 4), torch.int8), ((T, nb, 2, kernels.TILE), torch.int16)),
    }[fmt]


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{name: (out, in)} of every linear `LlamaModel.finalize` packs: "head" and the layers' (before
    finalize: the nn.Linear modules, meta or not)."""
    out = {name: (m.out_features, m.in_features) for name, m in model.layers.named_modules(prefix="layers")
           if isinstance(m, (nn.Linear, InvariantLinear))}
    out["head"] = (model.cfg.vocab_size, model.cfg.hidden_size)
    return out


def _hash(*parts: bytes) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()


@functools.cache
def _code() -> str:
    """The packing code's digest (read once per process)."""
    return _hash(*(p.read_bytes() for p in SOURCES), f"{VERSION}:{torch.__version__}".encode())


class PackedCache:
    """The cache entry of one checkpoint folder (its weight `files`) in one format."""

    def __init__(self, folder: Path, files: list[Path], weight_dtype: str, integer_dot: bool):
        integer_dot = integer_dot and _int8_layouts(weight_dtype)  # other formats: the same bytes
        self.folder, self.files = Path(folder).resolve(), list(files)
        self.dir = cache_dir() / "packed"
        self.stem = f"{self.folder.name}-{_hash(str(self.folder).encode())[:8]}"
        self.slot = f"{self.stem}-{weight_dtype}{'-int8act' if integer_dot else ''}"
        stats = [(f.resolve(), f.stat()) for f in files]
        config = self.folder / "config.json"
        self.key = _hash(*(f"{p}:{s.st_size}:{s.st_mtime_ns}".encode() for p, s in stats),
                         config.read_bytes() if config.exists() else b"",
                         f"{weight_dtype}:{integer_dot}".encode(), _code().encode())
        self.path = self.dir / f"{self.slot}.{self.key[:16]}.pt"

    def load(self, shapes: dict[str, tuple[int, int]]) -> Optional[dict[str, dict]]:
        """{name: {"format", "packed", "aux"}} for the linears `shapes` names; None when
        there is no entry or it is unreadable or does not fit (then packing writes it again)."""
        if not self.path.exists():
            return None
        t0 = time.perf_counter()
        try:
            blob = torch.load(self.path, map_location="cpu", weights_only=True)
            if blob.get("version") != VERSION or blob.get("key") != self.key:
                raise ValueError("another version or key")
            linears = blob["linears"]
            if set(linears) != set(shapes):
                raise ValueError(f"linears {sorted(set(linears) ^ set(shapes))[:4]} differ")
            for name, e in linears.items():
                _check(name, e, *shapes[name])
        except Exception as exc:  # a truncated or foreign file: pack again, and overwrite it
            log.warning("specguide: packed weights %s unreadable (%s: %s); packing again",
                        self.path, type(exc).__name__, exc)
            return None
        log.info("specguide: packed weights read from %s (%.0f MiB, %.2f s)", self.path,
                 self.path.stat().st_size / 2**20, time.perf_counter() - t0)
        try:
            os.utime(self.path)  # used: the last to go (_evict)
        except OSError:
            pass
        return linears

    def save(self, model: nn.Module) -> None:
        """Write the packed linears of a finalized `model` (temporary file, then renamed into place),
        then evict the folder's keys past KEEP and the entries of folders that are gone. Never raises: a
        read-only or full cache costs the next load its packing, nothing else."""
        linears = {name: m for name, m in model.named_modules() if isinstance(m, InvariantLinear)}
        if set(linears) != set(linear_shapes(model)):
            return  # not every linear is the C kernels' (cannot happen where the loader asks)
        blob = {"version": VERSION, "key": self.key,
                "linears": {name: {"format": m.weight_dtype, "packed": _own(m.packed), "aux": _own(m.scale)}
                            for name, m in linears.items()}}
        t0 = time.perf_counter()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(self.path, lambda f: torch.save(blob, f))
            log.info("specguide: packed weights written to %s (%.0f MiB, %.2f s)", self.path,
                     self.path.stat().st_size / 2**20, time.perf_counter() - t0)
            self._record_source()
            self._evict()
        except OSError as exc:
            log.warning("specguide: packed weights not cached (%s: %s)", type(exc).__name__, exc)

    def _record_source(self) -> None:
        source = self.dir / f"{self.stem}.source"
        if source.exists() and source.read_text() == str(self.folder):
            return
        _write_atomic(source, lambda f: f.write(str(self.folder).encode()))

    def _evict(self) -> None:
        """At most KEEP keys per format of this folder, the most recently used (names no load makes
        go too); none of a folder that is gone; no crashed writer's temporary file."""
        slots: dict[str, list[tuple[float, Path]]] = {}
        stale: list[Path] = []
        for p in self.dir.glob(f"{glob.escape(self.stem)}-*.pt"):
            fmt, _, act = p.name[len(self.stem) + 1: -KEY_SUFFIX].partition("-")
            try:
                if fmt in WEIGHT_DTYPES and (act == "" or (act == "int8act" and _int8_layouts(fmt))):
                    slots.setdefault(p.name[:-KEY_SUFFIX], []).append((p.stat().st_mtime, p))
                else:
                    stale.append(p)
            except OSError:  # removed meanwhile
                pass
        for entries in slots.values():
            entries.sort(key=lambda e: (e[1] == self.path, e[0]), reverse=True)  # ours first, then newest
            stale += [p for _, p in entries[KEEP:]]
        for source in self.dir.glob("*.source"):
            try:
                gone = not Path(source.read_text()).exists()
            except OSError:
                continue
            if gone:
                stale += [*self.dir.glob(f"{glob.escape(source.stem)}-*.pt"), source]
        now = time.time()
        for tmp in self.dir.glob("*.tmp"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    stale.append(tmp)
            except OSError:
                pass
        for p in stale:
            p.unlink(missing_ok=True)  # a process reading it keeps reading the unlinked inode


def _int8_layouts(weight_dtype: str) -> bool:
    """Whether int8 activations change this format's packed layout (its file name says `-int8act`)."""
    return weight_dtype in ("auto", *kernels.INT_DOT)


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """`write(f)` into a temporary file beside `path`, then renamed onto it: a reader sees the old
    file or the whole new one. Readable by all (mkstemp's 0600 would keep other users' servers out);
    a failed write leaves no temporary file."""
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _own(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """`t` in a storage of its own (torch.save writes a view's whole storage)."""
    if t is None or t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone()


def _check(name: str, e: dict, out_features: int, in_features: int) -> None:
    """Raise unless entry `e` is what packing W [out, in] in its format gives (shapes, dtypes, layout)."""
    fmt = e["format"]
    if fmt not in kernels.FORMATS:
        raise ValueError(f"{name}: format {fmt!r}")
    want_packed, want_aux = layout(fmt, out_features, in_features)
    for what, t, want in (("packed", e["packed"], want_packed), ("aux", e["aux"], want_aux)):
        got = None if t is None else (tuple(t.shape), t.dtype)
        if got != want or (t is not None and not t.is_contiguous()):
            raise ValueError(f"{name}: {what} {got} for {fmt} [{out_features}, {in_features}] (expected {want})")


def install(model: nn.Module, linears: dict[str, dict], missing: list[str]) -> None:
    """Put the cached linears in `model` (before `.to()` and `finalize`: the layers' nn.Linear are still
    on the meta device, their weights left out of the state dict; `missing`: load_state_dict's
    missing keys, which must be exactly those weights)."""
    shapes = linear_shapes(model)
    if set(missing) != {f"{name}.weight" for name in shapes if name != "head"}:
        raise RuntimeError(f"cached packed weights: unexpected missing keys {sorted(missing)[:4]}")
    for name, e in linears.items():
        old = None if name == "head" else model.get_submodule(name)
        bias = None if old is None or old.bias is None else old.bias.detach().to(torch.float32)  # as .to() would
        lin = InvariantLinear.from_packed(e["format"], e["packed"], e["aux"], bias, *shapes[name])
        parent, attr = name.rsplit(".", 1) if old is not None else ("", name)
        setattr(model.get_submodule(parent), attr, lin)
