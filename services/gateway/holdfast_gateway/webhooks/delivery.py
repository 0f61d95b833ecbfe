"""The gateway's delivery loop: sign and POST what the outbox holds, retry, dead-letter.

Every gateway runs one (``app.py``). It wakes when PostgreSQL notifies that a
delivery is due (``LISTEN``, migration 0018's trigger: a turn's end reaches its
receiver within milliseconds of its commit) and at least every
``HOLDFAST_WEBHOOK_POLL_SECONDS`` (retries fall due by the clock, and a lost
listening connection costs only latency). Each round claims due deliveries
(``outbox.claim_due``) and sends them concurrently through the outbound
policy's transport: a URL accepted when the webhook was given is checked
again as it is dialled (its name may resolve elsewhere now), and a refusal
is a failed attempt like any other. A 2xx answer delivers; anything else
(another status, a timeout, a refused connection, redirects included: they
are not followed) is retried after :func:`~.backoff.retry_delay`, and after
``HOLDFAST_WEBHOOK_MAX_ATTEMPTS`` attempts the delivery is ``failed``, listed
by ``GET /webhooks/deliveries?status=failed`` until redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import httpx2
from holdfast_shared.assets import Vault, VaultError
from holdfast_shared.db import create_engine
from holdfast_shared.db.models import WebhookDelivery
from holdfast_shared.outbound import DestinationNotAllowed, OutboundPolicy
from holdfast_shared.settings import Settings
from holdfast_shared.webhooks import DUE_CHANNEL
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

import holdfast_gateway.webhooks.outbox as outbox
from holdfast_gateway.webhooks.backoff import retry_delay
from holdfast_gateway.webhooks.signing import signed_headers
from holdfast_gateway.webhooks.tenant import signing_secrets

log = logging.getLogger(__name__)

# Deliveries one gateway claims per round (and sends at once).
BATCH = 32
# A claim outlives its attempt's timeout by this much before another gateway
# may take the delivery over.
_HOLD_MARGIN_SECONDS = 5.0
# How often a gateway deletes deliveries past their retention (any gateway may:
# the rows are locked with SKIP LOCKED, a batch at a time).
_SWEEP_SECONDS = 600.0
# A lost listening connection is opened again after this long.
_RELISTEN_SECONDS = 2.0


class Deliverer:
    """Delivers the outbox's messages; :meth:`run` until cancelled (by the
    gateway's ``Background`` at shutdown), then :meth:`aclose`."""

    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        vault: Vault,
        settings: Settings,
        *,
        transport: httpx2.AsyncBaseTransport | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        listen_url: str | None = None,
    ) -> None:
        self.sessions = sessions
        # Where to LISTEN for due deliveries (None: poll alone).
        self.listen_url = listen_url
        self._due = asyncio.Event()
        self.vault = vault
        self.settings = settings
        self.clock = clock
        policy = OutboundPolicy.from_settings(settings)
        self.http = httpx2.AsyncClient(
            transport=transport or policy.transport(("webhook", "url")),
            timeout=settings.webhook_timeout_seconds,
            follow_redirects=False,
            trust_env=False,
        )
        self._hold = timedelta(seconds=settings.webhook_timeout_seconds + _HOLD_MARGIN_SECONDS)

    async def run(self) -> None:
        """Deliver until cancelled; the listener, if any, is this task's and ends with it."""
        async with asyncio.TaskGroup() as group:
            if self.listen_url is not None:
                group.create_task(self._listen(self.listen_url), name="webhook-listener")
            await self._deliver()

    async def _deliver(self) -> None:
        poll = self.settings.webhook_poll_seconds
        loop = asyncio.get_running_loop()
        next_sweep = loop.time()
        while True:
            # Cleared before the round: a notification during it makes another.
            self._due.clear()
            try:
                sent = await self.round()
                if loop.time() >= next_sweep:
                    next_sweep = loop.time() + _SWEEP_SECONDS
                    await self.sweep()
            except Exception:
                log.warning("webhook deliveries: a round failed; next in %gs", poll, exc_info=True)
                sent = 0
            if sent < BATCH:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll):
                        await self._due.wait()

    async def _listen(self, url: str) -> None:
        """Set ``_due`` on each notification of a due delivery; reconnects for ever
        (a failure is logged: polling goes on meanwhile)."""
        engine = create_engine(url, pool_size=1)
        try:
            while True:
                try:
                    async with engine.connect() as connection:
                        await connection.execution_options(isolation_level="AUTOCOMMIT")
                        await connection.exec_driver_sql(f"LISTEN {DUE_CHANNEL}")
                        raw = await connection.get_raw_connection()
                        # A round now: what fell due while no one listened.
                        self._due.set()
                        async for _ in raw.driver_connection.notifies():  # type: ignore[union-attr]
                            self._due.set()
                except Exception:
                    log.warning(
                        "webhook deliveries: not listening (%s); polling until reconnected",
                        url.split("@")[-1],
                        exc_info=True,
                    )
                await asyncio.sleep(_RELISTEN_SECONDS)
        finally:
            await engine.dispose()

    async def sweep(self) -> int:
        """Delete settled deliveries older than ``HOLDFAST_WEBHOOK_RETENTION_DAYS``."""
        cutoff = self.clock() - timedelta(days=self.settings.webhook_retention_days)
        async with self.sessions.begin() as session:
            return await outbox.forget_before(session, cutoff)

    async def round(self) -> int:
        """Claim the due deliveries and try each once; how many were claimed."""
        async with self.sessions.begin() as session:
            claimed = await outbox.claim_due(session, limit=BATCH, hold=self._hold)
        if claimed:
            async with asyncio.TaskGroup() as group:
                for row in claimed:
                    group.create_task(self._attempt(row))
        return len(claimed)

    async def _attempt(self, row: WebhookDelivery) -> None:
        status: int | None = None
        try:
            async with self.sessions.begin() as session:
                body = await outbox.body_of(session, row)
                secrets = await signing_secrets(session, self.vault, row.tenant_id)
            if not secrets:
                error = "the tenant has no webhook signing secret (POST /webhooks/secret)"
            else:
                headers = signed_headers(secrets, row.id, body, self.clock())
                status = await self._post(row.url, body, headers)
                if 200 <= status < 300:
                    async with self.sessions.begin() as session:
                        await outbox.delivered(session, row.id, row.attempts, status)
                    return
                error = f"the receiver answered {status}"
        except TimeoutError:
            error = f"no answer within {self.settings.webhook_timeout_seconds:g} s"
        except DestinationNotAllowed as exc:
            error = f"destination not allowed: {exc.reason}"
        except httpx2.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        except VaultError as exc:
            error = str(exc)
        except Exception as exc:
            # Counted as a failed attempt: one delivery's surprise must not cut
            # the round's other attempts short (they would be sent again).
            log.exception("webhook %s: attempt %d failed unexpectedly", row.id, row.attempts)
            error = f"internal error ({type(exc).__name__})"
        await self._failed(row, error, status)

    async def _post(self, url: str, body: str, headers: dict[str, str]) -> int:
        """POST ``body``; the answer's status. The whole exchange is bounded (httpx's
        timeouts are per read, and a receiver dripping bytes would outlast the
        claim), and the answer's body is never read: only its status counts."""
        async with asyncio.timeout(self.settings.webhook_timeout_seconds):
            async with self.http.stream("POST", url, content=body, headers=headers) as response:
                return response.status_code

    async def _failed(self, row: WebhookDelivery, error: str, status: int | None) -> None:
        settings = self.settings
        retry_in = (
            None
            if row.attempts >= settings.webhook_max_attempts
            else retry_delay(
                row.attempts,
                base=settings.webhook_backoff_base_seconds,
                cap=settings.webhook_backoff_cap_seconds,
            )
        )
        if retry_in is None:
            log.warning("webhook %s failed after %d attempts: %s", row.id, row.attempts, error)
        async with self.sessions.begin() as session:
            await outbox.attempt_failed(
                session, row.id, row.attempts, error=error, status=status, retry_in=retry_in
            )

    async def aclose(self) -> None:
        await self.http.aclose()
