"""The Dockerfile and docker/ cannot be built here: check that what they copy and install exists."""
from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
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
    assert "exec python3 -m specguide.process.supervisor" in text and "-- tritonserver" in text and "/models" in text
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
    assert "v2/health/ready" in " ".join(svc["healthcheck"]["test"])


def test_compose_publishes_every_port_on_the_hosts_loopback_only():
    """Triton's interfaces have no authentication (and cancel requests by id): none of its ports, nor
    the OpenAI API's, is published on the host's other interfaces."""
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    assert set(compose["services"]["specguide"]["ports"]) == {"127.0.0.1:8000:8000", "127.0.0.1:8001:8001",
                                                             "127.0.0.1:8002:8002"}
    assert compose["services"]["openai"]["ports"] == ["127.0.0.1:9000:9000"]
    for svc in compose["services"].values():
        for port in svc.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), port


def _compose_env(value: str, env: dict[str, str]) -> str:
    """Compose's `${NAME:-default}` interpolation, the one form the file uses."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), value)


def test_compose_runs_the_openai_api_beside_triton_and_requires_its_key(monkeypatch, capsys):
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    svc = compose["services"]["openai"]
    cmd = svc["entrypoint"]
    assert cmd[0] == "specguide-openai" and cmd[cmd.index("--triton-url") + 1] == "specguide:8001"
    assert svc["image"] == compose["services"]["specguide"]["image"]
    pyproject = (ROOT / "backend_src" / "pyproject.toml").read_text()
    assert 'specguide-openai = "specguide.openai_api.cli:main"' in pyproject
    from specguide.openai_api.cli import parse_args

    # `docker compose up` without SPECGUIDE_API_KEY: the server refuses to start, saying why
    assert "--allow-no-key" not in cmd
    monkeypatch.setenv("SPECGUIDE_API_KEY", _compose_env(svc["environment"]["SPECGUIDE_API_KEY"], {}))
    with pytest.raises(SystemExit):
        parse_args(cmd[1:])
    assert "SPECGUIDE_API_KEY" in capsys.readouterr().err
    # with it, the server starts (on the container's interfaces: the host publishes it on loopback)
    monkeypatch.setenv("SPECGUIDE_API_KEY", _compose_env(svc["environment"]["SPECGUIDE_API_KEY"],
                                                         {"SPECGUIDE_API_KEY": "k3y"}))
    args = parse_args(cmd[1:])
    assert args.api_key == "k3y" and args.host == "0.0.0.0" and svc["ports"] == [f"127.0.0.1:{args.port}:{args.port}"]


def test_kubernetes_fleet_has_replicas_behind_a_service_with_readiness():
    docs = [d for d in yaml.safe_load_all((ROOT / "docker" / "kubernetes.yaml").read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    dep, svc = kinds["Deployment"], kinds["Service"]
    assert dep["spec"]["replicas"] > 1
    container = dep["spec"]["template"]["spec"]["containers"][0]
    # readiness is a real 1-token inference through each served name (Triton 2.51 reports a model
    # ready while its engine restarts); the probe is the installed package's module
    ready, live = container["readinessProbe"]["exec"]["command"], container["livenessProbe"]["exec"]["command"]
    assert ready[:3] == live[:3] == ["python3", "-m", "specguide.process.health_probe"] and "--liveness" in live
    import importlib

    assert callable(importlib.import_module(ready[2]).main)
    assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
    ports = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports


def test_kubernetes_pods_run_the_openai_api_beside_triton_with_a_key_from_a_secret(monkeypatch):
    docs = {d["kind"]: d for d in kubernetes_documents()}
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    api = next(c for c in pod["containers"] if c["name"] == "openai")
    triton = next(c for c in pod["containers"] if c["name"] == "tritonserver")
    assert api["image"] == triton["image"]
    cmd = api["command"]
    # the console entry point the package installs, on all interfaces, to the Triton in the same pod
    assert cmd[0] == "specguide-openai" and 'specguide-openai = "specguide.openai_api.cli:main"' in \
        (ROOT / "backend_src" / "pyproject.toml").read_text()
    from specguide.openai_api.cli import parse_args

    # the key comes from a Secret (required: no `optional`), and without it the server does not start
    (env,) = [e for e in api["env"] if e["name"] == "SPECGUIDE_API_KEY"]
    assert set(env) == {"name", "valueFrom"} and not env["valueFrom"]["secretKeyRef"].get("optional", False)
    assert env["valueFrom"]["secretKeyRef"] == {"name": "specguide-openai", "key": "api-key"}
    assert "--allow-no-key" not in cmd
    monkeypatch.delenv("SPECGUIDE_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args(cmd[1:])
    monkeypatch.setenv("SPECGUIDE_API_KEY", "from-the-secret")
    args = parse_args(cmd[1:])
    grpc_port = next(p["containerPort"] for p in triton["ports"] if p["name"] == "grpc")
    assert args.host == "0.0.0.0" and args.triton_url == f"127.0.0.1:{grpc_port}" and args.api_key == "from-the-secret"
    assert api["ports"][0]["containerPort"] == args.port and api["readinessProbe"]["httpGet"]["path"] == "/health"
    assert {"port": args.port, "targetPort": "openai", "name": "openai"} in docs["Service"]["spec"]["ports"]


def test_kubernetes_keeps_tritons_ports_inside_the_cluster():
    """A ClusterIP Service (nothing published outside the cluster), and a NetworkPolicy that admits
    Triton's HTTP and gRPC ports only from pods of the namespace; the OpenAI port (keyed) from anywhere."""
    docs = {d["kind"]: d for d in kubernetes_documents()}
    assert docs["Service"]["spec"]["type"] == "ClusterIP"
    pol, dep = docs["NetworkPolicy"], docs["Deployment"]
    assert pol["spec"]["podSelector"]["matchLabels"] == dep["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    named = {p["name"]: p["containerPort"] for c in dep["spec"]["template"]["spec"]["containers"] for p in c["ports"]}

    def sources(port_name: str) -> list:
        """The `from` lists of the rules that admit `port_name` (None: from anywhere)."""
        out = []
        for rule in pol["spec"]["ingress"]:
            ports = [p["port"] for p in rule.get("ports", [])]
            if not ports or port_name in ports or named[port_name] in ports:
                out.append(rule.get("from"))
        return out

    for port in ("http", "grpc"):
        assert sources(port) == [[{"podSelector": {}}]], port  # this namespace's pods only
    assert sources("metrics") == [[{"namespaceSelector": {}}]]  # Prometheus, wherever it runs in the cluster
    assert sources("openai") == [None]
    assert all(set(p) == {"port"} and p["port"] in named for r in pol["spec"]["ingress"] for p in r["ports"])


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


def kubernetes_documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((ROOT / "docker" / "kubernetes.yaml").read_text()) if d]


# the oldest Kubernetes the manifest is written for (autoscaling/v2, startupProbe) and the newest
# whose schemas the pinned kubernetes-validate bundles (requirements-test.txt): nothing is fetched
KUBERNETES_VERSIONS = ("1.25", "latest")


def test_every_kubernetes_document_validates_against_the_kubernetes_schemas():
    import kubernetes_validate

    docs = kubernetes_documents()
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "NetworkPolicy", "HorizontalPodAutoscaler"}
    for version in KUBERNETES_VERSIONS:
        version = kubernetes_validate.latest_version() if version == "latest" else version
        for doc in docs:
            # strict: a misspelt or misplaced field is an error, not silently dropped by the API server
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_misspelt_field():
    import kubernetes_validate

    dep = next(d for d in kubernetes_documents() if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, kubernetes_validate.latest_version(), strict=True)


def test_kubernetes_probes_and_resources():
    dep = next(d for d in kubernetes_documents() if d["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    # readiness: Triton's health endpoint first (health_probe.server_ready), then an inference
    assert container["startupProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["readinessProbe"]["exec"]["command"][:3] == ["python3", "-m", "specguide.process.health_probe"]
    assert "--liveness" in container["livenessProbe"]["exec"]["command"]
    resources = container["resources"]
    assert resources["requests"]["cpu"] and resources["requests"]["memory"] and resources["limits"]["memory"]


def test_the_autoscaler_scales_the_deployment_on_the_engine_queue():
    docs = {d["kind"]: d for d in kubernetes_documents()}
    hpa, dep = docs["HorizontalPodAutoscaler"], docs["Deployment"]
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", dep["metadata"]["name"])
    assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    # a family the engine model exports (triton/metrics.py), labelled with the model it serves
    assert name == "specguide_queue_depth" and f'gauge("{name}"' in (ROOT / "backend_src" / "specguide" / "triton" /
                                                                     "metrics.py").read_text()
    assert metric["pods"]["metric"]["selector"]["matchLabels"] == {"model": "specguide"}
    assert metric["pods"]["target"]["type"] == "AverageValue"


def test_the_readiness_probe_fails_while_triton_is_not_ready():
    """health_probe asks Triton's /v2/health/ready first: a 503 there fails readiness without an inference."""
    import http.server
    import threading

    from specguide.process import health_probe

    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            asked.append(self.path)
            self.send_response(503 if self.path == "/v2/health/ready" else 404)
            self.end_headers()

        def do_POST(self):  # noqa: N802
            asked.append(self.path)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"127.0.0.1:{srv.server_address[1]}"
        assert health_probe.main(["--url", url, "--timeout", "5"]) == 1
        assert asked == ["/v2/health/ready"]  # no inference was tried
        assert health_probe.server_ready(url, 5) == "/v2/health/ready: HTTP 503"
    finally:
        srv.shutdown()
