"""Long-term memory: what a brain keeps across tasks, and how it is found again.

A *brain* (:class:`Brain`) is a tenant, or one end user inside it. The
learning service fills it from trajectories (episodes, knowledge, the social
graph, the soul); the loop-worker reads it into every turn's context and
through the ``memory_search`` / ``memory_save`` tools; the gateway serves it
over HTTP. Storage (``store.py``) and retrieval (``search.py``) live here so
all three use one implementation.
"""

from holdfast_shared.memory.brain import Brain

__all__ = ["Brain"]
