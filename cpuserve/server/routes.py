"""The FastAPI app: the OpenAI routes and the server's own (/health, /version, /tokenize,
/detokenize, /metrics). The key is checked by APIKeyAuth before any route runs; each route
hands over to its module."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

from cpuserve import __version__
from cpuserve.engine import AsyncEngine
from cpuserve.server.access_log import install_access_log
from cpuserve.server.anthropic_messages import (
    AnthropicErrors,
    CountTokensRequest,
    MessagesRequest,
    count_tokens,
    create_message,
)
from cpuserve.server.auth import APIKeyAuth
from cpuserve.server.body_limit import BodySizeLimit
from cpuserve.server.chat import chat_prompt, create_chat_completion
from cpuserve.server.completions import create_completion
from cpuserve.server.embeddings import EmbeddingRequest, create_embedding
from cpuserve.server.errors import APIError, install_error_handlers
from cpuserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from cpuserve.server.responses import ResponsesRequest, create_response
from cpuserve.server.state import Server, ServerConfig
from cpuserve.server.stats_log import start_stats_log, stop_stats_log


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    server = Server(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        stats_log = start_stats_log(engine, config.log_stats)  # engine stats lines every 10 s while busy
        yield
        stop_stats_log(stats_log)
        server.tokens.shutdown()  # after the last connection closed: no request needs it now

    docs = {} if config.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="cpuserve", version=__version__, lifespan=lifespan, **docs)
    app.root_path = config.root_path  # as vLLM sets it (the constructor's argument is deprecated)
    app.state.server = server
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_bytes)
    # Starlette puts each add_middleware in front of the ones before it: a request without the key
    # gets 401 before its body is read, counted (413) or parsed (400) ...
    app.add_middleware(APIKeyAuth, api_key=config.api_key)
    # ... and CORS is in front of the key check: a browser's preflight carries no key, and a 401
    # needs the CORS headers for the page to read it.
    cors = config.cors
    app.add_middleware(
        CORSMiddleware,
        allow_origins=cors.origins,
        allow_methods=cors.methods,
        allow_headers=cors.headers,
        allow_credentials=cors.credentials,
    )
    install_error_handlers(app)
    install_access_log(app, server)  # after the handlers and every add_middleware: outermost, sees each 401

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/ping")  # vLLM's (SageMaker's) liveness route: /health's answer
    @app.post("/ping")
    async def ping() -> Response:
        return await health()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "cpuserve",
            "root": name,
            "parent": None,
            "max_model_len": engine.max_model_len,
            "permission": [],
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card(name) for name in config.served_model_names]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve)
    async def model(model: str) -> dict:
        server.check_model(model)
        return model_card(model)

    @app.post("/v1/completions")
    async def completions(request: Request, req: CompletionRequest) -> Response:
        return await create_completion(server, request, req)

    @app.post("/v1/chat/completions")
    async def chat(request: Request, req: ChatCompletionRequest) -> Response:
        return await create_chat_completion(server, request, req)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request, req: EmbeddingRequest) -> Response:
        return await create_embedding(server, request, req)

    @app.post("/v1/responses")
    async def responses(request: Request, req: ResponsesRequest) -> Response:
        return await create_response(server, request, req)

    async def messages(request: Request, req: MessagesRequest) -> Response:
        return await create_message(server, request, req)

    async def messages_count_tokens(req: CountTokensRequest) -> dict:
        return await count_tokens(server, req)

    # Its errors in Anthropic's shape for Anthropic clients (AnthropicErrors).
    app.router.add_api_route("/v1/messages", messages, methods=["POST"], route_class_override=AnthropicErrors)
    app.router.add_api_route(
        "/v1/messages/count_tokens", messages_count_tokens, methods=["POST"], route_class_override=AnthropicErrors
    )

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        server.check_model(req.model)
        if req.messages:
            chat_req = ChatCompletionRequest(
                **req.model_dump(include={"add_generation_prompt"} & req.model_fields_set),
                messages=req.messages,
                continue_final_message=req.continue_final_message,
                tools=req.tools,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            ids = await chat_prompt(server, chat_req)
        elif req.prompt is not None:
            ids = await server.tokens.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise APIError(400, "give either prompt or messages", param="prompt")
        body: dict = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}
        if req.return_token_strs:
            body["token_strs"] = [server.tokenizer.id_to_token(t) for t in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        server.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary", param="tokens")
        return {"prompt": await server.tokens.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(engine.stats()), media_type="text/plain; version=0.0.4")

    return app
