"""The router's FastAPI app: OpenAI endpoints, health, metrics, auth, and error shapes.

``create_app(config)`` wires the parts; tests pass a ready registry or tokenizer instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import importlib.metadata
import json
import logging
import os
import pathlib
import socket
import time
from collections.abc import Callable

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.protocol.channel_auth import ChannelAuth
from pdserve.protocol.cluster_key import load_key
from pdserve.protocol.model_digest import model_digest, weight_files
from pdserve.protocol.registry import Role
from pdserve.protocol.tracing import open_tracer
from pdserve.router import (
    jobs,
    messages_api,
    metrics,
    policy,
    responses_api,
    roles,
    serving,
    spans,
    tokenize_api,
)
from pdserve.router.admission import Admission, Stage
from pdserve.router.config import RouterConfig
from pdserve.router.errors import APIError, bad_request, error_response_parts
from pdserve.router.generation import Backend
from pdserve.router.lora import Adapter, AdapterTable, LoadBody, UnloadBody
from pdserve.router.messages_schema import CountTokensBody, MessagesBody
from pdserve.router.node_client import NodeClient
from pdserve.router.openai_schema import (
    BatchChatBody,
    ChatBody,
    CompletionBody,
    DetokenizeBody,
    TokenizeBody,
    validation_error,
)
from pdserve.router.registry_client import NodeRegistry, RedisRegistry, StaticRegistry
from pdserve.router.request_limits import Limits
from pdserve.router.response_store import ResponseStore, not_found
from pdserve.router.responses_schema import ResponsesBody
from pdserve.router.scaling_log import DecisionBody
from pdserve.router.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RouterState:
    config: RouterConfig
    model_name: str  # what /v1/models lists and requests name
    tokenizer: Tokenizer
    admission: Admission
    backend: Backend
    adapters: AdapterTable  # the LoRA adapters requests may name (router/lora.py)
    responses: ResponseStore  # the Responses API's stored responses (router/response_store.py)
    num_requests_running: int = 0  # generation requests under way, whole or streaming (GET /load)

    def max_model_len(self) -> int:
        """The smallest context of the live nodes, else the model's own."""
        lens = [n.max_model_len for n in self.backend.registry.snapshot()]
        return min(lens) if lens else self.tokenizer.max_model_len

    def limits(self) -> Limits:
        """What one request may ask for (router.request_limits)."""
        config = self.config
        return Limits(config.max_n, config.max_logprobs, config.max_logprob_entries)

    def check_model(self, model: str | None) -> Adapter | None:
        """The LoRA adapter ``model`` names, None for the base model; a 404 for any other name."""
        return self.adapters.get(model)


def make_registry(config: RouterConfig, nodes: NodeClient, key: bytes | None = None) -> NodeRegistry:
    if config.redis_url is not None:
        return RedisRegistry(
            config.redis_url,
            nodes,
            config.poll_interval_s,
            config.node_expiry_s,
            key,
            config.redis_password_file,
            config.max_record_skew_s,
        )
    return StaticRegistry(
        config.prefill_addrs, config.decode_addrs, nodes, config.poll_interval_s, config.node_expiry_s
    )


def create_app(
    config: RouterConfig,
    tokenizer: Tokenizer | None = None,
    registry: NodeRegistry | None = None,
    nodes: NodeClient | None = None,
) -> FastAPI:
    """The app; its lifespan opens the node sockets and starts polling the registry."""
    tokenizer = tokenizer or Tokenizer(config.model)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        key = load_key(config.cluster_key_file) if config.cluster_key_file else None
        auth = ChannelAuth(key, log.warning) if key is not None and nodes is None else None
        node_client = nodes or NodeClient(config.host, config.reply_port, config.advertise_host, auth=auth)
        node_client.start()
        log.info("nodes push replies to %s", node_client.reply_addr)
        node_registry = registry or make_registry(config, node_client, key)
        if registry is None and weight_files(
            pathlib.Path(config.model)
        ):  # a tokenizer-only folder cannot tell
            node_registry.expected_model = model_digest(config.model)
        node_registry.start()
        admission = Admission(
            {Stage.PREFILL: config.max_inflight_prefill, Stage.DECODE: config.max_inflight_decode}
        )
        backend = _backend(config, node_client, node_registry, admission)
        app.state.router = _router_state(config, tokenizer, admission, backend)
        with contextlib.suppress(TimeoutError):  # answer health checks early either way
            async with asyncio.timeout(2 * config.poll_interval_s + 1):
                await node_registry.ready.wait()
        yield
        await _close(node_registry, node_client, backend)

    app = FastAPI(title="pdserve router", version=PDSERVE_VERSION, lifespan=lifespan)
    _add_error_handlers(app)
    app.add_middleware(_Guard, config=config)
    _add_routes(app)
    return app


async def _close(registry: NodeRegistry, nodes: NodeClient, backend: Backend) -> None:
    await registry.stop()
    await nodes.close()
    if backend.tracer is not None:
        backend.tracer.close()  # the spans still batched go out


def _router_state(
    config: RouterConfig, tokenizer: Tokenizer, admission: Admission, backend: Backend
) -> RouterState:
    """The app's state: the served model's name, and the LoRA adapters requests may name."""
    name = config.served_model_name or pathlib.Path(config.model).name
    adapters = AdapterTable((name, config.model), config.lora_modules)
    store = ResponseStore(config.responses_store_size, config.responses_store_ttl_s)
    return RouterState(config, name, tokenizer, admission, backend, adapters, store)


def _backend(
    config: RouterConfig, nodes: NodeClient, registry: NodeRegistry, admission: Admission
) -> Backend:
    routing = policy.RoutingPolicy(
        config.disagg_threshold,
        prefix_routing=config.prefix_routing,
        local_prefill_margin_s=config.local_prefill_margin_s,
        tpot_slo_s=config.tpot_slo_s,
    )
    inflight = lambda: {str(s): n for s, n in admission.num_inflight.items()}  # noqa: E731
    instance = f"router-{socket.gethostname()}-{os.getpid()}"
    tracer = open_tracer("pdserve-router", instance, config.otlp_traces_endpoint)  # None: off
    router_metrics = metrics.RouterMetrics(registry.snapshot, inflight)
    return Backend(config, nodes, registry, routing, router_metrics, tracer)


GUARDED_PATHS = ("/v1", "/tokenize", "/detokenize", "/admin", "/invocations")  # what --api-key protects
# What GET /load counts while they run, streams to their last byte (vLLM's server load tracking).
LOAD_TRACKED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/invocations",
    }
)
try:
    PDSERVE_VERSION = importlib.metadata.version("pdserve")
except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
    PDSERVE_VERSION = "0.1.0"


def _state(request: Request) -> RouterState:
    return request.app.state.router


def error_response(path: str, error: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """``error`` in the shape of the API ``path`` belongs to (Anthropic's on /v1/messages)."""
    body, status = error_response_parts(path, error)
    return JSONResponse(body, status, headers={**error.headers(), **(headers or {})})


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request.url.path, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request.url.path, validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail))
        return error_response(request.url.path, err, dict(exc.headers or {}))


class _Guard:
    """Pure ASGI middleware (streams and disconnects pass through untouched): API key, body size,
    and the request counter by endpoint and status."""

    def __init__(self, app, config: RouterConfig) -> None:
        self.app = app
        self._config = config

    def _refuse(self, scope) -> APIError | None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        config = self._config
        guarded = GUARDED_PATHS + (("/metrics",) if config.metrics_auth else ())
        if config.api_key is not None and scope["path"].startswith(guarded):
            # Constant time: how long the check takes says nothing of how much of the key matched.
            # Anthropic's clients send x-api-key: KEY, OpenAI's Authorization: Bearer KEY.
            bearer = hmac.compare_digest(
                headers.get("authorization", b""), f"Bearer {config.api_key}".encode()
            )
            api_key = hmac.compare_digest(headers.get("x-api-key", b""), config.api_key.encode())
            if not (bearer or api_key):
                return APIError(401, "missing or wrong API key", None, "invalid_api_key")
        length = headers.get("content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > config.max_body_bytes:
            return APIError(413, f"request body over {config.max_body_bytes} bytes", None, "body_too_large")
        return None

    async def _read_capped(self, receive):
        """A body sent without Content-Length (chunked), read up to the limit: a receive that
        replays it, or the 413 once it passes the limit (the rest is never read)."""
        limit, parts, num = self._config.max_body_bytes, [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return receive, APIError(400, "the client went away mid-body")
            num += len(message.get("body", b""))
            if num > limit:
                return receive, APIError(413, f"request body over {limit} bytes", None, "body_too_large")
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(parts), "more_body": False}
            return await receive()

        return replay, None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        error = self._refuse(scope)
        if error is None and _has_body_without_length(scope):
            receive, error = await self._read_capped(receive)
        state: RouterState | None = getattr(scope["app"].state, "router", None)
        tracked = scope["method"] == "POST" and scope["path"] in LOAD_TRACKED_PATHS
        load = state if tracked else None  # the state whose count this request is in
        trace = None if load is None else spans.open_request(load.backend.tracer, scope)
        if load is not None:
            load.num_requests_running += 1
            scope.setdefault("state", {})[spans.SCOPE_KEY] = trace
        try:
            if error is not None:
                await error_response(scope["path"], error)(scope, receive, send_and_note)
            else:
                await self.app(scope, receive, send_and_note)
        finally:
            if load is not None:
                load.num_requests_running -= 1
            if trace is not None:
                trace.finish(status)
        if scope["path"].startswith("/v1/") and scope["method"] == "POST" and state is not None:
            endpoint = _endpoint_label(scope["path"])
            state.backend.metrics.requests.labels(endpoint=endpoint, outcome=str(status)).inc()


def _endpoint_label(path: str) -> str:
    """The endpoint as /metrics labels it: a response id is not a label value (unbounded)."""
    if path.startswith("/v1/responses/"):
        return "/v1/responses/{id}" + ("/cancel" if path.endswith("/cancel") else "")
    return path


def _has_body_without_length(scope) -> bool:
    names = {k.lower() for k, _ in scope["headers"]}
    return scope["method"] in ("POST", "PUT", "PATCH") and b"content-length" not in names


def _add_routes(app: FastAPI) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Response:
        return await _generate(jobs.completion_job, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Response:
        return await _generate(jobs.chat_job, body, request)

    @app.post("/v1/chat/completions/batch")
    async def batch_chat_completions(body: BatchChatBody, request: Request) -> Response:
        return await _generate(jobs.batch_chat_job, body, request)

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's entry: the body's shape picks the endpoint, as in vLLM."""
        body = await _json_object(request)
        schema, make_job = _invocation_kind(body)
        try:
            parsed = schema.model_validate(body)
        except pydantic.ValidationError as exc:
            raise validation_error([dict(e) for e in exc.errors()]) from None
        return await _generate(make_job, parsed, request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody, request: Request) -> dict:
        state = _state(request)
        state.check_model(body.model)
        return await asyncio.to_thread(tokenize_api.tokenize, body, state.tokenizer, state.max_model_len())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody, request: Request) -> dict:
        state = _state(request)
        state.check_model(body.model)
        return tokenize_api.detokenize(body, state.tokenizer)

    for add in (_add_responses_routes, _add_messages_routes, _add_admin_routes, _add_lora_routes):
        add(app)
    _add_info_routes(app)


def _add_responses_routes(app: FastAPI) -> None:
    """OpenAI's Responses API over the chat completions path (router/responses_api.py)."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesBody, request: Request) -> Response:
        store = _state(request).responses
        history = store.history(body.previous_response_id) if body.previous_response_id else []
        chat = responses_api.chat_body(body, history)
        presenter = responses_api.ResponsesPresenter(body, store)
        return await _generate(responses_api.responses_job, chat, request, presenter)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict:
        entry = _state(request).responses.get(response_id)
        if entry is None:
            raise not_found(response_id, None)
        return entry.body

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        if not _state(request).responses.delete(response_id):
            raise not_found(response_id, None)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> dict:
        if _state(request).responses.get(response_id) is None:
            raise not_found(response_id, None)
        raise bad_request(
            "only background responses can be cancelled, and pdserve runs none in the background "
            "(background: true is refused)",
            "background",
        )


def _add_messages_routes(app: FastAPI) -> None:
    """Anthropic's Messages API over the chat completions path (router/messages_api.py); its
    errors take Anthropic's shape (``error_response``)."""

    @app.post("/v1/messages")
    async def create_message(body: MessagesBody, request: Request) -> Response:
        chat = messages_api.chat_body(body)
        return await _generate(messages_api.messages_job, chat, request, messages_api.MessagesPresenter())

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensBody, request: Request) -> dict:
        state = _state(request)
        chat = messages_api.chat_body(body)
        state.check_model(chat.model)
        args = (chat, state.tokenizer, state.max_model_len(), state.limits())
        return await asyncio.to_thread(messages_api.count_tokens, *args)


def _add_lora_routes(app: FastAPI) -> None:
    """vLLM's runtime adapter endpoints (guarded by --api-key like the rest of /v1): the router's
    table changes at once; nodes read an adapter when a request first brings it (router/lora.py)."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadBody, request: Request) -> Response:
        state = _state(request)
        adapter = await asyncio.to_thread(
            state.adapters.add, body.lora_name, body.lora_path, body.load_inplace
        )
        state.backend.metrics.lora_loads.labels(adapter=adapter.name).inc()
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadBody, request: Request) -> Response:
        adapter = _state(request).adapters.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' removed successfully.")


def _add_admin_routes(app: FastAPI) -> None:
    @app.post("/admin/nodes/{node_id}/role")
    async def set_role(node_id: str, body: roles.RoleBody, request: Request) -> dict:
        return await roles.switch_role(_state(request).backend, node_id, body)

    @app.get("/admin/nodes")
    async def admin_nodes(request: Request) -> dict:
        return roles.nodes_body(_state(request).backend)

    @app.post("/admin/autoscale")
    async def autoscale_decision(body: DecisionBody, request: Request) -> dict:
        return _state(request).backend.metrics.scaling.record(body)

    @app.get("/admin/autoscale")
    async def autoscale_decisions(request: Request) -> dict:
        return _state(request).backend.metrics.scaling.body()


def _add_info_routes(app: FastAPI) -> None:
    @app.get("/version")
    async def version() -> dict:
        return {"version": PDSERVE_VERSION}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        state = _state(request)
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pdserve",
            "root": state.config.model,
            "parent": None,
            "max_model_len": state.max_model_len(),
        }
        adapters = state.adapters.cards(state.model_name, state.max_model_len())
        return {"object": "list", "data": [card, *adapters]}

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        serving, body = _health(_state(request).backend.registry.snapshot())
        return JSONResponse(body, 200 if serving else 503)

    @app.get("/load")
    async def load(request: Request) -> dict:
        """vLLM's server load: the generation requests under way (always tracked here)."""
        return {"server_load": _state(request).num_requests_running}

    @app.get("/ping")
    @app.post("/ping")
    async def ping(request: Request) -> JSONResponse:
        """SageMaker's health check, beside /invocations: /health's answer."""
        return await health(request)

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        return Response(_state(request).backend.metrics.render(), media_type=metrics.CONTENT_TYPE)


def _health(nodes) -> tuple[bool, dict]:
    """Whether the router can serve, and /health's body."""
    live = [n for n in nodes if not n.draining]
    decode_keys = {policy.fingerprint_key(n) for n in live if n.role is Role.DECODE}
    num_pairs = sum(1 for n in live if n.role is Role.PREFILL and policy.fingerprint_key(n) in decode_keys)
    num_colocated = sum(n.role is Role.COLOCATED for n in live)  # a whole pipeline each
    # A decode node alone serves every request too (it prefills them itself): the router is up
    # while any node can decode; without a prefill pair it says so.
    serving = any(n.role.decodes for n in live)
    body = {
        "status": ("ok" if num_pairs or num_colocated else "decode_only") if serving else "unavailable",
        "num_prefill": sum(n.role is Role.PREFILL for n in live),
        "num_decode": sum(n.role is Role.DECODE for n in live),
        "num_colocated": num_colocated,
        "num_pairs": num_pairs,
    }
    return serving, body


MakeJob = Callable[..., jobs.Job]  # router.jobs' completion_job, chat_job, batch_chat_job


async def _generate(
    make_job: MakeJob,
    body: CompletionBody | ChatBody,
    request: Request,
    presenter: serving.Presenter = serving.OPENAI,
) -> Response:
    """A generation endpoint: the body checked into a Job (off the event loop: it tokenizes), then
    served and written by ``presenter`` (OpenAI's shapes, or the Responses or Messages API's)."""
    state = _state(request)
    adapter = state.check_model(body.model)
    max_model_len = state.max_model_len()
    job = await asyncio.to_thread(make_job, body, state.tokenizer, max_model_len, state.limits())
    if adapter is not None:
        params = dataclasses.replace(job.params, adapter=adapter.name, adapter_path=adapter.path)
        job = dataclasses.replace(job, params=params, adapter_rank=adapter.rank)
        state.backend.metrics.lora_requests.labels(adapter=adapter.name).inc()
    return await _serve(state, job, max_model_len, request, adapter, presenter)


async def _json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", None) from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", None)
    return body


def _invocation_kind(body: dict) -> tuple[type[CompletionBody | ChatBody], MakeJob]:
    """The endpoint an /invocations body is for, by its fields (vLLM tries chat, then completions):
    messages: chat; prompt (or prompt_embeds): completions; input: embeddings, not served here."""
    if "messages" in body:
        return ChatBody, jobs.chat_job
    if "prompt" in body or "prompt_embeds" in body:
        return CompletionBody, jobs.completion_job
    if "input" in body:
        raise bad_request("embeddings are not served: pdserve serves generative models only", "input")
    raise bad_request(
        "Cannot find suitable handler for request. Expected one of: chat completions (messages) "
        "or completions (prompt)",
        None,
    )


async def _serve(
    state: RouterState,
    job: jobs.Job,
    max_model_len: int,
    request: Request,
    adapter: Adapter | None,
    presenter: serving.Presenter,
) -> Response:
    name = state.model_name if adapter is None else adapter.name  # what the response says ran
    trace = spans.of(request.scope)  # the request's spans, from the middleware (router/spans.py)
    run = serving.JobRun(state.backend, state.tokenizer, state.admission, job, name, max_model_len, trace)
    return await serving.serve(run, request, presenter)
