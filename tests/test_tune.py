"""The tuning script on a CPU with a fake device description: it writes a valid profile
covering every op of the shipped configs it was given, the planner loads it and takes
the measured fastest path; the kernel sweep (interpreted) writes a configuration per
kernel and shape that the launches then use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comera_engine.tensor import planner
from comera_engine.tensor.costs import OPS, Case
from comera_engine.tensor.profile import FORMAT, DeviceProfile

ROOT = Path(__file__).resolve().parents[1]
FAKE = {"name": "Fake GPU", "flops": {"float32": 1e11, "bfloat16": 4e11}, "bandwidth": 2e10}


def test_the_tuning_script_writes_a_profile_the_planner_loads(tmp_path, fresh_planner) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("COMERA_KERNELS", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "tune_gpu.py"), "--quick", "--out",
         str(tmp_path), "--fake-device", json.dumps(FAKE), "--rounds", "1", "--reps", "1"],
        capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "fake-gpu.json"
    raw = json.loads(path.read_text())
    assert raw["format"] == FORMAT and raw["device"]["fake"] and raw["device"]["complete"]
    prof = DeviceProfile.read(path)
    assert prof.name == "Fake GPU" and prof.spec.bandwidth == 2e10
    assert {m.case.op for m in prof.measurements} == set(OPS)  # every op of the configs
    for m in prof.measurements:  # every path that runs here (no kernels: no fused)
        assert set(m.path_ms()) == {p for p in OPS[m.case.op] if p != "fused"}, m.case
        assert any(k.startswith("nn.") for k in m.ms)
    assert {"mac_eff", "bw_eff", "op_overhead", "graph_op_overhead"} <= set(prof.fit)

    fresh_planner.setenv("COMERA_DEVICE_PROFILE", str(path))
    for m in prof.measurements:
        c = m.case
        e = planner.explain_case(c, "cpu")
        assert e["source"] == "measured" and e["profile"] == str(path)
        fastest = min(m.path_ms(), key=m.path_ms().get)
        assert e["path"] == fastest, (c, m.ms)


def test_the_kernel_sweep_picks_a_configuration_per_shape(fresh_planner, monkeypatch) -> None:
    pytest.importorskip("triton", reason="triton is not installed (Linux x86-64 only)")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run interpreted here only with TRITON_INTERPRET=1")
    from comera_engine.kernels import configs
    from comera_engine.tensor.tune import sweep_kernels

    monkeypatch.setenv("COMERA_KERNELS", "interpret")
    monkeypatch.setattr(configs, "CANDIDATES",
                        {k: v[:2] for k, v in configs.CANDIDATES.items()})
    cases = [Case("tt_linear", (4, 3), (5, 4), (1, 4, 6, 4, 1), 33),
             Case("ttm_lookup", (5, 4), (2, 3), (1, 5, 1), 17)]
    table = sweep_kernels(cases, torch.device("cpu"), rounds=1, reps=1, log=lambda s: None)
    assert set(table) == {"chain", "matmul_tn", "colsum", "lookup", "segment_grad"}
    shapes = {k: sorted(tuple(e["shape"]) for e in v) for k, v in table.items()}
    assert shapes["chain"] == [(33, 12, 6, 20), (33, 20, 6, 12)]  # forward, and dX
    assert shapes["matmul_tn"] == [(33, 6, 20), (33, 12, 6)]  # dR, dL
    for entries in table.values():
        for e in entries:
            assert e["config"] in configs.CANDIDATES[next(
                k for k, v in table.items() if e in v)] and e["ms"] > 0
    try:
        configs.install(table)
        got = configs.config("chain", (33, 12, 6, 20), "float32")
        assert got == next(e["config"] for e in table["chain"]
                           if tuple(e["shape"]) == (33, 12, 6, 20))
    finally:
        configs.reset()


def _gpu_check_steps() -> list[tuple[str, int, str]]:
    """``(function, limit seconds, command)`` of every step of experiments/gpu_check.sh."""
    import re

    text = (ROOT / "experiments" / "gpu_check.sh").read_text()
    out, fn = [], None
    lines = text.replace("\\\n", " ").splitlines()
    for line in lines:
        m = re.match(r"^(\w+)\(\) \{", line)
        if m:
            fn = m.group(1)
        m = re.search(r"\bstep (\d+) \S+ (.*)$", line)
        if m and fn in ("tune", "tests", "bench", "compile"):
            out.append((fn, int(m.group(1)), m.group(2)))
    return out


_HELPS = """
import contextlib, io, json, runpy, sys
out = {}
for script in sys.argv[1:]:
    sys.argv, buf = [script, "--help"], io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    out[script] = buf.getvalue()
print(json.dumps(out))
"""


def test_gpu_check_fits_ten_minutes_and_its_flags_exist() -> None:
    """Every step of the GPU script has a time limit; tune + tests + bench add up to under
    ten minutes (a 600 s device call, with room for the start and the summary); every
    flag a tune or bench step passes is one its script takes."""
    import re

    steps = _gpu_check_steps()
    per = {fn: sum(limit for f, limit, _ in steps if f == fn) for fn in ("tune", "tests",
                                                                          "bench")}
    assert all(per.values()) and sum(per.values()) <= 590, per
    used: dict[str, set[str]] = {}
    for fn, _, cmd in steps:
        script = re.search(r"(experiments/\w+\.py)", cmd)
        if fn != "tests" and script:
            used.setdefault(script.group(1), set()).update(re.findall(r"(--[a-z][a-z-]*)", cmd))
    # each script's --help, all in one interpreter (one torch import, not one a script)
    helps = subprocess.run([sys.executable, "-c", _HELPS, *used], capture_output=True,
                           text=True, timeout=120, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert helps.returncode == 0, helps.stderr[-2000:]
    helptext = json.loads(helps.stdout.splitlines()[-1])
    assert set(helptext) == set(used) and len(used) >= 6
    for script, flags in used.items():
        assert "usage:" in helptext[script], (script, helptext[script][-500:])
        for flag in flags:
            assert flag in helptext[script], (script, flag)
