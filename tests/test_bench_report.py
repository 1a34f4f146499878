"""docs/BENCHMARKS.md is generated from the committed results JSON by
experiments/bench_report.py: the committed page is the script's output, every table on it
names its command and machine, and it stays a reference (at most a third of the 68 KB
diary it replaced)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("bench_report",
                                                  ROOT / "experiments" / "bench_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_the_scripts_output() -> None:
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert page == _report().render(), "stale: run python experiments/bench_report.py"


def test_every_table_names_its_command_machine_and_results_file() -> None:
    page = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", page, flags=re.M)[1:]
    assert len(sections) >= 5
    for text in sections:
        if text.startswith("Measured again on demand"):
            assert "`python experiments/bench_tt_linear.py`" in text
            continue
        assert re.search(r"`(python experiments/\w+\.py|make reproduce)", text), text[:80]
        assert "experiments/results/" in text and ("Machine: " in text or "machine" in text)
    # reference, not a diary (it was 72 KB): room for the GPU sections, two GPUs'
    # profiles, the launch counts on the CPU and the GPU and the compiled step
    assert len(page.encode()) <= 35_000


def test_only_committed_results_feed_the_page(tmp_path: Path) -> None:
    """Every file the page reads is one git keeps (not ignored), and a missing file
    drops its section instead of failing."""
    import subprocess

    report = _report()
    names = [name for name, _ in report.SECTIONS]
    ignored = subprocess.run(["git", "check-ignore", *[f"experiments/results/{n}" for n in names]],
                             cwd=ROOT, capture_output=True, text=True)
    assert ignored.stdout.strip() == "", ignored.stdout
    (tmp_path / "reproduce").mkdir()
    empty = report.render(tmp_path)
    assert "## What the rank controller costs" not in empty
    assert "## Measured again on demand" in empty


def test_the_readme_quotes_the_own_loop_results_file() -> None:
    """README's "Your own model and training loop" states, per network, what
    experiments/results/own_loop.json (and own_loop_sgd.json) holds, in the script's own
    sentence (not figures copied by hand from an older run)."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    import own_loop

    data = json.loads((ROOT / "experiments" / "results" / "own_loop.json").read_text())
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for name, result in data["networks"].items():
        said = own_loop.sentence(name, result)
        assert said in readme, f"README should say: {said}"
    low = json.loads((ROOT / "experiments" / "results" / "own_loop_lr3e-4.json").read_text())
    said = f"in points: {own_loop.gaps(low)}."
    assert said in readme, f"README should say: {said}"
    for name, start in (("own_loop_cosine.json", "torch's `CosineAnnealingLR` over the run: "),
                        ("own_loop_cosine-held.json", "`ce.lr_scheduler`'s cosine: ")):
        sched = json.loads((ROOT / "experiments" / "results" / name).read_text())
        said = start + own_loop.gaps(sched)
        assert said in readme, f"README should say: {said}"
    sgd = json.loads((ROOT / "experiments" / "results" / "own_loop_sgd.json").read_text())
    assert sgd["optimizer"] == "sgd"
    for name, result in sgd["networks"].items():
        said = own_loop.sentence(name, result)
        assert said in readme, f"README should say: {said}"


def test_the_readme_quotes_the_controller_cost_results_file() -> None:
    """README's "Your own model and training loop" states what
    experiments/results/bench_controller_cpu.json holds, in the script's own sentence."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    import bench_controller

    data = json.loads((ROOT / "experiments" / "results" / "bench_controller_cpu.json")
                      .read_text())
    said = bench_controller.sentence(data["rows"])
    assert "digits" in said and "SNLI-tiny" in said
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert " ".join(said.split()) in readme, f"README should say: {said}"


def test_the_readme_quotes_the_hf_trainer_results_file() -> None:
    """README's Hugging Face Trainer paragraph states what
    experiments/results/hf_trainer.json holds, in the script's own sentence."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "experiments"))
    import hf_trainer

    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    for name, schedule in (("hf_trainer.json", "trainer"), ("hf_trainer_held.json", "held")):
        data = json.loads((ROOT / "experiments" / "results" / name).read_text())
        assert data.get("schedule", "trainer") == schedule
        said = hf_trainer.sentence(data["target"], data["summary"], data["majority"])
        assert "CoMERA" in said and "dense" in said and "fixed-rank TT" in said
        assert " ".join(said.split()) in readme, f"README should say: {said}"


def test_the_readme_says_what_the_gpu_step_results_file_says() -> None:
    """README's opening states the committed GPU training-step figures in bench_report's
    own sentence (the GPU, the batch, by how much CoMERA is faster or slower, the memory),
    so a claim cannot outlive the figures: a rerun that changes them fails here until the
    README says the new ones."""
    import json

    data = json.loads((ROOT / "experiments" / "results" / "gpu"
                       / "bench_train_step_cuda.json").read_text())
    said = _report().step_sentence(data)
    opening = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split(
        "## Quick start")[0].split())
    assert said in opening, f"README's opening should say: {said}"
    if "slower" in said:
        assert "faster and lighter" not in opening and "not faster" in opening
