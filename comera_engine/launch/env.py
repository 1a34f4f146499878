"""A run's launch environment: the variables that shape a run, recorded in its folder at
launch (``launch_env.json``) and given back to it on every start, so a resumed run
trains as it was launched; and its share of the cores, written there at dispatch
(:mod:`comera_engine.launch.threads`). Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from comera_engine.launch.threads import AUTO_KEY, cpu_cores, runs_in_flight, thread_budget
from comera_engine.store import RunStore

#: The launch environment a run keeps (resume runs with it, not the resumer's).
ENV_FILENAME = "launch_env.json"
#: Variables that shape a run: the engine's switches, thread counts, GPU selection and
#: the libraries' own settings. Names that look like credentials are never recorded.
_ENV_PREFIXES = ("COMERA_", "OMP_", "MKL_", "OPENBLAS_", "CUDA_", "NCCL_", "TORCH_",
                 "PYTORCH_", "TRITON_", "HF_", "TOKENIZERS_", "PYTHONHASHSEED")
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


def run_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that shape a run
    (``_ENV_PREFIXES``), without any whose name looks like a credential."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items())
            if k.startswith(_ENV_PREFIXES) and not any(w in k for w in _SECRET_WORDS)}


def recorded_env(run_dir: Path) -> dict[str, str] | None:
    """The launch environment a run folder recorded (``None``: none recorded)."""
    import json

    try:
        data = json.loads((run_dir / ENV_FILENAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    return {str(k): str(v) for k, v in data.items()}


def child_env(gpus: str | None = None, recorded: Mapping[str, str] | None = None
              ) -> dict[str, str]:
    """Environment for supervisor and trainer: unbuffered output, this package importable,
    ``CUDA_VISIBLE_DEVICES`` when ``gpus`` is given. ``recorded``: the run's launch
    environment (:func:`run_env` at launch): its variables replace this process's own
    run-shaping ones, so a resumed run trains as it was launched."""
    env = dict(os.environ)
    if recorded is not None:
        for key in run_env(env):
            env.pop(key)
        env.update(recorded)
    env["PYTHONUNBUFFERED"] = "1"
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if _PACKAGE_ROOT not in paths:
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *paths])
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def assign_threads(st: RunStore, rid: str) -> tuple[int, int, int] | None:
    """Give a dispatched run whose launch environment asks for it (``COMERA_THREADS =
    auto``, see :mod:`comera_engine.launch.threads`) its share of the cores: writes
    ``OMP_NUM_THREADS`` into its ``launch_env.json`` and logs a ``threads`` event.
    Returns ``(threads, cores, runs in flight)``, or ``None`` when the run keeps its
    own setting."""
    import json

    run_dir = st.run_dir(rid)
    env = recorded_env(run_dir)
    if env is None or env.get(AUTO_KEY) != "auto":
        return None
    cores, runs = cpu_cores(), max(1, runs_in_flight(st))
    threads = thread_budget(cores, runs)
    env["OMP_NUM_THREADS"] = str(threads)
    env["COMERA_THREADS_SHARED"] = f"{cores} cores, {runs} run(s) in flight"
    tmp = run_dir / (ENV_FILENAME + ".tmp")
    try:
        tmp.write_text(json.dumps(env, indent=1), encoding="utf-8")
        os.replace(tmp, run_dir / ENV_FILENAME)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    st.log_event(rid, "threads", f"{threads} thread(s): {cores} cores shared by {runs} "
                 "run(s) in flight (OMP_NUM_THREADS)")
    return threads, cores, runs
