"""Number, size, time and status formatting for the dashboard."""

from __future__ import annotations

import math
import os
import re
import time

from comera_engine.metrics import format_ratio

STATUS_ICON = {
    "queued": ":material/hourglass_top:",
    "running": ":material/play_circle:",
    "stopping": ":material/pending:",
    "finished": ":material/check_circle:",
    "stopped": ":material/stop_circle:",
    "failed": ":material/error:",
    "diverged": ":material/warning:",
    "crashed": ":material/dangerous:",
}
STATUS_COLOR = {
    "queued": "gray",
    "running": "blue",
    "stopping": "orange",
    "finished": "green",
    "stopped": "violet",
    "failed": "red",
    "diverged": "red",
    "crashed": "red",
}


def is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def count(n: float | None) -> str:
    """``1234567 -> "1.23M"``; ``None``/NaN -> ``"–"``."""
    if not is_num(n):
        return "–"
    a = abs(float(n))
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if a >= div:
            return f"{n / div:.3g}{suf}"
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.3g}"


def nbytes(b: float | None) -> str:
    if not is_num(b):
        return "–"
    b = float(b)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(b) < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.3g} {unit}"
        b /= 1024
    return f"{b:.3g} TiB"  # pragma: no cover


def mib(mb: float | None) -> str:
    return nbytes(mb * 2**20) if is_num(mb) else "–"


def ratio(x: float | None) -> str:
    """``60.6×`` (the engine's one format for a compression: ``format_ratio``)."""
    return format_ratio(x)


def pct(x: float | None) -> str:
    return f"{100 * x:.1f}%" if is_num(x) else "–"


#: The most characters a number takes on a metric tile before the tile wraps it
TILE_CHARS = 7


def num(x: float | None, digits: int = 4) -> str:
    """``x`` to ``digits`` significant digits, fewer (down to 2) where that is what keeps
    it within :data:`TILE_CHARS` (``0.0005601`` → ``0.00056``, ``1.234e-05`` →
    ``1.2e-05``); "–" for no number."""
    if not is_num(x):
        return "–"
    text = f"{x:.{digits}g}"
    while len(text) > TILE_CHARS and digits > 2:
        digits -= 1
        text = f"{x:.{digits}g}"
    return text


def duration(seconds: float | None) -> str:
    if not is_num(seconds) or seconds < 0:
        return "–"
    s = int(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


def ago(t: float | None) -> str:
    if not is_num(t):
        return "–"
    return duration(time.time() - float(t)) + " ago"


def clock(t: float | None) -> str:
    if not is_num(t):
        return "–"
    return time.strftime("%H:%M:%S", time.localtime(float(t)))


def when(t: float | None) -> str:
    if not is_num(t):
        return "–"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(float(t)))


#: What Streamlit's Markdown reads as markup: CommonMark's punctuation, and ``$`` (maths),
#: ``:`` (``:red[…]``, ``:material/…:``, emoji shortcodes) and ``~`` of its extensions.
_MARKUP = re.compile(r"([\\`*_{}\[\]()#+\-.!|<>$:~&=^\"'])")


#: An invisible word joiner after each ``:`` and ``@`` and between ``www`` and its ``.``
#: keeps Streamlit from reading ``:material/home:`` as an icon and ``http://…``,
#: ``www.…`` or ``a@b.c`` as a link (both are read from the text after the escapes are
#: undone).
_JOIN = re.compile(r"([:@])|(?i:(?<=www)(\\\.))")


#: an absolute POSIX path in running text: a ``/`` at the start or after a space, a quote,
#: a backtick, a bracket or ``=`` (not inside a URL, a ratio, a word or escaped Markdown)
_ABS_PATH = re.compile(r"(?<![^\s\"'`(\[=])/[^\s'\"`(),;<>|\\]+")


def server_paths_hidden(text: str, store_root: str | os.PathLike[str]) -> str:
    """``text`` with every absolute server path outside ``store_root`` (the run store's
    folder) shortened to its last part, the file's name: what the browser is shown of
    the server's files (an engine message naming a config's data file, a model card's
    provenance). Paths inside the run store are kept."""
    root = os.path.realpath(store_root)

    def short(m: re.Match[str]) -> str:
        path = m.group(0).rstrip(".")
        tail = m.group(0)[len(path):]
        real = os.path.realpath(path)
        if real == root or real.startswith(root + os.sep):
            return m.group(0)
        return (os.path.basename(path.rstrip("/")) or path) + tail

    return _ABS_PATH.sub(short, str(text))


def a_or_an(n: int) -> str:
    """The article a count under a thousand takes read aloud: "an" for 8, 11, 18, 80-89
    and 800-899; else "a"."""
    digits = str(abs(int(n)))
    return "an" if digits.startswith("8") or digits in ("11", "18") else "a"


def literal(text: object) -> str:
    """``text`` (a name a user typed: a run's, an uploaded file's) for ``st.markdown`` to
    show as typed: every character Markdown could read as markup is escaped (a run named
    ``[x](http://…)`` was drawn as a link, ``**a**`` in bold, ``$x$`` as maths), and each
    ``:`` and ``@``, and the ``.`` of ``www.``, has an invisible word joiner beside it
    (``:material/home:`` was an icon, ``http://…`` and ``www.…`` links even with their
    ``:`` and ``.`` escaped)."""
    return _JOIN.sub(lambda m: f"{m[1]}\u2060" if m[1] else f"\u2060{m[2]}",
                     _MARKUP.sub(r"\\\1", str(text)))


def status_badge(status: str) -> str:
    """Markdown badge for a run status."""
    color = STATUS_COLOR.get(status, "gray")
    icon = STATUS_ICON.get(status, "")
    return f":{color}-badge[{icon} {status}]"


#: The memory figures the pages show, by kind: ``(label, what it measures)``. Each is
#: one quantity with one label wherever it is shown (a tile, a column, a chart's line or
#: axis); what it measures is the help beside it.
MEMORY: dict[str, tuple[str, str]] = {
    "gpu_peak": (
        "Peak GPU memory (allocated)",
        "The most the run's tensors held on the GPU at once (torch.cuda."
        "max_memory_allocated): weights, gradients, optimizer state and saved activations. "
        "The CUDA caching allocator reserves more, and the device holds more still."),
    "gpu_reserved": (
        "Peak GPU memory (reserved)",
        "The most the CUDA caching allocator held on the GPU at once (torch.cuda."
        "max_memory_reserved): the allocated peak and the cache around it."),
    "gpu_used": (
        "GPU memory used (device)",
        "Memory in use on the whole GPU as the trainer last read it (NVML, else the CUDA "
        "runtime): this run's tensors and cache, the CUDA context, and any other process "
        "on the device."),
    "rss": (
        "Process memory (RSS)",
        "The trainer process's resident memory as it last read it: Python, PyTorch, the data "
        "and the model together. On a CPU most of it is the interpreter and the "
        "libraries, much the same for every method."),
    "model_state": (
        "Model + optimizer memory (estimate)",
        "The most parameters the run allocated × 16 bytes (fp32 weight and gradient, "
        "AdamW's two moments): the memory the method changes on a CPU run, without the "
        "activations and the process around it."),
    "estimate": (
        "Estimated training memory",
        "Before the run, from its config: weights, gradients, AdamW moments and saved "
        "activations at this batch (a rough estimate). The process adds a few hundred MiB "
        "of RSS, the same for every method."),
}


def memory_label(kind: str) -> str:
    """The label of a memory figure of this kind (:data:`MEMORY`)."""
    return MEMORY[kind][0]


def memory_help(kind: str) -> str:
    """What a memory figure of this kind measures (:data:`MEMORY`)."""
    return MEMORY[kind][1]


#: How the pages name the metrics a run logs (``metric_label``).
METRIC_LABELS = {
    "loss/task": "Task loss", "loss/total": "Total loss (objective)",
    "acc/train": "Train accuracy", "eval/acc": "Eval accuracy", "eval/loss": "Eval loss",
    "eval/auc": "Eval AUC", "eval/ppl": "Eval perplexity",
    "compression/tensorized": "Compression (TT layers)",
    "compression/model": "Compression (whole model)",
    "compression/target": "Target compression", "compression/error": "Error vs target",
    "compression/target_met": "Target met (1 = within 5 %)",
    "params/effective": "Parameters (effective)", "params/allocated": "Parameters (allocated)",
    "params/dense": "Parameters (dense model)",
    "params/tensorized_effective": "Parameters of the TT layers (effective)",
    "bytes/effective": "Model bytes (effective)", "bytes/dense": "Model bytes (dense)",
    "perf/samples_per_s": "Samples / s", "perf/tokens_per_s": "Tokens / s",
    "perf/step_time_s": "Step time (s)", "mem/rss_mb": f"{memory_label('rss')}, MiB",
    "mem/cuda_max_allocated_mb": f"{memory_label('gpu_peak')}, MiB",
    "mem/cuda_max_reserved_mb": f"{memory_label('gpu_reserved')}, MiB",
    "mem/gpu_used_mb": f"{memory_label('gpu_used')}, MiB",
    "mem/gpu_total_mb": "GPU memory of the device, MiB",
    "comera/lambda": "CoMERA λ (late stage: 1 = size step)",
    "comera/size": "CoMERA effective size S (parameters)",
    "comera/size_surrogate": "CoMERA size surrogate Ŝ (parameters)",
    "comera/gamma": "CoMERA γ (size weight)",
    "comera/z_f": "CoMERA z_f (plateau loss the late stage keeps)",
    "comera/target_size": "CoMERA target size (parameters)", "stage": "Stage (1 = late)",
    "ranks/removed_by_objective": "Rank entries removed by the objective's gates",
    "ranks/removed_by_pace": "Rank entries removed by the pace",
}


def metric_label(name: str) -> str:
    """``"comera/z_f"`` -> ``"CoMERA z_f (plateau loss the late stage keeps)"``; a metric
    without a label reads as its key, words spaced (``"perf/foo_bar"`` -> ``"perf · foo
    bar"``)."""
    return METRIC_LABELS.get(name) or name.replace("/", " · ").replace("_", " ")
