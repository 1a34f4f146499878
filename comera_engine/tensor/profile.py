"""Device profiles: every path of every TT op timed on one GPU model, committed as JSON.

A profile is written by the tuning script (``experiments/tune_gpu.py``, on the GPU it
describes) and read by the planner (:mod:`comera_engine.tensor.planner`). It holds

* ``device``: the name CUDA reports (``"NVIDIA H200"``), the library versions, whether the
  device was ``fake`` (a CPU standing in for a GPU, the tests' way);
* ``spec``: the device's peaks (:class:`~comera_engine.tensor.roofline.DeviceSpec`);
* ``measurements``: per case (:class:`~comera_engine.tensor.costs.Case`), milliseconds of
  one forward + backward of each path (and of the dense layer it replaces, for
  reference: ``"nn.Linear"``, ``"nn.Embedding"``);
* ``fit``: the cost model calibrated to those timings (:func:`calibrate`): the fraction
  of the peak MAC rate and bandwidth reached, the launch overheads eager and in a CUDA
  graph, a factor per path;
* ``kernels``: the Triton kernels' launch configurations the tuning script found best
  per shape (:mod:`comera_engine.kernels.configs`).

The planner takes a case's time per path from the profile (:meth:`DeviceProfile.times`):
the measured one where the case itself was measured; else the nearest measurement of
the same op, factors, dtype and graph setting (by tokens and ranks), scaled by the
model's ratio between the two cases; else the calibrated model. A GPU with no profile
gets the roofline of its datasheet peaks with the efficiencies calibrated on the
profiles there are (:func:`fallback_model`).

Where profiles are looked for, first match wins: ``$COMERA_DEVICE_PROFILE`` (one file,
for any device: the tests, or a GPU whose profile has another name), then
``$COMERA_PROFILE_DIR/<slug>.json`` and the package's ``profiles/<slug>.json``, the
slug being the device name lower-cased with runs of other characters as ``-``
(``nvidia-h200``).
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from .costs import OPS, Case, DeviceModel, path_seconds, path_work
from .roofline import DeviceSpec, geometric_mean

__all__ = ["FORMAT", "PACKAGE_DIR", "DeviceProfile", "Measurement", "calibrate",
           "fallback_model", "find_profile", "known_profiles", "model_from_fit", "slug"]

FORMAT = "comera-device-profile/1"
PACKAGE_DIR = Path(__file__).resolve().parent / "profiles"

#: Fit of a GPU nobody has profiled yet, where no profile exists to calibrate on: the
#: fractions of its datasheet peaks a cuBLAS GEMM and a copy reach, the cost of a kernel
#: launched eagerly from Python (autograd and dispatch included) and replayed in a CUDA
#: graph. Read off the committed H200 figures (experiments/results/gpu/, bf16, 4096
#: tokens): nn.Linear forward + backward at 768×3072 reaches ~0.4 of the bf16 peak; the
#: halves path's ~40 kernels take ~2.2 ms eagerly (~50 µs each) and ~0.23 ms graphed.
DEFAULT_FIT = {"mac_eff": 0.4, "bw_eff": 0.6, "op_overhead": 4e-5,
               "graph_op_overhead": 5e-6, "path_factors": {}}


def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``: a profile's file name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


@dataclass
class Measurement:
    """One case timed: milliseconds of a forward + backward per path."""

    case: Case
    ms: dict[str, float]

    def path_ms(self) -> dict[str, float]:
        """The op's own paths (the dense reference layer left out)."""
        return {p: t for p, t in self.ms.items() if p in OPS[self.case.op]}


@dataclass
class DeviceProfile:
    """A measured profile (module doc). ``source``: the file it was read from."""

    name: str
    spec: DeviceSpec
    measurements: list[Measurement]
    fit: dict
    kernels: dict[str, list[dict]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    source: str | None = None

    @property
    def fake(self) -> bool:
        return bool(self.meta.get("fake"))

    def model(self, base: DeviceModel) -> DeviceModel:
        """The cost model calibrated on this profile (``base`` gives the GEMM width at
        which efficiency saturates)."""
        label = f"profile:{Path(self.source).name if self.source else slug(self.name)}"
        return model_from_fit(self.spec, self.fit, base, label)

    def times(self, case: Case, dm: DeviceModel) -> tuple[dict[str, float], str]:
        """Seconds per path for ``case`` from the measurements, and how they were got:
        ``"measured"`` (this case), ``"nearest"`` (a measurement of the same op,
        factors, dtype and graph setting at other tokens or ranks, scaled by ``dm``'s
        ratio of the two cases) or ``""`` (none fits: ``{}``)."""
        near = self.nearest(case)
        if near is None:
            return {}, ""
        exact = near.case.tokens == case.tokens and near.case.ranks == case.ranks
        out = {}
        for p, ms in near.path_ms().items():
            scale = 1.0 if exact else (path_seconds(case, p, dm)
                                       / max(path_seconds(near.case, p, dm), 1e-12))
            out[p] = ms * 1e-3 * scale
        return out, "measured" if exact else "nearest"

    def nearest(self, case: Case) -> Measurement | None:
        """The measurement of ``case``'s shape key nearest in ``log tokens`` and
        ``log Σ ranks``; None where the shape was not measured."""
        same = [m for m in self.measurements if m.case.shape_key == case.shape_key]
        if not same:
            return None

        def dist(m: Measurement) -> float:
            return (abs(math.log(m.case.tokens / case.tokens))
                    + abs(math.log(sum(m.case.ranks) / max(1, sum(case.ranks)))))

        return min(same, key=dist)

    # ------------------------------------------------------------------ JSON
    def to_json(self) -> dict:
        return {"format": FORMAT, "device": {"name": self.name, **self.meta},
                "spec": self.spec.as_dict(), "fit": self.fit,
                "measurements": [{**m.case.as_dict(), "ms": m.ms} for m in self.measurements],
                "kernels": self.kernels}

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @staticmethod
    def from_json(d: dict, source: str | None = None) -> DeviceProfile:
        """Read and check a profile; ValueError saying what is wrong, and where."""
        where = f"{source}: " if source else ""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{where}not a device profile (format must be {FORMAT!r})")
        try:
            dev = dict(d["device"])
            name = str(dev.pop("name"))
            spec = DeviceSpec.from_dict(d["spec"])
            meas = [Measurement(Case.from_dict(m), {str(k): float(v) for k, v in
                                                    dict(m["ms"]).items()})
                    for m in d["measurements"]]
            fit = dict(d["fit"])
            for key in ("mac_eff", "bw_eff", "op_overhead", "graph_op_overhead"):
                float(fit[key])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}bad device profile: {type(exc).__name__}: {exc}") from None
        for m in meas:
            if not m.ms or min(m.ms.values()) <= 0 or not all(
                    p in OPS[m.case.op] or p.startswith("nn.") for p in m.ms):
                raise ValueError(f"{where}bad measurement {m.case.as_dict()}: times must be "
                                 f"positive, per path of {OPS[m.case.op]} (or nn.*)")
        return DeviceProfile(name, spec, meas, fit, dict(d.get("kernels") or {}), dev, source)

    @staticmethod
    def read(path: str | Path) -> DeviceProfile:
        path = Path(path)
        return DeviceProfile.from_json(json.loads(path.read_text()), str(path))


# ---------------------------------------------------------------------------- finding them
def _profile_dirs() -> list[Path]:
    extra = os.environ.get("COMERA_PROFILE_DIR")
    return [*([Path(extra)] if extra else []), PACKAGE_DIR]


@lru_cache(maxsize=64)
def _read_cached(path: str, mtime: float) -> DeviceProfile:
    return DeviceProfile.read(path)


def _read(path: Path) -> DeviceProfile:
    return _read_cached(str(path), path.stat().st_mtime)


def find_profile(device_name: str) -> DeviceProfile | None:
    """The profile of the GPU called ``device_name`` (module doc: where it is looked
    for), or None. A profile file that cannot be read raises ValueError naming it."""
    forced = os.environ.get("COMERA_DEVICE_PROFILE")
    if forced:
        return _read(Path(forced))
    for folder in _profile_dirs():
        path = folder / f"{slug(device_name)}.json"
        if path.is_file():
            return _read(path)
    return None


def known_profiles() -> list[DeviceProfile]:
    """Every readable profile of a real GPU in the profile folders (a fake device's
    and unreadable files left out): what :func:`fallback_model` calibrates on."""
    out, seen = [], set()
    for folder in _profile_dirs():
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            if path.name in seen:
                continue
            try:
                prof = _read(path)
            except (ValueError, OSError):
                continue
            if not prof.fake:
                seen.add(path.name)
                out.append(prof)
    return out


# ---------------------------------------------------------------------------- the model
def model_from_fit(spec: DeviceSpec, fit: dict, base: DeviceModel, source: str
                   ) -> DeviceModel:
    """The cost model of ``spec``'s peaks at a fit's efficiencies and overheads
    (MAC/s = FLOP/s / 2)."""
    eff = float(fit["mac_eff"])
    return DeviceModel(
        spec.name, mac_rate=spec.peak_flops("float32") / 2 * eff,
        bandwidth=spec.bandwidth * float(fit["bw_eff"]),
        op_overhead=float(fit["op_overhead"]), full_eff_dim=base.full_eff_dim,
        mac_rate_16=spec.peak_flops("bfloat16") / 2 * eff,
        graph_op_overhead=float(fit["graph_op_overhead"]),
        path_factors=tuple(sorted((str(k), float(v))
                                  for k, v in dict(fit.get("path_factors") or {}).items())),
        source=source)


def fallback_model(spec: DeviceSpec, base: DeviceModel,
                   profiles: Sequence[DeviceProfile] | None = None) -> DeviceModel:
    """The model of a GPU without a profile: its datasheet peaks at the median of the
    efficiencies, overheads and path factors fitted on the ``profiles`` there are
    (:func:`known_profiles` by default; :data:`DEFAULT_FIT` where there are none)."""
    profiles = known_profiles() if profiles is None else list(profiles)
    fits = [p.fit for p in profiles] or [DEFAULT_FIT]
    merged = {k: statistics.median(float(f[k]) for f in fits)
              for k in ("mac_eff", "bw_eff", "op_overhead", "graph_op_overhead")}
    keys = sorted({k for f in fits for k in dict(f.get("path_factors") or {})})
    merged["path_factors"] = {
        k: statistics.median(float(f["path_factors"][k]) for f in fits
                             if k in (f.get("path_factors") or {})) for k in keys}
    label = (f"roofline:{spec.name}, calibrated on "
             f"{', '.join(p.name for p in profiles) or 'no profile (defaults)'}")
    return model_from_fit(spec, merged, base, label)


def _kernel_arrays(case: Case, path: str) -> tuple[np.ndarray, ...]:
    """A path's kernels (both directions when training) as arrays: MACs, bytes, dim."""
    f, g = path_work(case, path)
    ks = f.kernels + (g.kernels if case.training else [])
    a = np.array(ks, dtype=np.float64).reshape(-1, 3)
    return a[:, 0], a[:, 1], a[:, 2]


def _predict(items: list, mac: np.ndarray, bw: np.ndarray, dim: int) -> np.ndarray:
    """Roofline seconds (no launch overhead) of each item on a grid of MAC rates
    (axis 0) and bandwidths (axis 1): ``(items, A, B)``."""
    out = np.empty((len(items), mac.size, bw.size))
    for i, (macs, nbytes, dims, _) in enumerate(items):
        eff = np.minimum(1.0, np.maximum(1.0, dims) / dim)
        comp = (macs / eff)[:, None, None] / mac[None, :, None]
        mem = nbytes[:, None, None] / bw[None, None, :]
        out[i] = np.maximum(comp, mem).sum(axis=0)
    return out


def calibrate(spec: DeviceSpec, measurements: Sequence[Measurement], base: DeviceModel
              ) -> dict:
    """Fit the cost model to measured paths (and the dense layers timed beside them):
    the fractions of the peak MAC rate
    (``mac_eff``) and bandwidth (``bw_eff``) and the launch overhead (``op_overhead``)
    that make the model closest to the eager timings in log error (a grid search), then
    the overhead inside a CUDA graph on the graphed ones, then per op and path the
    geometric mean of measured / modelled (``path_factors``, clamped to [0.2, 5]).
    Returns the ``fit`` dict of a profile."""
    rows = []
    for m in measurements:  # the paths and the dense layer beside them (cuBLAS's GEMMs)
        for p, ms in m.ms.items():
            macs, nbytes, dims = _kernel_arrays(m.case, p)
            elt16 = m.case.elt == 2
            peak = spec.peak_flops("bfloat16" if elt16 else "float32") / 2
            rows.append((m, p, ms * 1e-3, (macs / peak, nbytes, dims, len(macs))))
    if not rows:
        return dict(DEFAULT_FIT)
    effs = np.geomspace(0.01, 1.0, 15)
    bws = np.geomspace(0.03, 1.0, 12)
    ovs = np.geomspace(5e-7, 1e-4, 16)

    def fit_overhead(sel: list, mac_eff: float, bw_eff: float, grid: np.ndarray
                     ) -> tuple[float, float, float, float]:
        base_t = _predict([r[3] for r in sel], np.array([mac_eff]) if mac_eff else effs,
                          spec.bandwidth * (np.array([bw_eff]) if bw_eff else bws),
                          base.full_eff_dim)
        meas = np.log(np.array([r[2] for r in sel]))
        n = np.array([r[3][3] for r in sel], dtype=np.float64)
        pred = base_t[..., None] + n[:, None, None, None] * grid[None, None, None, :]
        loss = ((np.log(pred) - meas[:, None, None, None]) ** 2).mean(axis=0)
        i, j, k = np.unravel_index(int(np.argmin(loss)), loss.shape)
        e = mac_eff or float(effs[i])
        b = bw_eff or float(bws[j])
        return e, b, float(grid[k]), float(loss[i, j, k])

    eager = [r for r in rows if not r[0].case.graph] or rows
    mac_eff, bw_eff, op_ov, _ = fit_overhead(eager, 0.0, 0.0, ovs)
    graphed = [r for r in rows if r[0].case.graph]
    graph_ov = (fit_overhead(graphed, mac_eff, bw_eff, np.geomspace(1e-7, 5e-5, 30))[2]
                if graphed else min(op_ov, DEFAULT_FIT["graph_op_overhead"]))
    fit = {"mac_eff": mac_eff, "bw_eff": bw_eff, "op_overhead": op_ov,
           "graph_op_overhead": graph_ov, "path_factors": {}}
    model = model_from_fit(spec, fit, base, "fit")
    ratios: dict[str, list[float]] = {}
    for m, p, secs, _ in rows:
        ratios.setdefault(f"{m.case.op}/{p}", []).append(
            secs / max(path_seconds(m.case, p, model), 1e-12))
    fit["path_factors"] = {k: min(5.0, max(0.2, geometric_mean(v)))
                           for k, v in sorted(ratios.items())}
    return fit
