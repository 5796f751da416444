"""The command line: `specguide-openai --triton-url HOST:PORT --port 9000`."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from pathlib import Path
from typing import Optional

from .caps import Caps

DEFAULT_PORT = 9000  # OPENAI_PORT


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specguide-openai", description=__doc__)
    p.add_argument("--triton-url", default=os.environ.get("TRITON_GRPC_URL",
                                                          f"127.0.0.1:{os.environ.get('TRITON_GRPC_PORT', '8001')}"),
                   help="Triton's gRPC address (default 127.0.0.1:$TRITON_GRPC_PORT, else :8001)")
    p.add_argument("--triton-model", default="specguide", help="the model to send requests to")
    p.add_argument("--served-model-name", default="specguide", help="the model name clients give")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on (default 127.0.0.1); any other than a loopback address "
                        "needs an API key, or --allow-no-key")
    p.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", DEFAULT_PORT)))
    p.add_argument("--api-key", default=os.environ.get("SPECGUIDE_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default $SPECGUIDE_API_KEY; none: open, "
                        "which only a loopback --host allows unless --allow-no-key is given)")
    p.add_argument("--allow-no-key", action="store_true",
                   help="listen on a non-loopback --host without an API key: only behind a gateway of your own "
                        "that checks who may call")
    p.add_argument("--chat-template-dir", type=Path, default=None,
                   help="a model folder with the chat template (default: the served model's folder)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20, help="a larger body is 413 (default 4 MiB)")
    caps = Caps()
    p.add_argument("--max-choices-per-request", type=_positive, default=caps.max_choices,
                   help="prompts x n of one request (the choices of its answer; each prompt is a Triton request "
                        f"of n sequences): default {caps.max_choices}, room for lm-eval's batches of prompts or "
                        "n 16 on 4 prompts; more is a 400 (send them in several requests)")
    p.add_argument("--max-stop-strings", type=_positive, default=caps.max_stop,
                   help=f"stop strings per request (default {caps.max_stop}; OpenAI allows 4)")
    p.add_argument("--max-stop-token-ids", type=_positive, default=caps.max_stop_token_ids,
                   help=f"vLLM's stop_token_ids per request (default {caps.max_stop_token_ids})")
    p.add_argument("--max-bad-words", type=_positive, default=caps.max_bad_words,
                   help=f"vLLM's bad_words per request (default {caps.max_bad_words})")
    p.add_argument("--max-tools", type=_positive, default=caps.max_tools,
                   help=f"tools per chat request (default {caps.max_tools}, OpenAI's limit)")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    from .triton_client import split_url
    try:
        split_url(args.triton_url)
    except ValueError as e:
        p.error(str(e))
    if not args.api_key and not args.allow_no_key and not is_loopback(args.host):
        p.error(f"refusing to listen on {args.host} without an API key: anyone who reaches it could use the model. "
                "Set SPECGUIDE_API_KEY (or --api-key KEY), listen on 127.0.0.1, or pass --allow-no-key if a "
                "gateway of your own in front of this server checks who may call")
    return args


def is_loopback(host: str) -> bool:
    """`host` is a loopback address (127.0.0.0/8, ::1) or `localhost`; a name is taken as reachable
    from elsewhere (it is not resolved)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def caps_of(args: argparse.Namespace) -> Caps:
    return Caps(max_choices=args.max_choices_per_request, max_stop=args.max_stop_strings,
                max_stop_token_ids=args.max_stop_token_ids, max_bad_words=args.max_bad_words,
                max_tools=args.max_tools)


def main(argv: Optional[list[str]] = None) -> int:
    import uvicorn

    from ..util.heap import freeze_startup_heap
    from .app import Settings, create_app

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings(triton_url=args.triton_url, triton_model=args.triton_model,
                        served_model_name=args.served_model_name, api_key=args.api_key,
                        chat_template_dir=args.chat_template_dir, max_body_bytes=args.max_body_bytes,
                        caps=caps_of(args))
    app = create_app(settings)
    logging.getLogger("specguide.openai_api").info("start-up heap frozen: %d objects", freeze_startup_heap())
    # loop / http "auto" take uvloop and httptools (both dependencies): the event loop and HTTP
    # parser in C. Every streamed token passes through both, and on a small machine their CPU time
    # is taken from the engine's
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                loop="auto", http="auto", timeout_graceful_shutdown=5)
    return 0
