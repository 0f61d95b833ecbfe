"""The ``holdfast`` command: the whole engine (``up``), one service, or an admin task.

Every service and heavy library (settings included: pydantic-settings alone
takes a fifth of a second) is imported inside the command that needs it, so
``holdfast --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console

from holdfast.supervisor_link import follow_supervisor

if TYPE_CHECKING:
    from datetime import datetime

    from holdfast_shared.apikeys import KeyInfo
    from holdfast_shared.settings import Settings

console = Console(stderr=True)

app = typer.Typer(
    name="holdfast",
    help="Holdfast: a durable agent execution engine.",
    no_args_is_help=True,
    add_completion=False,
    # Plain tracebacks: service output ends up in logs, not only on terminals.
    pretty_exceptions_enable=False,
)
keys_app = typer.Typer(help="Manage API keys.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

_EXTERNAL = (
    "Needs HOLDFAST_REDIS_URL and HOLDFAST_DATABASE_URL; other settings come from "
    "HOLDFAST_* variables too. Runs in the foreground until SIGTERM or Ctrl-C, "
    "then stops cleanly and exits 0."
)


@app.command()
def up(
    workers: Annotated[
        int,
        typer.Option(
            "--workers",
            "-w",
            envvar="HOLDFAST_UP_WORKERS",
            min=1,
            help="How many loop-worker processes to run.",
        ),
    ] = 1,
) -> None:
    """Run the whole engine on this machine: gateway, loop-workers, tool-runner, learning.

    Uses the Redis and PostgreSQL named by HOLDFAST_REDIS_URL and
    HOLDFAST_DATABASE_URL; for each one left unset it starts an embedded
    server keeping its data in HOLDFAST_DATA_DIR (default ~/.holdfast). Runs
    migrations, makes sure an API key exists (HOLDFAST_API_KEY if set, else one
    is generated and shown once), restarts any service that dies, and stops
    everything cleanly on Ctrl-C or SIGTERM.
    """
    from holdfast.supervisor import run_up

    settings = _settings()
    _configure_logging(settings.log_level)
    status = run_up(settings, workers=workers, console=console)
    _exit_quickly()
    raise typer.Exit(status)


@app.command(epilog=_EXTERNAL)
def gateway() -> None:
    """Run the HTTP gateway (execute, replay, cancel, HITL, tasks) on HOLDFAST_HOST:PORT."""
    _run_service("holdfast_gateway.main")


@app.command("loop-worker", epilog=_EXTERNAL)
def loop_worker() -> None:
    """Run one loop-worker: consumes turn jobs and runs the agent loop."""
    _run_service("holdfast_loop_worker.main")


@app.command("tool-runner", epilog=_EXTERNAL)
def tool_runner() -> None:
    """Run one tool-runner: runs tool calls in the sandbox (bubblewrap + seccomp + landlock)."""
    _run_service("holdfast_tool_runner.main")


@app.command(epilog=_EXTERNAL)
def learning() -> None:
    """Run the learning centre (arq): trajectories into long-term memory, and retention."""
    _run_service("holdfast_learning.main")


@app.command()
def chat(
    task: Annotated[
        str | None, typer.Option("--task", help="Continue this task (default: a new one).")
    ] = None,
    agent: Annotated[
        str | None, typer.Option("--agent", help="The agent to talk to (default: general).")
    ] = None,
    url: Annotated[
        str | None,
        typer.Option(
            "--url", envvar="HOLDFAST_URL", help="The gateway (default: http://127.0.0.1:8000)."
        ),
    ] = None,
) -> None:
    """Chat with an agent in the terminal: streamed text, tool calls, permission prompts.

    The API key comes from HOLDFAST_API_KEY, else the one `holdfast up` saved
    in HOLDFAST_DATA_DIR (default ~/.holdfast/api-key). A dropped connection
    is resumed by itself; Ctrl-C cancels the running turn, Ctrl-D quits.
    """
    from holdfast.chat import run_chat

    out = Console()
    raise typer.Exit(run_chat(url=url, key=None, task_id=task, agent=agent, console=out))


@app.command()
def migrate() -> None:
    """Bring the database schema up to date (idempotent), then register HOLDFAST_API_KEY if set.

    Uses HOLDFAST_DATABASE_URL, or the embedded PostgreSQL of a running
    `holdfast up` in HOLDFAST_DATA_DIR. Registering HOLDFAST_API_KEY (stored
    hashed, tenant "default") lets deployments without `holdfast up`, such as
    compose.yaml, choose their key.
    """
    from holdfast_shared.apikeys import DEFAULT_TENANT
    from holdfast_shared.db import upgrade_head

    settings = _settings()
    _configure_logging(settings.log_level)
    database_url = _database_url(settings)
    upgrade_head(database_url)
    console.print("[green]Database schema is up to date.[/]")
    if settings.api_key:
        asyncio.run(_add_key(database_url, DEFAULT_TENANT, settings.api_key, "HOLDFAST_API_KEY"))
        console.print(f"Registered HOLDFAST_API_KEY for tenant [bold]{DEFAULT_TENANT}[/].")


@keys_app.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="Tenant the key belongs to (created if new).")] = (
        "default"
    ),
    name: Annotated[
        str, typer.Option("--label", "--name", help="A label to recognise the key by.")
    ] = "cli",
) -> None:
    """Create an API key and print it once; only its hash is stored.

    Uses HOLDFAST_DATABASE_URL, or the embedded PostgreSQL of a running
    `holdfast up` in HOLDFAST_DATA_DIR.
    """
    from holdfast_shared.apikeys import generate_key

    settings = _settings()
    database_url = _database_url(settings)
    key = generate_key()
    asyncio.run(_add_key(database_url, tenant, key, name))
    console.print(
        f"Created API key [bold]{name}[/] for tenant [bold]{tenant}[/]. It is shown only this once:"
    )
    # The key itself goes to stdout alone, so `KEY=$(holdfast keys create)` works.
    print(key)


@keys_app.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
) -> None:
    """List API keys: id, tenant, label, created, last used and revoked (never the key).

    Last use is recorded at most once a minute per key. Uses
    HOLDFAST_DATABASE_URL, or the embedded PostgreSQL of a running `holdfast up`.
    """
    from rich.table import Table

    settings = _settings()
    keys = asyncio.run(_list_keys(_database_url(settings), tenant))
    table = Table("id", "tenant", "label", "created", "last used", "revoked")

    def when(value: datetime | None) -> str:
        return value.astimezone().strftime("%Y-%m-%d %H:%M:%S") if value else "-"

    for key in keys:
        table.add_row(
            str(key.id),
            key.tenant,
            key.label,
            when(key.created_at),
            when(key.last_used_at),
            when(key.revoked_at),
        )
    # The table goes to stdout (the command's output); messages go to stderr.
    Console().print(table)


@keys_app.command("revoke")
def keys_revoke(
    key_id: Annotated[int, typer.Argument(metavar="ID", help="The key's id (`keys list`).")],
) -> None:
    """Revoke an API key. Gateways refuse it within their auth cache's TTL
    (HOLDFAST_AUTH_CACHE_TTL_SECONDS, 30 s by default), and its stream tokens with it."""
    settings = _settings()
    revoked = asyncio.run(_revoke_key(_database_url(settings), key_id))
    if revoked is None:
        _fail(f"no API key has id {key_id}", code=1)
    console.print(f"API key {key_id} is revoked (since {revoked.isoformat(timespec='seconds')}).")


async def _list_keys(database_url: str, tenant: str | None) -> list[KeyInfo]:
    from holdfast_shared.apikeys import list_keys
    from holdfast_shared.db import create_engine, session_factory

    engine = create_engine(database_url, pool_size=1)
    try:
        async with session_factory(engine)() as session:
            return await list_keys(session, tenant=tenant)
    finally:
        await engine.dispose()


async def _revoke_key(database_url: str, key_id: int) -> datetime | None:
    from holdfast_shared.apikeys import revoke_key
    from holdfast_shared.db import create_engine, session_factory

    engine = create_engine(database_url, pool_size=1)
    try:
        async with session_factory(engine)() as session, session.begin():
            return await revoke_key(session, key_id)
    finally:
        await engine.dispose()


async def _add_key(database_url: str, tenant: str, key: str, name: str) -> None:
    from holdfast_shared.apikeys import add_key
    from holdfast_shared.db import create_engine, session_factory

    engine = create_engine(database_url, pool_size=1)
    try:
        async with session_factory(engine)() as session, session.begin():
            await add_key(session, tenant, key, name=name)
    finally:
        await engine.dispose()


def _database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    from holdfast.embedded import running_database_url

    url = running_database_url(settings.data_dir / "postgres")
    if url is None:
        _fail(
            "HOLDFAST_DATABASE_URL is not set and no embedded PostgreSQL is running in "
            f"{settings.data_dir}. Set it, or start `holdfast up` first."
        )
    return url


def _run_service(module_name: str) -> None:
    """Import a service's ``main`` module and run its ``main()`` in this process.

    Each service sets up its own logging (``holdfast_shared.logs``).
    """
    settings = _settings()
    try:
        settings.require_urls()
    except RuntimeError as error:
        _fail(str(error))
    follow_supervisor()
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.startswith(error.name):
            _fail(f"{module_name} is not available in this installation", code=1)
        raise
    module.main()
    _exit_quickly()


def _exit_quickly() -> None:
    """Let the interpreter end without a last garbage collection of everything we imported.

    At exit Python collects the whole heap while it tears down modules: with
    the services' imports, 2 to 5 s on a loaded 2-core machine, after the
    process has already stopped cleanly; it made Ctrl-C on `holdfast up` wait
    for it twice over (each service, then the supervisor). Frozen objects are
    left out of that collection; atexit handlers and flushes still run.
    """
    gc.freeze()


def _configure_logging(level: str) -> None:
    from rich.logging import RichHandler

    handler = RichHandler(console=console, show_path=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _settings() -> Settings:
    from holdfast_shared.settings import get_settings

    try:
        return get_settings()
    except ValueError as error:  # pydantic's ValidationError: a bad HOLDFAST_* value
        _fail(str(error))


def _fail(message: str, *, code: int = 2) -> NoReturn:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)
