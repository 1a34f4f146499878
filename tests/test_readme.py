"""The README's loop ("Your own model and training loop") runs as written, on a network
defined here that no preset resembles, with the user's own learning rate and nothing set
on the controller: the model lands at the target and reloads exactly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comera_engine as ce

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.pytorch_path]


def readme_loop() -> str:
    """The first Python block of the README's "Your own model and training loop"."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Your own model and training loop", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's loop example is missing"
    return match.group(1)


class MyNet(nn.Module):
    """Two-feature-group tabular net: an embedding for a categorical column, a linear
    layer for the numeric ones, a hidden layer and a 3-way head."""

    def __init__(self) -> None:
        super().__init__()
        self.category = nn.Embedding(512, 32)
        self.numeric = nn.Linear(48, 96)
        self.hidden = nn.Linear(128, 128)
        self.head = nn.Linear(128, 3)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        h = torch.cat([self.category(batch["cat"]), self.numeric(batch["num"])], dim=1)
        return self.head(F.relu(self.hidden(F.relu(h))))


def test_the_readme_loop_runs_as_written(tmp_path, monkeypatch) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 3, generator=g)
    table = torch.randn(512, 3, generator=g)
    n = 4096
    cat = torch.randint(0, 512, (n,), generator=g)
    num = torch.randn(n, 48, generator=g)
    labels = (num @ w + table[cat]).argmax(1)
    step_batches = iter(torch.randint(0, n, (1500, 64), generator=g))
    state: dict[str, dict[str, torch.Tensor]] = {}

    def task_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        i = next(step_batches)  # each call its own batch (the README names one `batch`)
        state["batch"] = {"cat": cat[i], "num": num[i]}
        return F.cross_entropy(model(state["batch"]), labels[i])

    monkeypatch.chdir(tmp_path)  # ce.save writes small.safetensors here
    torch.manual_seed(0)
    scope = {"MyNet": MyNet, "task_loss": task_loss, "batch": None}
    exec(compile(readme_loop(), "README.md", "exec"), scope)  # noqa: S102
    comera, model, small = scope["comera"], scope["model"], scope["small"]
    rep = comera.report()
    assert rep["target"] == 20 and abs(rep["compression"] / 20 - 1) <= 0.05, rep["message"]
    assert rep["stage"] == "fixed" and comera.steps_done == 1500  # the optimizer stepped it
    model.eval()
    small.eval()
    with torch.no_grad():
        torch.testing.assert_close(small(state["batch"]), model(state["batch"]))
        acc = float((model({"cat": cat, "num": num}).argmax(1) == labels).float().mean())
    assert acc > 0.6  # it learned the task (three classes: chance is about 1/3)


def test_the_readme_engine_example_runs_as_written() -> None:
    """"Using the engine": the layers are drop-ins (same output shapes as the dense ones)
    and ``tensorize`` swaps a model's layers in place and returns it, smaller than dense."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## Using the engine", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "the README's engine example is missing"
    torch.manual_seed(0)
    dense = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    my_model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    scope: dict = {"my_model": my_model}
    exec(compile(match.group(1), "README.md", "exec"), scope)  # noqa: S102
    assert scope["my_model"] is my_model  # in place, and returned
    assert scope["layer"](torch.randn(2, 768)).shape == nn.Linear(768, 3072)(
        torch.randn(2, 768)).shape
    assert scope["emb"](torch.tensor([0, 30521])).shape == (2, 768)
    n_dense = sum(p.numel() for p in dense.parameters())
    n_tt = sum(p.numel() for p in my_model.parameters())
    report = ce.size_report(my_model)["model"]
    assert report["dense_params"] == n_dense  # counted against the dense twin
    assert report["compression"] == pytest.approx(n_dense / report["effective_params"])
    assert n_tt < n_dense / 10
    x = torch.randn(4, 256)
    assert my_model(x).shape == dense(x).shape
