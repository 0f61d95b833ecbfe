"""Schedules: a message sent as a turn at each due time of a cron expression
(in a time zone), an interval or one instant.

``when.py`` computes due times (DST-safe, with cronsim and zoneinfo);
``firing.py`` handles one schedule's due times and waiting runs with its row
locked; ``scheduler.py`` is the loop every gateway runs; ``wire.py`` holds the
API's bodies. Routes: ``routes/schedules.py``.

Guarantee: each due time of a schedule is handled exactly once across any
number of gateways — its ``schedule_runs`` row (unique per schedule and due
time) commits in the transaction that starts its turn, and a gateway handles
a schedule only with its row locked (``FOR NO KEY UPDATE SKIP LOCKED``) — also
when every gateway was down across it (``catch_up``).
"""
