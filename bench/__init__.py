"""Holdfast performance bench: ``uv run --group dev python -m bench.run --help``.

Everything runs against real processes (one gateway, one or two
loop-workers) on a real Redis and PostgreSQL, beside a raw redis-py baseline
measured in the same run. See ``docs/performance.md``.
"""
