"""The OpenAI-compatible HTTP server the agents call: ``/v1/chat/completions`` and ``/v1/models`` on
127.0.0.1 at an ephemeral port, served by uvicorn from a thread of its own.

That thread runs one asyncio event loop, which serves the requests and runs every episode's agent
(:mod:`~earl_lightning.rollout.endpoint.session`), so all agents of a rollout run at once. The
server only routes: a request's API key names its episode in the session open at the time, and
the session records the call and waits for the generation the trainer's thread does in batches.
Starlette (FastAPI's core, already installed with vLLM) is used directly: the two routes need no
dependency injection or schema generation, and each request costs less without them.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from earl_lightning.rollout.endpoint.protocol import MAX_BODY_BYTES, ApiError, parse_request

STARTUP_TIMEOUT_S = 30.0


class EndpointServer:
    """An OpenAI-compatible endpoint on 127.0.0.1 (see the module). ``handler(key, request)`` is
    the coroutine that answers a checked chat request for the episode of API key ``key``; None
    while no rollout is running (every key is then unknown).

    Args:
        model_name: the name ``/v1/models`` lists (requests may name any model: there is one).
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.handler: Callable[[str, Any], Awaitable[dict[str, Any]]] | None = None
        self.loop = asyncio.new_event_loop()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The ``base_url`` an OpenAI client takes."""
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> EndpointServer:
        """Bind an ephemeral port on 127.0.0.1 and serve from a daemon thread; returns once the
        server accepts connections."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=600,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name="earl-endpoint", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on 127.0.0.1:{self.port}")
            time.sleep(0.005)
        return self

    def _serve(self, sock: socket.socket) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._server.serve(sockets=[sock]))
        # what the agents left running (a session that ended) before the loop closes
        pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in pending:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.close()

    def close(self) -> None:
        """Stop serving and end the thread (idempotent)."""
        if self._server is not None and self._thread is not None and self._thread.is_alive():
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = None

    # ---- routes -------------------------------------------------------------------------------
    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
        )

    async def _chat(self, request: Any) -> Any:
        try:
            key = _api_key(request.headers.get("authorization", ""))
            size = request.headers.get("content-length")
            if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
                raise ApiError(
                    413,
                    f"the request body is {int(size):,} bytes; at most {MAX_BODY_BYTES:,} are read",
                )
            raw = await request.body()
            if len(raw) > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES:,} bytes")
            try:
                body = json.loads(raw)
            except (ValueError, RecursionError):
                raise ApiError(400, "the request body is not valid JSON") from None
            handler = self.handler
            if handler is None:
                raise _unknown_key(key)
            return _json(200, await handler(key, parse_request(body)))
        except ApiError as err:
            return _json(err.status, err.body())

    async def _models(self, request: Any) -> Any:
        return _json(
            200,
            {
                "object": "list",
                "data": [
                    {"id": self.model_name, "object": "model", "created": 0, "owned_by": "earl"}
                ],
            },
        )

    async def _not_found(self, request: Any, exc: Any) -> Any:
        path = request.url.path
        return _json(
            404,
            ApiError(
                404, f"no route {path!r}: this endpoint serves /v1/chat/completions and /v1/models"
            ).body(),
        )

    async def _not_allowed(self, request: Any, exc: Any) -> Any:
        return _json(
            405, ApiError(405, f"{request.method} is not allowed on {request.url.path!r}").body()
        )


def _api_key(header: str) -> str:
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ApiError(
            401,
            "no API key: send the episode's key as 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    return key.strip()


def _unknown_key(key: str) -> ApiError:
    shown = key if len(key) <= 24 else key[:21] + "..."
    return ApiError(
        401,
        f"Incorrect API key provided: {shown!r} names no running episode (the key of an episode that "
        "ended, or of another rollout)",
        code="invalid_api_key",
    )


def _json(status: int, body: dict[str, Any]) -> Any:
    from starlette.responses import Response

    return Response(json.dumps(body), status_code=status, media_type="application/json")
