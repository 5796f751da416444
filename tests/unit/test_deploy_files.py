"""The Dockerfile and docker/ cannot be built here: check that what they copy and install exists."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_base_image_is_an_ngc_tritonserver_py3_image():
    froms = [arg for op, arg in dockerfile_instructions() if op == "FROM"]
    assert len(froms) == 1 and re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d\d\.\d\d-py3", froms[0]), froms


def test_dockerfile_copies_and_installs_what_exists():
    ins = dockerfile_instructions()
    copies = [shlex.split(arg) for op, arg in ins if op == "COPY"]
    assert copies
    for args in copies:
        for src in [a for a in args[:-1] if not a.startswith("--")]:
            assert (ROOT / src).exists(), f"COPY source {src} is missing"
    copied = {Path(a[0].rstrip("/")).as_posix() for a in copies}
    assert {"requirements.txt", "backend_src", "model_repository"} <= copied
    runs = " ".join(arg for op, arg in ins if op == "RUN")
    for req in re.findall(r"-r\s+(\S+)", runs):
        assert (ROOT / req).exists(), req
    assert "./backend_src" in runs and (ROOT / "backend_src" / "pyproject.toml").exists()
    assert "TORCH_BUILD=default bash scripts/install_torch.sh" in runs  # the CUDA build of the one torch pin
    assert "specguide.models.default_model" in runs
    assert "scripts/train_draft_head.py --if-missing" in runs  # the image serves the hybrid with its head
    entry = [arg for op, arg in ins if op == "ENTRYPOINT"]
    assert entry and "/usr/local/bin/specguide-entrypoint" in entry[0]


def test_entrypoint_starts_tritonserver_on_the_copied_repository():
    ep = ROOT / "docker" / "entrypoint.sh"
    assert os.access(ep, os.X_OK)
    text = ep.read_text()
    # under the supervisor, which starts the server again if a Python backend stub dies
    assert "exec python3 -m specguide.supervisor" in text and "-- tritonserver" in text and "/models" in text
    assert (ROOT / "model_repository" / "specguide" / "config.pbtxt").exists()
    assert (ROOT / "model_repository" / "specguide" / "1" / "model.py").exists()


def test_dockerignore_keeps_local_state_out_of_the_context():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".work", ".git"} <= set(ignored)
    assert "backend_src" not in ignored and "model_repository" not in ignored


def test_compose_builds_this_repository():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    svc = compose["services"]["specguide"]
    ctx = (ROOT / "docker" / svc["build"]["context"]).resolve()
    assert ctx == ROOT and (ctx / svc["build"]["dockerfile"]).exists()
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(svc["ports"])
    assert "v2/health/ready" in " ".join(svc["healthcheck"]["test"])


def test_compose_runs_the_openai_api_beside_triton():
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    svc = compose["services"]["openai"]
    cmd = svc["entrypoint"]
    assert cmd[0] == "specguide-openai" and cmd[cmd.index("--triton-url") + 1] == "specguide:8001"
    assert "9000:9000" in svc["ports"] and svc["image"] == compose["services"]["specguide"]["image"]
    pyproject = (ROOT / "backend_src" / "pyproject.toml").read_text()
    assert 'specguide-openai = "specguide.openai_api.cli:main"' in pyproject


def test_kubernetes_fleet_has_replicas_behind_a_service_with_readiness():
    docs = [d for d in yaml.safe_load_all((ROOT / "docker" / "kubernetes.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    dep, svc = kinds["Deployment"], kinds["Service"]
    assert dep["spec"]["replicas"] > 1
    container = dep["spec"]["template"]["spec"]["containers"][0]
    # readiness is a real 1-token inference through each served name (Triton 2.51 reports a model
    # ready while its engine restarts); the probe is the installed package's module
    ready, live = container["readinessProbe"]["exec"]["command"], container["livenessProbe"]["exec"]["command"]
    assert ready[:3] == live[:3] == ["python3", "-m", "specguide.health_probe"] and "--liveness" in live
    import importlib

    assert callable(importlib.import_module(ready[2]).main)
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for p in container["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports


def test_the_installed_package_carries_the_training_data(tmp_path):
    """The Docker image pip-installs backend_src (not editable): the wheel must carry the schemas the
    draft head trains on, or the image's head would be trained on chat prompts alone."""
    import shutil
    import subprocess
    import sys
    import zipfile

    src = shutil.copytree(ROOT / "backend_src", tmp_path / "src", ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__"))  # setuptools writes build/ next to the sources
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("specguide-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = ROOT / "backend_src" / "specguide" / "training" / "data"
    shipped = {p.relative_to(ROOT / "backend_src").as_posix() for p in data.rglob("*") if p.is_file()}
    assert len(shipped) > 200 and shipped <= names, sorted(shipped - names)[:5]
    assert "specguide/kernels/ops.c" in names
