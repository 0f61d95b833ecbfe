"""Completion webhooks, the gateway's part: subscriptions, the tenant's secret,
signing, and the loop that delivers the outbox the loop-workers write.

Consumes ``webhook_deliveries`` rows (written by the loop-worker with a
turn's end or question, ``holdfast_loop_worker.webhook_outbox``); produces
signed POSTs to the subscribers. Guarantees: each message is delivered at
least once while the receiver answers 2xx within the attempts, with the same
``webhook-id`` and body every time (receivers dedupe on the id); otherwise it
is kept as ``failed`` until redelivered.
"""

from holdfast_gateway.webhooks.delivery import Deliverer
from holdfast_gateway.webhooks.subscription import accepted

__all__ = ["Deliverer", "accepted"]
