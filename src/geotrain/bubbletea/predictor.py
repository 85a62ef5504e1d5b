"""Bubble budgets for a running rank, refreshed from what it measured.

Keyed by the position of a blocking action (a receive, the DP reduction) in the rank's
action list: the schedule repeats every iteration, so the idle time before the same action
recurs. The budget is the smallest idle seen in the last few iterations, shrunk by a margin;
if a prefill ended after the awaited data had already arrived (the rank found the data
waiting), that position's budget is halved -- training must not wait for prefill twice in a row.
Each iteration without such a miss wins back a quarter, up to the full budget: a single slow
chunk (a busy machine) must not shut a bubble for the rest of the run.
"""

from __future__ import annotations

import collections


class BubblePredictor:
    RECOVERY = 1.25    # penalty factor regained per iteration without a miss at that position

    def __init__(self, margin_frac: float = 0.25, margin_s: float = 0.002, history: int = 3,
                 warmup_iterations: int = 1):
        self.margin_frac, self.margin_s, self.history = margin_frac, margin_s, history
        self.warmup = warmup_iterations
        self._idle: dict[int, collections.deque[float]] = {}
        self._penalty: dict[int, float] = {}
        self._missed: set[int] = set()      # positions that missed in the current iteration
        self.iteration = 0

    def budget(self, index: int) -> float:
        """Seconds of prefill that may start now, before the action at `index`."""
        seen = self._idle.get(index)
        if self.iteration < self.warmup or not seen:
            return 0.0
        b = min(seen) * (1 - self.margin_frac) * self._penalty.get(index, 1.0) - self.margin_s
        return max(0.0, b)

    def record(self, index: int, idle_s: float, data_was_waiting: bool) -> None:
        """idle_s: time from reaching the action to its data being there (prefill included).
        data_was_waiting: the data had already arrived when the prefill ended."""
        self._idle.setdefault(index, collections.deque(maxlen=self.history)).append(idle_s)
        if data_was_waiting:
            self._penalty[index] = self._penalty.get(index, 1.0) * 0.5
            self._missed.add(index)

    def next_iteration(self) -> None:
        for index, f in list(self._penalty.items()):
            if index not in self._missed:
                f = min(1.0, f * self.RECOVERY)
                if f >= 1.0:
                    del self._penalty[index]
                else:
                    self._penalty[index] = f
        self._missed.clear()
        self.iteration += 1
