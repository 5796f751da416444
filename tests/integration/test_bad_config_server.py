"""A config.pbtxt parameter the engine does not know stops the model's load, naming it and the
nearest setting (a typo, e.g. `max_slot`, must not leave the server running on a default)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from .conftest import MODEL, ROOT, _free_ports, repository_with


def test_a_misspelt_engine_setting_fails_the_load_naming_the_nearest_one(tmp_path):
    repo = repository_with(tmp_path, {})
    cfg = repo / MODEL / "config.pbtxt"
    text = cfg.read_text()
    cfg.write_text(re.sub(r'(key:\s*)"max_slots"', r'\1"max_slot"', text, count=1))
    http, grpc, metrics = _free_ports(3)
    env = {**os.environ, "TRITON_HTTP_PORT": str(http), "TRITON_GRPC_PORT": str(grpc),
           "TRITON_METRICS_PORT": str(metrics), "MODEL_REPOSITORY": str(repo)}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "tritonserver.py"), "run", f"--load-model={MODEL}",
                          "--model-control-mode=explicit"], env=env, capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode != 0, log[-3000:]  # --exit-on-error: the model did not load
    assert "unknown engine setting 'max_slot' in config.pbtxt; did you mean 'max_slots'?" in log, log[-3000:]
