"""Progress bars on stderr for long benches (rich), so stdout keeps the JSON alone.

`progress_bars(enabled)` yields a `Bars`; `bars.arm(label)` adds one bar of
`bars.per_arm` steps and returns the function that advances it by one (call it
once per finished request). Disabled, the same calls do nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


class Bars:
    def __init__(self, progress: Any, per_arm: int) -> None:
        self._progress = progress
        self.per_arm = per_arm
        """Steps of the next bar (requests of an arm)."""

    def status(self, text: str) -> None:
        """A log line above the bars (nothing when disabled)."""
        if self._progress is not None:
            self._progress.console.log(text)

    def arm(self, label: str) -> Callable[[], None]:
        if self._progress is None:
            return lambda: None
        task = self._progress.add_task(label, total=self.per_arm)
        return lambda: self._progress.advance(task)


@contextlib.contextmanager
def progress_bars(enabled: bool, per_arm: int = 1) -> Iterator[Bars]:
    if not enabled:
        yield Bars(None, per_arm)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.progress import TimeElapsedColumn as Elapsed

    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), Elapsed())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        yield Bars(progress, per_arm)
