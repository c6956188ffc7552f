"""Where a run's wall time goes: seconds per phase (set-up, step, eval, save, finite checks, log, sample).

    phases = Phases()                   # or, on a method of an object with .phases: @timed("save")
    with phases("save"):
        with phases("finite checks"):   # nested: counted as finite checks, not as save
            ...
    phases.seconds                      # {"save": 0.2, "finite checks": 0.05}

Time is exclusive: a phase entered inside another pauses the outer one, so the phases add up to
the time spent inside any of them. Two ``perf_counter`` calls per phase: cheap enough for every step.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Phases:
    """Exclusive wall seconds per named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.stack: list[str] = []  # the phases entered and not yet left, innermost last
        self.since = 0.0  # when the innermost phase last started counting

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._switch(name)
        try:
            yield
        finally:
            self._switch(None)

    def _switch(self, entering: str | None) -> None:
        """Credit the time since the last switch to the innermost phase, then enter ``entering`` (None: leave)."""
        now = time.perf_counter()
        if self.stack:
            inner = self.stack[-1]
            self.seconds[inner] = self.seconds.get(inner, 0.0) + now - self.since
        if entering is None:
            self.stack.pop()
        else:
            self.stack.append(entering)
        self.since = now


def timed(phase: str) -> Callable[[F], F]:
    """A method's calls counted as ``phase`` in its object's ``phases`` (a :class:`Phases`)."""
    def wrap(method: F) -> F:
        @functools.wraps(method)
        def inner(self, *args: Any, **kwargs: Any) -> Any:
            with self.phases(phase):
                return method(self, *args, **kwargs)
        return inner  # type: ignore[return-value]
    return wrap


def summary(seconds: dict[str, float]) -> str:
    """One line of where a run's time went, largest first: "time: step 141.2 s, eval 4.1 s, ..."."""
    parts = sorted(seconds.items(), key=lambda kv: -kv[1])
    return "time: " + ", ".join(f"{name} {s:.1f} s" for name, s in parts)
