"""The simulator's process (``python -m testbed.simworker``): reads its configuration as one
JSON line on stdin, prints one JSON line with its ports when every address listens, and exits
when its stdin closes (the process that started it ended, however it ended).
:class:`testbed.simworker.fleet.SimFleet` starts it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any

from testbed.simworker.server import SimServer


async def _serve_forever(config: dict[str, Any]) -> None:
    server = SimServer(config)
    port, control_port = await server.start(int(config.get("port") or 0))
    print(json.dumps({"port": port, "control_port": control_port}), flush=True)
    # Never outlive the test process, even one killed without a chance to stop us: the
    # parent holds our stdin open, so its end of file means the parent is gone.
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    await reader.read()


def main() -> None:
    config = json.loads(sys.stdin.readline())
    if not os.environ.get("SIMWORKER_NO_UVLOOP"):
        with contextlib.suppress(ImportError):
            import uvloop

            uvloop.install()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_forever(config))


if __name__ == "__main__":
    main()
