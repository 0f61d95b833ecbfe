"""The suite's engines: ``holdfast.testing``'s environment, under the names the tests use."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path

from holdfast.testing import EngineEnvironment, Process, free_port

__all__ = ["EngineProcesses", "engine_from_env", "free_port", "running_engine"]

# What an engine_env() dict holds that the environment takes as parameters.
_PARAMETERS = {
    "HOLDFAST_REDIS_URL": "redis_url",
    "HOLDFAST_DATABASE_URL": "database_url",
    "HOLDFAST_REDIS_PREFIX": "prefix",
    "HOLDFAST_WORKSPACE_ROOT": "workspace_root",
}


class EngineProcesses(EngineEnvironment):
    """An :class:`EngineEnvironment` with the suite's shorthands.

    ``workers``, ``runners`` and ``gateways`` are fresh lists of the processes
    started and not killed: to take one away, ``kill`` it.
    """

    @property
    def workers(self) -> list[Process]:
        return self.of("loop-worker")

    @property
    def runners(self) -> list[Process]:
        return self.of("tool-runner")

    @property
    def gateways(self) -> list[Process]:
        return self.of("gateway")

    def start_gateway(self) -> str:
        """Start a gateway; its URL once it is healthy."""
        url = self.start("gateway").url
        assert url is not None
        return url

    def start_worker(self) -> Process:
        return self.start("loop-worker")

    def start_tool_runner(self) -> Process:
        return self.start("tool-runner")

    def start_learning(self) -> Process:
        return self.start("learning")

    def stop(self) -> None:
        self.close()


def engine_from_env(env: Mapping[str, str], directory: Path | None = None) -> EngineProcesses:
    """An environment on the servers, database and prefix an ``engine_env()`` dict names,
    with the rest of it (settings, provider keys) as every process's environment."""
    parameters = {name: env[var] for var, name in _PARAMETERS.items() if env.get(var)}
    rest = {k: v for k, v in env.items() if k not in _PARAMETERS}
    return EngineProcesses(directory=directory, env=rest, **parameters)


@contextlib.contextmanager
def running_engine(
    env: Mapping[str, str],
    *,
    workers: int = 1,
    runners: int = 0,
    gateways: int = 1,
    learners: int = 0,
    directory: Path | None = None,
) -> Iterator[EngineProcesses]:
    """An engine of real processes for a fixture, each one ready; closed at the end.

    ``directory`` keeps the processes' logs (``<directory>/logs``) for a post-mortem.
    """
    with engine_from_env(env, directory) as procs:
        for _ in range(runners):
            procs.start_tool_runner()
        for _ in range(workers):
            procs.start_worker()
        for _ in range(gateways):
            procs.start_gateway()
        for _ in range(learners):
            procs.start_learning()
        yield procs
