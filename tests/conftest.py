"""Suite-wide fixtures: a run store per test (and ``home``, an empty one the dashboard's
tests run the app on), and the CPU backend, built once per session where it is not built
in this environment already (or skipped, with the reason, where it cannot be built)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The Triton kernels' tests run interpreted on the CPU unless the caller says otherwise
# (experiments/gpu_check.sh sets TRITON_INTERPRET=0 on a GPU). Triton reads the variable
# when it is first imported, and a test module collected before tests/test_kernels.py may
# import a library that imports Triton (transformers, in tests/test_integrations.py): so
# it is set here, before any test module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite in two pytest-xdist workers, one test file at a time each
# (--dist loadfile): on the two cores of CI, each worker and everything it starts (runs,
# the dashboard) runs one thread, since two workers' OpenMP threads spinning on two cores
# slowed single tests tenfold. Set before torch is imported.
IN_A_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if IN_A_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

#: The files that take longest, first: the workers take files in collection order
#: (--no-loadscope-reorder), so the longest start at once and the short ones fill the end.
LONGEST_FIRST = ("test_browser", "test_pace", "test_reproduce", "test_benchmarks",
                 "test_sweep", "test_train", "test_reliability", "test_ray_backend",
                 "test_faults", "test_app", "test_integrations", "test_data_peers",
                 "test_launch", "test_backend_cpu", "test_own")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collection order: :data:`LONGEST_FIRST`'s files first, in its order, then the rest
    as collected (the order of the tests within a file is kept)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(autouse=True)
def _own_run_store(tmp_path_factory: pytest.TempPathFactory,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Foreground ``comera train`` records every run in the run store: each test gets a
    fresh ``COMERA_HOME`` (its subprocesses inherit it), so nothing lands in the
    checkout's ``./runs``. A test about the default store deletes the variable itself."""
    monkeypatch.setenv("COMERA_HOME", str(tmp_path_factory.mktemp("comera-home")))


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty run store in ``COMERA_HOME`` for the dashboard's tests; the app runs from
    the repository root."""
    h = tmp_path / "home"
    monkeypatch.setenv("COMERA_HOME", str(h))
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    return h


@pytest.fixture(scope="session")
def cpu_backend_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding a complete CPU backend build: this environment's
    (``$COMERA_CPU_BACKEND_DIR`` or the virtualenv's) where it loads, else one built
    now into a session folder (about a minute; no GEMM timing)."""
    from comera_engine.backends.cpu import BackendUnavailable, backend_dir, load

    try:
        load(backend_dir())
        return backend_dir()
    except BackendUnavailable:
        pass
    from comera_engine.backends.cpu.build import build

    folder = tmp_path_factory.mktemp("cpu-backend")
    try:
        build(folder, tune=False)
    except Exception as exc:  # noqa: BLE001 (no compiler or ninja here)
        pytest.skip(f"the CPU backend cannot be built here ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0] if str(exc) else ''}): the PyTorch path is "
                    "tested alone")
    return folder


@pytest.fixture
def cpu_backend(cpu_backend_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The loaded CPU backend, in use through the hook for this test."""
    from comera_engine import backends

    monkeypatch.setenv("COMERA_CPU_BACKEND_DIR", str(cpu_backend_dir))
    monkeypatch.setenv("COMERA_NATIVE", "1")
    backends._load_once.cache_clear()
    backend = backends.cpu_backend()
    assert backend is not None
    yield backend
    backends._load_once.cache_clear()


@pytest.fixture(params=["pytorch", "backend"])
def op_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs an op test on the pure PyTorch path and through the CPU backend."""
    if request.param == "pytorch":
        monkeypatch.setenv("COMERA_NATIVE", "0")
    else:
        request.getfixturevalue("cpu_backend")
    return request.param


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test (tiny models train far faster single-threaded on
    small shared CPUs: threading overhead dominates); the count is restored after.
    Modules that want it for every test: ``pytestmark = pytest.mark.usefixtures(...)``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def train_threads() -> Iterator[int]:
    """Torch threads for a test that trains in the pytest process: two in one process, one
    in each of `make test`'s xdist workers (more threads than cores spin); the count is
    restored after."""
    import torch

    before = torch.get_num_threads()
    threads = 1 if IN_A_WORKER else 2
    torch.set_num_threads(threads)
    yield threads
    torch.set_num_threads(before)


@pytest.fixture
def count_calls(monkeypatch: pytest.MonkeyPatch) -> Callable[[object, str], list[int]]:
    """``count_calls(owner, name)``: ``owner.name`` replaced for this test by a wrapper
    that calls it as it was; returns the list that gets an entry per call."""
    def patch(owner: object, name: str) -> list[int]:
        calls: list[int] = []
        real = getattr(owner, name)

        def counting(*args: object, **kwargs: object) -> object:
            calls.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
        return calls

    return patch


@pytest.fixture
def fresh_planner(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The planner with no profile (the committed ones hidden too), no path family and
    nothing cached (and nothing left cached after the test); the test's monkeypatch, to
    set its own."""
    from comera_engine.tensor import planner, profile

    for var in ("COMERA_DEVICE_PROFILE", "COMERA_PROFILE_DIR", "COMERA_PATHS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(profile, "PACKAGE_DIR", profile.PACKAGE_DIR / "absent")
    planner.clear_caches()
    yield monkeypatch
    planner.clear_caches()
