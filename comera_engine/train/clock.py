"""The trainer's own clock: how long each training step took on the wall (waiting for
its batch, the step, the controller, logging), evaluation and checkpoints counted apart,
and the figures read from it: samples (and tokens) per second over the last steps, the
training seconds so far, and the time left.

Per-step rates of a tiny model swing by 10x with the scheduler (a 1 ms step reads 27k
samples/s), and the time since the run started counts its start-up: a window of whole
steps does not. The time left is the window's mean step, not its median: on a shared
machine most steps of a small model run at full speed and a few wait out another
process's time slice, so the median step was a third of the real one beside a browser
and the dashboard; and the evaluations and checkpoints to come, at what they have cost a
step so far.
"""

from __future__ import annotations

from collections import deque

__all__ = ["StepClock"]


class StepClock:
    """``clock.add(seconds, samples, tokens, other)`` once per training step; then
    :attr:`samples_per_s`, :attr:`tokens_per_s` (over the last ``window`` steps),
    :attr:`train_s` (every step so far) and :meth:`eta` (the window's mean step, plus
    the evaluations' and checkpoints' seconds a step so far, times the steps left)."""

    def __init__(self, window: int = 50) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.train_s = 0.0
        self.other_s = 0.0  # evaluations and checkpoints between the steps so far
        self.count = 0  # steps added

    def add(self, seconds: float, samples: float, tokens: float = 0.0,
            other: float = 0.0) -> None:
        """One training step of ``seconds`` on the wall that trained on ``samples``
        examples (``tokens`` of them, for text); ``other``: the seconds spent since the
        step before on evaluation and checkpoints (not training)."""
        seconds = max(float(seconds), 0.0)
        self._steps.append((seconds, float(samples), float(tokens)))
        self.train_s += seconds
        self.other_s += max(float(other), 0.0)
        self.count += 1

    def _rate(self, index: int) -> float | None:
        spent = sum(s[0] for s in self._steps)
        return sum(s[index] for s in self._steps) / spent if spent > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        """Samples per second over the window's steps (``None`` before a step)."""
        return self._rate(1)

    @property
    def tokens_per_s(self) -> float | None:
        return self._rate(2)

    @property
    def mean_step_s(self) -> float | None:
        """The window's mean step (seconds), ``None`` before a step."""
        return sum(s[0] for s in self._steps) / len(self._steps) if self._steps else None

    def eta(self, steps_left: int) -> float | None:
        """Seconds for ``steps_left`` more steps: the window's mean step plus the
        evaluations' and checkpoints' seconds a step so far, times ``steps_left``."""
        mean = self.mean_step_s
        if mean is None:
            return None
        return (mean + self.other_s / self.count) * max(int(steps_left), 0)
