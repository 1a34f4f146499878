"""The halves path's batch GEMMs: each way against float64, and the per-machine choice
between two ways (timed once, saved, reused by later processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from comera_engine.tensor import gemm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch, tmp_path):  # noqa: ANN001, ANN201
    """A private choices folder, ``auto`` mode, nothing chosen yet in this process."""
    monkeypatch.setenv("COMERA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("COMERA_GEMM_TUNE", raising=False)
    monkeypatch.setattr(gemm, "CPU_GEMM", "auto")
    monkeypatch.setattr(gemm, "_choices", None)
    return tmp_path


def _operands(kind: str, rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, float64 product)`` for a product of this kind."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(rows, 48, generator=g)
    if kind == "tn":
        b = torch.randn(rows, 24, generator=g)
        return a, b, a.double().t() @ b.double()
    b = torch.randn(48, 24, generator=g) if kind == "nn" else torch.randn(24, 48, generator=g)
    ref = a.double() @ (b.double() if kind == "nn" else b.double().t())
    return a, b, ref


def _slowed(monkeypatch, slow_way: int) -> list[tuple[str, int]]:  # noqa: ANN001
    """Make way ``slow_way`` of every kind 20 ms slower; returns the log of ways run."""
    calls: list[tuple[str, int]] = []
    real = gemm._run

    def run(kind, way, a, b):  # noqa: ANN001, ANN202
        calls.append((kind, way))
        if way == slow_way:
            time.sleep(0.02)
        return real(kind, way, a, b)

    monkeypatch.setattr(gemm, "_run", run)
    return calls


@pytest.mark.parametrize("kind", ["nn", "nt", "tn"])
@pytest.mark.parametrize("slow_way", [0, 1])
def test_tuning_keeps_the_faster_way_saves_it_and_reuses_it(fresh, monkeypatch, kind: str,
                                                            slow_way: int) -> None:
    if kind != "tn" and gemm.onednn_linear() is None:
        pytest.skip("this PyTorch build has no oneDNN linear op: nothing to choose")
    a, b, ref = _operands(kind)
    calls = _slowed(monkeypatch, slow_way)
    got = getattr(gemm, kind)(a, b)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    assert sorted(calls) == sorted([(kind, 0), (kind, 1)] * gemm._ROUNDS)  # timed both
    fast = gemm._KINDS[kind][1 - slow_way]
    key = f"{kind}|{1024 if kind != 'tn' else 48}x{48 if kind != 'tn' else 1024}x24|" \
          f"{torch.get_num_threads()}"
    assert gemm.choices() == {key: fast}
    assert gemm.way_for(kind, a, b) == fast
    saved = json.loads(gemm.choices_path().read_text())
    assert saved == {"machine": gemm._machine_id(), "choices": {key: fast}}
    # as a later process would: the file's choice, one call, no timing
    gemm._reset()
    calls.clear()
    again = getattr(gemm, kind)(a, b)
    assert calls == [(kind, 1 - slow_way)] and torch.equal(again, got)


def test_a_later_process_makes_the_same_choice_without_timing(fresh) -> None:
    """The machine id is stable across processes: a subprocess finds this process's
    choice in the file and runs that way (here: the one the file names, even if the
    other were faster there)."""
    a, b, _ = _operands("tn")
    key = gemm._key("tn", a, b)
    path = gemm.choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # the way the fixed rule would not take, so a match shows the file was read
    path.write_text(json.dumps({"machine": gemm._machine_id(), "choices": {key: "ba"}}))
    code = ("import torch, sys; from comera_engine.tensor import gemm; "
            "a = torch.randn(1024, 48); b = torch.randn(1024, 24); "
            "gemm._run = lambda kind, way, a, b: sys.exit(10 + way); gemm.tn(a, b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)  # inherits COMERA_CACHE_DIR
    assert out.returncode == 11, out.stderr[-2000:]  # way 1 ("ba"), called once


def test_foreign_or_corrupt_choices_files_are_ignored_and_rewritten(fresh) -> None:
    a, b, ref = _operands("tn")
    path = gemm.choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = gemm._key("tn", a, b)
    for text in ("{not json", json.dumps({"machine": "another CPU", "choices": {key: "ba"}}),
                 json.dumps({"machine": gemm._machine_id(), "choices": {key: "sideways"}})):
        path.write_text(text)
        gemm._reset()
        assert gemm.choices() == {}
        got = gemm.tn(a, b)
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
        saved = json.loads(path.read_text())
        assert saved["machine"] == gemm._machine_id()
        assert saved["choices"][key] in ("ab", "ba")


def test_other_choices_in_the_file_are_kept(fresh) -> None:
    path = gemm.choices_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": gemm._machine_id(),
                                "choices": {"tn|7x2048x5|3": "ba"}}))
    gemm.tn(*_operands("tn")[:2])
    saved = json.loads(path.read_text())["choices"]
    assert saved["tn|7x2048x5|3"] == "ba" and len(saved) == 2
    assert not list(path.parent.glob("*.tmp*"))  # nothing half-written left behind


def test_no_timing_below_the_row_threshold_when_disabled_or_forced(fresh, monkeypatch) -> None:
    calls = _slowed(monkeypatch, slow_way=-1)
    a, b, _ = _operands("tn", rows=gemm.TUNE_MIN_ROWS - 1)
    gemm.tn(a, b, default=1)
    assert calls == [("tn", 1)]  # small: the caller's default form, once
    a, b, _ = _operands("tn")
    monkeypatch.setenv("COMERA_GEMM_TUNE", "0")
    calls.clear()
    gemm.tn(a, b)
    assert calls == [("tn", 0)] and gemm.way_for("tn", a, b) == "ab"
    monkeypatch.delenv("COMERA_GEMM_TUNE")
    for forced in ("mkl", "onednn"):
        monkeypatch.setattr(gemm, "CPU_GEMM", forced)
        calls.clear()
        gemm.nt(*_operands("nt")[:2])
        assert len(calls) == 1
    assert not gemm.choices_path().exists() and gemm.choices() == {}


def test_an_unwritable_cache_folder_keeps_the_choice_in_this_process(fresh, monkeypatch) -> None:
    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("COMERA_CACHE_DIR", str(blocker / "sub"))  # a folder under a file
    monkeypatch.setattr(gemm, "_warned", False)
    a, b, ref = _operands("tn")
    with pytest.warns(RuntimeWarning, match="COMERA_CACHE_DIR"):
        got = gemm.tn(a, b)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    assert gemm.way_for("tn", a, b) in ("ab", "ba")


def test_a_way_that_fails_is_never_chosen(fresh, monkeypatch) -> None:
    """oneDNN refusing an operand (a RuntimeError from way 1) leaves the product on
    torch.mm, recorded as the choice; an error of torch.mm itself is not hidden."""
    real = gemm._run

    def run(kind, way, a, b):  # noqa: ANN001, ANN202
        if way == 1:
            raise RuntimeError("could not create a primitive")
        return real(kind, way, a, b)

    monkeypatch.setattr(gemm, "_run", run)
    a, b, ref = _operands("tn")
    got = gemm.tn(a, b)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    assert gemm.way_for("tn", a, b) == "ab"
    monkeypatch.setattr(gemm, "_run", lambda *args: (_ for _ in ()).throw(RuntimeError("mm")))
    with pytest.raises(RuntimeError, match="mm"):
        gemm.tn(torch.randn(2048, 8), torch.randn(2048, 4))
