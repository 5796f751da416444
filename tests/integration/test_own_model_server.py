"""Serving your own model through a real tritonserver (docs/own-model.md): a copy of the
model repository whose config.pbtxt names another checkpoint (a small random Llama with the default
model's tokenizer); the script trains its head from that config.pbtxt, and the server loads that
model and drafts with that head: guided answers over HTTP, the same with speculation on and off."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from client.common import http_generate
from specguide.models.loader import resolve_model_dir

from ..engine.test_own_model import make_checkpoint
from .conftest import ROOT, launch, repository_with, stop_and_check

WORDS = r"[a-z]{3,6}( [a-z]{3,6}){2}"


def test_make_passes_the_repository_to_the_head_and_the_server():
    def dry(target: str) -> str:
        return subprocess.run(["make", "-n", target, "MODEL_REPOSITORY=/srv/mine", "PY=python"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    out = dry("serve")
    assert "scripts/tritonserver.py serve" in out  # which reads $MODEL_REPOSITORY, exported by the Makefile
    assert "train_draft_head" not in out  # serving starts at once: the server trains a missing head itself
    assert "scripts/train_draft_head.py --if-missing --model-repository /srv/mine" in dry("draft-head")
    assert "scripts/train_draft_head.py --if-missing --model-repository /srv/mine" in dry("test")
    assert re.search(r"^export MODEL_REPOSITORY \?= model_repository$", (ROOT / "Makefile").read_text(), re.M)


@pytest.fixture(scope="module")
def own_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("own_model_server")
    checkpoint = make_checkpoint(tmp / "checkpoint", resolve_model_dir(), seed=0)
    head = tmp / "head.pt"
    repo = repository_with(tmp, {"model_dir": str(checkpoint), "draft_head_path": str(head), "max_seq_len": "512"})
    subprocess.run([sys.executable, "scripts/train_draft_head.py", "--model-repository", str(repo), "--quick",
                    "--if-missing"], cwd=ROOT, check=True, timeout=900, capture_output=True)
    assert head.exists()
    srv = launch(tmp / "server.log", repo)
    yield srv
    stop_and_check(srv)


def test_the_server_serves_the_repositorys_model_with_the_head_trained_for_it(own_server):
    assert "engine ready, drafter hybrid with the trained draft head" in own_server.log.read_text()
    values = {"text_input": "Three words:", "max_tokens": 32, "exclude_input_in_output": True,
              "guided_decoding_guide_type": "regex", "guided_decoding_guide": WORDS}
    on = http_generate({**values, "num_draft_tokens": 3}, own_server.http)
    off = http_generate({**values, "num_draft_tokens": 0}, own_server.http)
    assert on.error is None and on.finish_reason == "stop" and re.fullmatch(WORDS, on.text), on
    assert (on.text, on.token_ids) == (off.text, off.token_ids)  # lossless
