"""``comera launch | runs | logs | stop | resume`` subcommands.

``comera_engine.cli`` registers them with :func:`add_subparsers`; every subcommand sets
``func`` on the parsed namespace, and ``args.func(args)`` returns the exit code. Errors
(bad config, unknown run, foreign store, wrong status) print one line ``comera: error: ...`` on
stderr and return 2. ``python -m comera_engine.launch.cli`` runs them standalone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comera_engine.launch.liveness import reap
from comera_engine.launch.logs import logs
from comera_engine.launch.runs import (
    DEFAULT_STOP_TIMEOUT,
    housekeeping,
    launch,
    open_store,
    resume,
    stop,
)
from comera_engine.metrics import format_ratio, run_compression, run_target, target_status
from comera_engine.store import FINAL_STATUSES, RunStore, StoreError, resolve_store_path
from comera_engine.store.errors import StoreLocked, is_damaged
from comera_engine.store.runs import STATUSES

__all__ = ["add_override_option", "add_subparsers", "bounded_float", "bounded_int",
           "housekeeping_if_free", "main", "one_line", "quiet_on_closed_pipe"]


def _add_store(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        help="run store database file or folder (default: $COMERA_HOME/comera.db "
        "or ./runs/comera.db)",
    )


def add_override_option(p: argparse.ArgumentParser) -> None:
    """``--set SECTION.KEY=VALUE`` (repeatable) into ``args.overrides``, for every command
    that reads a run config (``comera train``, ``comera launch``)."""
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a config value (repeatable; the value is read as TOML), "
        "e.g. --set train.steps=500",
    )


def add_subparsers(subparsers: Any) -> None:
    """Register ``launch``, ``runs``, ``logs``, ``stop`` and ``resume`` on an argparse
    subparsers object."""
    p = subparsers.add_parser(
        "launch", help="start a training run in the background and print its id"
    )
    p.add_argument("config", help="TOML run config")
    add_override_option(p)
    p.add_argument("--name", default=None, help="run name (default: the config's name)")
    p.add_argument(
        "--gpus", default=None, help="CUDA_VISIBLE_DEVICES for this run, e.g. 0 or 0,1"
    )
    p.add_argument(
        "--nproc", type=bounded_int(1, 1024), default=1,
        help="processes (GPUs) through torchrun (default 1)"
    )
    p.add_argument(
        "--max-concurrent",
        type=bounded_int(0, 100_000),
        default=None,
        help="set the store's limit on runs at once (0: none); later runs wait queued",
    )
    p.add_argument("--json", action="store_true", help="print {run_id, run_dir, log} as JSON")
    _add_store(p)
    p.set_defaults(func=cmd_launch)

    p = subparsers.add_parser("runs", help="list runs with their status (and phase)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--status", action="append", default=None, choices=STATUSES,
                   help="only this status (repeatable)")
    p.add_argument("--name", default=None, help="only runs whose name contains this")
    p.add_argument("--limit", type=_positive_int, default=None,
                   help="at most this many (newest)")
    _add_store(p)
    p.set_defaults(func=cmd_runs)

    p = subparsers.add_parser("logs", help="print a run's log")
    p.add_argument("run", help="run id, unique id prefix or run name")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until it ends")
    p.add_argument("-n", "--tail", type=bounded_int(0, 1_000_000), default=None,
                   help="only the last N lines")
    _add_store(p)
    p.set_defaults(func=cmd_logs)

    p = subparsers.add_parser("stop", help="stop a run (or every cell of a sweep) gracefully "
                              "(checkpoint, then stop)")
    p.add_argument("run", help="run or sweep id, unique id prefix or name")
    p.add_argument(
        "--timeout",
        type=bounded_float(0.0, 7 * 86400.0),
        default=DEFAULT_STOP_TIMEOUT,
        help="seconds to wait for the checkpoint before SIGKILL "
        f"(default {DEFAULT_STOP_TIMEOUT:g})",
    )
    p.add_argument("--no-wait", action="store_true", help="return right after the request")
    _add_store(p)
    p.set_defaults(func=cmd_stop)

    p = subparsers.add_parser("resume", help="resume a stopped, crashed or failed run (or "
                              "those cells of a sweep)")
    p.add_argument("run", help="run or sweep id, unique id prefix or name")
    _add_store(p)
    p.set_defaults(func=cmd_resume)

    p = subparsers.add_parser("repair", help="check the run store (quick_check); a damaged "
                              "one is moved aside and rebuilt from the run folders")
    _add_store(p)
    p.set_defaults(func=cmd_repair)


def _fail(e: BaseException) -> int:
    print(f"comera: error: {one_line(e)}", file=sys.stderr)
    return 2


def _no_store_yet(args: argparse.Namespace, what: str) -> bool:
    """Say there are no ``what`` when the store file does not exist yet; returns whether
    it said so."""
    path = resolve_store_path(args.store)
    if path.exists():
        return False
    print("[]" if args.json else f"no {what} (no run store at {path}{_repair_hint(path)})")
    return True


def _repair_hint(path: Path, recorded: int = 0) -> str:
    """``; N run folder(s) in DIR: `comera repair` ...`` when the store's folder holds run
    folders that the store (with ``recorded`` runs) does not list; else ``""``."""
    from comera_engine.store.layout import run_folders

    n = len(run_folders(path.parent))
    if n <= recorded:
        return ""
    return (f"; {path.parent} holds {n} run folder(s): `comera repair` rebuilds the store "
            "from them")


def _said_without_a_table(items: list[Any], as_json: bool, none: str) -> bool:
    """Print ``items`` as JSON, or ``none`` when there are none; returns whether it did
    (else the caller prints its table)."""
    if as_json or not items:
        print(json.dumps(items, default=str, indent=1) if as_json else none)
        return True
    return False


def quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run ``command`` (a CLI command, returning its exit code) and flush its output; when
    the reader of stdout has gone (``comera runs | head -1``), end quietly with exit 0,
    as ``git log | head`` does: the rest of the output goes to /dev/null, no traceback
    (not even at the interpreter's exit, when it flushes stdout once more)."""
    try:
        try:
            return command()
        finally:  # argparse's --help and usage errors leave through SystemExit
            sys.stdout.flush()
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, sys.stdout.fileno())
        finally:
            os.close(null)
        return 0


def one_line(e: BaseException | str) -> str:
    """An error's message as one line of bounded length (a value it echoes is cut)."""
    from comera_engine.errors import MAX_PROBLEM_CHARS, shorten

    return shorten(" ".join(str(e).split("\n")), MAX_PROBLEM_CHARS + 200)


def _existing_store(path: str | None) -> RunStore:
    return RunStore(path, create=False)


def cmd_launch(args: argparse.Namespace) -> int:
    try:  # the config is validated before the store is opened (or created)
        rid = launch(
            args.config,
            args.overrides,
            store=args.store,
            name=args.name,
            gpus=args.gpus,
            nproc=args.nproc,
            max_concurrent=args.max_concurrent,
        )
    except ValueError as e:
        return _fail(e)
    st = open_store(args.store)
    _say_threads(st, rid)
    if args.json:
        info = {"run_id": rid, "run_dir": str(st.run_dir(rid)), "log": str(st.log_path(rid))}
        print(json.dumps(info))
    else:
        print(rid)
    return 0


def _say_threads(st: RunStore, rid: str) -> None:
    """One line on stderr when the new run shares this machine's cores with others."""
    from comera_engine.launch.env import recorded_env
    from comera_engine.launch.threads import AUTO_KEY, cpu_cores, runs_in_flight

    env = recorded_env(st.run_dir(rid)) or {}
    runs = runs_in_flight(st)
    if env.get(AUTO_KEY) == "auto" and "OMP_NUM_THREADS" in env and runs > 1:
        print(f"comera: {rid} shares this machine's {cpu_cores()} cores with "
              f"{runs - 1} other run(s): {env['OMP_NUM_THREADS']} thread(s) for it "
              "(OMP_NUM_THREADS; each run follows the runs in flight)", file=sys.stderr)


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _fmt_duration(run: dict[str, Any]) -> str:
    if not run["started_at"]:
        return "-"
    end = run["ended_at"] if run["status"] in FINAL_STATUSES and run["ended_at"] else time.time()
    s = int(max(0.0, end - run["started_at"]))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_compression(run: dict[str, Any], latest: dict[str, Any]) -> str:
    """The run's compression in its scope (the one its target is asked in), e.g.
    ``60.6x TT layers`` (``-`` before its first evaluation)."""
    comp = run_compression(run.get("config"), latest)
    return "-" if comp.value is None else f"{format_ratio(comp.value, 'x')} {comp.label}"


def _fmt_size(latest: dict[str, Any]) -> str:
    """The model's size: parameters and bytes as stored (``3.9k · 15.2 KiB``; an int8
    model holds about a byte a parameter); ``-`` before it is measured."""
    def value(name: str) -> float | None:
        v = latest.get(name)
        v = v[1] if isinstance(v, (tuple, list)) else v
        return float(v) if isinstance(v, (int, float)) else None

    params, nbytes = value("params/effective"), value("bytes/effective")
    if params is None or nbytes is None:
        return "-"
    count = f"{params / 1e6:.2f}M" if params >= 1e6 else f"{params / 1e3:.1f}k"
    size = (f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 1024:.1f} KiB")
    return f"{count} · {size}"


def _fmt_target(run: dict[str, Any], latest: dict[str, Any]) -> str:
    """The run's target and where it stands: a verdict once the run finished its steps
    (``10x→10.2x +2%``, ``60x→39.8x miss 34%``), else its progress (``60x, now 28.0x``,
    ``60x, at 28.0x (stopped)``); ``-``: no target."""
    target = run_target(run.get("config"))
    if target is None:
        return "-"
    reached = run_compression(run.get("config"), latest).value
    return target_status(target, reached, str(run["status"]), short=True)


def _fmt_status(run: dict[str, Any]) -> str:
    """The status, and for a run that is not over its phase (with its progress when
    known): ``running · evaluating 40%``; a run with no progress for too long (see
    :meth:`RunStore.stalled_for`): ``running · stalled 95 s at step 812``."""
    status, phase = str(run["status"]), run.get("phase")
    if run.get("stalled_s") is not None:
        return f"{status} · stalled {run['stalled_s']:.0f} s at step {run['last_step']}"
    if status in FINAL_STATUSES or not phase:
        return status
    progress = run.get("phase_progress")
    return f"{status} · {phase}" + ("" if progress is None else f" {progress * 100:.0f}%")


#: How long a listing waits for the store's write lock before it lists without
#: housekeeping (the store's own wait, for writes that must happen, is longer).
HOUSEKEEPING_WAIT_S = 2.0


def housekeeping_if_free(st: RunStore) -> None:
    """:func:`housekeeping` before a listing (``comera runs``, ``comera sweeps``) when the
    store's write lock comes within :data:`HOUSEKEEPING_WAIT_S`; else a note on stderr,
    and the listing goes on from what is recorded (reads need no lock: a trainer frozen in
    a write blocks no listing)."""
    try:
        if st.readonly:  # a read-only home is listed as it is
            return
        housekeeping(RunStore(st.path, create=False, busy_timeout=HOUSEKEEPING_WAIT_S))
    except StoreLocked as e:
        print(f"comera: note: {e}; listed without marking dead runs crashed or starting "
              "queued ones", file=sys.stderr)


def cmd_runs(args: argparse.Namespace) -> int:
    if _no_store_yet(args, "runs"):
        return 0
    try:
        st = _existing_store(args.store)
        housekeeping_if_free(st)
        runs = st.list_runs(status=args.status, name_like=args.name, limit=args.limit)
        for r in runs:
            r["stalled_s"] = st.stalled_for(r)
    except ValueError as e:
        return _fail(e)
    if not runs and not args.json and not (args.status or args.name):
        hint = _repair_hint(st.path, len(st.list_runs()))
        print("no runs" + (f" ({hint[2:]})" if hint else ""))
        return 0
    if _said_without_a_table(runs, args.json, "no runs"):
        return 0
    header = ("ID", "NAME", "STATUS", "STEP", "COMPRESSION", "PARAMS · BYTES", "TARGET",
              "STARTED", "TIME", "DEVICE", "ERROR")
    rows = []
    for r in runs:
        err = (r["error"] or "").strip().splitlines()
        latest = st.latest_metrics(r["id"])
        rows.append(
            (
                r["id"],
                _printable(r["name"]),
                _printable(_fmt_status(r)),
                "-" if r["last_step"] is None else str(r["last_step"]),
                _fmt_compression(r, latest),
                _fmt_size(latest),
                _fmt_target(r, latest),
                _fmt_time(r["started_at"] or r["created_at"]),
                _fmt_duration(r),
                (r["device"] or "-") + (f" [{r['gpus']}]" if r["gpus"] else ""),
                (_printable(err[0][:60]) if err else ""),
            )
        )
    print_table([header, *rows])
    return 0


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Print ``rows`` (the header first) as left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def bounded_int(low: int, high: int) -> Any:
    """argparse type: a whole number in ``low..high`` (a number past any sensible
    value is refused in one line, before it can overflow anything)."""

    def parse(text: str) -> int:
        if len(text) > 30:
            raise argparse.ArgumentTypeError(f"must be a whole number {low}..{high:,}, got "
                                             f"{len(text)} characters")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be a whole number {low}..{high:,}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be a whole number {low}..{high:,}, got "
                                             f"{value}")
        return value

    return parse


def bounded_float(low: float, high: float) -> Any:
    """argparse type: a finite number in ``low..high``."""

    def parse(text: str) -> float:
        try:
            value = float(text[:40])
        except ValueError:
            value = float("nan")
        if not low <= value <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(
                f"must be a number {low:g}..{high:g}, got {text[:40]!r}")
        return value

    return parse


#: A whole number >= 1, bounded (``--limit``, ``--seeds``, ``--max-parallel``).
_positive_int = bounded_int(1, 1_000_000)


def _printable(text: str) -> str:
    """``text`` with control characters (terminal escapes, newlines) shown as ``?``: a
    store written by an older version may hold such names."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(text))


def cmd_logs(args: argparse.Namespace) -> int:
    try:
        st = _existing_store(args.store)
        rid = st.resolve(args.run)
        if not args.follow:
            text = logs(rid, tail=args.tail, store=st)
            if not st.log_path(rid).exists():  # a foreground run logs to its terminal
                print(f"comera: {rid} has no log file ({st.log_path(rid)}): a run trained "
                      "with comera train wrote its output to its terminal", file=sys.stderr)
            sys.stdout.write(text if text.endswith("\n") or not text else text + "\n")
            return 0
        return _follow(st, rid, args.tail)
    except ValueError as e:
        return _fail(e)
    except KeyboardInterrupt:
        return 0


def _follow(st: RunStore, rid: str, tail: int | None) -> int:
    path = st.log_path(rid)
    if tail is not None:
        text = logs(rid, tail=tail, store=st)
        if text:
            sys.stdout.write(text + "\n")
        pos = path.stat().st_size if path.exists() else 0
    else:
        pos = 0
    quiet_since: float | None = None
    while True:
        chunk = b""
        if path.exists():
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
        if chunk:
            pos += len(chunk)
            sys.stdout.write(chunk.decode("utf-8", errors="replace"))
            sys.stdout.flush()
            quiet_since = None
        else:
            run = st.get_run(rid)
            if not st.readonly:
                reap(st)
            if run is None or run["status"] in FINAL_STATUSES:
                if quiet_since is None:
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since > 1.0:  # the supervisor's last line
                    return 0
            time.sleep(0.25)


def _stop_without_store(args: argparse.Namespace) -> int:
    """``comera stop`` when the store cannot be read: through the run folder's owner
    record (its ``.lock``)."""
    from comera_engine.launch.runs import run_folder_of, stop_folder

    try:
        folder = run_folder_of(resolve_store_path(args.store).parent, args.run)
        status = stop_folder(folder, timeout=args.timeout)
    except ValueError as e:
        return _fail(e)
    print(f"{folder.name}: {status} (the store is damaged: run `comera repair`)")
    return 0


def _sweep_named(st: RunStore, ref: str) -> str | None:
    """The id of the sweep ``ref`` names, or ``None`` when it names a run."""
    return st.resolve_sweep(ref) if st.is_sweep(ref) else None


def cmd_stop(args: argparse.Namespace) -> int:
    try:
        st = _existing_store(args.store)
        if (sid := _sweep_named(st, args.run)) is not None:
            from comera_engine.launch.sweep import stop_sweep

            counts = stop_sweep(sid, st, timeout=args.timeout, wait=not args.no_wait)
            print(f"{sid}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
            live = [k for k in counts if k not in FINAL_STATUSES]
            return 1 if live and not args.no_wait else 0
        rid = st.resolve(args.run)
        status = stop(rid, timeout=args.timeout, store=st, wait=not args.no_wait)
    except StoreError as e:  # a damaged store still lets a run be stopped
        return _stop_without_store(args) if is_damaged(e) else _fail(e)
    except ValueError as e:
        return _fail(e)
    if status in FINAL_STATUSES or args.no_wait:
        print(f"{rid}: {status}")
        return 0
    run = st.get_run(rid) or {}
    print(f"{rid}: could not stop it: still {status}, pid {run.get('pid')} on "
          f"{run.get('host')} did not report a final status", file=sys.stderr)
    return 1


def cmd_resume(args: argparse.Namespace) -> int:
    try:
        st = _existing_store(args.store)
        if (sid := _sweep_named(st, args.run)) is not None:
            from comera_engine.launch.sweep import resume_sweep

            done = resume_sweep(sid, st)
            print(f"{sid}: {len(done.queued)} cells queued again")
            for cell, why in done.left.items():
                print(f"{cell}: left as it is: the run {why}", file=sys.stderr)
            return 0
        rid = resume(args.run, store=st)
    except ValueError as e:
        return _fail(e)
    print(rid)
    return 0


def cmd_repair(args: argparse.Namespace) -> int:
    from comera_engine.store.repair import repair

    try:
        report = repair(args.store)
    except ValueError as e:
        return _fail(e)
    if report.problem is None:
        print(f"{report.path}: sound (quick_check ok); nothing to repair")
        return 0
    moved = f"; the damaged file is kept as {report.moved_to}" if report.moved_to else ""
    # the store's own advice (run `comera repair`, the file is kept) is what happens here
    problem = re.split(r"; it was left untouched|; refusing to open|; `comera repair`",
                       one_line(report.problem))[0]
    print(f"{report.path}: {problem}{moved}")
    if report.moved_to is not None or report.runs or report.problem == "no store file":
        print(f"rebuilt {len(report.runs)} run(s) with {report.metric_rows} metric rows "
              f"from their folders in {report.path.parent}")
    for skipped in report.skipped:
        print(f"skipped {one_line(skipped)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m comera_engine.launch.cli``)."""
    parser = argparse.ArgumentParser(prog="comera")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subparsers(sub)
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: int(args.func(args)))


if __name__ == "__main__":
    sys.exit(main())

