"""Readiness as a client sees it: a 1-token inference through each served model name.

    python3 -m specguide.process.health_probe [--url 127.0.0.1:8000] [--timeout 10] [--liveness] [MODEL ...]

Readiness (the default): exits 0 when Triton's health endpoint (`/v2/health/ready`) says ready and
every name answers with a token, 1 otherwise (naming what failed). Triton 2.51 keeps reporting a
model ready while its engine restarts (its Python backend does not ask the model), so the
inference is needed too; this is the Kubernetes readiness probe (docker/kubernetes.yaml).
`--liveness` fails only where nothing but a restart of the server helps: a model whose Python
backend stub died (Triton never restarts a decoupled model's stub; every request to it fails
with "Stub process ... is not healthy"). A busy server or a restarting engine is alive.
Standard library only.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request

SERVED = ("specguide", "specguide_unary", "specguide_vllm")
PROMPT = "Hi"
STUB_DEAD = "is not healthy"  # Triton's answer for a model whose stub died


def probe(url: str, model: str, timeout: float) -> str:
    """'' when `model` generated a token through HTTP `generate`, else what went wrong."""
    body = {"text_input": PROMPT, "max_tokens": 1}
    if model.endswith("_vllm"):
        body = {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 1})}
    req = urllib.request.Request(f"http://{url}/v2/models/{model}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {(e.read() or b'').decode(errors='replace').strip()}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "" if "text_output" in answer else f"no text_output in {answer}"


def server_ready(url: str, timeout: float) -> str:
    """'' when Triton's `/v2/health/ready` answers 200 (the server and every loaded model ready), else why not."""
    try:
        with urllib.request.urlopen(f"http://{url}/v2/health/ready", timeout=timeout) as r:
            return "" if r.status == 200 else f"/v2/health/ready: HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return f"/v2/health/ready: HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"/v2/health/ready: {type(e).__name__}: {e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8000", help="Triton's HTTP address")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per inference")
    ap.add_argument("--liveness", action="store_true", help="fail only for a dead stub (see above)")
    ap.add_argument("models", nargs="*", default=list(SERVED))
    args = ap.parse_args(argv)
    if not args.liveness and (why := server_ready(args.url, args.timeout)):
        print(f"server: not ready: {why}", file=sys.stderr)
        return 1
    failed = {m: why for m in args.models if (why := probe(args.url, m, args.timeout))}
    if args.liveness:
        failed = {m: why for m, why in failed.items() if STUB_DEAD in why}
    for model, why in failed.items():
        print(f"{model}: {'not live' if args.liveness else 'not ready'}: {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
