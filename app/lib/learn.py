"""Numbers behind the Learn page: TT-SVD of a matrix or an image, core shapes, gates and
contraction costs. Pure functions (numpy, tensorly through ``comera_engine.tensor``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SIDE = 256  # the playground's matrices are 256 x 256 = 4^4 x 4^4
SOURCES = {
    "photo": "Photo (256×256 grayscale)",
    "smooth": "Smooth kernel matrix (compressible)",
    "random": "Random Gaussian matrix (incompressible)",
}
LAYOUTS = {
    "halves": "rows | columns (TT layer)",
    "interleaved": "interleaved (TT-matrix)",
}


def make_matrix(source: str, seed: int = 0) -> np.ndarray:
    """A 256×256 float matrix scaled to [0, 1] (photo) or unit RMS (matrices)."""
    if source == "photo":
        try:
            from PIL import Image
            from sklearn.datasets import load_sample_image

            rgb = load_sample_image("china.jpg")  # 427 x 640, ships with scikit-learn
            gray = Image.fromarray(rgb).convert("L").crop((150, 20, 550, 420))
            img = np.asarray(gray.resize((SIDE, SIDE), Image.LANCZOS), dtype=np.float64)
            return img / 255.0
        except Exception:  # noqa: BLE001 - no sklearn images or PIL: draw one
            pass
        y, x = np.mgrid[0:SIDE, 0:SIDE] / SIDE
        disc = ((x - 0.5) ** 2 + (y - 0.4) ** 2 < 0.05).astype(float)
        return np.clip(0.5 + 0.25 * np.sin(12 * x) * np.cos(7 * y) + 0.25 * disc, 0, 1)
    rng = np.random.default_rng(seed)
    if source == "smooth":
        t = np.linspace(0, 1, SIDE)
        k = np.exp(-((t[:, None] - t[None, :]) ** 2) / 0.02)
        k += 0.3 * np.outer(np.sin(6 * t), np.cos(4 * t))
        k += 0.01 * rng.standard_normal((SIDE, SIDE))
        return k / np.sqrt(np.mean(k**2))
    if source == "random":
        return rng.standard_normal((SIDE, SIDE))
    raise ValueError(f"source: unknown source {source!r}; choose from {', '.join(SOURCES)}")


def to_tensor(m: np.ndarray, layout: str) -> np.ndarray:
    """256×256 -> order-8 tensor of 4s (rows then columns) or order-4 tensor of 16s with
    interleaved row/column digits."""
    t = m.reshape([4] * 8)
    if layout == "halves":
        return t
    if layout == "interleaved":
        return t.transpose(0, 4, 1, 5, 2, 6, 3, 7).reshape([16] * 4)
    raise ValueError(f"layout: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")


def from_tensor(t: np.ndarray, layout: str) -> np.ndarray:
    if layout == "halves":
        return t.reshape(SIDE, SIDE)
    return t.reshape([4] * 8).transpose(0, 2, 4, 6, 1, 3, 5, 7).reshape(SIDE, SIDE)


def _one_thread():  # noqa: ANN202 - a context manager
    try:
        from threadpoolctl import threadpool_limits

        return threadpool_limits(1)
    except Exception:  # noqa: BLE001 - optional
        import contextlib

        return contextlib.nullcontext()


@dataclass
class TTResult:
    rank: int
    ranks: list[int]
    params: int
    dense: int
    rel_error: float
    reconstruction: np.ndarray
    core_shapes: list[tuple[int, int, int]]

    @property
    def compression(self) -> float:
        return self.dense / self.params


def tt_approx(m: np.ndarray, layout: str, rank: int) -> TTResult:
    """TT-SVD (tensorly) of the matrix in ``layout`` with every rank capped at ``rank``."""
    import tensorly as tl

    from comera_engine import tt_svd

    t = to_tensor(m, layout)
    # tensorly's backend is global: a tltorch peer's preview in this process switched it
    # to PyTorch, and these are NumPy arrays
    with _one_thread(), tl.backend_context("numpy"):  # tiny SVDs: threads only fight
        cores = tt_svd(t, max_rank=int(rank))
        rec_t = tl.tt_to_tensor([np.asarray(c) for c in cores])
    rec = from_tensor(np.asarray(rec_t), layout)
    err = float(np.linalg.norm(rec - m) / max(np.linalg.norm(m), 1e-12))
    shapes = [tuple(int(x) for x in c.shape) for c in cores]
    ranks = [1, *[s[2] for s in shapes[:-1]], 1]
    return TTResult(int(rank), ranks, int(sum(c.size for c in cores)), m.size, err, rec, shapes)


# ------------------------------------------------------------------ cores of a layer


def rank_bounds(in_factors: list[int], out_factors: list[int]) -> list[int]:
    """The most each inner bond ``r_1 … r_{d-1}`` of a TT linear layer with these factors
    can hold: the maximal TT rank, what the modes on either side of it allow."""
    from comera_engine import max_tt_ranks

    return [int(c) for c in max_tt_ranks([*in_factors, *out_factors])]


def tt_layer_cores(in_factors: list[int], out_factors: list[int], rank: int
                   ) -> list[tuple[int, int, int]]:
    """Core shapes ``(r_{k-1}, s_k, r_k)`` of a TT linear layer at a uniform rank, each
    bond clamped to the maximal TT rank."""
    modes = [*in_factors, *out_factors]
    ranks = [1, *[min(rank, c) for c in rank_bounds(in_factors, out_factors)], 1]
    return [(ranks[k], s, ranks[k + 1]) for k, s in enumerate(modes)]


_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
          "ten", "eleven", "twelve")


def in_words(n: int) -> str:
    """``6`` → ``"six"`` (up to twelve; digits beyond)."""
    return _WORDS[n] if 0 <= n < len(_WORDS) else f"{n:,}"


def bounds_text(in_factors: list[int], out_factors: list[int], rank: int | None = None
                ) -> str:
    """The inner bonds' bounds as a sentence part: ``"r1 ≤ 12, r2 ≤ 96, …, r5 ≤ 12"``;
    with ``rank``, which of them hold the bond below it (``"; at rank 30, r1 and r5 are
    held at their bound"``)."""
    bounds = rank_bounds(in_factors, out_factors)
    text = ", ".join(f"r{k} ≤ {c:,}" for k, c in enumerate(bounds, 1))
    held = [f"r{k}" for k, c in enumerate(bounds, 1) if c < (rank or 0)]
    if held:
        names = held[0] if len(held) == 1 else f"{', '.join(held[:-1])} and {held[-1]}"
        text += (f"; at rank {rank}, {names} {'is' if len(held) == 1 else 'are'} held at "
                 f"{'its' if len(held) == 1 else 'their'} bound")
    return text


# ------------------------------------------------------------------ rank gates


def gate_importance(r: int, seed: int = 3) -> np.ndarray:
    """How much each of ``r`` rank directions matters (a decaying spectrum, as trained
    layers show), scaled so the largest is 1."""
    rng = np.random.default_rng(seed)
    base = np.exp(-np.arange(r) / max(r / 4.0, 1.0)) * rng.uniform(0.7, 1.3, r)
    return np.sort(base)[::-1] / base.max()


def gates_after(importance: np.ndarray, pressure: float) -> np.ndarray:
    """Gate magnitudes after the l1 size surrogate has pushed every gate down by
    ``pressure`` (the loss holds each gate near its importance): ``max(0, g - pressure)``."""
    return np.maximum(0.0, importance - pressure)


# ------------------------------------------------------------------ contraction costs


def path_macs(batch: int, in_factors: list[int], out_factors: list[int], rank: int,
              training: bool = True, device: str = "cpu") -> dict[str, float]:
    """MACs of every contraction path (forward, plus backward when ``training``) and of a
    dense ``nn.Linear``, plus the planner's pick under ``"pick"``."""
    from comera_engine import estimate, plan

    shapes = tt_layer_cores(in_factors, out_factors, rank)
    ranks = [1, *[s[2] for s in shapes[:-1]], 1]
    costs = estimate(batch, in_factors, out_factors, ranks, device, training=training)
    n, m = math.prod(in_factors), math.prod(out_factors)
    out: dict[str, float] = {
        p: float(c.macs_fwd + (c.macs_bwd if training else 0)) for p, c in costs.items()
    }
    out["nn.Linear"] = float(batch * n * m * (3 if training else 1))
    out["seconds"] = {p: c.seconds for p, c in costs.items()}  # type: ignore[assignment]
    out["pick"] = plan(batch, in_factors, out_factors, ranks, device, training=training)  # type: ignore[assignment]
    return out
