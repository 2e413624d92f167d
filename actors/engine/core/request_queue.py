"""Waiting queues: first come first served, or by priority.

Both give the scheduler the same five operations. A preempted request goes back
with `prepend`: at the very front under FCFS, and by (priority, arrival) under
the priority policy (its arrival is old, so it lands ahead of newer work).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from spur.actors.engine.core.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest (priority, arrival_time) first; ties broken by insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(
            self._heap, (request.priority, request.arrival_time, next(self._seq), request)
        )

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[3] for e in sorted(self._heap))


RequestQueue = FCFSQueue | PriorityQueue


def make_queue(policy: str) -> RequestQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy {policy!r} is unknown: use 'fcfs' or 'priority'")
