"""The FastAPI app: routes, API key, body caps, OpenAI-shaped errors.

Bodies are read by us (capped in bytes, then in JSON nesting depth, before `json.loads`) and
validated by the pydantic models of `schemas.py`, so that every refusal is OpenAI-shaped and names
its field. A body past INLINE_BODY_BYTES is parsed, checked and turned into Triton requests in a
worker thread (`asyncio.to_thread`), off the event loop that streams every other client's tokens.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ReasoningMarkers, parse_adapters
from ..guided.limits import json_depth
from . import chat_endpoint, completions_endpoint, handlers
from .chat import ChatTemplate
from .caps import Caps
from .errors import ApiError, ErrorType, bad_request, from_triton, from_validation
from .event_stream import EventStream
from .request_params import Limits
from .schemas import ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .triton_client import MODEL, TritonClient, TritonError

log = logging.getLogger("specguide.openai_api")

# a body up to this size is parsed and prepared in the event loop (well under a millisecond); a
# larger one, up to --max-body-bytes, in a worker thread
INLINE_BODY_BYTES = 16 << 10


@dataclass
class Settings:
    """How the server runs (the command line's options)."""

    triton_url: str = "127.0.0.1:8001"
    triton_model: str = MODEL
    served_model_name: str = MODEL
    api_key: Optional[str] = None
    chat_template_dir: Optional[Path] = None  # default: the model folder named in the model's config
    max_body_bytes: int = 4 << 20
    max_json_depth: int = 80  # the model caps a guide at 64 levels; the body wraps it in a few more
    caps: Caps = field(default_factory=Caps)  # counts per request (prompts x n, stop strings, tools, ...)


def _default_template_dir(params: dict[str, str]) -> Path:
    from ..util.paths import cache_dir

    model_dir = params.get("model_dir", "")
    if model_dir and Path(model_dir).is_dir():
        return Path(model_dir)
    return cache_dir() / "models" / "smollm2-135m-instruct"  # the default model's converted folder


def adapter_names(text: str) -> list[str]:
    """The LoRA adapters config `lora_adapters` names (inline JSON or a file this server can read:
    /v1/models lists them); [] when none or unreadable (a `multi_lora.json` the model found itself)."""
    try:
        return list(parse_adapters(text))
    except ValueError:
        return []


def max_tokens_limit(params: dict[str, str], folder: Path) -> int:
    """The model's max_tokens_limit as its engine resolves it: the setting, else max_seq_len, else
    (0: the model's whole context) `max_position_embeddings` of the model folder's config.json;
    2048 where none is known (e.g. a GGUF file)."""
    for key in ("max_tokens_limit", "max_seq_len"):
        if int(params.get(key) or 0) > 0:
            return int(params[key])
    try:
        conf = json.loads((folder / "config.json").read_text())
        return int((conf.get("text_config") or conf)["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 2048


def create_app(settings: Settings, client: Optional[TritonClient] = None) -> FastAPI:
    """The app; `client` defaults to a TritonClient on settings.triton_url, made at start-up."""
    ctx = handlers.Context(client=client, template=None, model_name=settings.served_model_name, caps=settings.caps)

    def configure(params: dict[str, str]) -> None:
        model_folder = _default_template_dir(params)
        limit = max_tokens_limit(params, model_folder)
        ctx.limits, ctx.default_chat_max_tokens = Limits(limit), limit
        ctx.reasoning = ReasoningMarkers.parse(params.get("reasoning_markers", ""))
        ctx.adapters = adapter_names(params.get("lora_adapters", ""))
        folder = settings.chat_template_dir or model_folder
        try:
            ctx.template = ChatTemplate(folder)
        except (OSError, ValueError) as e:
            log.warning("no chat template (%s): /v1/chat/completions refuses requests", e)

    async def configure_when_ready() -> None:
        """Triton may still be starting (`make serve` starts both): read the model's settings once it answers."""
        while not (params := await ctx.client.parameters()):
            await asyncio.sleep(2.0)
        configure(params)
        log.info("configured from Triton at %s: max_tokens_limit %d", settings.triton_url, ctx.limits.max_tokens_limit)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if ctx.client is None:  # a gRPC channel belongs to the loop that makes it: uvicorn's
            ctx.client = TritonClient(settings.triton_url, settings.triton_model)
        configure({})  # defaults until Triton answers
        task = asyncio.create_task(configure_when_ready())
        yield
        task.cancel()
        await ctx.client.close()

    app = FastAPI(title="SpecGuide OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        etype = ErrorType.NOT_FOUND if e.status_code == 404 else ErrorType.INVALID_REQUEST
        return JSONResponse(ApiError(e.status_code, str(e.detail), etype).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _fault(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(ApiError(500, "internal error (the server log has the details)", ErrorType.SERVER).body(),
                            status_code=500)

    if settings.api_key:
        app.add_middleware(ApiKeyCheck, key=settings.api_key)

    def parse(body: bytes, model: type[BaseModel]) -> Any:
        """The body as `model` (a 400 / 404 naming what is wrong); its size is capped already."""
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            raise bad_request("the body is not UTF-8") from None
        if json_depth(text) > settings.max_json_depth:  # one linear pass, before json.loads can recurse
            raise bad_request(f"the JSON body nests deeper than {settings.max_json_depth} levels")
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise bad_request(f"the body is not valid JSON: {e}") from None
        if not isinstance(obj, dict):
            raise bad_request("the body must be a JSON object")
        try:
            req = model.model_validate(obj)
        except ValidationError as e:
            raise from_validation(e, obj) from None
        return req  # a `model` other than the served one names a LoRA adapter (the engine knows which it serves)

    async def handle(request: Request, model: type[BaseModel], prepare: Callable[[handlers.Context, Any], Any],
                     run: Callable[[handlers.Context, Any], Any]) -> Any:
        body = await _read_body(request, settings.max_body_bytes)  # the byte cap first

        def work() -> Any:
            return prepare(ctx, parse(body, model))

        plan = work() if len(body) <= INLINE_BODY_BYTES else await asyncio.to_thread(work)
        result: handlers.Answer = await run(ctx, plan)
        if isinstance(result, dict):
            return JSONResponse(result)
        return EventStream(result)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ChatCompletionRequest, chat_endpoint.prepare, chat_endpoint.run)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, CompletionRequest, completions_endpoint.prepare, completions_endpoint.run)

    def model_card(name: str = "") -> dict[str, Any]:
        card = {"id": name or settings.served_model_name, "object": "model", "created": created,
                "owned_by": "specguide"}
        return {**card, "parent": settings.served_model_name} if name else card  # an adapter: vLLM's card

    async def adapters() -> list[str]:
        """The adapters the engine serves (config, its own multi_lora.json, run-time loads); the
        config's names while Triton cannot say."""
        try:
            return list((await ctx.client.lora({"action": "list"}))["adapters"])
        except (ApiError, TritonError, KeyError, TypeError, ValueError) as e:
            log.warning("listing the LoRA adapters: %s", e)
            return ctx.adapters

    async def lora_control(request: Request, model: type[BaseModel], action: str) -> Any:
        """/v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's bodies and answers (plain text)."""
        req = parse(await _read_body(request, 1 << 16), model)
        if req.lora_name == settings.served_model_name:
            raise bad_request(f"lora_name {req.lora_name!r} is the served model's name", "lora_name")
        control = {"action": action, "lora_name": req.lora_name}
        if action == "load":
            control.update(lora_path=req.lora_path, load_inplace=req.load_inplace)
        try:
            await ctx.client.lora(control)
        except TritonError as e:
            if e.code == "NOT_FOUND":  # unloading a name not served
                raise ApiError(404, e.message, ErrorType.NOT_FOUND, "lora_name", "not_found") from None
            raise from_triton(e.code, e.message, "lora_path" if action == "load" else "lora_name") from None
        done = "added" if action == "load" else "removed"
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' {done} successfully.")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await lora_control(request, LoadLoRAAdapterRequest, "load")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await lora_control(request, UnloadLoRAAdapterRequest, "unload")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()] + [model_card(a) for a in await adapters()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != settings.served_model_name and name not in await adapters():
            raise ApiError(404, f"The model `{name}` does not exist.", ErrorType.NOT_FOUND, "model", "model_not_found")
        return model_card("" if name == settings.served_model_name else name)

    @app.get("/health")
    async def health():
        if await ctx.client.ready():
            return {"status": "ok"}
        # no address or model name of the back end: /health answers without a key
        return JSONResponse(ApiError(503, "the model is not ready (Triton is not reachable, or still loading it)",
                                     ErrorType.UNAVAILABLE).body(), status_code=503)

    return app


class ApiKeyCheck:
    """`Authorization: Bearer KEY` on /v1/*, compared in constant time.

    NOTE: a plain ASGI middleware: Starlette's `@app.middleware("http")` passes every streamed
    chunk through a task and a memory channel of its own, a cost paid per token."""

    def __init__(self, app: Any, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
                e = ApiError(401, "Incorrect API key provided." if given else "Missing API key (Authorization: Bearer).",
                             ErrorType.AUTHENTICATION, None, "invalid_api_key")
                await JSONResponse(e.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused (413) past `limit` bytes, by Content-Length or while it arrives."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body has {declared} bytes; the limit is {limit}", ErrorType.INVALID_REQUEST)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise ApiError(413, f"the body exceeds {limit} bytes", ErrorType.INVALID_REQUEST)
        chunks.append(chunk)
    return b"".join(chunks)
