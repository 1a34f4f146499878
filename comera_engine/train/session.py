"""A ``comera train`` run in the foreground: the trainer's whole session, from the loaded
config to its end (the ``comera`` command parses the arguments and hands them here).

A foreground run is recorded in the run store like a launched one (``--store``, else
``$COMERA_HOME``, else ``./runs``): ``comera runs`` lists it, the dashboard follows it
live, ``comera export ID`` finds it, ``comera stop ID`` stops it and, if its process dies,
it is marked crashed. ``--no-store`` trains into the folder alone. ``--run-id ID`` trains
a run the launcher created (its supervisor passes it).

The run folder is ``--run-dir``, else the folder holding CONFIG when ``--run-id`` is
given (the launcher's layout, ``<run_dir>/config.toml``), else ``<store dir>/<run id>/``
(``runs/<timestamp>-<name>/`` with ``--no-store``). ``--resume`` continues the run
recorded for that folder. It receives ``config.toml`` (the resolved config),
``metrics.jsonl``, ``checkpoints/`` and ``.lock``, held while the trainer lives: a second
trainer on the same folder (or on the same run anywhere) is refused before it writes
anything (a :class:`~comera_engine.launch.owner.RunBusyError`, a ``ConfigError``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError


def train_foreground(args: argparse.Namespace, cfg: Any,
                     check_runnable: Callable[..., Any]) -> str:
    """Train ``cfg`` (a loaded ``Config``) as ``comera train`` was asked to by ``args``
    (``run_dir``, ``run_id``, ``resume``, ``config``, ``store``, ``no_store``,
    ``no_progress``; ``args.folder`` is set to the run folder once it is known).
    ``check_runnable``: :func:`comera_engine.preview.check_runnable` (device, data files,
    memory), run before a new run writes anything; the caller passes it (the preview
    sits above the trainer). Returns how the training ended (``TrainResult.status``:
    ``"finished"``, ``"stopped"``, ``"diverged"``, ...); bad input raises a
    ``ConfigError`` before anything is written."""
    is_main = int(os.environ.get("RANK", "0")) == 0
    record = _Record(args) if is_main and not args.no_store else None
    try:
        return _train(args, cfg, record, is_main, check_runnable)
    finally:
        if record is not None:
            record.close()


def _train(args: argparse.Namespace, cfg: Any, record: _Record | None, is_main: bool,
           check_runnable: Callable[..., Any]) -> str:
    """:func:`train_foreground` once the store record is known: check, prepare, train."""
    from comera_engine.config import to_toml

    early = _EarlyPhase(record)
    early("preparing data")
    run_dir = _run_dir(args, cfg.name, record)
    if record is not None and record.wanted is not None:
        _check_run_id(record, run_dir, args.resume)
    if is_main:
        _check_folder(run_dir, args)
    if not args.resume and is_main:
        _refuse_a_used_folder(run_dir, "--run-dir" if args.run_dir else
                              "--run-id" if args.run_id else None)
    args.folder = run_dir  # named by a one-line error (a full disk)
    saved_tok = run_dir / "tokenizer.json"
    if saved_tok.is_file() and isinstance(cfg.data, dict) and "tokenizer_path" not in cfg.data:
        # a resumed text run must reuse its own vocabulary (WordPiece training is not
        # deterministic, so a retrained tokenizer would scramble the embedding ids)
        cfg.data["tokenizer_path"] = str(saved_tok.resolve())
    # planned once, before any data is read: an unreachable target is refused here
    plan = plan_from_config(cfg)
    if plan is not None:
        cfg = plan.config  # with the initial ranks (config.toml keeps them for a resume)
    if not args.resume and int(os.environ.get("RANK", "0")) == 0:
        # device, data files, memory: refused before anything is written
        check_runnable(cfg, nproc=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), plan=plan)
    bundle = _prepare(cfg, run_dir, args.resume, early)  # validates the data
    if plan is None or not plan.fits(bundle):  # no shape facts, or other ones: from the data
        from comera_engine.runplan import plan_run

        plan = plan_run(cfg, bundle)
    if not is_main:
        return _run(plan, run_dir, bundle, args, None)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError("--run-dir" if args.run_dir else "--store",
                          f"cannot make the run folder {run_dir} ({e.strerror or e}); "
                          "choose a folder you can write") from None
    with _Writer(run_dir, record, cfg) as writer:  # or RunBusyError: exit 2
        _write_config(run_dir, args.config, to_toml(cfg))
        _write_data_record(run_dir, bundle, plan)
        return _run(plan, run_dir, bundle, args, writer)


class _Record:
    """Where a trainer records its run: the store (``--store``, else the default) and the
    run's id there: ``--run-id``, the run recorded for the folder of a ``--resume``, or a
    new id for a new foreground run. Nothing is opened or created until :meth:`open`
    (called by :class:`_Writer` once the folder is locked, so a refused start leaves no
    store and no row)."""

    def __init__(self, args: argparse.Namespace) -> None:
        from comera_engine.store import resolve_store_path

        try:
            self.path = resolve_store_path(args.store or None)
        except Exception as e:  # noqa: BLE001 (an unusable path)
            raise ConfigError("--store", str(e)) from None
        self.root = self.path.parent
        self.wanted: str | None = args.run_id
        self.run_id: str | None = None
        self.new = args.run_id is None
        self.store: Any = None

    def open(self) -> Any:
        from comera_engine.store import RunStore, StoreError

        if self.store is None:
            try:
                self.store = RunStore(self.path, create=self.wanted is None)
                if self.wanted is not None:
                    self.run_id = self.store.resolve(self.wanted)
            except StoreError as e:  # no such store or run, or one that cannot be made
                raise ConfigError("--store", str(e)) from None
        return self.store

    def find(self, folder: Path) -> None:
        """The run recorded for ``folder`` (a ``--resume``), if the store has one."""
        from comera_engine.store import RunStore, StoreError

        if not self.path.is_file():
            return
        try:
            with RunStore(self.path, create=False) as st:
                self.run_id = st.run_for_folder(folder)
        except StoreError as e:
            raise ConfigError("--store", str(e)) from None
        self.new = self.run_id is None

    def new_folder(self) -> Path:
        return _unused_folder(self.root)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


class _EarlyPhase:
    """A launched run's phase before its trainer claims the run (``--run-id``: the row
    exists from the start), as ``on_phase(phase, progress)``. Written only while the
    row's owner already names this process or its parent (the supervisor records the
    trainer's pid), with that token checked in the write: a second trainer on a live run
    writes nothing before it is refused. A foreground run has no row yet: nothing is
    written. Store problems are left for :class:`_Writer` to report."""

    def __init__(self, record: _Record | None) -> None:
        self.store: Any = None
        self.run_id: str | None = None
        self.owner: dict[str, Any] | None = None
        if record is None or record.wanted is None:
            return
        from comera_engine.launch.owner import owned_here

        try:
            self.store = record.open()
            self.run_id = record.run_id
            self.owner = owned_here(self.store, str(self.run_id))
        except (ConfigError, ValueError):  # no such store or run: _Writer says so
            record.close()  # so that _Writer opens (and resolves) it afresh

    def __call__(self, phase: str, progress: float | None = None) -> None:
        if self.owner is None:
            return
        from comera_engine.store.errors import NotOwnerError

        try:
            self.store.write_batch(str(self.run_id), phase=(phase, progress), owner=self.owner)
        except NotOwnerError:  # another process took the run: write nothing more
            self.owner = None
        except ValueError:  # a busy store: the next phase (or the sink) writes it
            pass


class _Writer:
    """This process as the run's one writer, for as long as it trains: the run folder's
    lock and, when the run is recorded, the run's owner token (see
    :mod:`comera_engine.launch.owner`). Taken before anything is written; a run that
    already has a live writer raises :class:`~comera_engine.launch.owner.RunBusyError`.
    A new foreground run gets its store row here, after the lock: ``running``, owned by
    this process (so it is marked crashed if this process dies)."""

    def __init__(self, run_dir: Path, record: _Record | None, cfg: Any) -> None:
        self.run_dir, self.record, self.cfg = run_dir, record, cfg
        self.store: Any = None
        self.run_id: str | None = None
        self.owner: dict[str, Any] | None = None

    def __enter__(self) -> _Writer:
        from comera_engine.launch.owner import RunLock, claim_run
        from comera_engine.store.layout import make_reserve

        self.lock = RunLock(self.run_dir).acquire()
        make_reserve(self.run_dir)  # room for the last records when the disk fills
        try:
            if self.record is not None:
                from comera_engine.store import StoreError

                try:
                    self.store = self.record.open()
                    self.run_id = self.record.run_id
                    if self.run_id is None:
                        self.run_id = self._create()
                        self.record.run_id = self.run_id
                    self.owner = claim_run(self.store, str(self.run_id))
                    if self.record.wanted is None and not self.record.new:
                        self._reopen()
                except StoreError as e:  # no such store or run: one line
                    raise ConfigError("--store", str(e)) from None
        except BaseException:
            self.__exit__()
            raise
        return self

    def _create(self) -> str:
        from comera_engine.launch.env import run_env
        from comera_engine.launch.liveness import this_process

        in_root = self._in_store_root()
        rid = self.run_dir.name if in_root else self.record.new_folder().name
        folder = None if in_root else self.run_dir
        me = this_process()
        device = self.cfg.train.device
        self.store.create_run(self.cfg.name, self.cfg.to_dict(), "running", device=device,
                              cwd=os.getcwd(), run_id=rid, folder=folder)
        self.store.update_run(rid, **me)
        self.store.log_event(rid, "launch", f"started in the foreground by pid {me['pid']} "
                             f"({self.cfg.name}, folder {self.run_dir})")
        import json

        from comera_engine.store.layout import write_atomic

        env = self.run_dir / "launch_env.json"
        if not env.exists():
            write_atomic(env, json.dumps(run_env(), indent=1))
        return rid

    def _reopen(self) -> None:
        """A foreground ``--resume`` of a recorded run: it is running again, as the same
        run (a live owner was refused by the claim)."""
        self.store.lifecycle(str(self.run_id)).reopen(
            event=("resume", f"resumed in the foreground by pid {os.getpid()}"), exit_code=None)

    def _in_store_root(self) -> bool:
        return self.run_dir.resolve().parent == self.store.root.resolve() and \
            self.store.get_run(self.run_dir.name) is None

    def __exit__(self, *exc: object) -> None:
        from comera_engine.store.layout import release_reserve

        if self.record is not None:
            self.record.close()
        release_reserve(self.run_dir)
        self.lock.release()


def _write_data_record(run_dir: Path, bundle: Any, plan: Any) -> None:
    """Keep what the run was trained on beside it: the tokenizer, the data spec a model
    builder needs, the dataset identity (export and resume read them back) and the run's
    plan (``plan.json``)."""
    import json

    from comera_engine.runplan import data_spec_from_bundle, write_plan
    from comera_engine.store.layout import write_atomic

    if getattr(bundle, "tokenizer", None) is not None and not (run_dir / "tokenizer.json").exists():
        tmp = run_dir / "tokenizer.tmp.json"
        try:
            bundle.tokenizer.save(tmp)
            os.replace(tmp, run_dir / "tokenizer.json")
        finally:
            tmp.unlink(missing_ok=True)
    for name, payload in (("data_spec.json", data_spec_from_bundle(bundle)),
                          ("dataset.json", bundle.identity)):
        write_atomic(run_dir / name, json.dumps(payload, indent=1, default=str))
    write_plan(run_dir, plan)


def _refuse_a_used_folder(folder: Path, flag: str | None) -> None:
    """A new run started in a folder that holds another run's records would write its
    metrics after them and its checkpoints over them: refused (ConfigError). ``flag``:
    how the folder was named: ``--run-dir`` (any metrics or checkpoint there), ``--run-id``
    (a store run's folder: its checkpoints; the launcher starts a run that has none
    afresh, over a failed attempt's metrics), ``None`` (a new folder: nothing to check)."""
    from comera_engine.store.layout import list_checkpoints

    if flag is None:
        return
    ckpts = folder / "checkpoints"
    # the complete checkpoints, as the supervisor counts them when it picks a fresh start
    has_ckpt = bool(list_checkpoints(ckpts))
    if flag == "--run-dir" and (has_ckpt or (folder / "metrics.jsonl").exists()):
        raise ConfigError("--run-dir", f"{folder} holds a run already (its metrics or "
                          "checkpoints): add --resume to continue that run, or name a new "
                          "folder")
    if flag == "--run-id" and has_ckpt:
        raise ConfigError("--run-id", f"this run has checkpoints in {ckpts}: add --resume "
                          "to continue it (a start from scratch would write over them)")


def _holds_run(folder: Path) -> bool:
    """Whether a trainer has written to ``folder`` (it takes ``.lock`` before it writes
    anything, then ``config.toml``, ``metrics.jsonl``, ``checkpoints/``)."""
    return any((folder / name).exists() for name in (".lock", "metrics.jsonl", "checkpoints"))


def _check_folder(run_dir: Path, args: argparse.Namespace) -> None:
    """The run folder is a folder (or can be one), and a run never takes over a folder
    of the user's: a ``--resume`` without ``--run-dir`` continues the run in the config's
    folder only when that folder holds one, and a ``config.toml`` no run wrote (the
    user's own) is never replaced by the run's resolved config."""
    flag = "--run-dir" if args.run_dir else "--resume" if args.resume else "--store"
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(flag, f"{run_dir} is a file, not a folder; name a folder for the "
                          "run")
    if args.run_id:  # the launcher's folder: it wrote config.toml there
        return
    if args.resume and not args.run_dir and not _holds_run(run_dir):
        raise ConfigError("--resume", f"{run_dir} is not a run folder (no metrics.jsonl or "
                          "checkpoints); give --run-dir RUN, or use comera resume RUN")
    target = run_dir / "config.toml"
    if target.exists() and not _holds_run(run_dir) and \
            target.resolve() != Path(args.config).resolve():  # (a Ray cell's own folder)
        raise ConfigError(flag, f"{run_dir} holds a config.toml that no run wrote; a run "
                          "writes its resolved config there, so name another folder")


def _check_run_id(record: _Record, run_dir: Path, resume: bool) -> None:
    """``--run-id RID`` trains that run in its own folder only (the launcher's
    ``RUN/config.toml``), and starts it without ``--resume`` only while the launcher
    starts it (not once it has ended): anything else would write another run's metrics
    over RID's record in the store, and its files into a folder that is not RID's."""
    from comera_engine.launch.liveness import pid_alive, this_host
    from comera_engine.store import FINAL_STATUSES

    st = record.open()
    rid = str(record.run_id)
    own = Path(st.run_dir(rid))
    run = st.get_run(rid) or {}
    status = run.get("status")
    if own.resolve() != run_dir.resolve():
        if status not in FINAL_STATUSES and run.get("pid") and run.get("host") == this_host() and \
                run["pid"] != os.getpid() and pid_alive(run["pid"], run.get("pid_started")):
            raise ConfigError("--run-id", f"{rid} is {status} and owned by pid {run['pid']} "
                              f"on {run['host']}; stop it first (comera stop RUN)")
        raise ConfigError("--run-id", f"run {rid} lives in {own}, not in {run_dir}; a new "
                          "run needs no --run-id, and comera resume " + rid + " continues it")
    if not resume and status in FINAL_STATUSES:
        raise ConfigError("--run-id", f"run {rid} is {status} (folder {own}); a new run "
                          f"needs no --run-id, and comera resume {rid} (or --resume) "
                          "continues it")


def _run_dir(args: argparse.Namespace, name: str, record: _Record | None = None) -> Path:
    """The run folder (see the module docstring); for a ``--resume`` without
    ``--run-id``, also finds the run recorded for that folder."""
    if args.run_dir:
        folder = Path(args.run_dir)
    elif args.run_id:
        folder = Path(args.config).resolve().parent
    elif args.resume:
        folder = Path(args.config).resolve().parent
    elif record is not None:
        folder = record.new_folder()
    else:
        folder = None
    if folder is not None:
        if record is not None and record.wanted is None and args.resume:
            record.find(folder)
        return folder
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name)
    return _unused_folder(Path("runs"), f"-{safe}")


def _unused_folder(root: Path, suffix: str = "") -> Path:
    """``root/<a new run id><suffix>``, a folder that does not exist yet (the id is time
    + random and never repeated by this process; another process may have drawn it)."""
    from comera_engine.store import new_run_id

    for _ in range(20):
        folder = root / f"{new_run_id()}{suffix}"
        if not folder.exists():
            return folder
    raise ConfigError("--run-dir", "could not allocate a new run folder; name one with "
                                   "--run-dir")  # pragma: no cover


def plan_from_config(cfg: Any) -> Any:
    """The run's plan (:func:`comera_engine.runplan.plan_run`) from the config and the
    dataset registry's shape facts alone (no data is read): a ConfigError for an
    unreachable target; ``None`` for a dataset without shape facts (planned from its
    data once built). Its note (the initial ranks chosen) is the trainer's first event."""
    from comera_engine.runplan import plan_run

    try:
        return plan_run(cfg)
    except ConfigError:  # an unreachable target, user data that cannot be read: one line
        raise
    except (ValueError, KeyError):  # a dataset without shape facts
        return None


def _prepare(cfg: Any, run_dir: Path, resume: bool, on_phase: Any = None) -> Any:
    """Build the dataset (its problems surface here as a ConfigError) and check the task.
    ``on_phase(phase, progress)`` hears the phases (preparing data, training tokenizer,
    building)."""
    from comera_engine.data import build_dataset
    from comera_engine.models import run_task
    from comera_engine.runplan import data_config

    if resume and not (run_dir / "checkpoints").is_dir() and not run_dir.is_dir():
        raise ConfigError("--resume", f"run folder {run_dir} does not exist")
    if resume:
        from comera_engine.store.layout import resume_point

        resume_point(run_dir / "checkpoints")  # every checkpoint damaged: one line
    bundle = build_dataset(data_config(cfg), base_dir=cfg.base_dir, on_phase=on_phase)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.train.batch_size * world > len(bundle.train):
        raise ConfigError(
            "train.batch_size",
            f"a global batch of {cfg.train.batch_size * world} exceeds the "
            f"{len(bundle.train)} training examples",
        )
    if on_phase is not None:
        on_phase("building")
    run_task(cfg, bundle)  # a task.factory that does not import or build
    return bundle


def _write_config(run_dir: Path, source: str, text: str) -> None:
    from comera_engine.store.layout import write_atomic

    target = run_dir / "config.toml"
    if target.exists() and target.resolve() == Path(source).resolve():
        if target.read_text(encoding="utf-8") == text:
            return
    write_atomic(target, text)


def _run(
    plan: Any, run_dir: Path, bundle: Any, args: argparse.Namespace, writer: _Writer | None
) -> str:
    """Train the run of ``plan`` (:class:`comera_engine.runplan.RunPlan`); ``writer`` (rank 0
    only) is this process as the run's one writer. Returns how the training ended."""
    from comera_engine.metrics import JSONLSink, MultiSink
    from comera_engine.train.loop import train

    is_main = writer is not None
    sink: Any = None
    if writer is not None:
        jsonl = run_dir / "metrics.jsonl"
        if args.resume or args.run_id:  # safe: this process holds the run folder's lock
            _rewind(jsonl, run_dir, args.resume, writer)
        sinks: list[Any] = [JSONLSink(jsonl)]
        if writer.store is not None:
            from comera_engine.store import StoreSink

            sinks.append(StoreSink(writer.store, str(writer.run_id), owner=writer.owner,
                                   keep_going=True))  # a failing store never stops training
            if writer.record is not None and writer.record.new:
                print(f"comera: run {writer.run_id} recorded in {writer.store.path} "
                      f"(folder {run_dir})", file=sys.stderr)
        sink = MultiSink(*sinks)
        if writer.store is not None:
            sink.sinks.extend(_thread_budget(writer.store, sink))
    try:
        result = train(
            plan.config,
            run_dir,
            sink,
            resume=args.resume,
            bundle=bundle,
            progress=not args.no_progress,
            plan=plan,
        )
    finally:
        if sink is not None:
            sink.close()
    if is_main:
        where = f"; checkpoint {result.checkpoint}" if result.checkpoint else ""
        print(f"{result.status} at step {result.step}{where}", file=sys.stderr)
    return result.status


def _rewind(jsonl: Path, run_dir: Path, resume: bool, writer: _Writer) -> None:
    """Before a run trains again in its folder: ``metrics.jsonl`` keeps what the attempt
    it continues from logged up to its checkpoint (the newest good one of a
    ``--resume``), and is mended from the store where it lacks some of those steps.
    Without a checkpoint (a crash before the first one, or the launcher's restart of a
    run that never checkpointed: ``--run-id`` without ``--resume``) the run starts from
    step 0, so every record of a step goes, as the store's rows do when it logs its
    first step: the folder and the store then hold each step once."""
    from comera_engine.store.repair import mend_jsonl, rewind_jsonl

    step = None
    if resume:
        from comera_engine.store.layout import resume_point

        latest, _ = resume_point(run_dir / "checkpoints")
        step = int(latest.stem.split("_")[1]) if latest else None
    if step is None:
        rewind_jsonl(jsonl, -1)  # records without a step (events, statuses) are kept
        return
    rewind_jsonl(jsonl, step)
    mend_jsonl(jsonl, step, writer.store, writer.run_id)
    if writer.store is not None and writer.run_id is not None:
        from comera_engine.store.repair import backfill_store

        try:
            added = backfill_store(jsonl, step, writer.store, str(writer.run_id),
                                   writer.owner)
        except ValueError as e:  # a store that fails: the sink says so, the run goes on
            print(f"comera: the run store was not given the steps it lacks: {e}",
                  file=sys.stderr)
        else:
            if added:
                print(f"comera: the run store lacked {added} of steps 1..{step}: added from "
                      "metrics.jsonl", file=sys.stderr)


def _thread_budget(store: Any, sink: Any) -> list[Any]:
    """A launched run with ``COMERA_THREADS=auto`` follows its share of the cores while
    other runs start and end (:mod:`comera_engine.launch.threads`); ``[]`` otherwise."""
    from comera_engine.launch.threads import AUTO_KEY, cpu_cores, runs_in_flight

    if os.environ.get(AUTO_KEY) != "auto" or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return []
    from comera_engine.train.threads import ThreadBudget

    def changed(threads: int, runs: int, step: int) -> None:
        sink.log_event("threads", f"{threads} thread(s): {cpu_cores()} cores shared by "
                       f"{runs} run(s) in flight", step)

    return [ThreadBudget(lambda: runs_in_flight(store), cpu_cores(), on_change=changed)]
