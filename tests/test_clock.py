"""Throughput and ETA from the trainer's own clock (issue 46 item 4): samples per second
of training over the last steps (the wait for the batch counted, evaluations and
checkpoints not), and the time left from the mean step plus the evaluations' and
checkpoints' share, checked against a clock outside the trainer on a run whose step
time is known."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from comera_engine.config import config_from_dict
from comera_engine.metrics import NullSink
from comera_engine.train.clock import StepClock

pytestmark = pytest.mark.usefixtures("one_thread")

DATA_WAIT_S = 0.02  # each batch takes this long to arrive: the step time is known


class Stopwatch(NullSink):
    """Notes when each step's metrics arrive, on a clock of its own."""

    def __init__(self) -> None:
        self.at: dict[int, float] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def log_metrics(self, step: int, values: dict[str, Any]) -> None:
        self.at[step] = time.perf_counter()
        self.metrics[step] = dict(values)


def test_throughput_and_eta_on_a_run_of_known_step_time(tmp_path, monkeypatch) -> None:
    import comera_engine.train.loop as loop
    from comera_engine.train.loop import train

    real = loop.iterate_batches

    def slow_batches(*args: Any, **kwargs: Any) -> Any:
        for item in real(*args, **kwargs):
            time.sleep(DATA_WAIT_S)  # a slow loader: the old per-step figure left it out
            yield item

    monkeypatch.setattr(loop, "iterate_batches", slow_batches)
    steps, batch = 80, 16
    cfg = config_from_dict({
        "name": "clock", "model": {"name": "tt_mlp", "preset": "tiny", "rank": 4},
        "data": {"name": "digits"}, "comera": {"switch": "never"},
        "train": {"steps": steps, "batch_size": batch, "eval_every": 40, "ckpt_every": 20,
                  "device": "cpu"}})
    sink = Stopwatch()
    train(cfg, tmp_path, sink, progress=False)
    at, m = sink.at, sink.metrics
    # the machine, read by the trainer (issue 46 item 6): CPU %, system RAM, RSS
    sys_keys = {"sys/cpu_percent", "sys/ram_used_mb", "sys/ram_total_mb", "sys/rss_mb"}
    assert sys_keys <= set(m[steps])
    assert 0 < m[steps]["sys/ram_used_mb"] < m[steps]["sys/ram_total_mb"]
    assert m[steps]["sys/cpu_percent"] >= 0 and m[steps]["sys/rss_mb"] > 50

    def outside(first: int, last: int) -> float:
        """Training seconds of steps first+1..last by the outside clock, less the
        evaluation and checkpoints made after step 40 (timed by the outside clock too:
        the gap to step 41 less the median step)."""
        gaps = sorted(at[s] - at[s - 1] for s in range(first + 1, last + 1))
        median = gaps[len(gaps) // 2]
        spent = at[last] - at[first]
        for s in range(first + 1, last + 1):  # the steps after an eval or checkpoint
            if (s - 1) % 20 == 0:
                spent -= (at[s] - at[s - 1]) - median
        return spent

    # samples per second over the last 50 steps: steps x batch / their training seconds
    expected = 50 * batch / outside(steps - 51, steps - 1)
    got = m[steps - 1]["perf/samples_per_s"]
    assert got == pytest.approx(expected, rel=0.10), (got, expected)
    assert got < batch / DATA_WAIT_S  # the wait for the batch is training time
    # the training seconds so far, likewise
    train_s = m[steps - 1]["perf/train_s"] - m[1]["perf/train_s"]
    assert train_s == pytest.approx(outside(1, steps - 1), rel=0.10)
    # the ETA at step 30: the 50 steps left at the mean step so far, by the outside
    # clock (the step after the checkpoint at 20 left out), plus that checkpoint's
    # share a step (its gap less a mean step, over the 30 steps); not the time since
    # the run started (which counts its start-up: 13 min at step 8 of 300)
    gaps = [at[s] - at[s - 1] for s in range(2, 31) if s != 21]
    step = sum(gaps) / len(gaps)
    saving = (at[21] - at[20]) - step
    eta = m[30]["perf/eta_s"]
    assert eta == pytest.approx(50 * (step + saving / 30), rel=0.10), (eta, gaps)


def test_step_clock_window_mean_and_the_time_between_steps() -> None:
    clock = StepClock(window=3)
    assert clock.samples_per_s is None and clock.eta(10) is None
    for seconds in (10.0, 0.1, 0.1, 0.2):  # a slow first step leaves the window
        clock.add(seconds, 32, 0)
    assert clock.samples_per_s == pytest.approx(96 / 0.4)
    assert clock.eta(10) == pytest.approx(10 * 0.4 / 3)  # the window's mean step x 10
    assert clock.train_s == pytest.approx(10.4)
    # an evaluation of 2 s between steps: 2 s over the 5 steps seen, 0.4 s a step more
    clock.add(0.1, 32, 0, other=2.0)
    assert clock.eta(10) == pytest.approx(10 * (0.4 / 3 + 2.0 / 5))
    assert clock.train_s == pytest.approx(10.5)


def test_the_eta_of_a_step_that_mostly_runs_fast_but_waits_now_and_then() -> None:
    """On a shared machine most steps of a small model run at full speed and every few
    wait out another process's time slice: the time left is what those steps take on
    the wall, their mean (the median would say a third of it)."""
    clock = StepClock(window=50)
    pattern = [0.01, 0.01, 0.1]  # two fast steps, one that waits
    steps = [pattern[i % 3] for i in range(48)]
    for seconds in steps:
        clock.add(seconds, 1)
    real = 100 * sum(pattern) / 3  # the wall time 100 more such steps take
    assert clock.eta(100) == pytest.approx(real)
    assert statistics.median(steps) * 100 < real / 3
    with pytest.raises(ValueError):
        StepClock(window=0)


def test_system_meter_reads_at_most_once_a_second() -> None:
    import torch

    from comera_engine.train.sysinfo import SystemMeter

    meter = SystemMeter(torch.device("cpu"), every=3600.0)
    first = meter.read()
    sum(i * i for i in range(200_000))  # some CPU work in between
    assert meter.read() == first  # within the interval: the last reading
    assert first["sys/ram_total_mb"] > first["sys/ram_used_mb"] > 0


class FakeNvml:
    """What the meters call of ``pynvml``, for one device whose handle is ``"gpu-a"``:
    87 % busy, 9 GiB of 80 GiB used; ``broken`` makes every call raise as a lost
    driver does."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.handles: list[object] = []

    def _check(self, handle: object) -> None:
        self.handles.append(handle)
        if self.broken:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Any:  # noqa: N802
        from types import SimpleNamespace

        self._check(handle)
        return SimpleNamespace(gpu=87, memory=31)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> Any:  # noqa: N802
        from types import SimpleNamespace

        self._check(handle)
        return SimpleNamespace(used=9 * 2**30, total=80 * 2**30, free=71 * 2**30)


def test_the_meters_read_gpu_utilisation_and_memory_through_nvml(monkeypatch) -> None:
    """Issue 46 item 6: with NVML on a CUDA device the trainer samples the device's
    utilisation (sys/*) and used / total memory (mem/*, NVML's figures, not the CUDA
    runtime's); NVML failing leaves the other readings (and the runtime's memory); a CPU
    device opens no NVML."""
    import torch

    from comera_engine.train.sysinfo import MemoryMeter, SystemMeter, open_nvml

    assert open_nvml(torch.device("cpu")) is None
    nv = FakeNvml()
    sys_read = SystemMeter(torch.device("cuda"), every=0.0, nvml=(nv, "gpu-a")).read()
    assert sys_read["sys/gpu_util_percent"] == 87.0
    assert sys_read["sys/ram_total_mb"] > 0  # the machine's readings beside it
    gib = 1024.0  # MiB
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 2 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: (60 * 2**30, 64 * 2**30))
    mem = MemoryMeter(torch.device("cuda"), nvml=(nv, "gpu-a")).read()
    assert mem == {"mem/cuda_max_allocated_mb": 2 * gib, "mem/cuda_max_reserved_mb": 3 * gib,
                   "mem/gpu_used_mb": 9 * gib, "mem/gpu_total_mb": 80 * gib}
    assert set(nv.handles) == {"gpu-a"}

    lost = FakeNvml(broken=True)
    sys_read = SystemMeter(torch.device("cuda"), every=0.0, nvml=(lost, "gpu-a")).read()
    assert "sys/gpu_util_percent" not in sys_read and "sys/cpu_percent" in sys_read
    mem = MemoryMeter(torch.device("cuda"), nvml=(lost, "gpu-a")).read()
    assert (mem["mem/gpu_used_mb"], mem["mem/gpu_total_mb"]) == (4 * gib, 64 * gib)
