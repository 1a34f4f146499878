"""A small terminal progress bar (stderr).

On a terminal it redraws one line in place; when stderr is a file or pipe it prints a
plain line every ``every`` seconds instead, so logs stay readable.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO


class ProgressBar:
    """``bar.update(step, {"loss": 0.5, ...})``; ``bar.close()`` ends the line."""

    def __init__(
        self, total: int, start: int = 0, stream: TextIO | None = None, every: float = 10.0
    ) -> None:
        self.total = total
        self.start = start
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self._t0 = time.monotonic()
        self._last = 0.0

    def update(self, step: int, info: dict[str, str | float], *, rate: float | None = None,
               unit: str = "it/s", eta: float | None = None) -> None:
        """Draw ``step``; ``rate`` (in ``unit``) and ``eta`` (seconds) as the trainer's
        clock reads them, else steps per second and the time left since the bar began."""
        now = time.monotonic()
        if self.tty and now - self._last < 0.1 and step < self.total:
            return
        if not self.tty and now - self._last < self.every and step < self.total:
            return
        self._last = now
        if rate is None:
            done = step - self.start
            rate = done / max(now - self._t0, 1e-9)
            unit = "it/s"
            eta = (self.total - step) / rate if rate > 0 else float("inf")
        elif eta is None:
            eta = float("inf")
        frac = step / max(self.total, 1)
        width = 24
        filled = int(frac * width)
        bar = "#" * filled + "." * (width - filled)
        extras = " ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()
        )
        shown = f"{rate:.{1 if rate < 100 else 0}f} {unit}"
        line = f"[{bar}] {step}/{self.total} {extras} {shown} eta {_fmt_time(eta)}"
        try:
            if self.tty:
                self.stream.write("\r" + line[:200].ljust(100))
            else:
                self.stream.write(line + "\n")
            self.stream.flush()
        except OSError:  # a terminal that went away (EIO) or a full disk: no more bar
            self.tty, self.every = False, float("inf")

    @staticmethod
    def terminal_fds() -> list[int]:
        """The descriptors of stdout and stderr that are a terminal now (a hung-up
        terminal is no tty any more, so they are noted while it lives)."""
        fds = []
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None and os.isatty(stream.fileno()):
                    fds.append(stream.fileno())
            except (OSError, ValueError):  # closed or not a file
                pass
        return fds

    @staticmethod
    def detach_terminal(fds: list[int] | None = None) -> None:
        """Point stdout and stderr at /dev/null where they are a terminal, or were one
        (``fds``, from :meth:`terminal_fds` while it lived): the terminal was closed
        (SIGHUP), and a write to it would fail with EIO. A file or pipe is kept."""
        targets = set(fds or []) | set(ProgressBar.terminal_fds())
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in targets:
                try:
                    os.dup2(null, fd)
                except OSError:
                    pass
        finally:
            os.close(null)

    def write(self, text: str) -> None:
        """Print a message line without breaking the bar."""
        if self.tty:
            self.stream.write("\r" + " " * 100 + "\r")
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _fmt_time(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
