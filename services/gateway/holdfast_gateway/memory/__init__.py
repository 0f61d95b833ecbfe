"""A brain as a file: the NDJSON format (``transfer.py``) and importing it (``importing.py``).

Only the gateway reads and writes this format (``GET /memory/export``,
``POST /memory/import``); the brain's storage and search, which every service
uses, stay in :mod:`holdfast_shared.memory`.
"""
