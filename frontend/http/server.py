"""The HTTP API's server: uvicorn, run as a task of the frontend's event loop (the one grpc.aio serves on).

No thread and no second process: a route awaits the same engine streams as a gRPC call, on the same loop.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator

import uvicorn

from spindle.frontend.grpc.servicer import SpindleServicer
from spindle.frontend.http.app import OpenAIApp

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the frontend's own SIGTERM drains it with the gRPC server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Leave the process's signal handlers as they are."""
        yield


class HttpServer:
    """Serves :class:`~spindle.frontend.http.app.OpenAIApp` on ``host:port`` from the running event loop.

    Args:
        servicer: the gRPC server's servicer (its engine, limits and admission).
        metrics: renders the Prometheus text that ``/metrics`` serves.
        host: the interface to listen on.
        port: the TCP port; ``0`` picks a free one (:meth:`start` returns it).

    Attributes:
        api: the routes.
        port: the bound port, once started.

    """

    def __init__(self, servicer: SpindleServicer, metrics: Callable[[], bytes], host: str, port: int) -> None:
        self.api = OpenAIApp(servicer, metrics)
        self.config = uvicorn.Config(
            self.api.app,
            host=host,
            port=port,
            lifespan="off",
            access_log=False,
            log_config=None,
            # What a stop leaves to connections once it has cancelled the generations: only idle keep-alives.
            timeout_graceful_shutdown=1,
        )
        self.server = _Server(self.config)
        self.port: int | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind the port and start serving in a task; returns the bound port."""
        socket = self.config.bind_socket()
        self.port = socket.getsockname()[1]
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[socket]))
        while not self.server.started:
            if self._task.done():  # it failed to start: raise why
                await self._task
                raise RuntimeError(f"the HTTP API did not start on {self.config.host}:{self.port}")
            await asyncio.sleep(0.01)
        logger.info("Serving the OpenAI-compatible API on http://%s:%d/v1", self.config.host, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop serving: generations in flight are cancelled (which aborts them in the backend)."""
        self.api.cancel()
        self.server.should_exit = True
        if self._task is not None:
            await self._task
