"""Does the trainer's learning-rate decay (``train.lr_schedule``) help CoMERA, and where
should it start? For each config, over seeds, on its held-out split:

* ``constant``: the config as shipped (no warm-up, no decay);
* ``cosine from warm-up``: warm-up over a tenth of the steps, then a cosine decay to 0
  from the warm-up's end, as a plain scheduler runs it (the run's pace step hidden from
  the trainer, so its decay starts at once);
* ``cosine held``: the same, but the decay starts where the pace fixes the ranks
  (``CoMERA.reach_step``), what ``comera train`` does;
* ``dense constant`` and ``dense cosine``: the same network dense, for reference.

Prints a table (mean ± std of the config's score, the compression reached) and writes
experiments/results/lr_schedule.json (every run's score too).

    python experiments/lr_schedule_check.py                  # digits (5 seeds), reviews (4)
    python experiments/lr_schedule_check.py --only digits_tt_mlp --seeds 0 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import tomllib

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "experiments" / "configs"
#: config -> (seeds, step override or None, score metric)
TASKS = {"digits_tt_mlp": ((0, 1, 2, 3, 4), None, "eval/acc"),
         "reviews_transformer_tiny": ((0, 1, 2, 3), 400, "eval/auc")}
VARIANTS = ("constant", "cosine from warm-up", "cosine held", "dense constant",
            "dense cosine")


def run_one(config: str, variant: str, seed: int, steps: int | None, metric: str) -> dict:
    """Train one cell in a temporary folder (one torch thread); its final score."""
    import torch

    from comera_engine.config import config_from_dict
    from comera_engine.metrics import NullSink
    from comera_engine.rank import CoMERA
    from comera_engine.train import train

    torch.set_num_threads(1)
    raw = tomllib.loads((CONFIGS / f"{config}.toml").read_text())
    t = raw.setdefault("train", {})
    t["seed"] = seed
    if steps is not None:
        t.update(steps=steps, eval_every=steps, ckpt_every=steps)
    if "cosine" in variant:
        t.update(lr_schedule="cosine", warmup_steps=int(t.get("steps", 1000)) // 10)
    if variant.startswith("dense"):
        raw["model"]["dense"] = True
    cfg = config_from_dict(raw)
    cfg.base_dir = str(ROOT)
    if variant == "cosine from warm-up":  # the trainer sees no pace step: decay at once
        CoMERA.reach_step = property(lambda self: None)  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        result = train(cfg, tmp, NullSink(), stop_flag=threading.Event(), progress=False)
    m = result.metrics
    return {"config": config, "variant": variant, "seed": seed, "score": m.get(metric),
            "metric": metric, "compression": None if variant.startswith("dense")
            else m.get(f"compression/{cfg.comera.target_scope}")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, choices=list(TASKS))
    ap.add_argument("--seeds", nargs="*", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2, help="runs at once (one thread each)")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    args = ap.parse_args(argv)
    jobs = [(c, v, s, steps, metric) for c, (seeds, steps, metric) in TASKS.items()
            if args.only is None or c in args.only
            for s in (args.seeds if args.seeds is not None else seeds) for v in VARIANTS]
    # a fresh process per run: the patched pace step never leaks into another variant
    with ProcessPoolExecutor(args.workers, max_tasks_per_child=1) as pool:
        runs = list(pool.map(run_one, *zip(*jobs)))
    rows = []
    for c in dict.fromkeys(r["config"] for r in runs):
        for v in VARIANTS:
            cell = [r for r in runs if (r["config"], r["variant"]) == (c, v)]
            scores = [r["score"] for r in cell]
            comp = [r["compression"] for r in cell if r["compression"] is not None]
            rows.append({"config": c, "variant": v, "metric": cell[0]["metric"],
                         "seeds": len(cell), "mean": statistics.mean(scores),
                         "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                         "min": min(scores),
                         "compression": statistics.mean(comp) if comp else None})
    print_table([{**r, "compression": "dense" if r["compression"] is None
                  else f"{r['compression']:.1f}"} for r in rows],
                [("config", "config", ""), ("variant", "variant", ""), ("metric", "metric", ""),
                 ("seeds", "seeds", ""), ("mean", "mean", ".4f"), ("std", "std", ".4f"),
                 ("min", "min", ".4f"), ("compression", "compression x", "")])
    write_json("lr_schedule", {"machine": machine(), "rows": rows, "runs": runs},
               args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
