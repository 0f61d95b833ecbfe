"""Run one turn: model iterations until a stop condition, every step as an event.

The package: ``run.py`` (the conductor, and the one table from how a run
stopped to how the turn ends), ``handle.py`` (the :class:`TurnHandle` every
step takes), ``live.py`` (the engine's implementation of it over Redis,
PostgreSQL, the providers and the tool-runners), and
one module per step: ``model_step.py``, ``tool_step.py`` (one routing table
for tool calls), ``hitl.py``, ``parking.py``, ``resume.py``, ``ending.py``
(its SQL in ``rows.py``), ``result.py`` (an ``output_schema``'s answer,
validated, corrected once; a ``result`` event before ``completed``).

Event order for a plain answer (the gateway already logged ``started``)::

    content_block_start → text_delta… → content_block_stop → usage
    → thread_lifecycle completed (stop_reason)

With tools, each ``tool_use`` block becomes a ``tool_call`` event, the calls
run (a permission prompt first where the policy says ``ask``), and their
``tool_result`` events follow in order; the results go back to the model.
``end_turn`` / ``stop_sequence`` / ``max_tokens`` end the turn (``completed``
carries the stop reason); ``HOLDFAST_MAX_ITERATIONS`` bounds runaway loops;
``usage`` sums every iteration.

Durability. The loop is a small state machine (``../state.py``) snapshotted at
every boundary, so any worker can continue it: after a crash (the lease ran
out), a hand-back on shutdown, an answered HITL request or a Redis that lost
its data. A continued turn first emits ``turn_resumed``; if the step that
was cut off had already emitted events (a model call's partial deltas),
``turn_resumed`` names them (``discard_from_seq``..``discard_to_seq``) and
the step runs again. Tool calls are not run again: their outcomes are stored
by call id.

Endings. A failure emits ``error`` (stable code) and ``thread_lifecycle``
``errored``; past ``HOLDFAST_TURN_DEADLINE_SECONDS`` the code is
``DEADLINE_EXCEEDED``. ``POST /execute/cancel`` ends the turn with
``thread_lifecycle`` ``completed`` and ``stop_reason: "cancelled"``. If a
stream breaks after output reached the client, the open blocks are closed
(``content_block_stop``) before the ``error``, and the partial message is
stored marked ``interrupted``. The task takes its next message either way.
"""

from holdfast_loop_worker.turn.handle import TurnHandle
from holdfast_loop_worker.turn.live import LiveTurn, TurnContext
from holdfast_loop_worker.turn.run import TurnRunner

__all__ = ["LiveTurn", "TurnContext", "TurnHandle", "TurnRunner"]
