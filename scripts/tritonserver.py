"""Set up and start a real `tritonserver` from the `nvidia-pytriton` wheel (no container needed).

    python scripts/tritonserver.py setup            # copy the server + Python backend into .work/
    python scripts/tritonserver.py serve [ARGS...]  # start it on 127.0.0.1 under specguide.process.supervisor
                                                    # (extra ARGS go to tritonserver)
    python scripts/tritonserver.py run [ARGS...]    # the same without the supervisor (exec's tritonserver)
    python scripts/tritonserver.py env              # print the environment it runs with

Run it with the virtual environment's python: the Python backend stub embeds the interpreter it
finds as `python3` on PATH, so putting this venv's `bin/` first on PATH makes the stub read the
venv's `pyvenv.cfg` and use its site-packages (including the editable `specguide` install).
`LD_LIBRARY_PATH` gets this interpreter's libpython folder (else the stub loads another one)
and the wheel's bundled libraries.

Ports: TRITON_HTTP_PORT (8000), TRITON_GRPC_PORT (8001), TRITON_METRICS_PORT (8002);
address: TRITON_ADDRESS (127.0.0.1); repository: MODEL_REPOSITORY (./model_repository).
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("SPECGUIDE_WORK_DIR", ROOT / ".work"))
SERVER_DIR = WORK / "tritonserver"
PY_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


def wheel_paths() -> tuple[Path, Path]:
    """(pytriton/tritonserver folder, nvidia_pytriton.libs folder) of the installed wheel."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        sys.exit("nvidia-pytriton is not installed: pip install --no-deps nvidia-pytriton==0.7.0")
    pkg = Path(spec.origin).parent
    return pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs"


def setup(force: bool = False) -> Path:
    """Copy bin/, backends/, caches/ and the stub for this Python into .work/tritonserver (once)."""
    src, _ = wheel_paths()
    stub_src = src / "python_backend_stubs" / PY_VERSION / "triton_python_backend_stub"
    if not stub_src.exists():
        sys.exit(f"the nvidia-pytriton wheel has no Python backend stub for Python {PY_VERSION}")
    stamp = SERVER_DIR / ".ready"
    if stamp.exists() and stamp.read_text() == str(stub_src) and not force:
        return SERVER_DIR
    shutil.rmtree(SERVER_DIR, ignore_errors=True)
    SERVER_DIR.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src, SERVER_DIR, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub_src, SERVER_DIR / "backends" / "python" / "triton_python_backend_stub")
    stamp.write_text(str(stub_src))
    return SERVER_DIR


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    _, libs = wheel_paths()
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    ld = [p for p in (libdir, str(libs), env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = ":".join(ld)
    venv_bin = str(Path(sys.prefix) / "bin")  # not resolved: the venv's python3 symlink is the point
    env["PATH"] = venv_bin + ":" + env.get("PATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def server_command(
    model_repository: str | Path | None = None,
    http_port: int | None = None,
    grpc_port: int | None = None,
    metrics_port: int | None = None,
    address: str | None = None,
    extra: list[str] | None = None,
) -> list[str]:
    repo = Path(model_repository or os.environ.get("MODEL_REPOSITORY", ROOT / "model_repository")).resolve()
    address = address or os.environ.get("TRITON_ADDRESS", "127.0.0.1")
    http_port = http_port or int(os.environ.get("TRITON_HTTP_PORT", 8000))
    grpc_port = grpc_port or int(os.environ.get("TRITON_GRPC_PORT", 8001))
    metrics_port = metrics_port or int(os.environ.get("TRITON_METRICS_PORT", 8002))
    return [
        str(SERVER_DIR / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={SERVER_DIR / 'backends'}",
        f"--cache-directory={SERVER_DIR / 'caches'}",
        f"--http-address={address}",
        f"--grpc-address={address}",
        f"--metrics-address={address}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--exit-on-error=true",
        *(extra or []),
    ]


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "serve"
    if cmd == "setup":
        print(setup(force="--force" in argv))
        return 0
    if cmd == "env":
        env = server_env()
        for k in ("PATH", "LD_LIBRARY_PATH"):
            print(f"{k}={env[k]}")
        return 0
    if cmd in ("serve", "run"):
        setup()
        args = server_command(extra=argv[1:])
        if cmd == "serve":  # restarts the server if a Python backend stub dies (specguide/process/supervisor.py)
            http = f"{os.environ.get('TRITON_ADDRESS', '127.0.0.1')}:{os.environ.get('TRITON_HTTP_PORT', 8000)}"
            args = [sys.executable, "-m", "specguide.process.supervisor", "--http", http, "--", *args]
        print("+", " ".join(args), flush=True)
        os.execve(args[0], args, server_env())
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
