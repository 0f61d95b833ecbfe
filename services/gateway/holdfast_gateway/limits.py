"""Per-tenant limits, so one noisy tenant cannot starve the rest.

Three, each off at 0 (the default):

* ``HOLDFAST_TENANT_RATE_PER_MINUTE`` — authenticated requests per tenant in
  any 60 s window (a sliding log in Redis, ``Keys.tenant_requests``: one
  script checks and records atomically, across every gateway);
* ``HOLDFAST_TENANT_MAX_RUNNING_TURNS`` — the tenant's turns that are running
  or about to (``queued`` for a worker, or ``running``) when a new one would
  start;
* ``HOLDFAST_TENANT_MAX_QUEUED_TURNS`` — the tenant's messages waiting for
  their task's running turn (``on_busy`` enqueue, interrupt, steer: the
  ``turnqueue`` statuses), across all its tasks. (A turn ``queued`` for a worker
  counts as running: it starts as soon as a worker is free.)

Over a limit the request is answered 429 ``RATE_LIMITED`` with ``Retry-After``
and ``details.limit`` naming the setting, before anything is written. How the
turns are counted: ``holdfast_shared.tenantturns`` (the loop-worker counts a
subagent's turn the same way). A turn promoted from a task's own queue when
its predecessor ends was accepted already and is not refused again.
"""

from __future__ import annotations

import hashlib
import math
import uuid
from collections.abc import Awaitable
from typing import cast

from holdfast_shared import tenantturns
from holdfast_shared.errors import ErrorCode
from holdfast_shared.keys import Keys
from holdfast_shared.settings import Settings
from redis.asyncio import Redis
from redis.exceptions import NoScriptError
from sqlalchemy.ext.asyncio import AsyncSession

from holdfast_gateway.errors import ApiError

WINDOW_MS = 60_000
# A slot frees when some turn ends, which the gateway cannot foresee: a client
# told to come back this soon finds out cheaply.
TURNS_RETRY_AFTER_SECONDS = 2

# KEYS: the tenant's request log. ARGV: limit, window ms, a unique member.
# Returns {1, 0} when the request is recorded, {0, ms until a slot frees} when refused
# (and then records nothing).
_RATE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local window = tonumber(ARGV[2])
-- Integers as text: a Lua number could print in exponent form.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', now - window))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {0, tonumber(oldest[2]) + window - now}
end
redis.call('ZADD', KEYS[1], string.format('%d', now), ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
return {1, 0}
"""

_RATE_SHA = hashlib.sha1(_RATE.encode()).hexdigest()


def _refuse(message: str, limit: str, maximum: int, retry_after: int) -> ApiError:
    return ApiError(
        429,
        ErrorCode.RATE_LIMITED,
        message,
        {"limit": limit, "max": maximum},
        headers={"Retry-After": str(retry_after)},
    )


async def check_rate(redis: Redis, keys: Keys, settings: Settings, tenant_id: str) -> None:
    """``HOLDFAST_TENANT_RATE_PER_MINUTE``: count the request, or refuse it (429) without
    counting it. One script call (by its SHA; the source only when Redis lacks it)."""
    per_minute = settings.tenant_rate_per_minute
    if per_minute <= 0:
        return
    args = (keys.tenant_requests(tenant_id), str(per_minute), str(WINDOW_MS), uuid.uuid4().hex)
    try:
        reply = await cast(Awaitable[list[int]], redis.evalsha(_RATE_SHA, 1, *args))
    except NoScriptError:
        reply = await cast(Awaitable[list[int]], redis.eval(_RATE, 1, *args))
    allowed, wait_ms = reply
    if int(allowed):
        return
    retry = max(1, math.ceil(int(wait_ms) / 1000))
    raise _refuse(
        f"tenant {tenant_id!r} sent {per_minute} requests in the last minute "
        f"(HOLDFAST_TENANT_RATE_PER_MINUTE); retry in {retry} s",
        "HOLDFAST_TENANT_RATE_PER_MINUTE",
        per_minute,
        retry,
    )


async def check_new_turn(session: AsyncSession, settings: Settings, tenant_id: str) -> None:
    """Before a turn that starts now (``queued`` for a worker) is written in ``session``'s
    transaction: 429 when the tenant is at its running turns limit."""
    await _check_turns(session, tenant_id, tenantturns.RUNNING, settings.tenant_max_running_turns)


async def check_waiting_turn(session: AsyncSession, settings: Settings, tenant_id: str) -> None:
    """Before a message is stored to wait for its task (``on_busy``) in ``session``'s
    transaction: 429 when the tenant is at its queued turns limit."""
    await _check_turns(session, tenant_id, tenantturns.WAITING, settings.tenant_max_queued_turns)


async def _check_turns(
    session: AsyncSession, tenant_id: str, limit: tenantturns.TurnLimit, most: int
) -> None:
    try:
        await tenantturns.check_turns(session, tenant_id, limit, most)
    except tenantturns.AtTurnLimit as exc:
        raise _refuse(str(exc), limit.setting, most, TURNS_RETRY_AFTER_SECONDS) from None
