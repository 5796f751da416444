"""The command line: `specguide-openai --triton-url HOST:PORT --port 9000`."""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Optional

DEFAULT_PORT = 9000  # OPENAI_PORT


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specguide-openai", description=__doc__)
    p.add_argument("--triton-url", default=os.environ.get("TRITON_GRPC_URL",
                                                          f"127.0.0.1:{os.environ.get('TRITON_GRPC_PORT', '8001')}"),
                   help="Triton's gRPC address (default 127.0.0.1:$TRITON_GRPC_PORT, else :8001)")
    p.add_argument("--triton-model", default="specguide", help="the model to send requests to")
    p.add_argument("--served-model-name", default="specguide", help="the model name clients give")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", DEFAULT_PORT)))
    p.add_argument("--api-key", default=os.environ.get("SPECGUIDE_API_KEY") or None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default $SPECGUIDE_API_KEY; none: open)")
    p.add_argument("--chat-template-dir", type=Path, default=None,
                   help="a model folder with the chat template (default: the served model's folder)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    from .triton_client import split_url
    try:
        split_url(args.triton_url)
    except ValueError as e:
        p.error(str(e))
    return args


def main(argv: Optional[list[str]] = None) -> int:
    import uvicorn

    from ..heap import freeze_startup_heap
    from .app import Settings, create_app

    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = Settings(triton_url=args.triton_url, triton_model=args.triton_model,
                        served_model_name=args.served_model_name, api_key=args.api_key,
                        chat_template_dir=args.chat_template_dir, max_body_bytes=args.max_body_bytes)
    app = create_app(settings)
    logging.getLogger("specguide.openai_api").info("start-up heap frozen: %d objects", freeze_startup_heap())
    # loop / http "auto" take uvloop and httptools (both dependencies): the event loop and HTTP
    # parser in C. Every streamed token passes through both, and on a small machine their CPU time
    # is taken from the engine's
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                loop="auto", http="auto", timeout_graceful_shutdown=5)
    return 0
