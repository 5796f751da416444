"""The LoRA adapters an engine serves: registered by name (config `lora_adapters`: a vLLM backend
`multi_lora.json`, or the same object inline), at most `max_loras` resident in the model's bank
(models/lora.py), least recently used first out among those no sequence holds. A sequence holds its
adapter from admission to its end (preemption included); its cache row is bound to it while it
holds a slot.

Adapters are also loaded and unloaded at run time (`load`, `unload`: the OpenAI server's
/v1/load_lora_adapter, through the engine model's control request) from folders under `lora_root`
only. An unloaded adapter's running sequences finish with it; its queued ones fail."""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from ..models.llama import LlamaModel
from ..models.lora import CONFIG, WEIGHTS, AdapterError, LoRAAdapter, LoRABank, load_adapter
from ..request import InvalidRequestError, task_name
from .scheduler import Sequence, SlotOwner

log = logging.getLogger("specguide")
_serials = itertools.count(1)
MAX_REGISTERED = 1024  # adapters served by name at once (each costs a registry entry; loads make more)
MAX_NAME = 256  # characters of an adapter's name
MAX_PATH = 4096  # characters of a `lora_path`
WANTED_S = 1.0  # an adapter read ahead that no sequence asked for this long may be dropped


class AdapterNotFoundError(InvalidRequestError):
    """Unloading a name no adapter is served under."""

    code = "NOT_FOUND"


def _new_key(name: str) -> bytes:
    """A registration's key, unique to it: the prefix cache's seed (blocks of another adapter never match)."""
    return f"lora:{name}:{next(_serials)}".encode()


def check_name(name: object) -> str:
    """An adapter name a client gives (InvalidRequestError otherwise): printable, at most MAX_NAME
    characters, not a TensorRT-LLM task's name."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME or not name.isprintable() \
            or name != name.strip():
        raise InvalidRequestError(f"lora_name must be 1 to {MAX_NAME} printable characters without surrounding "
                                  f"spaces")
    if name.startswith("task "):  # request.task_name
        raise InvalidRequestError(f"lora_name {name!r}: names starting with 'task ' are TensorRT-LLM LoRA tasks'")
    return name


def lora_root(setting: str) -> Optional[Path]:
    """config `lora_root`: the folder run-time loads come from ("" = the cache folder's `loras/`),
    None for "off"."""
    from ..util.paths import cache_dir

    if setting == "off":
        return None
    return Path(setting).expanduser() if setting else cache_dir() / "loras"


def under_root(root: Path, lora_path: object) -> Path:
    """The adapter folder `lora_path` names (relative: to `root`), resolved; InvalidRequestError when
    it, or a file the load reads, is not under `root` once every symlink is followed."""
    if not isinstance(lora_path, str) or not lora_path or len(lora_path) > MAX_PATH or "\0" in lora_path:
        raise InvalidRequestError(f"lora_path must be a folder's path of 1 to {MAX_PATH} characters")
    base = root.expanduser().resolve()
    folder = (base / lora_path).resolve()  # an absolute path stays itself
    for path in (folder, folder / CONFIG, folder / WEIGHTS):
        real = path.resolve()
        if real != base and base not in real.parents:
            raise InvalidRequestError(f"lora_path {lora_path!r} is not under the adapter root (lora_root); "
                                      f"adapters are loaded from there only")
    if not folder.is_dir():
        raise InvalidRequestError(f"lora_path {lora_path!r}: no such folder under the adapter root")
    return folder


def _same(a: LoRAAdapter, b: LoRAAdapter) -> bool:
    """The same pieces, bit for bit (a client sending a cached task's weights again)."""
    pa = [p for layer in a.layers for ps in layer for p in ps]
    pb = [p for layer in b.layers for ps in layer for p in ps]
    return len(pa) == len(pb) and all(x.off == y.off and x.scale == y.scale and torch.equal(x.a, y.a)
                                      and torch.equal(x.bt, y.bt) and (x.sa is None) == (y.sa is None)
                                      and (x.sa is None or torch.equal(x.sa, y.sa) and torch.equal(x.sb, y.sb))
                                      for x, y in zip(pa, pb))


@dataclass(eq=False)
class Registered:
    """An adapter the engine serves, resident at `index` of the bank or on disk (None)."""

    name: str
    path: Path
    key: bytes  # unique per registration: the prefix cache's seed (blocks of another adapter never match)
    index: Optional[int] = None
    users: set[int] = field(default_factory=set)  # the sequences holding it
    last_used: float = 0.0
    wanted_at: float = 0.0  # a waiting sequence last asked for it (reads ahead nobody wants are dropped)
    adapter: Optional[LoRAAdapter] = None  # a TensorRT-LLM task's weights, kept on the host (no folder)
    root: Optional[Path] = None  # loaded at run time: its folder must stay under this one at every read


class LoRAAdapters(SlotOwner):
    """Names -> adapters; the bank's residents; which sequence holds which (one owner of all three).
    NOTE: intake (a client's thread) registers and looks up while the loop acquires: `_lock`."""

    def __init__(self, model: LlamaModel, rows: int, max_loras: int, adapters: dict[str, Path],
                 captured: bool = False, lora_dtype: str = "auto", host_bytes: int = 1 << 30,
                 root: Optional[Path] = None):
        self.model = model
        self.root = root  # run-time loads come from under it (None: none)
        self._lock = threading.Lock()
        self.host_bytes = host_bytes  # TensorRT-LLM tasks' weights kept on the host (lora_cache_host_memory_bytes)
        self.lora_dtype = lora_dtype  # how adapters' weights are held (models/lora.py load_adapter)
        self.captured = captured  # the step runs as CUDA graphs, which do not hold the adapters' products yet
        self.bank = LoRABank(model.cfg, rows, max(max_loras, 1), model.device)
        model.lora = self.bank
        self.max_loras = max_loras
        self.by_name: dict[str, Registered] = {}
        self.held: dict[int, Registered] = {}  # seq_id -> what it holds
        self.retired: set[Registered] = set()  # unloaded while sequences held them: in the bank until they end
        # adapters read from their folders off the loop (one reader thread), placed when a place is free;
        # at most max_loras at once (host memory)
        self.reading: dict[Registered, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="specguide-lora-read")
        self.failed: dict[int, str] = {}  # seq_id -> why its adapter could not be loaded
        self.loads = 0
        for name, path in adapters.items():
            self.register(name, path)

    def register(self, name: str, path: Path) -> None:
        """Serve the adapter at `path` as `name` (at start-up), checked against the model now
        (AdapterError); resident at once while there is room."""
        if self.max_loras < 1:
            raise AdapterError(f"LoRA adapter {name!r}: max_loras is 0 (no adapter can be resident)")
        if name in self.by_name:
            raise AdapterError(f"LoRA adapter {name!r} is already registered")
        if self.captured:
            raise AdapterError(f"LoRA adapter {name!r}: adapters on CUDA need cuda_graphs off for now "
                               f"(the captured step does not hold their products yet)")
        adapter = load_adapter(name, path, self.model.cfg, self.lora_dtype, self.model.device)
        with self._lock:
            reg = self.by_name[name] = Registered(name, Path(path), _new_key(name))
            free = self._free_index()
            if free is not None:
                self._place(reg, free, adapter)
        log.info("LoRA adapter %r: rank %d, %.1f MiB, %s", name, adapter.rank, adapter.nbytes / 2**20,
                 "resident" if free is not None else "on disk until used")

    # ---- run time -----------------------------------------------------------------------------
    def load(self, name: str, lora_path: str, replace: bool = False) -> str:
        """Serve the folder `lora_path` (under the adapter root) as `name` from now on (vLLM's
        /v1/load_lora_adapter); returns the folder. `replace` (vLLM's `load_inplace`): an adapter
        served as `name` already is replaced (its running sequences finish with it). InvalidRequestError
        for a name or path refused, a name already served (unless `replace`), an adapter this model
        cannot use."""
        if self.root is None:
            raise InvalidRequestError("loading LoRA adapters at run time is off (lora_root \"off\")")
        check_name(name)
        if self.max_loras < 1 or self.captured:
            raise InvalidRequestError("this engine serves no LoRA adapters (max_loras 0, or CUDA graphs on)")
        folder = under_root(self.root, lora_path)
        with self._lock:
            old = self.by_name.get(name)
            if old is not None and (not replace or old.adapter is not None):
                raise InvalidRequestError(f"The lora adapter '{name}' has already been loaded.")
            if old is None and len(self.by_name) >= MAX_REGISTERED:
                raise InvalidRequestError(f"{MAX_REGISTERED} LoRA adapters are served already; unload one first")
        try:
            adapter = load_adapter(name, folder, self.model.cfg, self.lora_dtype, self.model.device)
        except AdapterError as exc:
            raise InvalidRequestError(str(exc)) from None
        with self._lock:
            if self.by_name.get(name) is not old:  # changed by another caller meanwhile
                raise InvalidRequestError(f"LoRA adapter {name!r} changed while it loaded; try again")
            if old is not None:
                self._retire(old)
            # NOTE: only the loop places adapters in the bank at run time (the forward reads it): on first use
            self.by_name[name] = Registered(name, folder, _new_key(name), root=self.root)
        log.info("LoRA adapter %r loaded from %s: rank %d, %.1f MiB%s", name, folder, adapter.rank,
                 adapter.nbytes / 2**20, " (replacing the one served so)" if old is not None else "")
        return str(folder)

    def unload(self, name: str) -> None:
        """Serve `name` no more (vLLM's /v1/unload_lora_adapter): running sequences finish with it,
        queued ones fail; AdapterNotFoundError when no adapter is served under `name`."""
        with self._lock:
            reg = self.by_name.get(name)
            if reg is None or reg.adapter is not None:  # TensorRT-LLM tasks go by their own cache
                raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
            self._retire(reg)
        log.info("LoRA adapter %r unloaded%s", name, f" ({len(reg.users)} running)" if reg.users else "")

    def _retire(self, reg: Registered) -> None:
        """`reg` is served no more; it stays in the bank while sequences hold it."""
        del self.by_name[reg.name]
        self.reading.pop(reg, None)
        if reg.users:
            self.retired.add(reg)
        elif reg.index is not None:
            self._unplace(reg)

    def served(self) -> list[str]:
        """The names adapters are served under, in the order they came (TensorRT-LLM tasks apart)."""
        with self._lock:
            return [n for n, r in self.by_name.items() if r.adapter is None]

    def put_task(self, task_id: int, adapter: Optional[LoRAAdapter]) -> str:
        """TensorRT-LLM's LoRA cache: a request's `lora_task_id`, with its weights (`adapter`) the first
        time, the id alone later. Returns the name its requests run under; InvalidRequestError for an id
        never sent, or sent again with other weights while running with the first ones."""
        name = task_name(task_id)
        with self._lock:
            reg = self.by_name.get(name)
            if adapter is None:
                if reg is None:  # TensorRT-LLM's words
                    raise InvalidRequestError(f"LoRA task {task_id} not found in cache. Please send LoRA weights "
                                              f"with request")
                return name
            if reg is not None and reg.adapter is not None and _same(reg.adapter, adapter):
                return name
            if reg is not None and reg.users:
                raise InvalidRequestError(f"LoRA task {task_id} is running with other weights; send these under "
                                          f"another lora_task_id")
            if reg is not None:
                self._forget(reg)
            self.by_name[name] = Registered(name, Path(), _new_key(name), adapter=adapter)
            tasks = sorted((r for r in self.by_name.values() if r.adapter is not None), key=lambda r: r.last_used)
            total = sum(r.adapter.nbytes for r in tasks)
            for r in tasks:  # the host cache's bound: the least recently used idle tasks go
                if total <= self.host_bytes:
                    break
                if not r.users and r.name != name:
                    total -= r.adapter.nbytes
                    self._forget(r)
            return name

    def _forget(self, reg: Registered) -> None:
        del self.by_name[reg.name]
        self.reading.pop(reg, None)
        if reg.index is not None:
            self._unplace(reg)

    def key(self, name: str) -> bytes:
        """The registered adapter's key; InvalidRequestError naming what is served otherwise."""
        with self._lock:
            reg = self.by_name.get(name)
            names = [n for n in self.by_name if self.by_name[n].adapter is None]
            served = ", ".join(repr(n) for n in names[:16]) + (f" and {len(names) - 16} more" if len(names) > 16
                                                               else "") or "none"
        if reg is None:
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded (adapters served: {served})")
        return reg.key

    # ---- holding ----------------------------------------------------------------------------
    def acquire(self, seq: Sequence) -> bool:
        """Whether the sequence may be admitted now: it holds its adapter, made resident (the least
        recently used one no sequence holds goes); False while every place is held, or when the load
        failed (`poll_failures` then says why)."""
        if not seq.adapter or seq.seq_id in self.held:
            return True
        with self._lock:
            return self._acquire(seq)

    def _acquire(self, seq: Sequence) -> bool:
        if seq.seq_id in self.failed:
            return False
        reg = self.by_name.get(seq.adapter)
        if reg is None or reg.key != seq.adapter_key:  # unloaded since its intake
            self.failed[seq.seq_id] = f"LoRA adapter {seq.adapter!r} was unloaded before the request ran"
            return False
        if reg.index is None:
            adapter = reg.adapter or self._read(reg, seq)  # a TensorRT-LLM task's weights are on the host
            if adapter is None:
                return False  # being read (the loop goes on), or failed (`failed` says why)
            index = self._free_index()
            if index is None:
                idle = [r for r in self.by_name.values() if r.index is not None and not r.users]
                if not idle:
                    return False  # what was read waits in `reading` for a place
                index = self._unplace(min(idle, key=lambda r: r.last_used))
            self.reading.pop(reg, None)
            self._place(reg, index, adapter)
        reg.users.add(seq.seq_id)
        reg.last_used = time.monotonic()
        self.held[seq.seq_id] = reg
        return True

    def _read(self, reg: Registered, seq: Sequence) -> Optional[LoRAAdapter]:
        """`reg`'s adapter once read from its folder on the reader thread (NOTE: never on the loop:
        reading and checking an adapter takes milliseconds to seconds, and every stream would wait);
        None while it is read, or when it failed (the sequence's `failed` entry says why)."""
        now = reg.wanted_at = time.monotonic()
        fut = self.reading.get(reg)
        if fut is None:
            if len(self.reading) >= self.max_loras:  # drop reads ahead that no waiting sequence wants now
                for r in [r for r, f in self.reading.items() if f.done() and now - r.wanted_at > WANTED_S]:
                    del self.reading[r]
                if len(self.reading) >= self.max_loras:
                    return None
            self.reading[reg] = self._reader.submit(self._load, reg)
            return None
        if not fut.done():
            return None
        try:
            return fut.result()
        except Exception as exc:  # read again for a later request (the folder may be mended)
            del self.reading[reg]
            if not isinstance(exc, AdapterError):
                log.error("reading LoRA adapter %r failed: %r", reg.name, exc)
            self.failed[seq.seq_id] = str(exc) if isinstance(exc, AdapterError) else \
                f"LoRA adapter {reg.name!r} could not be read ({type(exc).__name__}; the server log has the details)"
            return None

    def _load(self, reg: Registered) -> LoRAAdapter:
        """The reader thread's work: a run-time adapter's folder checked under the root again (a
        symlink may have been put there since its load), then read."""
        if reg.root is not None:
            try:
                under_root(reg.root, str(reg.path))
            except InvalidRequestError as exc:
                raise AdapterError(f"LoRA adapter {reg.name!r}: {exc}") from None
        return load_adapter(reg.name, reg.path, self.model.cfg, self.lora_dtype, self.model.device)

    def poll_failures(self) -> list[tuple[int, str]]:
        """(seq_id, message) of each sequence whose adapter could not be made resident."""
        out, self.failed = list(self.failed.items()), {}
        return out

    def release(self, seq: Sequence) -> None:
        """A finished sequence lets its adapter go (it stays resident until its place is needed)."""
        with self._lock:
            reg = self.held.pop(seq.seq_id, None)
            if reg is not None:
                reg.users.discard(seq.seq_id)
                reg.last_used = time.monotonic()
                if reg in self.retired and not reg.users:  # unloaded: its place is free now
                    self.retired.discard(reg)
                    if reg.index is not None:
                        self._unplace(reg)
            self.failed.pop(seq.seq_id, None)

    def admit(self, slot: int, seq: Sequence) -> None:
        reg = self.held.get(seq.seq_id)
        self.bank.bind(slot, -1 if reg is None else reg.index)

    def free(self, slot: int) -> None:
        self.bank.bind(slot, -1)

    # ---- the bank -----------------------------------------------------------------------------
    def _free_index(self) -> Optional[int]:
        used = {r.index for r in self.by_name.values()} | {r.index for r in self.retired}
        return next((i for i in range(self.max_loras) if i not in used), None)

    def _unplace(self, reg: Registered) -> int:
        """Take an idle resident adapter out of the bank; returns the place it had."""
        index, reg.index = reg.index, None
        self.bank.place(index, None)
        return index

    def _place(self, reg: Registered, index: int, adapter) -> None:
        self.bank.place(index, adapter)
        reg.index = index
        self.loads += 1

    def close(self) -> None:
        """Stop the reader thread (a read in progress is left to finish on its own)."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    def stats(self) -> dict[str, int]:
        """Adapters registered and resident, and loads so far (any thread)."""
        with self._lock:
            return {"lora_adapters_registered": len(self.by_name),
                    "lora_adapters_resident": sum(r.index is not None for r in self.by_name.values()),
                    "lora_adapter_loads": self.loads}
