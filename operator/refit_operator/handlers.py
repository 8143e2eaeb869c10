"""kopf glue only: one daemon per WeightRefit drives Engine.tick; deletion waits (through the
finalizer) until no pod is left mid-pass."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import kopf
from refit_worker.contract import API_GROUP

from .controller.reconcile_loop import Engine
from .core import api
from .edges import metrics
from .edges.cluster import FINALIZER
from .edges.leader import LeadershipLost

log = logging.getLogger(__name__)

ACTIVE_INTERVAL = 1.0  # seconds between ticks while pods are moving
IDLE_INTERVAL = 5.0  # while queued or watching a converged fleet for late pods
DORMANT_INTERVAL = 60.0  # finished and no longer the fleet's target
# A tick decides over every pod: at 10,000 pods that is most of a second of the event loop the
# passes and the lease renewals share. Every pass that ends wakes the refit, so without a pause
# the ticks of a large refit run back to back; above PAUSE_ABOVE_PODS units, after a tick that
# took t seconds, wakes wait at least t * TICK_PAUSE (they coalesce meanwhile). A smaller
# fleet ticks in milliseconds: a hand-off (a round ready, a pass ended, the trainer's
# announcement) is decided at once, not a pause later.
TICK_PAUSE = 1.0
PAUSE_ABOVE_PODS = 256


def pause_after(seconds: float, pods: int, interval: float) -> float:
    """How long wakes wait after a tick of ``seconds`` over ``pods`` units."""
    return min(seconds * TICK_PAUSE, interval) if pods > PAUSE_ABOVE_PODS else 0.0


def memo(engine: Engine, connection: kopf.ConnectionInfo) -> kopf.Memo:
    """What every handler reads from kopf's memo: the engine, and the credentials our own
    client loaded (kopf logs in with them)."""
    return kopf.Memo(engine=engine, connection=connection)


def _engine(memo: kopf.Memo) -> Engine:
    engine: Engine = memo.engine
    return engine


@kopf.on.login()
def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf talks to the API server with the credentials our own client loaded."""
    connection: kopf.ConnectionInfo = memo.connection
    return connection


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=API_GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=API_GROUP)
    settings.posting.enabled = False  # our Events say what happened; kopf's repeat its logs
    # The namespaces to watch come from the command line and the CRD is installed by the chart:
    # without this kopf lists namespaces and CRDs cluster-wide, which least-privilege RBAC
    # (rightly) forbids.
    settings.scanning.disabled = True


@kopf.daemon(API_GROUP, api.VERSION, api.PLURAL, cancellation_timeout=5.0)
async def refit_daemon(
    name: str,
    namespace: str | None,
    uid: str,
    stopped: kopf.DaemonStopped,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    assert namespace is not None  # WeightRefit is namespaced
    eng = _engine(memo)
    loop = asyncio.get_running_loop()
    fresh = True  # read the refit: the first tick, and every tick its interval brings
    while not stopped:
        interval = IDLE_INTERVAL
        began = loop.time()
        try:
            d = await eng.tick(namespace, name, fresh=fresh)
            if d is None:
                return
            interval = (
                DORMANT_INTERVAL if d.dormant else IDLE_INTERVAL if d.idle else ACTIVE_INTERVAL
            )
        except LeadershipLost:
            return  # the process is stopping: another replica may lead now
        except Exception as e:
            metrics.reconcile_error("api")
            log.exception("reconcile of %s/%s failed: %s", namespace, name, e)
        st = eng.state(uid)
        pause = pause_after(loop.time() - began, len(st.listing.pods), interval)
        if pause:
            await asyncio.sleep(pause)
        try:
            await asyncio.wait_for(st.wake.wait(), timeout=interval - pause)
            fresh = False  # a hand-off: decide from the refit as the watch last showed it
        except TimeoutError:
            fresh = True
        st.wake.clear()


@kopf.on.event(API_GROUP, api.VERSION, api.PLURAL)
async def refit_event(event: kopf.RawEvent, memo: kopf.Memo, **_: Any) -> None:
    """Keep the engine's index of WeightRefits current (queueing, rollback targets and
    history collection read it instead of listing every refit on every tick), and stamp a
    refit created without a creation stamp in watch order. Async so that kopf runs it on the
    event loop with the ticks, never in a thread beside them."""
    await _engine(memo).seen(dict(event["object"]), deleted=event["type"] == "DELETED")


@kopf.on.delete(API_GROUP, api.VERSION, api.PLURAL)
async def refit_deleted(name: str, namespace: str | None, memo: kopf.Memo, **_: Any) -> None:
    assert namespace is not None
    d = await _engine(memo).tick(namespace, name, deleting=True)
    if d is not None and not d.release_finalizer:
        raise kopf.TemporaryError("waiting for pods in flight to finish their pass", delay=2)
