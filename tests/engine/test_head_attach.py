"""A draft head written while the engine serves (the background training's output) is attached
between steps: the requests running then keep model-free drafts, later ones draft with the head,
and no output changes across the switch (greedy and seeded sampling)."""
from __future__ import annotations

import os
import shutil
import threading

import pytest

from specguide.engine import loop as engine_module
from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import Request, SamplingParams
from specguide.speculative.draft_head import default_head_path

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _request(text: str, k: int, n: int, seeded: bool) -> Request:
    params = (SamplingParams(max_tokens=n, temperature=0.8, seed=7, ignore_eos=True) if seeded
              else SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return Request(prompt=CHAT.format(text), num_draft_tokens=k, params=params)


def _tokens(engine: Engine, request: Request) -> list[int]:
    return [t for o in engine.generate(request) for t in o.token_ids]


@pytest.fixture(scope="module")
def trained_head(model_dir) -> str:
    path = default_head_path(model_dir)
    assert path.exists(), f"{path}: make test trains the default model's head first"
    return str(path)


def test_a_head_written_while_serving_is_attached_and_changes_no_output(tmp_path, trained_head, monkeypatch):
    monkeypatch.setattr(engine_module, "HEAD_POLL_S", 0.05)
    path = tmp_path / "head.pt"
    eng = Engine(EngineConfig(drafter="hybrid", draft_head_path=str(path), num_draft_tokens=3, max_slots=4,
                              max_seq_len=512, prefill_chunk=64, cost_aware_k=False))
    try:
        assert eng.core.drafter == "grammar" and eng.core.head_drafter is None and eng.stats()["draft_head"] == 0
        attach, running_at_attach = eng.core.proposer.attach_head, []

        def spy() -> bool:  # on the loop thread, between steps
            ok = attach()
            if ok:
                running_at_attach.append(len(eng.core.scheduler.running))
            return ok
        eng.core.proposer.attach_head = spy
        texts = ["Count from one to forty in words.", "Write a limerick about a cat."]
        want = {(t, s): _tokens(eng, _request(t, 0, 128, s)) for t in texts for s in (False, True)}

        # two requests run across the switch: the file appears once each has 8 tokens
        got: dict[tuple[str, bool], list[int]] = {}
        started, done = threading.Barrier(3), threading.Event()
        live = [threading.Event(), threading.Event()]

        def run(i: int, key: tuple[str, bool]) -> None:
            toks: list[int] = []
            for o in eng.generate(_request(key[0], 3, 128, key[1])):
                toks += o.token_ids
                if len(toks) >= 8 and not live[i].is_set():
                    live[i].set()
                    started.wait(timeout=120)
            got[key] = toks
        keys = [(texts[0], False), (texts[1], True)]
        threads = [threading.Thread(target=run, args=(i, k)) for i, k in enumerate(keys)]
        for t in threads:
            t.start()
        started.wait(timeout=120)
        tmp = tmp_path / "head.pt.partial"
        shutil.copy(trained_head, tmp)
        os.replace(tmp, path)  # the trainer's atomic save
        for t in threads:
            t.join(timeout=300)
        assert eng.core.head_drafter is not None and eng.core.drafter == "hybrid" and eng.stats()["draft_head"] == 1
        assert running_at_attach == [2]  # attached while both ran
        for k in keys:
            assert got[k] == want[k], k  # across the switch: the same tokens

        # after the switch the head drafts (its per-slot rows fill) and still changes nothing
        head = eng.core.head_drafter
        assert max(head.valid) == 0  # the requests that ran across the switch never used it
        filled = []
        for text, seeded in [("List five fruits, one per line.", False), ("Describe a sunset in two lines.", True)]:
            drafted = _tokens(eng, _request(text, 3, 64, seeded))  # a new prompt: the head has all its features
            filled.append(max(head.valid))  # (its slot's rows stay until the slot's next admission)
            assert drafted == _tokens(eng, _request(text, 0, 64, seeded)), text
        assert min(filled) > 0
        eng.core.scheduler.check_integrity()
    finally:
        eng.shutdown()


def test_a_head_file_that_fails_to_load_leaves_the_engine_drafting_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(engine_module, "HEAD_POLL_S", 0.05)
    path = tmp_path / "head.pt"
    eng = Engine(EngineConfig(drafter="hybrid", draft_head_path=str(path), num_draft_tokens=3, max_slots=2,
                              max_seq_len=256, prefill_chunk=64, warmup=False))
    try:
        path.write_bytes(b"not a draft head")
        want = _tokens(eng, _request("Name three rivers.", 0, 24, False))
        assert _tokens(eng, _request("Name three rivers.", 3, 24, False)) == want
        assert eng.core.head_drafter is None and eng.core.drafter == "grammar" and eng.stats()["draft_head"] == 0
    finally:
        eng.shutdown()
