"""Prometheus /metrics served from a service's own event loop.

A service's collectors read its live state at scrape time. They run on the event loop (the
aiohttp handler calls `generate_latest`), so they see the service's dicts and deques between
two awaits, never half-updated by another thread. Each service object gets its own
CollectorRegistry (never prometheus' global one), so one test process can run many services.

    server = MetricsServer(MyCollector(service))
    port = await server.start(0)          # GET http://127.0.0.1:<port>/metrics
    await server.stop()
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from asyncrl.logging import get_logger

log = get_logger()


def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    """A gauge family for a collector to fill with `add_metric(label_values, value)`."""
    return GaugeMetricFamily(name, doc, labels=list(labels))


class MetricsServer:
    """An aiohttp server with one route, GET /metrics, rendering `collectors`."""

    def __init__(self, *collectors: Collector):
        self.registry = CollectorRegistry(auto_describe=False)
        for c in collectors:
            self.registry.register(c)
        self._runner: web.AppRunner | None = None

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def start(self, port: int = 0, host: str = "127.0.0.1", ssl_context=None) -> int:
        """Listen on host:port (0: a free port), HTTPS with `ssl_context`; returns the port."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # a fixed port is shared with a successor starting beside this process (a hand-over)
        reuse = bool(port) or None
        await web.TCPSite(
            self._runner, host, port, ssl_context=ssl_context, reuse_port=reuse
        ).start()
        bound = self._runner.addresses[0][1]
        log.info("metrics_serving", host=host, port=bound, tls=ssl_context is not None)
        return bound

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
