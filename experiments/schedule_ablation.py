"""What each of our additions to the paper's method does (docs/METHODS.md, "Schedules").

Trains shipped configs (default: digits 60× and SNLI-tiny 10×) with every schedule
(``paced``, the default; ``comera``, no pace; ``paper``, the spec alone) and with the
default schedule less one switch at a time, over seeds; prints the compression reached,
the accuracy and how many rank entries the objective's gates and the pace removed, and
writes experiments/results/schedule_ablation.json.

A variant that keeps the preset's ranks (``paper``, ``ranks_from_target = false``) is
refused where those ranks already compress more than the target asks (SNLI-tiny: rank 8
is 16× against 10×); it then runs from the ranks the default schedule starts from, and
its row says so.

    python experiments/schedule_ablation.py [--configs digits_tt_mlp snli_transformer_tiny]
                                            [--seeds 0 1 2] [--variants 1 8]
    python experiments/schedule_ablation.py --markdown   # the table of docs/METHODS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import machine, print_table, write_json  # noqa: E402
from target_check import CONFIGS, ROOT, run_one  # noqa: E402

from comera_engine.errors import ConfigError  # noqa: E402

#: (variant, overrides): the schedules, then the default less one switch.
VARIANTS: list[tuple[str, list[str]]] = [
    ("paced (default)", []),
    ("comera: no pace", ['comera.schedule="comera"']),
    ("paper: the spec alone", ['comera.schedule="paper"']),
    ("paced, late_norm initial", ['comera.late_norm="initial"']),
    ("paced, size_off_at_target off", ["comera.size_off_at_target=false"]),
    ("paced, keep_task_loss off", ["comera.keep_task_loss=false"]),
    ("paced, plateau_min_drop 0", ["comera.plateau_min_drop=0.0"]),
    ("paced, rank_floor off", ["comera.rank_floor=false"]),
    ("paced, ranks_from_target off", ["comera.ranks_from_target=false"]),
    ("comera, balance off", ['comera.schedule="comera"', "comera.balance=false"]),
    ("comera, deadline off", ['comera.schedule="comera"', "comera.deadline=false"]),
    ("paced, balance on", ["comera.balance=true"]),
    ("comera, gate_speed off", ['comera.schedule="comera"', "comera.gate_speed=false"]),
    ("comera, keep_task_loss on", ['comera.schedule="comera"', "comera.keep_task_loss=true"]),
    # not a switch: the gates' step size, which bounds how fast the objective can prune
    ("paced, lr_gates 3e-3", ["comera.lr_gates=3e-3"]),
]


def start_ranks(path: Path) -> list[str]:
    """Overrides pinning the ranks the default schedule starts ``path`` from."""
    from comera_engine.config import load_config
    from comera_engine.preview import data_shape
    from comera_engine.runplan import plan_initial_ranks

    cfg = load_config(path, base_dir=path.parents[2])
    planned, _ = plan_initial_ranks(cfg, data_shape(cfg.data))
    return [f"model.{k}={v}" for k in ("rank", "embedding_rank")
            if (v := getattr(planned.model, k)) is not None]


def _merged(folder: Path | None, rows: list[dict], runs: list[dict]
            ) -> tuple[list[dict], list[dict]]:
    """``rows`` and ``runs`` in place of the same (config, variant) in the table last
    written (kept in its order; new variants after it)."""
    import json

    path = (folder or ROOT / "experiments" / "results") / "schedule_ablation.json"
    if not path.is_file():
        return rows, runs
    old = json.loads(path.read_text())
    new = {(r["config"], r["variant"]): r for r in rows}
    merged = [new.pop((r["config"], r["variant"]), r) for r in old.get("rows", [])]
    done = {(r["config"], r["variant"]) for r in rows}
    kept = [r for r in old.get("runs", []) if (r.get("config"), r.get("variant")) not in done]
    return merged + list(new.values()), kept + runs


TASK_NAMES = {"digits_tt_mlp": "digits", "snli_transformer_tiny": "SNLI-tiny"}


def markdown(rows: list[dict]) -> str:
    """The docs/METHODS.md "Schedules" table of ``rows`` (the JSON's)."""
    lines = ["| task | variant | reached (asked) | eval acc % | entries removed by the "
             "objective / by the pace |", "|---|---|---|---|---|"]
    order = {v: i for i, (v, _) in enumerate(VARIANTS)}
    tasks = list(dict.fromkeys(r["config"] for r in rows))
    for r in sorted(rows, key=lambda r: (tasks.index(r["config"]),
                                         order.get(r["variant"], len(order)))):
        mark = " †" if r.get("note") else ""
        lines.append(f"| {TASK_NAMES.get(r['config'], r['config'])} | {r['variant']}{mark} | "
                     f"{r['reached']}× ({r['target']:g}×) | {r['acc']} | "
                     f"{r['by_objective']:.0f} / {r['by_pace']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", nargs="+", default=["digits_tt_mlp", "snli_transformer_tiny"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", type=int, default=None,
                    help="indices into the variant list (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="JSON folder (experiments/results)")
    ap.add_argument("--markdown", action="store_true",
                    help="print the last table as docs/METHODS.md has it, and stop")
    args = ap.parse_args(argv)
    if args.markdown:
        import json

        path = (args.out or ROOT / "experiments" / "results") / "schedule_ablation.json"
        print(markdown(json.loads(path.read_text())["rows"]))
        return 0
    for name in args.configs:
        if not (CONFIGS / f"{name}.toml").is_file():
            ap.error(f"--configs: no experiments/configs/{name}.toml")
    chosen = [VARIANTS[i] for i in (args.variants or range(len(VARIANTS)))]
    runs, rows = [], []
    for name in args.configs:
        path = CONFIGS / f"{name}.toml"
        for variant, overrides in chosen:
            note, got = "", []
            for seed in args.seeds:
                try:
                    got.append(run_one(path, seed, overrides=overrides + [
                        "train.eval_every=0"] + (start_ranks(path) if note else [])))
                except ConfigError as exc:
                    if note or exc.field != "model.rank":
                        raise
                    note = "from the default's start ranks (the preset's compress more)"
                    got.append(run_one(path, seed, overrides=overrides + [
                        "train.eval_every=0"] + start_ranks(path)))
                print(f"{name} {variant} seed {seed}: {got[-1]['reached']:.2f}x "
                      f"acc {got[-1]['eval_acc']:.4f}", flush=True)
            runs += [{**g, "variant": variant, "note": note} for g in got]
            acc = [g["eval_acc"] for g in got]
            rows.append({
                "config": name, "variant": variant, "target": got[0]["target"],
                "reached": " – ".join(f"{x:.1f}" for x in (min(g["reached"] for g in got),
                                                            max(g["reached"] for g in got))),
                "acc": f"{100 * statistics.mean(acc):.1f} ± "
                       f"{100 * (statistics.stdev(acc) if len(acc) > 1 else 0):.1f}",
                "by_objective": statistics.mean(g["by_objective"] for g in got),
                "by_pace": statistics.mean(g["by_pace"] for g in got),
                "seeds": len(got), "note": note})
    print_table(rows, [("config", "config", ""), ("variant", "variant", ""),
                       ("target", "target x", ".0f"), ("reached", "reached x", ""),
                       ("acc", "eval acc %", ""), ("by_objective", "removed by objective", ".1f"),
                       ("by_pace", "by pace", ".1f"), ("note", "note", "")])
    if args.variants is not None:  # a subset: the other rows of the last full table stay
        rows, runs = _merged(args.out, rows, runs)
    out = write_json("schedule_ablation", {"machine": machine(), "seeds": args.seeds,
                                           "rows": rows, "runs": runs}, args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
