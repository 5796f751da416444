"""The package installs: a wheel built from backend_src, installed into a clean virtual environment
with only its declared dependencies (pinned by requirements.txt as constraints, torch by
scripts/install_torch.sh), imports the engine and answers one guided request there."""
from __future__ import annotations

import re
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = tuple(line.split("==")[0].strip().lower() for line in (ROOT / "requirements-test.txt").read_text().splitlines()
                  if line.strip() and not line.startswith("#"))  # test tools: never runtime needs

SCRIPT = r'''
import json, sys
import jsonschema
import specguide
from specguide.config import EngineConfig
from specguide.engine.loop import Engine
from specguide.request import GuidedDecodingParams, Request, SamplingParams

assert specguide.__file__.startswith(sys.prefix), specguide.__file__  # the installed wheel, not the checkout
schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
eng = Engine(EngineConfig(max_slots=1, max_seq_len=512, warmup=False))
try:
    prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "Alice is 30. As JSON, please."}])
    outs = list(eng.generate(Request(prompt=prompt, guided=GuidedDecodingParams("json_schema", json.dumps(schema)),
                                     params=SamplingParams(max_tokens=64, temperature=0.0))))
finally:
    eng.shutdown()
text = "".join(o.text for o in outs)
assert outs[-1].finish_reason == "stop", outs[-1]
jsonschema.validate(json.loads(text), schema)
print("GUIDED", text)
'''


def _run(*args: object, timeout: float = 900) -> str:
    done = subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.mark.timeout(1800)
def test_a_wheel_installs_in_a_clean_venv_and_answers_a_guided_request(tmp_path):
    wheels = tmp_path / "wheels"
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, ROOT / "backend_src")
    (wheel,) = wheels.glob("specguide-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        assert any(n.endswith("specguide/kernels/ops.c") for n in z.namelist())  # built per machine at first use
    needs = {line.split(":", 1)[1].strip().split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0]
             .strip().lower() for line in meta.splitlines() if line.startswith("Requires-Dist:")}
    assert needs and not needs & set(TEST_ONLY), needs

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    _run("bash", ROOT / "scripts" / "install_torch.sh", py)
    pins = tmp_path / "constraints.txt"  # requirements.txt's pins (constraints take no extras)
    pins.write_text(re.sub(r"\[[^]]*\]", "", (ROOT / "requirements.txt").read_text()))
    _run(py, "-m", "pip", "install", "-q", wheel, "-c", pins)
    installed = _run(py, "-m", "pip", "list", "--format=freeze").lower()
    assert not any(line.split("==")[0] in TEST_ONLY for line in installed.splitlines()), installed
    out = _run(py, "-c", SCRIPT)
    assert "GUIDED {" in out, out
