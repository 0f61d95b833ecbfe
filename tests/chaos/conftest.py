"""Each chaos module runs on a database of its own (see tests/isolation.py)."""

from tests.isolation import own_api_keys, own_database_url

__all__ = ["own_api_keys", "own_database_url"]
