"""holdfast_shared.runtime.settle_heap: start-up objects leave the collector's reach,
what the service allocates afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

from holdfast_shared import runtime


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_settle_heap_freezes_what_is_alive_and_later_garbage_is_still_collected() -> None:
    before = _Node()
    try:
        runtime.settle_heap()
        assert gc.get_freeze_count() > 0
        frozen = gc.get_freeze_count()
        # A cycle made after settling: garbage once dropped, and collected.
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
        assert gc.get_freeze_count() == frozen  # nothing new was frozen
        assert before.other is None
    finally:
        gc.unfreeze()  # give the test process its heap back
