"""Letting go of a turn without ending it: parked on a question to the user, or
handed back on shutdown. Either way no worker holds it until a job continues it."""

from __future__ import annotations

from holdfast_shared.jobs import TurnJob

from holdfast_loop_worker.turn.handle import ParkingTurn


async def park(turn: ParkingTurn, request_id: str) -> str:
    """Park on HITL request ``request_id``: snapshot, keep the task, free the worker."""
    await turn.snapshot("hitl")
    await turn.keep_task_while_parked()
    # A question may wait for hours: the task's stdio MCP servers do not wait
    # with it (security issue #23); its next call starts them again. Asked while
    # the lease is held, so no resumed call of the turn can come before it.
    await turn.stop_tools()
    await turn.release_lease(status="parked")
    # An answer that came in since we read the request queued its resume job while
    # we still held the turn; whoever took that job may have found it busy. Queue
    # one more: resuming twice is harmless (the lease lets one through, and the
    # other finds the question answered or the turn over).
    _question, answer = await turn.read_question(request_id)
    if answer.status != "pending":
        job = turn.job
        await turn.requeue(TurnJob.resuming(job.tenant_id, job.task_id, job.turn_id))
    return "parked"


async def hand_back(turn: ParkingTurn) -> str:
    """Shutdown: snapshot, give up the lease and queue the turn for another worker.

    The snapshot keeps the last boundary's ``last_seq``: what the cut-off
    step emitted since is then named by the resumer's ``turn_resumed``.
    """
    await turn.snapshot("shutdown", advance=False)
    await turn.release_lease()
    await turn.requeue(turn.job.model_copy(update={"resume": True}))
    return "handed_back"
