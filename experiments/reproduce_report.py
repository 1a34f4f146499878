"""docs/RESULTS.md and its figures from experiments/results/reproduce/*.json (written by
experiments/reproduce.py): per task a table of every method at every target (mean ± std
over seeds, compression reached vs asked), the paper's claims checked against the
numbers, and an accuracy-vs-compression Pareto figure (PNG).

    python experiments/reproduce_report.py                    # the CPU-size results
    python experiments/reproduce_report.py --results DIR --out docs/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "reproduce"
DOC = ROOT / "docs" / "RESULTS.md"
MEMORY = RESULTS / "memory" / "bench_memory_peers.json"  # experiments/bench_memory_peers.py
#: Written by hand after a run: where the claims are missed, by how much, what was tried.
NOTES = "notes.md"
ORDER = ("dense", "comera", "sched_comera", "sched_paper", "comera_int8", "fixed", "tt_svd",
         "tt_svd_ft", "tltorch", "prune", "int8", "prune_int8")
TITLES = {"dense": "dense", "comera": "CoMERA (paced)", "sched_comera": "CoMERA, no pace",
          "sched_paper": "CoMERA, paper's schedule", "fixed": "fixed-rank TT",
          "tt_svd": "TT-SVD (no fine-tune)", "tt_svd_ft": "TT-SVD + fine-tune",
          "tltorch": "tltorch TT", "prune": "pruning + fine-tune", "int8": "int8 (dense)",
          "prune_int8": "pruning + int8", "comera_int8": "CoMERA + int8",
          "hash": "hashing trick", "qr": "quotient-remainder", "mixed_dim": "mixed dimension",
          "int8_table": "int8 tables", "dense_sparse": "dense (sparse Adam)"}
#: The embedding task's methods (experiments/reproduce.py, task criteo), TT first.
EMBEDDING_ORDER = ("comera", "fixed", "hash", "qr", "mixed_dim", "int8_table", "dense_sparse")
TT_METHODS = ("comera", "fixed")
#: The training-memory cap of the embedding task's claims row.
MEMORY_CAP_MB = 4096.0
#: Where a claim is checked: (task, target, points within dense).
CLAIMS = (("digits", 10.0, 1.0), ("snli_small", 10.0, 1.0), ("digits", 30.0, 2.0),
          ("snli_small", 30.0, 2.0), ("snli_heldout", 10.0, 2.0))


def _ok(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def fmt_score(g: dict[str, Any] | None, pct: bool) -> str:
    if not g or not _ok(g.get("score")):
        return "—"
    k = 100.0 if pct else 1.0
    sd = g.get("score_std")  # None with one seed: no spread to state (never "± 0")
    mean = f"{g['score'] * k:.1f}" if pct else f"{g['score']:.3f}"
    if not _ok(sd):
        return mean
    return f"{mean} ± {sd * k:.1f}" if pct else f"{mean} ± {sd:.3f}"


def fmt_comp(g: dict[str, Any] | None, target: float | None) -> str:
    if not g or not _ok(g.get("compression")):
        return ""
    c = g["compression"]
    if target is None:
        return f"{c:.1f}×"
    err = (c - target) / target
    return f"{c:.1f}× ({err:+.0%})"


#: Judged in bytes (the whole model's weights as stored), not against a parameter target.
IN_BYTES = ("int8", "prune_int8")
#: Cells that only evaluate (no training): left out of the cost table.
NO_TRAINING = ("tt_svd", *IN_BYTES, "comera_int8")


def nbytes(g: dict[str, Any] | None) -> float | None:
    """The cell's weights in bytes as stored: recorded (``bytes``), else, for results
    written before bytes were recorded, 4 a parameter (those methods store float32)."""
    if not g:
        return None
    if _ok(g.get("bytes")):
        return float(g["bytes"])
    return 4.0 * g["params"] if _ok(g.get("params")) else None


def fmt_bytes(g: dict[str, Any] | None) -> str:
    b = nbytes(g)
    return "" if b is None else f"<br>{b / 1024:,.1f} KiB"


def best_by_bytes(res: dict[str, Any]) -> list[str]:
    """Per size budget (each method's cell sizes, in bytes), the most accurate method
    whose model fits it: the reading a user choosing a method needs."""
    metric = next((r["metric"] for r in res["methods"].values() if r.get("metric")), "score")
    higher = next((r.get("higher_is_better", True) for r in res["methods"].values()
                   if r.get("metric")), True)
    pct = metric in ("eval/acc", "eval/auc")
    cells = [(m, g) for m in ORDER if m in res["methods"] and m != "tt_svd"
             for g in res["methods"][m]["groups"]
             if nbytes(g) is not None and _ok(g.get("score"))]
    if not cells:
        return []
    lines = [f"| budget (bytes) | best {metric} | method (target) | runner-up |",
             "|---|---|---|---|"]
    previous = None
    for budget in sorted({nbytes(g) for _, g in cells}):
        fit = sorted(((m, g) for m, g in cells if nbytes(g) <= budget * 1.0001),
                     key=lambda mg: mg[1]["score"], reverse=higher)
        if fit[0][1] is previous:
            continue  # the same winner as at the smaller budget
        previous = fit[0][1]
        def name(mg: tuple[str, dict[str, Any]]) -> str:
            m, g = mg
            return TITLES[m] + (f" ({g['target']:g}×)" if g.get("target") else "")
        second = (f"{name(fit[1])}: {fmt_score(fit[1][1], pct)}" if len(fit) > 1 else "—")
        lines.append(f"| ≤ {budget / 1024:,.1f} KiB | {fmt_score(fit[0][1], pct)} | "
                     f"{name(fit[0])} | {second} |")
    return ["Best method at each size (every cell's bytes as a budget, a row where the "
            "winner changes; a method wins a budget when its mean is highest among the "
            "cells that fit it; where the runner-up is within the seeds' std it is a tie). "
            "Bytes are the weights as stored: float32 methods 4 a parameter; int8 one a "
            "weight plus scales (torchao's, or the int8 export's for CoMERA + int8):",
            "", *lines]


def group(res: dict[str, Any], method: str, target: float | None) -> dict[str, Any] | None:
    for g in res["methods"].get(method, {}).get("groups", []):
        if (g["target"] is None and target is None) or (
                g["target"] is not None and target is not None and abs(g["target"] - target)
                < 1e-9):
            return g
    return None


def task_table(res: dict[str, Any]) -> list[str]:
    """Rows: targets; columns: methods (score mean ± std, compression reached)."""
    methods = [m for m in ORDER if m in res["methods"]]
    metric = next((r["metric"] for r in res["methods"].values() if r.get("metric")), "score")
    pct = metric in ("eval/acc", "eval/auc")
    head = ["target", *(TITLES[m] for m in methods if m != "dense")]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    dense = group(res, "dense", None)
    for t in res["targets"]:
        cells = [f"{t:g}×"]
        for m in methods:
            if m == "dense":
                continue
            g = group(res, m, t)
            comp = (fmt_comp(g, None) + " in bytes") if m in IN_BYTES else fmt_comp(g, t)
            cells.append(f"{fmt_score(g, pct)}<br>{comp}{fmt_bytes(g)}" if g else "—")
        lines.append(f"| {' | '.join(cells)} |")
    int8 = group(res, "int8", None)
    if int8:
        lines.append(f"| (none) | int8 (dense): {fmt_score(int8, pct)}{fmt_bytes(int8)} |"
                     + " |" * (len(head) - 2))
    unit = " (%)" if pct else ""
    note = (f"Dense: **{fmt_score(dense, pct)}**{unit} {metric}. " if dense else "") + \
        f"Each cell: {metric}{unit} mean ± std over {res['seeds']} seed(s), then the " \
        "compression reached (and its error against the target), then the model's " \
        "weights in bytes as stored (int8: values, scales and zero points)."
    return [note, "", *lines]


def _cost(g: dict[str, Any] | None) -> str:
    if not g:
        return "—"
    parts = []
    if _ok(g.get("params")):
        parts.append(f"{g['params'] / 1e3:,.1f}k params")
    if _ok(g.get("step_time_s")):
        parts.append(f"{g['step_time_s'] * 1e3:.1f} ms/step")
    if _ok(g.get("peak_mem_mb")):
        parts.append(f"{g['peak_mem_mb']:.0f} MiB")
    return "<br>".join(parts) or "—"


def cost_table(res: dict[str, Any]) -> list[str]:
    """The cost of each cell: parameters, wall time per training step and the run's peak
    memory (the process's on a CPU, the allocator's on a GPU), mean over seeds."""
    methods = [m for m in ORDER if m in res["methods"]
               and m not in ("dense", *NO_TRAINING)]
    head = ["target", *(TITLES[m] for m in methods)]
    lines = [f"| {' | '.join(head)} |", "|" + "---|" * len(head)]
    for t in res["targets"]:
        lines.append(f"| {t:g}× | " + " | ".join(_cost(group(res, m, t)) for m in methods)
                     + " |")
    dense = group(res, "dense", None)
    # files before the sweep report kept each run's median step time hold its last
    # logged step's (one sample, several times the typical step when it pruned)
    sampled = [TITLES[m] for m in ("dense", *methods)
               if m in res["methods"] and res["methods"][m].get("step_time") != "median"]
    every = [m for m in ("dense", *methods) if m in res["methods"]]
    if not sampled:
        timing = "ms/step: each run's median step"
    elif len(sampled) == len(every):
        timing = ("ms/step: each run's last logged step, one sample, not its median (the "
                  "runs predate the median)")
    else:
        timing = ("ms/step: each run's median step; for " + ", ".join(sampled)
                  + " its last logged step, one sample")
    return [f"Cost per cell (mean over seeds; {timing}; dense: "
            f"{_cost(dense).replace('<br>', ', ')}; TT-SVD without a fine-tune and the int8 "
            "cells only evaluate). The cells train several at a time on the machine's "
            "cores, so a step time carries the load of whatever ran beside it: it says "
            "where a cell's cost lies, not a speed ratio (those are measured side by side "
            "in docs/BENCHMARKS.md):", "", *lines]


def claims(results: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's targets, checked against the numbers, whatever they come out as."""
    out = ["| claim | measured | met |", "|---|---|---|"]
    for task, target, pts in CLAIMS:
        res = results.get(task)
        if res is None:
            out.append(f"| CoMERA within {pts:g} point(s) of dense at {target:g}× on {task} | "
                       "not run | — |")
            continue
        d, c = group(res, "dense", None), group(res, "comera", target)
        if not (d and c and _ok(d.get("score")) and _ok(c.get("score"))):
            out.append(f"| CoMERA within {pts:g} point(s) of dense at {target:g}× on {task} | "
                       "missing cells | — |")
            continue
        gap = (d["score"] - c["score"]) * 100.0
        # a dense model well below CoMERA did not train at these steps: no fair check
        met = "yes" if -pts <= gap <= pts else (
            "**no**" if gap > pts else "not a fair check: dense undertrained")
        out.append(f"| CoMERA within {pts:g} point(s) of dense at {target:g}× on {task} | "
                   f"gap {gap:.1f} points | {met} |")
    worst = 0.0
    n = 0
    for res in results.values():
        for m in ("comera",):
            for g in res["methods"].get(m, {}).get("groups", []):
                if g["target"] and _ok(g.get("compression")):
                    worst = max(worst, abs(g["compression"] - g["target"]) / g["target"])
                    n += 1
    if n:
        out.append(f"| compression within ±10 % of the target in every CoMERA cell | worst "
                   f"{worst:.1%} over {n} grid points | {'yes' if worst <= 0.10 else '**no**'} |")
    beaten = []
    for task, res in results.items():
        for t in res["targets"]:
            if t < 10:
                continue
            c = group(res, "comera", t)
            for peer in ("fixed", "tt_svd", "tt_svd_ft"):
                p = group(res, peer, t)
                if c and p and _ok(c.get("score")) and _ok(p.get("score")):
                    higher = res["methods"]["comera"].get("higher_is_better", True)
                    lead = (p["score"] - c["score"]) * (1 if higher else -1)
                    # a lead within the seeds' spread is a tie, not a loss
                    if lead > max(c.get("score_std") or 0.0, p.get("score_std") or 0.0):
                        beaten.append(f"{task} {t:g}× by {TITLES[peer]} "
                                      f"({abs(c['score'] - p['score']) * 100:.1f})")
    if MEMORY.exists():
        rows = json.loads(MEMORY.read_text()).get("rows", [])
        one = {(r["preset"], r["method"]): r for r in rows if r["batch"] == 1}
        presets = sorted({p for p, _ in one}, key=lambda p: -one.get(
            (p, "dense+galore"), {"params": 0})["params"])
        if presets and (presets[0], "dense+galore") in one and (presets[0], "comera-tt") in one:
            g, c = one[presets[0], "dense+galore"], one[presets[0], "comera-tt"]
            ratio = g["held_mib"] / c["held_mib"]
            out.append(f"| Training memory at batch 1 at least 5× below GaLore (transformer "
                       f"{presets[0]}) | {ratio:.2f}× ({g['held_mib']:.1f} vs "
                       f"{c['held_mib']:.1f} MiB held) | {'yes' if ratio >= 5 else '**no**'} |")
    wins = []
    for task, res in results.items():
        higher = (res["methods"].get("comera") or {}).get("higher_is_better", True)
        for c in (res["methods"].get("comera") or {}).get("groups", []):
            if nbytes(c) is None or not _ok(c.get("score")):
                continue
            for peer in ("prune", "int8", "prune_int8"):
                for p in (res["methods"].get(peer) or {}).get("groups", []):
                    if nbytes(p) is None or nbytes(p) > nbytes(c) or not _ok(p.get("score")):
                        continue
                    lead = (p["score"] - c["score"]) * (1 if higher else -1)
                    if lead > max(c.get("score_std") or 0.0, p.get("score_std") or 0.0):
                        wins.append(f"{task} {c['target']:g}× by {TITLES[peer]}"
                                    + (f" {p['target']:g}×" if p.get("target") else "")
                                    + f" (+{lead * 100:.1f}, {nbytes(p) / 1024:.0f} vs "
                                    f"{nbytes(c) / 1024:.0f} KiB)")
                        break
    if any("prune" in r["methods"] for r in results.values()):
        out.append("| CoMERA at least as good as pruning and int8 with as few bytes (a lead "
                   "within the larger seed std is a tie; per CoMERA cell, each peer's "
                   "winning cell of the lowest target) | "
                   + ("; ".join(wins) if wins else "no exception") + " | "
                   + ("**no**" if wins else "yes") + " |")
    out.append("| CoMERA at least as good as fixed-rank TT and TT-SVD at every target ≥ 10× "
               "(a peer ahead by less than the larger seed std counts as a tie) | "
               + ("; ".join(beaten) if beaten else "no exception") + " | "
               + ("**no**" if beaten else "yes") + " |")
    return [*out, *embedding_claims(results)]


def figure(res: dict[str, Any], path: Path) -> bool:
    """Accuracy (or the task's score) against the model's bytes (weights as stored), one
    line per method, error bars over seeds; the dense model as a dashed line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: figures skipped (pip install matplotlib)", file=sys.stderr)
        return False
    metric = next((r["metric"] for r in res["methods"].values() if r.get("metric")), "score")
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for m in ORDER:
        if m == "dense" or m not in res["methods"]:
            continue
        gs = [g for g in res["methods"][m]["groups"]
              if _ok(g.get("score")) and nbytes(g) is not None]
        if not gs or m == "tt_svd":
            continue
        gs.sort(key=lambda g: nbytes(g))
        ax.errorbar([nbytes(g) / 1024 for g in gs], [g["score"] for g in gs],
                    yerr=[g.get("score_std") or 0 for g in gs],
                    xerr=[(g.get("bytes_std") or 0) / 1024 for g in gs], marker="o",
                    capsize=3, label=TITLES[m])
    dense = group(res, "dense", None)
    if dense and _ok(dense.get("score")):
        ax.axhline(dense["score"], color="black", linestyle="--", linewidth=1,
                   label="dense")
    ax.set_xscale("log")
    ax.set_xlabel("model weights as stored (KiB, log)")
    ax.set_ylabel(metric)
    ax.set_title(res["title"])
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def memory_table(path: Path) -> list[str]:
    """Training memory of dense+AdamW, dense+GaLore and the TT models (the JSON of
    ``experiments/bench_memory_peers.py``), with GaLore / method ratios."""
    if not path.exists():
        return [f"Not measured yet (`python experiments/bench_memory_peers.py` writes "
                f"`{path.relative_to(ROOT)}`)."]
    data = json.loads(path.read_text())
    rows = data.get("rows", [])
    if not rows:
        return ["No rows in the memory benchmark's JSON."]
    galore = {(r["preset"], r["batch"]): r for r in rows if r["method"] == "dense+galore"}
    lines = ["| preset | batch | method | params | held MiB | optimizer MiB | RSS +train MiB "
             "| GaLore ÷ this (held) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = galore.get((r["preset"], r["batch"]))
        ratio = f"{g['held_mib'] / r['held_mib']:.2f}×" if g and r["held_mib"] else "—"
        lines.append(f"| {r['preset']} | {r['batch']} | {r['method']} | {r['params']:,} | "
                     f"{r['held_mib']:.1f} | {r['optim_mib']:.1f} | {r['rss_train_mib']:.1f} | "
                     f"{ratio} |")
    mach = data.get("machine", {})
    return [f"`python experiments/bench_memory_peers.py` on "
            f"{mach.get('cpu_model', mach.get('processor', '?'))}: held = parameters + "
            "gradients + optimizer state (GaLore's projectors included) + tensors saved for "
            "backward; RSS +train = the process's peak over three steps minus its size "
            "before them. CoMERA's model is measured at the ranks it starts from (tiny, "
            "small: 3× the size of the config's 10× target; paper: the paper's ranks 30 "
            "and 32 at d 768, sequence 128, 30522 words); fixed-tt at the size CoMERA "
            "ends at (tiny, small: 10× of the TT layers; paper: 80× of the whole model, "
            "the paper's 256 MB → 3.2 MB).", "", *lines]


def _probe(res: dict[str, Any], method: str, target: float | None) -> dict[str, Any]:
    """The memory / step-time probe of one (method, target) of the embedding task."""
    key = "none" if target is None else f"{target:g}"
    return (res.get("probe") or {}).get(method, {}).get(key) or {}


def _emb_groups(res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(m, g) for m in EMBEDDING_ORDER for g in res["methods"].get(m, {}).get("groups", [])
            if _ok(g.get("score"))]


def _mem_text(pr: dict[str, Any]) -> str:
    if _ok(pr.get("peak_train_mb")):
        return f"{pr['peak_train_mb']:,.0f} MiB"
    if pr.get("skipped"):
        return f"not run: {pr['skipped']}"
    return "—"


def _label(m: str, g: dict[str, Any]) -> str:
    return TITLES[m] + (f" {g['target']:g}×" if g.get("target") else "")


def _seed_scores(res: dict[str, Any], m: str, g: dict[str, Any]) -> dict[Any, float]:
    """``{seed: score}`` of the finished cells of method ``m`` in group ``g``."""
    return {c["seed"]: c["score"] for c in res["methods"].get(m, {}).get("cells", [])
            if c["status"] == "finished" and _ok(c.get("score"))
            and c.get("target") == g.get("target")}


def paired(res: dict[str, Any], a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]
           ) -> tuple[float, float, int] | None:
    """Mean and std of the per-seed differences ``a - b`` over the seeds both finished
    (the seeds share data, initial MLP weights and batch order across methods, so their
    spread cancels)."""
    sa, sb = _seed_scores(res, *a), _seed_scores(res, *b)
    d = [sa[k] - sb[k] for k in sa if k in sb]
    if len(d) < 2:
        return None
    mean = sum(d) / len(d)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)), len(d)


def _lead(res: dict[str, Any], a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]
          ) -> str:
    """``+x.xxxx AUC (std a / b; paired +x.xxxx ± s over n seeds)``."""
    ga, gb = a[1], b[1]
    lead = f"+{(ga['score'] - gb['score']):.4f} AUC"
    sd = [g.get("score_std") for g in (ga, gb)]
    notes = ([f"std {' / '.join('—' if not _ok(v) else f'{v:.4f}' for v in sd)}"]
             if any(_ok(v) for v in sd) else [])  # one seed: no spread to state
    p = paired(res, a, b)
    if p:
        notes.append(f"paired {p[0]:+.4f} ± {p[1]:.4f} over {p[2]} seeds")
    return f"{lead} ({'; '.join(notes)})" if notes else lead


def _tie(res: dict[str, Any], a: tuple[str, dict[str, Any]], b: tuple[str, dict[str, Any]]
         ) -> bool:
    """Whether ``a``'s lead over ``b`` is within the noise: the paired differences' std
    where there are paired seeds, else the larger seed std."""
    p = paired(res, a, b)
    if p is not None:
        return abs(p[0]) <= p[1]
    return a[1]["score"] - b[1]["score"] <= max(a[1].get("score_std") or 0,
                                                 b[1].get("score_std") or 0)


def budget_winners(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Per target, the byte budget (the hashing trick's model at that target: it fills
    its tables' budget exactly; 1 % slack) and the cells that fit it, best AUC first."""
    out = []
    cells = _emb_groups(res)
    for t in res["targets"]:
        ref = group(res, "hash", t) or group(res, "fixed", t)
        if not ref or nbytes(ref) is None:
            continue
        budget = nbytes(ref) * 1.01
        fit = sorted(((m, g) for m, g in cells if nbytes(g) is not None
                      and nbytes(g) <= budget), key=lambda mg: -mg[1]["score"])
        over = [_label(m, g) for m, g in cells if g.get("target") == t
                and nbytes(g) is not None and nbytes(g) > budget]
        out.append({"target": t, "budget": budget, "fit": fit, "over": over})
    return out


def cap_winner(res: dict[str, Any], cap_mb: float = MEMORY_CAP_MB
               ) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The cells whose measured peak training memory is within ``cap_mb`` (best AUC
    first) and the methods / targets that need more (measured, or predicted where the
    probe was not run)."""
    fit, over = [], []
    for m, g in _emb_groups(res):
        pr = _probe(res, m, g.get("target"))
        mem = pr.get("peak_train_mb")
        if _ok(mem) and mem <= cap_mb:
            fit.append((m, g))
        elif _ok(mem) or pr.get("skipped"):
            over.append(f"{_label(m, g)} ({_mem_text(pr)})")
    for m in EMBEDDING_ORDER:  # probed but never trained (the dense tables, too big)
        for key, pr in (res.get("probe") or {}).get(m, {}).items():
            if pr.get("skipped") and not res["methods"].get(m, {}).get("groups"):
                over.append(f"{TITLES[m]} {key}: {_mem_text(pr)}")
    return sorted(fit, key=lambda mg: -mg[1]["score"]), over


def embedding_claims(results: dict[str, dict[str, Any]]) -> list[str]:
    """Claims rows of the embedding task: is TT (CoMERA or fixed ranks) the best AUC at
    each byte budget and under the training-memory cap, by how much, with the seeds'
    spread."""
    out = []
    for res in results.values():
        if not res.get("peer_config"):
            continue
        for row in budget_winners(res):
            fit = row["fit"]
            if not fit:
                continue
            (m, g), rest = fit[0], fit[1:]
            best_other = next(((m2, g2) for m2, g2 in rest if (m in TT_METHODS)
                               != (m2 in TT_METHODS)), None)
            tie = best_other is not None and _tie(res, (m, g), best_other)
            met = ("yes" if m in TT_METHODS else "**no**") + (" (within the noise: a tie)"
                                                               if tie else "")
            vs = (f"; vs {_label(*best_other)}: {_lead(res, (m, g), best_other)}"
                  if best_other else "")
            out.append(f"| TT the best AUC at ≤ {row['budget'] / 2**20:,.2f} MiB of weights "
                       f"({row['target']:g}× tables), {res['task']} | {_label(m, g)} "
                       f"{g['score']:.4f}{vs} | {met} |")
        fit, _ = cap_winner(res)
        if fit:
            (m, g) = fit[0]
            other = next(((m2, g2) for m2, g2 in fit[1:] if (m in TT_METHODS)
                          != (m2 in TT_METHODS)), None)
            vs = f"; vs {_label(*other)}: {_lead(res, (m, g), other)}" if other else ""
            tie = other is not None and _tie(res, (m, g), other)
            out.append(f"| TT the best AUC under a {MEMORY_CAP_MB / 1024:g} GiB training-memory "
                       f"cap, {res['task']} | {_label(m, g)} {g['score']:.4f}{vs} | "
                       + ("yes" if m in TT_METHODS else "**no**")
                       + (" (within the noise: a tie)" if tie else "") + " |")
    return out


def embedding_section(res: dict[str, Any], figs: Path, name: str, suffix: str) -> list[str]:
    """The embedding task: per method and target AUC, log-loss, bytes, step time and
    measured training memory; the best method at each byte budget and under the memory
    cap; the figure."""
    facts = (res.get("data") or {})
    extra, params = facts.get("extra") or {}, facts.get("params") or {}
    n = facts.get("num_examples") or {}
    lines = []
    if extra:
        lines += [f"Data: {n.get('train', 0):,} training and {n.get('eval', 0):,} eval "
                  f"examples (the eval split drawn with its own seed, "
                  f"{params.get('eval_seed')}), {sum(params.get('cardinalities') or []):,} "
                  f"table rows, ids power law (exponent {params.get('zipf_exponent')}). "
                  f"The generator's **Bayes AUC {extra.get('bayes_auc_eval', 0):.4f}**, "
                  f"Bayes log-loss {extra.get('bayes_log_loss_eval', 0):.4f} on the eval "
                  "split (the true click probabilities': no model does better in "
                  "expectation).", ""]
    lines += ["| method | target | AUC | log-loss | weights as stored | ms/step (run) | "
              "peak training memory (probe) | ms/step (probe) |",
              "|---|---|---|---|---|---|---|---|"]
    for m in EMBEDDING_ORDER:
        groups = res["methods"].get(m, {}).get("groups", [])
        probed = (res.get("probe") or {}).get(m, {})
        if not groups and probed:  # measured, never trained
            for key, pr in probed.items():
                lines.append(f"| {TITLES[m]} | {key} | not trained | | "
                             f"{(pr.get('predicted_bytes') or 0) / 3 / 2**20:,.0f} MiB "
                             f"(tables) | | {_mem_text(pr)} | |")
        for g in groups:
            pr = _probe(res, m, g.get("target"))
            ll = ("—" if not _ok(g.get("log_loss")) else f"{g['log_loss']:.4f}" + (
                f" ± {g['log_loss_std']:.4f}" if _ok(g.get("log_loss_std")) else ""))
            step = f"{g['step_time_s'] * 1e3:.0f}" if _ok(g.get("step_time_s")) else "—"
            pstep = f"{pr['step_s'] * 1e3:.1f}" if _ok(pr.get("step_s")) else "—"
            b = nbytes(g)
            lines.append(f"| {TITLES[m]} | {g['target']:g}× | " if g.get("target") else
                         f"| {TITLES[m]} | — | ")
            lines[-1] += (f"{fmt_score(g, False) if _ok(g.get('score')) else '—'} "
                          f"({g['finished']}/{g['cells']}) | {ll} | "
                          f"{'—' if b is None else f'{b / 2**20:,.2f} MiB'} | {step} | "
                          f"{_mem_text(pr)} | {pstep} |")
    for m, why in (res.get("not_trained") or {}).items():
        lines.append(f"| {TITLES.get(m, m)} | | {why} | | | | {_mem_text(_probe(res, m, None))} "
                     "| |")
    lines += ["", "AUC and log-loss: mean ± std over the seeds (finished / cells). Weights "
              "as stored: the whole model's (tables, MLPs; int8 codes and scales; the "
              "mixed-dimension id map), as the run recorded them. ms/step (run): each "
              "run's median step while other cells trained beside it. The probe: each "
              "(method, target) alone in a fresh process, one thread, "
              "20 AdamW steps at the run's batch size: peak training memory is the peak "
              "RSS over the RSS before the model was built (model, optimizer state, "
              "activations), ms/step the median of its last 10 steps.", ""]
    png = figs / f"reproduce_{name}{suffix}.png"
    if embedding_figure(res, png):
        lines += [f"![{res['title']}](figures/{png.name})", ""]
    lines += ["Best method at each byte budget (the budget: the hashing trick's model at "
              "the target, which fills it exactly, + 1 %; a cell of a higher target fits a "
              "lower target's budget). The margin: the means' difference with each "
              "method's seed std, and the mean ± std of the per-seed differences (the "
              "seeds share data, initial MLP weights and batch order across methods); a "
              "lead within that std is a tie:", "",
              "| budget | best | AUC | runner-up | margin | over the budget |",
              "|---|---|---|---|---|---|"]
    for row in budget_winners(res):
        if row["fit"]:
            lines.append(_winner_row(res, f"≤ {row['budget'] / 2**20:,.2f} MiB "
                                     f"({row['target']:g}×)", row["fit"], ", ".join(row["over"])))
    fit, over = cap_winner(res)
    if fit:
        lines.append(_winner_row(res, f"training memory ≤ {MEMORY_CAP_MB / 1024:g} GiB", fit,
                                 "; ".join(over)))
    return lines


def _winner_row(res: dict[str, Any], budget: str, fit: list[tuple[str, dict[str, Any]]],
                over: str) -> str:
    """``| budget | best | AUC | runner-up | margin | over |`` of cells best first."""
    (m, g), second = fit[0], (fit[1] if len(fit) > 1 else None)
    runner = (f"{_label(*second)} {fmt_score(second[1], False)} | "
              f"{_lead(res, (m, g), second)}" if second else "— | —")
    return f"| {budget} | {_label(m, g)} | {fmt_score(g, False)} | {runner} | {over or '—'} |"


def embedding_figure(res: dict[str, Any], path: Path) -> bool:
    """AUC and log-loss against the weights as stored, and the probe's training memory
    and step time against them: one line per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=110)
    panels = (("score", "eval AUC"), ("log_loss", "eval log-loss"),
              ("peak_train_mb", "peak training memory (MiB, probe)"),
              ("step_s", "step time (s, probe)"))
    for ax, (key, label) in zip(axes.flat, panels):
        for m in EMBEDDING_ORDER:
            gs = [g for g in res["methods"].get(m, {}).get("groups", [])
                  if nbytes(g) is not None]
            pts = []
            for g in sorted(gs, key=nbytes):
                v = g.get(key) if key in ("score", "log_loss") else _probe(
                    res, m, g.get("target")).get(key)
                if _ok(v):
                    pts.append((nbytes(g) / 2**20, v, g.get(f"{key}_std") or 0))
            if pts:
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                            yerr=[p[2] for p in pts], marker="o", capsize=3, label=TITLES[m])
        if key == "peak_train_mb":
            ax.axhline(MEMORY_CAP_MB, color="black", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("model weights as stored (MiB, log)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(res["title"], fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def machine_line(res: dict[str, Any]) -> str:
    """``<CPU>, <n> cores, torch <version>[, <GPU>]`` of one task's results file."""
    m = res.get("machine", {})
    return (f"{m.get('cpu_model', m.get('processor', '?'))}, {m.get('cpu_count', '?')} "
            f"cores, torch {m.get('torch', '?')}" + (f", {m['gpu']}" if m.get("gpu") else ""))


def added_line(res: dict[str, Any]) -> str:
    """Where methods added to a task's file later ran, when elsewhere than the file's
    machine (their costs then compare across machines)."""
    home = machine_line(res)
    parts = [f"{', '.join(TITLES.get(m, m) for m in a['methods'])} on {machine_line(a)}"
             for a in res.get("added", []) if machine_line(a) != home]
    return f" ({'; '.join(parts)}: added later)" if parts else ""


#: The dataset tasks README's "Datasets" section quotes (:func:`readme_datasets`), with the
#: words it names each by
README_TASKS = (("movielens", "`movielens`"), ("adult", "`adult`"), ("reviews", "`reviews`"))


def readme_datasets(results_dir: Path = RESULTS) -> str:
    """What the reproduction measured on the tabular and review datasets, in one sentence
    (README's "Datasets" section quotes it; tests/test_reproduce.py checks): per task
    CoMERA at the smallest target of its grid against dense, mean ± std over seeds of the
    held-out score, with the compression reached and the steps."""
    parts = []
    for task, word in README_TASKS:
        path = results_dir / f"{task}.json"
        if not path.exists():
            continue
        res = json.loads(path.read_text())
        metric = res["methods"]["comera"].get("metric", "eval/acc").split("/")[-1]
        dense = group(res, "dense", None)
        target = min(g["target"] for g in res["methods"]["comera"]["groups"])
        tt = group(res, "comera", target)
        steps = next((o.split("=")[1] for o in res["overrides"] if o.startswith("train.steps=")),
                     None)
        parts.append(f"{word} {metric.upper() if metric == 'auc' else metric} "
                     f"{fmt_score(tt, False)} at {tt['compression']:.1f}× (asked "
                     f"{target:g}×) vs {fmt_score(dense, False)} dense"
                     + (f" ({steps} steps)" if steps else ""))
    return ("The reproduction (`experiments/results/reproduce/`, docs/RESULTS.md; "
            "held-out split, mean ± std over seeds, the config's steps unless said): "
            + "; ".join(parts) + ".")


def build(results_dir: Path, out: Path, suffix: str = "") -> str:
    results = {}
    for p in sorted(results_dir.glob(f"*{suffix}.json")):
        stem = p.stem[: -len(suffix)] if suffix else p.stem
        if not suffix and "_" in stem and stem.rsplit("_", 1)[1] in ("quick", "paper"):
            continue
        results[stem] = json.loads(p.read_text())
        probes = results_dir / "probes" / p.name  # reproduce.py --probes-only
        if results[stem].get("peer_config") and probes.exists() and (
                "probe" not in results[stem] or probes.stat().st_mtime > p.stat().st_mtime):
            results[stem]["probe"] = json.loads(probes.read_text())["probe"]  # the later
    figs = out.parent / "figures"
    src = results_dir.relative_to(ROOT) if results_dir.is_relative_to(ROOT) else results_dir
    lines = ["# Results: CoMERA side by side with the peers", "",
             f"Generated by `python experiments/reproduce_report.py` from `{src}`"
             " (written by `python experiments/reproduce.py`, `make reproduce`). Every "
             "cell is an ordinary run in the run store: the dashboard's Sweeps and Compare "
             "pages show the same numbers. Methods: `docs/METHODS.md`.", ""]
    if not results:
        lines.append("No results yet: run `make reproduce`.")
    else:
        any_res = next(iter(results.values()))
        machines: dict[str, list[str]] = {}  # each task ran where its file says
        for name, res in results.items():
            machines.setdefault(machine_line(res), []).append(name)
        where = ("Machine: " + next(iter(machines)) if len(machines) == 1 else
                 "Machines (each task's section names its own): " + "; ".join(
                     f"{m} ({', '.join(names)})" for m, names in machines.items()))
        lines += [where + f"; scale `{any_res['scale']}`"
                  + (" (quick)" if any_res.get("quick") else "") + ".", "",
                  f"The tasks took {sum(r['wall_s'] for r in results.values()) / 60:.0f} "
                  "min in all (one after the other).", "",
                  "## The claims, checked", "", *claims(results), ""]
        notes = results_dir / NOTES
        if notes.exists():
            lines += [notes.read_text(encoding="utf-8").rstrip(), ""]
    for name, res in results.items():
        lines += [f"## {res['title']}", "",
                  f"Config `experiments/configs/{res['config']}`"
                  + (f" with `{' '.join(res['overrides'])}`" if res["overrides"] else "")
                  + f"; {res['wall_s'] / 60:.1f} min for the whole task on "
                  f"{machine_line(res)}{added_line(res)}.", ""]
        if res.get("peer_config"):  # the embedding task: its own tables and figure
            lines += [*embedding_section(res, figs, name, suffix), ""]
            continue
        lines += task_table(res)
        png = figs / f"reproduce_{name}{suffix}.png"
        if figure(res, png):
            lines += ["", f"![{res['title']}](figures/{png.name})"]
        lines += ["", *cost_table(res), ""]
        best = best_by_bytes(res)
        if best:
            lines += [*best, ""]
    lines += ["## Peak training memory (GaLore vs CoMERA)", "", *memory_table(MEMORY), ""]
    text = "\n".join(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--out", type=Path, default=None,
                    help="default: docs/RESULTS.md (--quick: beside the results)")
    ap.add_argument("--quick", action="store_true", help="report the --quick results")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = args.results / "RESULTS_quick.md" if args.quick else DOC
    build(args.results, args.out, "_quick" if args.quick else "")
    print(f"wrote {args.out}", file=sys.stderr)
    if not args.quick:  # README quotes it
        print(readme_datasets(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
