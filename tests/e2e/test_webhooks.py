"""Completion webhooks (#27) end to end: real processes, a real receiver.

The receiver is a small HTTP server in the test process that checks every
message with ``standardwebhooks``' own ``Webhook.verify`` (the receiver's side
of the spec) and processes each ``webhook-id`` once, as receivers must. It can
fail its first N attempts, be down (its port closed), or hold a request open
while the gateway delivering it is killed.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from holdfast_shared.db.models import Turn, WebhookDelivery
from sqlalchemy import select, update
from standardwebhooks import Webhook, WebhookVerificationError

from tests.conftest import engine_env
from tests.isolation import own_api_keys, own_database_url  # noqa: F401 (fixtures)
from tests.processes import EngineProcesses, free_port, running_engine
from tests.sse_client import execute
from tests.waiting import until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

MAX_ATTEMPTS = 3
TIMEOUT_SECONDS = 2.0


@dataclass
class Receiver:
    """A webhook receiver on 127.0.0.1:``port``; ``secret`` verifies what it gets."""

    port: int
    secret: str = ""
    # Answer 500 to this many more requests before answering 204.
    fail_next: int = 0
    # Answer this many more requests only after the gateway's attempt timed out.
    slow_next: int = 0
    # Hold each request open until released (the delivering gateway dies meanwhile).
    hold: threading.Event | None = None
    received: list[dict[str, Any]] = field(default_factory=list)
    processed: dict[str, dict[str, Any]] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0"))).decode()
                headers = {k.lower(): v for k, v in self.headers.items()}
                try:
                    payload = Webhook(receiver.secret).verify(body, headers)
                except WebhookVerificationError as exc:
                    with receiver.lock:
                        receiver.rejected.append(str(exc))
                    self._answer(400)
                    return
                with receiver.lock:
                    receiver.received.append({"headers": headers, "body": body})
                    failing = receiver.fail_next > 0
                    slow = receiver.slow_next > 0
                    if slow:
                        receiver.slow_next -= 1
                    if failing:
                        receiver.fail_next -= 1
                    elif headers["webhook-id"] not in receiver.processed:
                        # Processed once per webhook-id, however often it comes.
                        receiver.processed[headers["webhook-id"]] = payload
                if receiver.hold is not None:
                    receiver.hold.wait(30)
                if slow:
                    time.sleep(TIMEOUT_SECONDS * 2)
                self._answer(500 if failing else 204)

            def _answer(self, status: int) -> None:
                try:
                    self.send_response(status)
                    self.send_header("content-length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender is gone (killed)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def count(self, webhook_id: str) -> int:
        with self.lock:
            return sum(1 for r in self.received if r["headers"]["webhook-id"] == webhook_id)


@pytest.fixture(scope="module")
def cluster(
    redis_url: str,
    database_url: str,
    redis_prefix: str,
    api_keys: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EngineProcesses]:
    """A gateway and a loop-worker, retrying deliveries fast."""
    env = engine_env(
        redis_url,
        database_url,
        f"{redis_prefix}webhooks:",
        HOLDFAST_WEBHOOK_MAX_ATTEMPTS=str(MAX_ATTEMPTS),
        HOLDFAST_WEBHOOK_BACKOFF_BASE_SECONDS="0.2",
        HOLDFAST_WEBHOOK_BACKOFF_CAP_SECONDS="0.5",
        HOLDFAST_WEBHOOK_TIMEOUT_SECONDS=str(TIMEOUT_SECONDS),
        HOLDFAST_WEBHOOK_POLL_SECONDS="0.1",
    )
    with running_engine(env, directory=tmp_path_factory.mktemp("webhooks")) as procs:
        yield procs


@pytest.fixture(scope="module")
def secret(cluster: EngineProcesses, api_keys: dict[str, str]) -> str:
    response = httpx.post(
        f"{cluster.url}/webhooks/secret", headers={"X-Engine-Key": api_keys["main"]}
    )
    assert response.status_code == 201, response.text
    value = response.json()["secret"]
    assert value.startswith("whsec_")
    return str(value)


@pytest.fixture
def receiver(secret: str) -> Iterator[Receiver]:
    got = Receiver(free_port(), secret)
    got.start()
    yield got
    if got.hold is not None:
        got.hold.set()
    got.stop()


def _headers(api_keys: dict[str, str]) -> dict[str, str]:
    return {"X-Engine-Key": api_keys["main"]}


async def _delivery(
    client: httpx.AsyncClient, cluster: EngineProcesses, key: str, delivery_id: str
) -> dict[str, Any]:
    response = await client.get(
        f"{cluster.url}/webhooks/deliveries/{delivery_id}", headers={"X-Engine-Key": key}
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


async def _status(
    client: httpx.AsyncClient, cluster: EngineProcesses, key: str, delivery_id: str
) -> str | None:
    """The delivery's status; None before the turn's end is recorded (the stream
    ends with the terminal event, a moment before the row commits)."""
    response = await client.get(
        f"{cluster.url}/webhooks/deliveries/{delivery_id}", headers={"X-Engine-Key": key}
    )
    if response.status_code == 404:
        return None
    assert response.status_code == 200, response.text
    return str(response.json()["status"])


async def test_a_turn_s_end_is_delivered_signed_after_failed_attempts(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    key = api_keys["main"]
    receiver.fail_next = MAX_ATTEMPTS - 1
    task_id = f"hook-{secrets.token_hex(3)}"
    body = {
        "message": "hello",
        "task_id": task_id,
        "webhook": {"url": receiver.url, "events": ["completed", "errored"]},
    }
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(client, cluster.url, key, body)
        assert got.events[-1].get("phase") == "completed", got.events[-1]
        turn_id = got.headers["X-Turn-Id"]
        webhook_id = f"msg_{turn_id}_completed"

        async def processed() -> bool:
            return webhook_id in receiver.processed

        await until(processed, "the turn's end delivered")
        assert receiver.count(webhook_id) == MAX_ATTEMPTS
        assert not receiver.rejected
        # Every attempt: the same id and body, each signed anew.
        bodies = {r["body"] for r in receiver.received if r["headers"]["webhook-id"] == webhook_id}
        assert len(bodies) == 1
        message = receiver.processed[webhook_id]
        assert message["type"] == "turn.completed"
        data = message["data"]
        assert data["task_id"] == task_id
        assert data["turn_id"] == turn_id
        assert data["status"] == "completed"
        # The last seq: the terminal event's, where a receiver replays from.
        assert data["last_seq"] == got.events[-1]["seq"]
        assert data["usage"]["output_tokens"] > 0
        assert data["text"] == got.text

        async def recorded() -> bool:
            return await _status(client, cluster, key, webhook_id) == "delivered"

        await until(recorded, "the delivery recorded")
        row = await _delivery(client, cluster, key, webhook_id)
        assert row["attempts"] == MAX_ATTEMPTS
        assert row["task_id"] == task_id
        assert row["last_status"] == 204
        # Another tenant sees none of it.
        other = await client.get(
            f"{cluster.url}/webhooks/deliveries/{webhook_id}",
            headers={"X-Engine-Key": api_keys["other"]},
        )
        assert other.status_code == 404
        assert other.json()["error"] == "WEBHOOK_DELIVERY_NOT_FOUND"


async def test_a_receiver_down_longer_than_the_retries_gets_it_when_redelivered(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    key = api_keys["main"]
    receiver.stop()  # down: its port refuses connections
    task_id = f"hook-{secrets.token_hex(3)}"
    body = {"message": "hello", "task_id": task_id, "webhook": {"url": receiver.url}}
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(client, cluster.url, key, body)
        webhook_id = f"msg_{got.headers['X-Turn-Id']}_completed"

        async def dead() -> bool:
            return await _status(client, cluster, key, webhook_id) == "failed"

        await until(dead, "the delivery dead-lettered")
        row = await _delivery(client, cluster, key, webhook_id)
        assert row["attempts"] == MAX_ATTEMPTS
        assert row["last_error"] and row["last_status"] is None
        failed = await client.get(
            f"{cluster.url}/webhooks/deliveries",
            params={"status": "failed"},
            headers={"X-Engine-Key": key},
        )
        assert webhook_id in [d["id"] for d in failed.json()["deliveries"]]

        receiver.start()
        again = await client.post(
            f"{cluster.url}/webhooks/deliveries/{webhook_id}/redeliver",
            headers={"X-Engine-Key": key},
        )
        assert again.status_code == 202, again.text
        assert again.json()["status"] == "pending"

        async def processed() -> bool:
            return webhook_id in receiver.processed

        await until(processed, "the redelivered message")
        assert receiver.processed[webhook_id]["data"]["task_id"] == task_id

        async def delivered() -> bool:
            return await _status(client, cluster, key, webhook_id) == "delivered"

        await until(delivered, "the redelivery recorded")
        assert receiver.count(webhook_id) == 1
        missing = await client.post(
            f"{cluster.url}/webhooks/deliveries/msg_nothing/redeliver",
            headers={"X-Engine-Key": key},
        )
        assert missing.status_code == 404


async def test_a_gateway_killed_mid_delivery_the_message_is_processed_once(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    """The receiver holds the first attempt open; its gateway is SIGKILLed before
    hearing the answer. Another gateway sends it again once the claim runs out:
    the same webhook-id and body, which the receiver processes once."""
    key = api_keys["main"]
    receiver.hold = threading.Event()
    task_id = f"hook-{secrets.token_hex(3)}"
    body = {"message": "hello", "task_id": task_id, "webhook": {"url": receiver.url}}
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(client, cluster.url, key, body)
        webhook_id = f"msg_{got.headers['X-Turn-Id']}_completed"

        async def arrived() -> bool:
            return receiver.count(webhook_id) >= 1

        await until(arrived, "the first attempt")
        cluster.kill(cluster.gateways[0])
        receiver.hold.set()
        receiver.hold = None
        cluster.start_gateway()

        async def again() -> bool:
            return receiver.count(webhook_id) >= 2

        # The claim outlives the attempt's timeout by 5 s before it is taken over.
        await until(again, "the second attempt", within=30 + TIMEOUT_SECONDS)

        async def delivered() -> bool:
            return await _status(client, cluster, key, webhook_id) == "delivered"

        await until(delivered, "the delivery recorded")
    copies = [r for r in receiver.received if r["headers"]["webhook-id"] == webhook_id]
    assert len(copies) == 2
    assert copies[0]["body"] == copies[1]["body"]
    assert list(receiver.processed) == [webhook_id]


async def test_a_question_is_posted_when_the_turn_asks_it(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    key = api_keys["main"]
    task_id = f"hook-{secrets.token_hex(3)}"
    ask = "/script " + json.dumps(
        {"tool_calls": [{"name": "ask_user", "input": {"question": "Which one?"}}]}
    )
    body = {
        "message": ask,
        "task_id": task_id,
        "webhook": {"url": receiver.url, "events": ["hitl_request"]},
    }
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST", f"{cluster.url}/execute", json=body, headers={"X-Engine-Key": key}
        ) as response:
            assert response.status_code == 200
            turn_id = response.headers["X-Turn-Id"]

        async def asked() -> bool:
            return any(m["type"] == "turn.hitl_request" for m in receiver.processed.values())

        await until(asked, "the question's message")
        pending = await client.get(
            f"{cluster.url}/hitl/pending", params={"task_id": task_id}, headers=_headers(api_keys)
        )
    [request] = pending.json()["pending"]
    [message] = receiver.processed.values()
    assert message["data"]["request_id"] == request["request_id"]
    assert message["data"]["task_id"] == task_id
    assert message["data"]["turn_id"] == turn_id
    assert message["data"]["kind"] == "question"
    assert message["data"]["question"] == "Which one?"
    assert list(receiver.processed) == [f"msg_{request['request_id']}"]


async def test_every_process_killed_between_the_turn_s_end_and_its_delivery(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver, sessions: Any
) -> None:
    """The gateway SIGKILLed as the turn starts, the loop-worker as soon as the
    turn is over: nothing ran to deliver it. New processes deliver it, once."""
    key = api_keys["main"]
    task_id = f"hook-{secrets.token_hex(3)}"
    body = {"message": "hello", "task_id": task_id, "webhook": {"url": receiver.url}}
    async with httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST", f"{cluster.url}/execute", json=body, headers={"X-Engine-Key": key}
        ) as response:
            assert response.status_code == 200
            turn_id = response.headers["X-Turn-Id"]
            cluster.kill(cluster.gateways[0])
        webhook_id = f"msg_{turn_id}_completed"

        async def over() -> bool:
            async with sessions() as session:
                status = await session.scalar(select(Turn.status).where(Turn.id == turn_id))
            return status == "completed"

        await until(over, "the turn's end recorded")
        cluster.kill(cluster.workers[0])
        cluster.start_worker()
        cluster.start_gateway()

        async def delivered() -> bool:
            return await _status(client, cluster, key, webhook_id) == "delivered"

        await until(delivered, "the delivery after the restart")
    assert receiver.count(webhook_id) == 1
    assert list(receiver.processed) == [webhook_id]


async def test_the_turn_s_end_recorded_twice_adds_one_delivery(
    cluster: EngineProcesses, api_keys: dict[str, str], sessions: Any
) -> None:
    """A worker killed between logging the terminal event and recording the end:
    its successor records the end again. The outbox row's id is the message's,
    so the second statement adds nothing (turn/live.py's record_end statement)."""
    from holdfast_loop_worker.trajectory import TurnEnding
    from holdfast_loop_worker.webhook_outbox import turn_end_insert

    key = api_keys["main"]
    task_id = f"hook-{secrets.token_hex(3)}"
    url = "http://127.0.0.1:9/never"
    webhook = {"url": url, "events": ["errored"]}
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(
            client,
            cluster.url,
            key,
            {
                "message": "hello",
                "task_id": task_id,
                "webhook": {"url": url, "events": ["errored"]},
            },
        )
    turn_id = got.headers["X-Turn-Id"]
    async with sessions() as session:
        turn = await session.get(Turn, turn_id)
        assert turn.webhook == webhook
    ending = TurnEnding(
        tenant_id="tenant-main",
        user_id="",
        task_id=turn.task_id,
        task_name=task_id,
        turn_id=turn_id,
        agent=None,
        model=None,
        status="errored",
        stop_reason=None,
        error={"code": "INTERNAL", "message": "test"},
        usage={},
        active_ms=0,
        started_at=None,
    )
    async with sessions.begin() as session:
        # Not subscribed to "completed": the real end added nothing.
        assert (
            await session.scalar(
                select(WebhookDelivery.id).where(WebhookDelivery.turn_id == turn_id)
            )
            is None
        )
        # Held back from the gateways while it is looked at.
        for _ in range(2):
            await session.execute(turn_end_insert(ending, last_seq=7))
        await session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.turn_id == turn_id)
            .values(status="failed")
        )
    async with sessions() as session:
        rows = (
            await session.scalars(select(WebhookDelivery).where(WebhookDelivery.turn_id == turn_id))
        ).all()
    assert [(r.id, r.event, r.data["last_seq"]) for r in rows] == [
        (f"msg_{turn_id}_errored", "errored", 7)
    ]


@pytest.mark.parametrize(
    ("webhook", "loc", "code"),
    [
        ({"url": "http://169.254.169.254/latest"}, "url", "DESTINATION_NOT_ALLOWED"),
        ({"url": "http://10.1.2.3/hook"}, "url", "DESTINATION_NOT_ALLOWED"),
        ({"url": "ftp://example.com/hook"}, "url", "INVALID_REQUEST"),
        ({"url": "https://example.com/hook", "events": ["finished"]}, "events", "INVALID_REQUEST"),
        ({"url": "https://example.com/hook", "events": []}, "events", "INVALID_REQUEST"),
        ({"url": "https://example.com/hook", "secret": "x"}, "secret", "INVALID_REQUEST"),
    ],
)
async def test_a_webhook_the_engine_may_not_post_to_is_refused_before_anything_is_written(
    cluster: EngineProcesses,
    api_keys: dict[str, str],
    secret: str,
    webhook: dict[str, Any],
    loc: str,
    code: str,
) -> None:
    key = api_keys["main"]
    task_id = f"hook-{secrets.token_hex(3)}"
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{cluster.url}/execute",
            json={"message": "hello", "task_id": task_id, "webhook": webhook},
            headers={"X-Engine-Key": key},
        )
        assert response.status_code == 422, response.text
        error = response.json()
        assert error["error"] == code
        assert error["details"]["errors"][0]["loc"][:3] == ["body", "webhook", loc]
        task = await client.get(f"{cluster.url}/tasks/{task_id}", headers={"X-Engine-Key": key})
        assert task.status_code == 404
        default = await client.put(
            f"{cluster.url}/webhooks/default", json=webhook, headers={"X-Engine-Key": key}
        )
        assert default.status_code == 422, default.text


async def test_the_tenant_s_default_subscribes_turns_without_their_own(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    key = api_keys["main"]
    headers = {"X-Engine-Key": key}
    async with httpx.AsyncClient(timeout=60) as client:
        put = await client.put(
            f"{cluster.url}/webhooks/default",
            json={"url": receiver.url, "events": ["completed"]},
            headers=headers,
        )
        assert put.status_code == 200, put.text
        try:
            got = await execute(
                client, cluster.url, key, {"message": "hi", "task_id": secrets.token_hex(4)}
            )
            webhook_id = f"msg_{got.headers['X-Turn-Id']}_completed"

            async def processed() -> bool:
                return webhook_id in receiver.processed

            await until(processed, "the default subscription's delivery")
        finally:
            gone = await client.delete(f"{cluster.url}/webhooks/default", headers=headers)
            assert gone.status_code == 204
        shown = await client.get(f"{cluster.url}/webhooks/default", headers=headers)
        assert shown.json() == {"webhook": None}


async def test_a_tenant_without_a_secret_is_told_to_make_one(
    cluster: EngineProcesses, api_keys: dict[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(
            f"{cluster.url}/execute",
            # A public address, given as one: nothing to resolve.
            json={"message": "hello", "webhook": {"url": "https://93.184.215.14/hook"}},
            headers={"X-Engine-Key": api_keys["other"]},
        )
    assert response.status_code == 422, response.text
    assert "POST /webhooks/secret" in response.json()["message"]


def test_signing_matches_the_spec_s_reference_verification() -> None:
    from datetime import UTC, datetime

    from holdfast_gateway.webhooks.signing import signed_headers
    from holdfast_gateway.webhooks.tenant import new_secret

    secret = new_secret()
    body = json.dumps({"type": "turn.completed", "data": {}})
    headers = signed_headers([secret], "msg_1", body, datetime.now(UTC))
    assert headers["webhook-signature"].startswith("v1,")
    assert Webhook(secret).verify(body, headers) == json.loads(body)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body + " ", headers)
    # While a rotated-out secret still signs: one signature each, either verifies.
    new = new_secret()
    both = signed_headers([new, secret], "msg_1", body, datetime.now(UTC))
    assert len(both["webhook-signature"].split(" ")) == 2
    for each in (new, secret):
        assert Webhook(each).verify(body, both) == json.loads(body)
    with pytest.raises(WebhookVerificationError):
        Webhook(new_secret()).verify(body, both)


def test_backoff_doubles_to_its_cap_with_jitter() -> None:
    from holdfast_gateway.webhooks.backoff import retry_delay

    low = [retry_delay(n, base=1, cap=60, rng=lambda: 0.0) for n in range(1, 9)]
    high = [retry_delay(n, base=1, cap=60, rng=lambda: 1.0) for n in range(1, 9)]
    assert high == [1, 2, 4, 8, 16, 32, 60, 60]
    assert low == [h / 2 for h in high]


async def test_settled_deliveries_past_their_retention_are_deleted(
    sessions: Any, api_keys: dict[str, str]
) -> None:
    from datetime import UTC, datetime, timedelta

    from holdfast_gateway.webhooks import outbox

    now = datetime.now(UTC)
    tag = secrets.token_hex(3)
    rows = {
        f"msg_old_delivered_{tag}": ("delivered", now - timedelta(days=40)),
        f"msg_old_failed_{tag}": ("failed", now - timedelta(days=40)),
        f"msg_old_pending_{tag}": ("pending", now - timedelta(days=40)),
        f"msg_new_delivered_{tag}": ("delivered", now),
    }
    async with sessions.begin() as session:
        for row_id, (status, made) in rows.items():
            session.add(
                WebhookDelivery(
                    id=row_id,
                    tenant_id="tenant-main",
                    task_id="task",
                    turn_id="turn",
                    event="completed",
                    url="http://127.0.0.1:9/never",
                    data={},
                    status=status,
                    created_at=made,
                    # Not due: no gateway takes the pending one meanwhile.
                    next_attempt_at=now + timedelta(days=1),
                )
            )
    async with sessions.begin() as session:
        await outbox.forget_before(session, now - timedelta(days=30))
    async with sessions() as session:
        left = set(
            (
                await session.scalars(
                    select(WebhookDelivery.id).where(WebhookDelivery.id.in_(list(rows)))
                )
            ).all()
        )
    assert left == {f"msg_old_pending_{tag}", f"msg_new_delivered_{tag}"}


async def test_the_python_client_passes_the_webhook(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    from holdfast_client import AsyncClient

    async with AsyncClient(cluster.url, api_keys["main"]) as client:
        turn = client.stream("hello", webhook={"url": receiver.url, "events": ["completed"]})
        events = [e async for e in turn]
    webhook_id = f"msg_{events[-1].turn_id}_completed"

    async def processed() -> bool:
        return webhook_id in receiver.processed

    await until(processed, "the SDK turn's delivery")


async def test_a_rotated_secret_still_signs_beside_the_new_one(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    """The receiver still holds the old secret: it verifies; so does the new one."""
    key = api_keys["main"]
    async with httpx.AsyncClient(timeout=60) as client:
        rotated = await client.post(f"{cluster.url}/webhooks/secret", headers=_headers(api_keys))
        assert rotated.status_code == 201
        new = rotated.json()["secret"]
        assert new != receiver.secret
        got = await execute(
            client, cluster.url, key, {"message": "hi", "webhook": {"url": receiver.url}}
        )
    webhook_id = f"msg_{got.headers['X-Turn-Id']}_completed"

    async def processed() -> bool:
        return webhook_id in receiver.processed

    await until(processed, "the delivery signed with both secrets")
    [copy] = [r for r in receiver.received if r["headers"]["webhook-id"] == webhook_id]
    assert Webhook(new).verify(copy["body"], copy["headers"])["data"]["status"] == "completed"


async def test_an_answer_slower_than_the_timeout_is_a_failed_attempt(
    cluster: EngineProcesses, api_keys: dict[str, str], receiver: Receiver
) -> None:
    """The receiver processes the first attempt but answers after the gateway gave
    up on it: the second attempt is a repeat it drops by its webhook-id."""
    key = api_keys["main"]
    receiver.slow_next = 1
    body = {"message": "hello", "webhook": {"url": receiver.url}}
    async with httpx.AsyncClient(timeout=60) as client:
        got = await execute(client, cluster.url, key, body)
        webhook_id = f"msg_{got.headers['X-Turn-Id']}_completed"

        async def delivered() -> bool:
            return await _status(client, cluster, key, webhook_id) == "delivered"

        await until(delivered, "the second attempt delivered")
        row = await _delivery(client, cluster, key, webhook_id)
    assert row["attempts"] == 2
    assert receiver.count(webhook_id) == 2
    assert list(receiver.processed) == [webhook_id]


async def test_the_deliveries_api_refuses_malformed_ids_and_filters(
    cluster: EngineProcesses, api_keys: dict[str, str]
) -> None:
    headers = _headers(api_keys)
    async with httpx.AsyncClient(timeout=30) as client:
        for path in ("/webhooks/deliveries/bad%00id", "/webhooks/deliveries/%20x"):
            got = await client.get(f"{cluster.url}{path}", headers=headers)
            assert got.status_code == 422, got.text
        for params in ({"status": "lost"}, {"limit": "0"}, {"task_id": "a\x00b"}):
            got = await client.get(
                f"{cluster.url}/webhooks/deliveries", params=params, headers=headers
            )
            assert got.status_code == 422, (params, got.text)
        missing = await client.get(f"{cluster.url}/webhooks/deliveries/msg_none", headers=headers)
        assert missing.status_code == 404
