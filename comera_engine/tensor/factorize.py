"""Shape factorisation: write a dimension as a product of small, balanced factors.

``768 -> (12, 8, 8)``; a dimension that factors badly is padded to a nearby number that
factors well (``30522 -> 30576 = 14·14·13·12``, 54 padded rows) and the padding is
reported. Explicit factor lists (e.g. the paper's ``[16, 20, 10, 10]`` for the BERT
vocabulary, which pads to 32000) are validated and accepted as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Factorization", "factorize", "resolve_factors"]


@dataclass(frozen=True)
class Factorization:
    """Result of :func:`factorize`.

    ``factors`` multiply to ``padded`` (``>= n``); ``pad = padded - n`` extra rows/columns
    are zero-padded (linear inputs), ignored (linear outputs) or never looked up
    (embedding rows).
    """

    n: int
    factors: tuple[int, ...]

    @property
    def padded(self) -> int:
        return math.prod(self.factors)

    @property
    def pad(self) -> int:
        return self.padded - self.n


def _divisors(m: int) -> list[int]:
    """All divisors of m, ascending (trial division up to sqrt(m))."""
    small, large = [], []
    i = 1
    while i * i <= m:
        if m % i == 0:
            small.append(i)
            if i * i != m:
                large.append(m // i)
        i += 1
    return small + large[::-1]


@lru_cache(maxsize=4096)
def _balanced_exact(m: int, d: int) -> tuple[int, ...] | None:
    """Most balanced non-increasing d-tuple of factors >= 2 with product m, or None.

    Balance is ``max/min``; ties go to the first found (largest leading factor).
    """
    if d == 1:
        return (m,)
    divs = [f for f in _divisors(m) if f >= 2]
    best: tuple[float, tuple[int, ...]] | None = None

    def rec(rem: int, k: int, hi: int, acc: tuple[int, ...]) -> None:
        nonlocal best
        if k == 1:
            if 2 <= rem <= hi:
                cand = (*acc, rem)
                score = math.log(cand[0] / cand[-1])
                if best is None or score < best[0] - 1e-12:
                    best = (score, cand)
            return
        lo = max(2, math.ceil(rem ** (1.0 / k) - 1e-9))  # largest remaining factor >= this
        for f in reversed(divs):
            if f > hi or f > rem:
                continue
            if f < lo:
                break
            if rem % f:
                continue
            if best is not None and acc and math.log(acc[0] / f) > best[0]:
                continue
            rec(rem // f, k - 1, f, (*acc, f))

    rec(m, d, m, ())
    return best[1] if best else None


_GOOD_RATIO = 2.0  # max/min factor accepted without looking further
_MAX_SCAN = 20000  # padded candidates examined at most


def factorize(n: int, d: int, max_pad: float = 0.1) -> Factorization:
    """Balanced factorisation of ``n`` into ``d`` factors, padding ``n`` if that helps.

    Rule: the most balanced exact factorisation (factors >= 2, non-increasing) if its
    ``max/min`` ratio is at most 2 (``768 -> (12, 8, 8)``); otherwise the smallest padded
    ``m`` in ``(n, n·(1+max_pad)]`` whose factorisation reaches that ratio
    (``30522 -> 30576 = 14·14·13·12``); otherwise the best-balanced candidate seen. When
    ``n < 2**d``, trailing factors of 1 are used.

    Args:
        n: dimension to factor, ``n >= 1``.
        d: number of factors, ``d >= 1``.
        max_pad: largest relative padding considered.

    Raises:
        ValueError: ``n`` or ``d`` not a positive integer, or ``max_pad`` negative.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: must be a positive integer, got {n!r}")
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d: must be a positive integer, got {d!r}")
    if max_pad < 0:
        raise ValueError(f"max_pad: must be >= 0, got {max_pad!r}")
    if d == 1:
        return Factorization(n, (n,))
    if n < 2**d:
        for k in range(d - 1, 0, -1):
            f = _balanced_exact(n, k) if n >= 2**k else None
            if f is not None:
                return Factorization(n, (*f, *([1] * (d - k))))
        return Factorization(n, (n, *([1] * (d - 1))))
    best: tuple[float, tuple[int, ...]] | None = None
    hi = min(max(n + 8, math.floor(n * (1.0 + max_pad))), n + _MAX_SCAN)
    for m in range(n, hi + 1):
        f = _balanced_exact(m, d)
        if f is None:
            continue
        ratio = f[0] / f[-1]
        if ratio <= _GOOD_RATIO + 1e-12:
            return Factorization(n, f)
        if best is None or math.log(ratio) < best[0]:
            best = (math.log(ratio), f)
    if best is None:
        return Factorization(n, (n, *([1] * (d - 1))))
    return Factorization(n, best[1])


def resolve_factors(
    n: int, factors: list[int] | tuple[int, ...] | None, d: int | None, name: str
) -> Factorization:
    """Validate explicit ``factors`` for dimension ``n``, or choose them with ``factorize``.

    Raises ``ValueError`` naming ``name`` when a factor is not a positive integer or the
    product is smaller than ``n`` (padding up is allowed, never truncation).
    """
    if factors is None:
        if d is None:
            d = 3 if n >= 8 else (2 if n >= 4 else 1)
        return factorize(n, d)
    fs = tuple(factors)
    if not fs or not all(isinstance(f, int) and not isinstance(f, bool) and f >= 1 for f in fs):
        raise ValueError(f"{name}: factors must be positive integers, got {list(factors)!r}")
    if d is not None and len(fs) != d:
        raise ValueError(f"{name}: expected {d} factors, got {len(fs)} ({list(fs)})")
    if math.prod(fs) < n:
        raise ValueError(
            f"{name}: factors {list(fs)} multiply to {math.prod(fs)} < {n}; "
            "their product must be at least the dimension"
        )
    return Factorization(n, fs)
