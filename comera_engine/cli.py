"""``comera`` command line: ``train`` and ``app`` here; ``launch``/``runs``/``logs``/``stop``/
``resume`` come from :mod:`comera_engine.launch.cli`, ``export`` from
:mod:`comera_engine.export`.

``comera train CONFIG.toml [--set section.key=value ...] [--print-config] [--run-dir DIR]
[--resume] [--store DB] [--run-id ID] [--no-store]``

Everything (config fields, data files, model/data fit, batch size vs data) is checked
before anything is written; a bad input prints one line on stderr and exits with code 2.
The foreground run itself (its record in the run store, its run folder and lock, the
resume) is :mod:`comera_engine.train.session`; this module parses the arguments and
dispatches.

Exit codes: 0 finished or stopped, 1 error during training, 2 bad input, 3 diverged.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_DIVERGED = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"comera: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    from comera_engine.launch import cli as launch_cli

    parser = _Parser(prog="comera", description="CoMERA: rank-adaptive tensor-train training")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    p = sub.add_parser("train", help="train a model from a TOML config")
    p.add_argument("config", help="TOML config file (see experiments/configs/)")
    launch_cli.add_override_option(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--run-dir", help="run folder (default: runs/<timestamp>-<name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--store", help="run store to record into (default: $COMERA_HOME or "
                   "./runs)")
    p.add_argument("--run-id", help="train this run of the store (the launcher's)")
    p.add_argument("--no-store", action="store_true",
                   help="record nothing in the run store (the run folder only)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train)

    launch_cli.add_subparsers(sub)
    from comera_engine.launch import sweep_cli

    sweep_cli.add_subparsers(sub, check=_check_cell)
    from comera_engine.export import add_subparsers as add_export

    add_export(sub)

    p = sub.add_parser("app", help="start the Streamlit dashboard (127.0.0.1:8501)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=launch_cli.bounded_int(1, 65535), default=8501,
                   help="port (default 8501)")
    p.add_argument("--store", help="run store folder or .db file (default: $COMERA_HOME "
                   "or ./runs)")
    p.add_argument("--models", action="append", default=[], metavar="MODULE",
                   help="offer the model factories this module exposes (its COMERA_MODELS) "
                   "on New experiment; repeatable")
    p.add_argument("--data", action="append", default=[],
                   metavar="NAME=PATH[,eval=PATH][,label=COL][,task=classify|regress]",
                   help="offer this local CSV / JSON lines / Parquet file for user models; "
                   "repeatable")
    p.set_defaults(func=cmd_app)
    return parser


def _check_cell(cfg: Any) -> None:
    """What ``comera launch`` checks before queueing, for one cell of a sweep."""
    from comera_engine.preview import check_runnable
    from comera_engine.train.session import plan_from_config

    plan = plan_from_config(cfg)
    check_runnable(cfg if plan is None else plan.config, nproc=1, plan=plan)


def dashboard_launcher() -> Any:
    """The module ``app.launcher`` of the source checkout this engine runs from (its
    ``run_app`` starts the dashboard). The dashboard is not part of the installed package
    and no engine module imports it: ``comera app`` imports it by name at run time, with
    the checkout first on ``sys.path``, and refuses an ``app`` package from elsewhere."""
    import importlib

    root = Path(__file__).resolve().parents[1]
    if not (root / "app" / "launcher.py").is_file():
        raise ConfigError("app", f"the dashboard is not beside this engine ({root / 'app'} "
                          "is missing); it runs from a source checkout: `make run` there")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module("app.launcher")
    found = Path(getattr(module, "__file__", "") or "").resolve()
    if found.parent.parent != root:
        raise ConfigError("app", f"another 'app' package ({found.parent}) shadows the "
                          f"dashboard of {root}; run `comera app` from that checkout")
    return module


def cmd_app(args: argparse.Namespace) -> int:
    """Exec ``streamlit run app/Home.py`` through ``app.launcher.run_app``; needs the
    ``app`` extra (streamlit, plotly)."""
    import importlib.util

    if importlib.util.find_spec("streamlit") is None:
        raise ConfigError("app", "streamlit is not installed; pip install "
                          "'comera-studio[app]' (or run `make run`)")
    launcher = dashboard_launcher()
    registry = None
    if args.models or args.data:  # checked here, before anything starts (comera_engine.studio)
        from comera_engine.studio import build_registry

        registry = build_registry(args.models, args.data)
    try:
        launcher.run_app(args.host, args.port, args.store, registry=registry)
    except ValueError as exc:
        field, _, problem = str(exc).partition(": ")
        raise ConfigError(f"--{field}", problem) from None
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from comera_engine.launch.cli import quiet_on_closed_pipe

    parser = build_parser()
    return quiet_on_closed_pipe(lambda: _run(parser.parse_args(argv)))


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command: its exit code, bad input as one line and code 2."""
    try:
        if args.command == "launch":  # what cannot run is refused before queueing
            from comera_engine.config import load_config
            from comera_engine.data.registry import check_data_table
            from comera_engine.preview import check_runnable
            from comera_engine.train.session import plan_from_config

            cfg = load_config(args.config, args.overrides)
            check_data_table(cfg.data)
            plan = plan_from_config(cfg)
            pv = check_runnable(cfg if plan is None else plan.config, nproc=args.nproc,
                                plan=plan)
            _check_room(args.store, pv)
        return int(args.func(args) or 0)
    except ConfigError as exc:
        from comera_engine.launch.cli import one_line

        sys.stderr.write(f"comera: error: {one_line(exc)}\n")
        return EXIT_BAD_INPUT
    except Exception as exc:  # a full disk under a run: one line, no traceback
        from comera_engine.store.layout import disk_full_text, is_disk_full, release_reserve

        if not is_disk_full(exc):
            raise
        where = getattr(args, "folder", None) or Path.cwd()  # the run folder, once known
        release_reserve(where)
        sys.stderr.write(f"comera: error: {disk_full_text(where, exc=exc)}\n")
        return EXIT_ERROR


def _check_room(store: str | None, pv: Any) -> None:
    """Refuse a launch when the home has less free space than one checkpoint of the run
    (its weights and AdamW moments, by the preview's estimate) and a margin."""
    from comera_engine.store import resolve_store_path
    from comera_engine.store.layout import check_free_space

    mem = pv.memory["dense" if pv.dense_model else "tt"]
    need = int(mem.get("weights", 0) + mem.get("optimizer", 0))
    check_free_space(resolve_store_path(store).parent, need, "COMERA_HOME")


def cmd_train(args: argparse.Namespace) -> int:
    """``comera train``: check the arguments and the config, then train in the foreground
    (:func:`comera_engine.train.session.train_foreground`)."""
    from comera_engine.config import load_config, to_toml

    if args.no_store and (args.store or args.run_id):
        raise ConfigError("--no-store", "cannot be combined with --store or --run-id")
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        sys.stdout.write(to_toml(cfg))
        return EXIT_OK
    if (not args.run_dir and not args.run_id and not args.no_store
            and int(os.environ.get("WORLD_SIZE", "1")) > 1):
        raise ConfigError("--run-dir", "a multi-process run started with torchrun needs "
                          "--run-dir DIR (the same for every process), or use "
                          "`comera launch --nproc N`")
    from comera_engine.preview import check_runnable
    from comera_engine.train.session import train_foreground

    status = train_foreground(args, cfg, check_runnable)
    return EXIT_DIVERGED if status == "diverged" else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
