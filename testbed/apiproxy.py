"""A TLS proxy in front of the test kube-apiserver that loses chosen watch events, as a watch
that relisted after a disconnect does: the objects it lists are current, and the DELETED
events of the ones deleted meanwhile never arrive.

    with WatchEventDropper(control_plane) as proxy:
        proxy.drop("DELETED", "wr-a")          # lose wr-a's deletion from every watch
        Operators(proxy.kubeconfig, ...)        # the operator talks to the API server through it

Everything else passes unchanged (requests, bodies, headers, streamed watch lines). It serves
with the control plane's own certificate (valid for 127.0.0.1), so a client that trusts the
test CA trusts it; it runs its own event loop in a thread."""

from __future__ import annotations

import asyncio
import json
import ssl
import threading
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from testbed.controlplane import ControlPlane, free_port

# Hop-by-hop, or recomputed by aiohttp for the body it sends; no compression asked for, so
# that the watch's lines pass as text.
_SKIP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive",
         "accept-encoding", "content-encoding"}  # fmt: skip


class WatchEventDropper:
    def __init__(self, cp: ControlPlane) -> None:
        self.upstream = cp.server
        pki = cp.state_dir / "pki"
        self._server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ssl.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
        self._client_ssl = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        self.port = free_port()
        config = yaml.safe_load(cp.kubeconfig.read_text())
        config["clusters"][0]["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        self.kubeconfig = Path(f"{cp.kubeconfig}.proxy-{self.port}")
        self.kubeconfig.write_text(yaml.safe_dump(config, sort_keys=False))
        self._drop: set[tuple[str, str]] = set()
        self.dropped: list[tuple[str, str]] = []  # (type, name) of every event lost
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def drop(self, event_type: str, name: str) -> None:
        """Lose every watch event of this type for objects of this name, from now on."""
        with self._lock:
            self._drop.add((event_type, name))

    def _lost(self, line: bytes) -> bool:
        try:
            event = json.loads(line)
            key = (event["type"], event["object"]["metadata"]["name"])
        except (ValueError, KeyError, TypeError):
            return False
        with self._lock:
            if key in self._drop:
                self.dropped.append(key)
                return True
        return False

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        body = await request.read()
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers,
            data=body or None, ssl=self._client_ssl, timeout=aiohttp.ClientTimeout(total=None),
        ) as up:  # fmt: skip
            out = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _SKIP:
                    out.headers[k] = v
            await out.prepare(request)
            watch = request.query.get("watch") in ("true", "1")
            try:
                while line := await up.content.readline():
                    if not (watch and self._lost(line)):
                        await out.write(line)
                await out.write_eof()
            except (aiohttp.ClientError, ConnectionResetError):
                pass  # either end went away mid-stream: the other sees its connection end
            return out

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._session: aiohttp.ClientSession | None = None

        async def start() -> web.AppRunner:
            self._session = aiohttp.ClientSession(auto_decompress=False)
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port, ssl_context=self._server_ssl).start()
            return runner

        self._runner = self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> WatchEventDropper:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the API proxy did not start")
        return self

    def __exit__(self, *_: Any) -> None:
        async def stop() -> None:
            # Watches stream until their upstream ends: end them first.
            if self._session is not None:
                await self._session.close()
            await self._runner.cleanup()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self.kubeconfig.unlink(missing_ok=True)
