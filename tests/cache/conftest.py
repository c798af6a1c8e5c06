from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from vramctl.cache import TensorCache
from vramctl.guard import _guard


@pytest.fixture
def new_cache() -> Iterator[Callable[..., TensorCache]]:
    """``TensorCache(...)``, closed when the test ends (its prefetch thread stopped, its
    reliever taken off the guard's list)."""
    made: list[TensorCache] = []

    def make(*args: Any, **kwargs: Any) -> TensorCache:
        cache = TensorCache(*args, **kwargs)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


@pytest.fixture(autouse=True)
def _no_reliever_left() -> Iterator[None]:
    """A cache left answering the guard would evict its values in other tests' guarded
    steps on a simulated GPU of the same name."""
    before = list(_guard._relievers)
    yield
    leaked = [fn for fn in _guard._relievers if fn not in before]
    for fn in leaked:
        _guard.remove_reliever(fn)
    assert not leaked, f"{len(leaked)} cache(s) still registered with the guard: close() them"
