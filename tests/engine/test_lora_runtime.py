"""LoRA adapters loaded and unloaded at run time (engine/lora_adapters.py `load` / `unload`, the engine
process's calls) on the real SmolLM2 against `peft`: only folders under `lora_root` (no path or
symlink out of it), a name served once, running requests finish with an adapter unloaded under them
and queued ones fail, `load_inplace` replaces, and a restarted engine process serves what the old
one was given."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from specguide.config import EngineConfig
from specguide.engine.lora_adapters import MAX_NAME, AdapterNotFoundError, lora_root
from specguide.util.paths import cache_dir
from specguide.engine.loop import Engine
from specguide.request import InvalidRequestError, Request, SamplingParams

from ..lora_helpers import make_adapters, peft_greedy
from .conftest import PROMPTS, run_alone

FLOAT32 = dict(weight_dtype="float32", activation_dtype="float32", max_seq_len=512, prefill_chunk=64)


@pytest.fixture(scope="module")
def root(tmp_path_factory, model_dir):
    """The adapter root holding `support` and `legal` (made by peft), and the peft model."""
    base = tmp_path_factory.mktemp("lora_runtime")
    folders, pm = make_adapters(model_dir, base / "loras")
    (base / "outside").mkdir()
    return base, pm


@pytest.fixture(scope="module")
def engine(root):
    base, _ = root
    eng = Engine(EngineConfig(max_slots=4, max_loras=1, lora_root=str(base / "loras"), **FLOAT32))
    yield eng
    eng.shutdown()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _text_of(engine, name, n=16, prompt=PROMPTS[0]):
    return run_alone(engine, Request(prompt_ids=engine.tokenizer.encode(prompt), params=_greedy(n), lora_name=name))[0]


@torch.inference_mode()
def test_an_adapter_loaded_at_run_time_serves_peft_s_text_until_unloaded(engine, root):
    _, pm = root
    ids = engine.tokenizer.encode(PROMPTS[0])
    with pytest.raises(InvalidRequestError, match="'support' is not loaded"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_name="support"))
    assert engine.load_adapter("support", "support").endswith("/loras/support")
    assert engine.adapters() == ["support"]
    assert _text_of(engine, "support") == peft_greedy(pm, "support", ids, 16) != peft_greedy(pm, None, ids, 16)
    with pytest.raises(InvalidRequestError, match="The lora adapter 'support' has already been loaded."):
        engine.load_adapter("support", "legal")
    engine.unload_adapter("support")
    assert engine.adapters() == []
    with pytest.raises(InvalidRequestError, match="'support' is not loaded"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_name="support"))
    with pytest.raises(AdapterNotFoundError, match="The lora adapter 'support' cannot be found."):
        engine.unload_adapter("support")
    assert AdapterNotFoundError.code == "NOT_FOUND"
    # loaded again (an absolute path under the root this time): served again, the same text
    engine.load_adapter("support", str(root[0] / "loras" / "support"))
    assert _text_of(engine, "support") == peft_greedy(pm, "support", ids, 16)
    engine.unload_adapter("support")
    assert engine.is_alive()


def test_only_folders_under_the_root_are_read(engine, root, tmp_path):
    base, _ = root
    loras = base / "loras"
    outside = base / "outside" / "copy"
    if not outside.exists():
        outside.mkdir()
        for f in (loras / "legal").iterdir():
            (outside / f.name).write_bytes(f.read_bytes())
    (loras / "link-out").unlink(missing_ok=True)
    (loras / "link-out").symlink_to(outside)  # a folder symlink out of the root
    files_out = loras / "files-out"
    files_out.mkdir(exist_ok=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):  # a folder in the root, its files outside
        (files_out / f).unlink(missing_ok=True)
        (files_out / f).symlink_to(outside / f)
    for path in (str(outside), "../outside/copy", "link-out", "files-out", "/etc"):
        with pytest.raises(InvalidRequestError, match="is not under the adapter root"):
            engine.load_adapter("x", path)
    with pytest.raises(InvalidRequestError, match="no such folder under the adapter root"):
        engine.load_adapter("x", "missing")
    for name in ("", " x", "a" * (MAX_NAME + 1), "new\nline", "task 5"):
        with pytest.raises(InvalidRequestError, match="lora_name"):
            engine.load_adapter(name, "legal")
    bad = loras / "not-lora"
    bad.mkdir(exist_ok=True)
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "PREFIX_TUNING"}))
    with pytest.raises(InvalidRequestError, match="LoRA adapter 'x'.*not a LoRA adapter"):
        engine.load_adapter("x", "not-lora")
    assert engine.adapters() == [] and engine.is_alive()
    assert lora_root("off") is None and lora_root("") == cache_dir() / "loras"
    root_was, engine.core.adapters.root = engine.core.adapters.root, lora_root("off")
    try:
        with pytest.raises(InvalidRequestError, match="at run time is off"):
            engine.load_adapter("x", "legal")
    finally:
        engine.core.adapters.root = root_was


def test_unloading_under_running_and_queued_requests(engine, root):
    """max_loras 1: `legal` runs (holding the one place), a `support` request waits in the queue.
    Unloading `support` fails the queued one; unloading `legal` lets the running one finish with
    the text it has alone; the place is then free."""
    engine.load_adapter("legal", "legal")
    engine.load_adapter("support", "support")
    ids = engine.tokenizer.encode(PROMPTS[1])
    alone = run_alone(engine, Request(prompt_ids=ids, params=_greedy(160), lora_name="legal"))[0]
    got: dict[str, list] = {"legal": [], "support": []}
    ends: dict[str, object] = {}
    started, finished = threading.Event(), threading.Event()

    def cb(name):
        def on(out):
            got[name].extend(out.token_ids)
            started.set()
            if out.finished:
                ends[name] = out
                if len(ends) == 2:
                    finished.set()
        return on

    engine.submit(Request(prompt_ids=ids, params=_greedy(160), lora_name="legal"), cb("legal"))
    assert started.wait(120)
    engine.submit(Request(prompt_ids=ids, params=_greedy(8), lora_name="support"), cb("support"))
    time.sleep(0.2)  # the support request is queued: no place for its adapter
    engine.unload_adapter("support")
    engine.unload_adapter("legal")
    assert "legal" not in ends, "the running request ended before the unload: make it longer"
    with pytest.raises(InvalidRequestError, match="'legal' is not loaded"):
        engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_name="legal"))
    assert finished.wait(300)
    assert ends["legal"].error is None and got["legal"] == alone
    assert ends["support"].error_code == "INVALID_ARG" and "was unloaded before the request ran" in ends["support"].error
    deadline = time.monotonic() + 10
    while engine.core.adapters.stats()["lora_adapters_resident"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.core.adapters.stats()["lora_adapters_resident"] == 0 and not engine.core.adapters.retired
    assert engine.adapters() == []


def test_a_folder_changed_to_point_out_of_the_root_after_its_load_is_not_read(engine, root):
    """The folder is checked again at every read (its first request, and each swap in): a file made
    a symlink out of the root after the load fails the request that would read it, and no other."""
    import shutil

    base, _ = root
    folder = base / "loras" / "turncoat"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(base / "loras" / "legal", folder)
    engine.load_adapter("turncoat", "turncoat")  # checked and read: fine
    weights = folder / "adapter_model.safetensors"
    outside = base / "outside" / "weights.safetensors"
    shutil.copy(weights, outside)
    weights.unlink()
    weights.symlink_to(outside)
    ids = engine.tokenizer.encode(PROMPTS[0])
    outs = []
    engine.submit(Request(prompt_ids=ids, params=_greedy(4), lora_name="turncoat"), outs.append)
    alone = run_alone(engine, Request(prompt_ids=ids, params=_greedy(4)))
    deadline = time.monotonic() + 60
    while not (outs and outs[-1].finished):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert outs[-1].error_code == "INVALID_ARG" and "is not under the adapter root" in outs[-1].error, outs[-1]
    assert alone[2].error is None and engine.is_alive()
    engine.unload_adapter("turncoat")


@torch.inference_mode()
def test_load_inplace_replaces_the_adapter_served_under_a_name(engine, root):
    _, pm = root
    ids = engine.tokenizer.encode(PROMPTS[0])
    engine.load_adapter("a", "support")
    assert _text_of(engine, "a") == peft_greedy(pm, "support", ids, 16)
    engine.load_adapter("a", "legal", True)
    assert _text_of(engine, "a") == peft_greedy(pm, "legal", ids, 16)
    assert engine.adapters() == ["a"]
    engine.unload_adapter("a")


def test_a_restarted_engine_process_serves_the_adapters_loaded_and_unloaded_before(root):
    """Loads and unloads go to every engine process the stub starts: a killed engine's successor
    serves the run-time adapter with the same text, and not the config's adapter unloaded before."""
    from specguide.process.engine_process import EngineProcess

    base, _ = root
    loras = base / "loras"
    ep = EngineProcess(EngineConfig(max_slots=2, max_loras=2, warmup=False, lora_root=str(loras),
                                    lora_adapters=json.dumps({"legal": str(loras / "legal")}), **FLOAT32))
    try:
        ids = ep.tokenizer.encode(PROMPTS[2])

        def text(name):
            done, toks, end = threading.Event(), [], []

            def cb(out):
                toks.extend(out.token_ids)
                if out.finished:
                    end.append(out)
                    done.set()
            ep.submit(Request(prompt_ids=ids, params=_greedy(12), lora_name=name), cb)
            assert done.wait(120) and end[0].error is None, end
            return toks

        assert ep.load_adapter("support", "support").endswith("/loras/support")
        before = text("support")
        ep.unload_adapter("legal")
        assert ep.adapters() == ["support"]
        restarts, old = ep.restarts, ep.pid
        os.kill(ep.pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (ep.is_alive() and ep.restarts > restarts):
            assert time.monotonic() < deadline, ep.down_reason()
            time.sleep(0.05)
        assert ep.pid != old
        assert ep.adapters() == ["support"]  # loaded again, and the config's `legal` unloaded again
        assert text("support") == before
        with pytest.raises(InvalidRequestError, match="'legal' is not loaded"):
            ep.submit(Request(prompt_ids=ids, params=_greedy(4), lora_name="legal"))
    finally:
        ep.shutdown(drain=False, timeout=10)


def test_an_adapter_is_read_off_the_engine_loop_while_other_streams_go_on(engine, root, monkeypatch):
    """Reading an adapter's folder (milliseconds to seconds) never holds the loop: with the read held
    up, a base-model request runs to its end; the adapter's request then runs with its text."""
    from specguide.engine import lora_adapters

    _, pm = root
    gate, readers = threading.Event(), []
    real = lora_adapters.load_adapter

    def held_read(*args, **kw):
        readers.append(threading.current_thread().name)
        assert gate.wait(120)
        return real(*args, **kw)

    engine.load_adapter("held", "support")  # (checked at once, with the real read)
    monkeypatch.setattr(lora_adapters, "load_adapter", held_read)
    ids = engine.tokenizer.encode(PROMPTS[0])
    waiting, base = [], threading.Event()
    engine.submit(Request(prompt_ids=ids, params=_greedy(16), lora_name="held"), waiting.append)
    engine.submit(Request(prompt_ids=ids, params=_greedy(48)), lambda out: out.finished and base.set())
    try:
        assert base.wait(120), "the base request waited for the adapter's read"
        assert readers and all(name.startswith("specguide-lora-read") for name in readers), readers
        assert not any(out.token_ids for out in waiting)  # its adapter is still being read
    finally:
        gate.set()
    deadline = time.monotonic() + 120
    while not (waiting and waiting[-1].finished):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert waiting[-1].error is None
    assert [t for out in waiting for t in out.token_ids] == peft_greedy(pm, "support", ids, 16)
    engine.unload_adapter("held")
