"""Launching, stopping and resuming runs: a run is queued (its folder, ``config.toml``,
``launch_env.json`` and row) and the queue started by detached supervisors
(:func:`dispatch`); a stop asks the trainer to checkpoint and, past its timeout, kills
it; a resume queues a run again from its newest whole checkpoint. Torch-free.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from comera_engine.errors import ConfigError
from comera_engine.launch import signals
from comera_engine.launch.env import ENV_FILENAME, assign_threads, child_env, run_env
from comera_engine.launch.liveness import pid_alive, processes_alive, reap, this_host
from comera_engine.launch.owner import lock_holder
from comera_engine.launch.threads import AUTO_KEY
from comera_engine.store import (
    FINAL_STATUSES,
    RESUMABLE_STATUSES,
    RunStore,
    list_checkpoints,
    new_run_id,
)
from comera_engine.store.layout import (
    check_free_space,
    checkpoint_bytes,
    disk_full_text,
    is_disk_full,
    resume_point,
)

#: Seconds a stop waits for the trainer's checkpoint before SIGKILL.
DEFAULT_STOP_TIMEOUT = 60.0
CONFIG_FILENAME = "config.toml"
#: What a requeued run (a resume) starts afresh; ``queued_at`` and ``resume_pending`` are
#: set beside these. Its phase too: the new attempt reports its own.
_REQUEUE_CLEARS = dict.fromkeys(("dispatched_at", "ended_at", "exit_code", "stop_deadline",
                                 "phase", "phase_progress"))


class LaunchError(ValueError):
    """A launcher request that cannot be carried out (wrong status, other host, ...)."""


class ResumeRefused(LaunchError):
    """:func:`resume` refused the run by the resume rule (:func:`resume_from`);
    ``problem`` says why, in words that follow "the run"."""

    def __init__(self, run_id: str, problem: str) -> None:
        super().__init__(f"run: {run_id} {problem}")
        self.problem = problem


def open_store(store: RunStore | str | os.PathLike[str] | None = None) -> RunStore:
    """A :class:`RunStore` from a store, a path (file or folder) or ``None`` (default)."""
    return store if isinstance(store, RunStore) else RunStore(store)


def resolve_config(
    config: Mapping[str, Any] | str | os.PathLike[str], overrides: Sequence[str] = ()
) -> Any:
    """Load and validate a run config (a TOML path or a dict of TOML tables) with
    ``section.key=value`` overrides; returns a ``comera_engine.config.Config``.
    Raises :class:`~comera_engine.errors.ConfigError` with a one-line message."""
    from comera_engine import config as cfgmod
    from comera_engine.data.registry import check_data_table

    if isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
        for item in overrides:
            cfgmod.apply_override(raw, item)
        cfg = cfgmod.config_from_dict(raw)
        cfg.base_dir = str(Path.cwd())
    else:
        cfg = cfgmod.load_config(config, list(overrides))
    check_data_table(cfg.data)  # a registered dataset and only its keys, no data read
    return cfg


def _check_gpus(gpus: str | None, nproc: int) -> str | None:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ConfigError("nproc", f"must be a positive integer, got {nproc!r}")
    if gpus is None or str(gpus).strip() == "":
        return None
    gpus = str(gpus).replace(" ", "")
    ids = gpus.split(",")
    if not all(i.isdigit() for i in ids) or len(set(ids)) != len(ids):
        raise ConfigError("gpus", f"must be GPU indices like 0 or 0,1, got {gpus!r}")
    if nproc > len(ids):
        raise ConfigError("nproc", f"{nproc} processes need {nproc} GPUs, got gpus={gpus}")
    return gpus


def launch(
    config: Mapping[str, Any] | str | os.PathLike[str],
    overrides: Sequence[str] = (),
    store: RunStore | str | os.PathLike[str] | None = None,
    name: str | None = None,
    gpus: str | None = None,
    nproc: int = 1,
    max_concurrent: int | None = None,
) -> str:
    """Queue a training run and start it in the background; returns the run id at once.

    ``config``: a TOML path or a dict; ``overrides``: ``section.key=value`` items;
    ``gpus``: ``CUDA_VISIBLE_DEVICES`` for the run (e.g. ``"1"`` or ``"0,1"``);
    ``nproc > 1``: that many processes through ``torchrun``; ``max_concurrent``: set the
    store's limit on runs at once (``0`` for none); further runs wait as ``queued``.
    An invalid config raises :class:`ConfigError` and writes nothing.
    """
    cfg = resolve_config(config, overrides)
    if name is not None:
        from comera_engine.config import check_run_name

        cfg.name = check_run_name(name)
    gpus = _check_gpus(gpus, nproc)
    if max_concurrent is not None and (
        not isinstance(max_concurrent, int) or max_concurrent < 0
    ):
        raise ConfigError("max_concurrent", f"must be an integer >= 0, got {max_concurrent!r}")
    st = open_store(store)
    if st.readonly:
        raise st.read_only_error()
    check_free_space(st.root, 0, "COMERA_HOME")  # the caller checks a checkpoint's size
    rid = queue_run(st, cfg, gpus=gpus, nproc=nproc)
    if max_concurrent is not None:
        set_max_concurrent(st, max_concurrent)
    dispatch(st)
    return rid


def queue_run(
    st: RunStore,
    cfg: Any,
    *,
    gpus: str | None = None,
    nproc: int = 1,
    sweep_id: str | None = None,
    cell: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """Record a validated config (``comera_engine.config.Config``) as a ``queued`` run:
    its folder with ``config.toml`` and ``launch_env.json`` (``env``, default
    :func:`run_env`), and its row (of sweep ``sweep_id``, as ``cell``). Starts nothing
    (:func:`dispatch` does). Returns the run id; on failure nothing is left behind."""
    import json

    from comera_engine.config import to_toml

    text = to_toml(cfg)
    device = cfg.train.device
    if gpus is not None and device in ("auto", "cpu"):
        device = "cuda" if device == "auto" else device
    for _ in range(20):
        rid = new_run_id()
        run_dir = st.run_dir(rid)
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover
        raise LaunchError("launch: could not allocate a run folder")
    try:
        (run_dir / CONFIG_FILENAME).write_text(text, encoding="utf-8")
        recorded = dict(run_env() if env is None else env)
        if "OMP_NUM_THREADS" not in recorded:  # the launcher sets it at dispatch
            recorded[AUTO_KEY] = "auto"
        (run_dir / ENV_FILENAME).write_text(json.dumps(recorded, indent=1), encoding="utf-8")
        st.create_run(
            cfg.name,
            cfg.to_dict(),
            "queued",
            device=device,
            gpus=gpus,
            nproc=nproc,
            cwd=cfg.base_dir or os.getcwd(),
            run_id=rid,
            sweep_id=sweep_id,
            cell=cell,
        )
    except BaseException as e:
        shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(e, OSError):  # a full disk, a read-only home: one line
            raise LaunchError(disk_full_text(st.root, exc=e, home=True) if is_disk_full(e) else
                              f"launch: cannot write the run folder {run_dir} "
                              f"({e.strerror or e}); check COMERA_HOME") from None
        raise
    st.log_event(rid, "launch", f"queued {cfg.name} (nproc={nproc}, gpus={gpus or 'default'})")
    return rid


def set_max_concurrent(store: RunStore | str | os.PathLike[str] | None, limit: int | None) -> None:
    """Limit the runs active at once in this store (``None``/``0``: no limit)."""
    st = open_store(store)
    st.set_setting("max_concurrent", int(limit) if limit else None)
    dispatch(st)


def dispatch(store: RunStore | str | os.PathLike[str] | None = None) -> list[str]:
    """Start queued runs, oldest first, while the store's ``max_concurrent`` allows.
    Returns the ids started."""
    st = open_store(store)
    limit = st.get_setting("max_concurrent")
    started = []
    while (rid := st.claim_queued(limit)) is not None:
        try:
            _spawn_supervisor(st, rid)
        except OSError as e:
            st.lifecycle(rid).end("failed", f"launch: could not start the supervisor: {e}")
        started.append(rid)
    return started


def housekeeping(store: RunStore | str | os.PathLike[str] | None = None) -> dict[str, list[str]]:
    """What a poller (``comera runs``, the dashboard) should call now and then: mark dead
    runs crashed (:func:`~comera_engine.launch.liveness.reap`) and start queued runs that fit
    (:func:`dispatch`), e.g. after a reboot left no supervisor to do it."""
    st = open_store(store)
    return {"crashed": reap(st), "started": dispatch(st)}


def _spawn_supervisor(st: RunStore, rid: str) -> None:
    run = st.get_run(rid)
    assert run is not None
    st.run_dir(rid).mkdir(parents=True, exist_ok=True)
    assign_threads(st, rid)
    cwd = run["cwd"] if run["cwd"] and os.path.isdir(run["cwd"]) else str(st.run_dir(rid))
    cmd = [
        sys.executable,
        str(Path(__file__).with_name("supervise.py")),  # = -m ...launch.supervisor, no torch
        "--store",
        str(st.path),
        "--run-id",
        rid,
    ]
    with open(st.log_path(rid), "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=child_env(),
            start_new_session=True,
            close_fds=True,
        )
    # only set the pid if the supervisor has not registered itself yet
    st.lifecycle(rid).attach_supervisor(proc.pid, this_host())
    # reap the child when it exits so a long-lived launcher (the dashboard) keeps no zombies
    threading.Thread(target=proc.wait, name=f"reap-{rid}", daemon=True).start()


def checkpoint_steps(run_dir: str | os.PathLike[str]) -> list[int]:
    """Steps of the complete checkpoints in ``<run_dir>/checkpoints/``, oldest first."""
    return [step for step, _ in list_checkpoints(Path(run_dir) / "checkpoints")]


def stop(
    run_id: str,
    timeout: float = DEFAULT_STOP_TIMEOUT,
    store: RunStore | str | os.PathLike[str] | None = None,
    wait: bool = True,
) -> str:
    """Stop a run gracefully: SIGTERM to its owner (the trainer), which writes a checkpoint
    and reports ``stopped``; after ``timeout`` seconds it is killed and, once it is gone,
    recorded as ``crashed``.

    A queued run that has not started becomes ``stopped`` at once. A cell of a Ray
    sweep is only marked ``stopping``: its driver cancels the task (:func:`is_ray_cell`;
    the cell's pid is the driver's, which is never signalled). With ``wait`` this
    returns the final status (or ``stopping`` when the owner could not be stopped:
    ``comera stop`` then says so and exits 1); without, it
    returns right after the request (the supervisor enforces the timeout).
    """
    st = open_store(store)
    rid = st.resolve(run_id)
    reap(st)
    run = st.get_run(rid)
    assert run is not None
    if run["status"] in FINAL_STATUSES:
        return str(run["status"])
    if run["status"] == "queued" and run["dispatched_at"] is None:
        if st.lifecycle(rid).cancel(event=("stop", "stopped while queued (never started)")):
            return "stopped"
        run = st.get_run(rid)
        assert run is not None
    if is_ray_cell(st, run):
        return _stop_ray_cell(st, rid, timeout, wait)
    if run["host"] and run["host"] != this_host():
        raise LaunchError(f"run: {rid} runs on host {run['host']}; stop it there")
    deadline = time.time() + float(timeout)
    # a trainer frozen in the middle of a store write holds its lock: woken first, it
    # finishes the write, and the request below gets the lock
    signals.wake(run["pid"])
    st.lifecycle(rid).request_stop(
        deadline, event=("stop", f"stop requested (SIGTERM, kill after {timeout:g} s)"))
    run = st.get_run(rid)
    assert run is not None
    deadline = run["stop_deadline"] or deadline
    if not pid_alive(run["supervisor_pid"]) and run["status"] == "stopping":
        signals.send_stop_signal(run["pid"], int(run["nproc"] or 1))  # no supervisor to do it
    if not wait:
        return str(run["status"])
    killed = False
    while True:
        run = st.get_run(rid)
        assert run is not None
        if run["status"] in FINAL_STATUSES:
            # confirmed; give the processes a moment to exit so a resume cannot overlap
            _wait_gone(run, 10.0)
            return str(run["status"])
        now = time.time()
        supervised = pid_alive(run["supervisor_pid"])
        if now > deadline + 2.0 and not supervised and not killed:
            killed = True
            if signals.kill_owner(run):  # only a process that is gone is recorded as such
                st.lifecycle(rid).crash(
                    f"stop: no checkpoint confirmed within {timeout:g} s; killed (SIGKILL)",
                    where={"attempt": run["attempt"]},
                )
        if now > deadline + 15.0:
            return str(run["status"])
        time.sleep(0.1)


def run_folder_of(root: Path, ref: str) -> Path:
    """The run folder ``<root>/<ref>``, or the one folder whose name starts with
    ``ref``, found without the store (its file may be unreadable). LaunchError when
    none or several match."""
    root = Path(root)
    if ref and "/" not in ref and (root / ref / CONFIG_FILENAME).is_file():
        return root / ref
    found = [p for p in (root.iterdir() if root.is_dir() else [])
             if p.name.startswith(ref) and (p / CONFIG_FILENAME).is_file()]
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise LaunchError(f"run: {what} run folder(s) named {ref!r}... in {root}")
    return found[0]


def stop_folder(folder: Path, timeout: float = DEFAULT_STOP_TIMEOUT) -> str:
    """Stop the trainer that holds ``folder``'s lock, through the owner record in its
    ``.lock`` alone (for a store that cannot be read): SIGCONT and SIGTERM, then after
    ``timeout`` seconds SIGKILL. Returns ``stopped`` (it let go of its folder),
    ``killed`` or ``not running``; LaunchError when the owner runs on another host or
    outlives the kill."""
    holder = lock_holder(folder)
    if holder is None:
        return "not running"
    pid = holder.get("pid")
    if not pid or (holder.get("host") and holder["host"] != this_host()):
        raise LaunchError(f"run: {folder} is held by pid {pid} on {holder.get('host')}; "
                          "stop it there")
    signals.send_stop_signal(int(pid))
    deadline = time.monotonic() + float(timeout)
    while lock_holder(folder) is not None:
        if time.monotonic() > deadline:
            signals.kill_owner({"pid": pid, "pid_started": holder.get("pid_started")})
            time.sleep(0.2)
            if lock_holder(folder) is not None:
                raise LaunchError(f"run: pid {pid} still holds {folder} after SIGKILL")
            return "killed"
        time.sleep(0.1)
    return "stopped"


def is_ray_cell(st: RunStore, run: Mapping[str, Any]) -> bool:
    """Whether ``run`` is a cell of a sweep whose cells run as Ray tasks
    (:mod:`comera_engine.launch.ray_backend`). Such a cell's ``pid`` is the sweep's
    driver, shared by every cell it runs: never a trainer to signal or kill."""
    sid = run.get("sweep_id")
    if not sid:
        return False
    sweep = st.get_sweep(str(sid))
    return sweep is not None and sweep.get("backend") == "ray"


def _stop_ray_cell(st: RunStore, rid: str, timeout: float, wait: bool) -> str:
    """Stop a Ray cell: only mark it ``stopping`` (with its deadline). Its driver, which
    polls the store, cancels the task (the trainer checkpoints and reports ``stopped``)
    and forces the cancel after the deadline; nothing here signals a process. With
    ``wait``, waits for the final status (a driver that died meanwhile has its cells
    marked crashed), else returns at once."""
    deadline = time.time() + float(timeout)
    st.lifecycle(rid).request_stop(deadline, event=(
        "stop", f"stop requested (the sweep's Ray driver cancels the task, by force after "
        f"{timeout:g} s)"))
    last_reap = time.monotonic()
    while True:
        run = st.get_run(rid)
        assert run is not None
        if not wait or run["status"] in FINAL_STATUSES:
            return str(run["status"])
        if time.time() > (run["stop_deadline"] or deadline) + 15.0:
            return str(run["status"])
        if time.monotonic() - last_reap > 1.0:
            last_reap = time.monotonic()
            reap(st)  # a driver that is gone (pid here, heartbeat elsewhere): crashed
        time.sleep(0.1)


def _wait_gone(run: Mapping[str, Any], timeout: float) -> bool:
    """Wait until the run's trainer and supervisor processes have exited."""
    t0 = time.monotonic()
    while processes_alive(run):
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.05)
    return True


def resume_from(store: RunStore, run: Mapping[str, Any]) -> tuple[Path | None, str | None]:
    """Where a resume of ``run`` would start and what stops it: ``(checkpoint, problem)``,
    the newest checkpoint that reads back (``None``: the start) and, when the run cannot
    be resumed, why in words that follow "the run" (``None``: it can). The one rule that
    :func:`resume` enforces and the dashboard's Resume button shows: a stopped, crashed
    or failed run, not a Ray sweep's cell, with its folder's config, and a checkpoint
    that reads back if it has any. A failed run needs a checkpoint besides: started
    afresh it would fail as it did (its error says why; launch it again once that is
    fixed). A crashed run (killed, its machine gone) without one starts afresh."""
    status = str(run.get("status"))
    if status not in RESUMABLE_STATUSES:
        return None, f"is {status}; only stopped, crashed or failed runs can be resumed"
    if is_ray_cell(store, run):  # the local launcher never starts a Ray sweep's cells
        return None, (f"is a cell of Ray sweep {run['sweep_id']}; a Ray cell cannot be "
                      "resumed yet (run its config again)")
    folder = store.run_dir(str(run["id"]))
    if not (folder / CONFIG_FILENAME).is_file():
        return None, f"has no {CONFIG_FILENAME} in its folder to resume from"
    try:
        start, _ = resume_point(folder / "checkpoints")
    except ConfigError as e:  # every checkpoint damaged
        return None, f"has no checkpoint that reads back ({e.problem})"
    if start is None and status == "failed":
        return None, ("failed before its first checkpoint: a resume would start it afresh, "
                      "into the same failure; fix what its error says and launch it "
                      "again")
    return start, None


def resume(run_id: str, store: RunStore | str | os.PathLike[str] | None = None) -> str:
    """Continue a ``stopped``, ``crashed`` or ``failed`` run from its newest checkpoint
    that reads back whole, as the same run (step numbers continue; metrics the old
    attempt logged after that checkpoint are replaced); a stopped or crashed one
    without a checkpoint from the start (:func:`resume_from` says what can be resumed).
    Returns the run id; the run is queued and started like a new one. Refused (one
    line, nothing changed) when it cannot be, or while a process still holds the run
    folder's lock."""
    st = open_store(store)
    rid = st.resolve(run_id)
    if st.readonly:
        raise st.read_only_error()
    reap(st)
    run = st.get_run(rid)
    assert run is not None
    start, problem = resume_from(st, run)
    if problem is not None:
        raise ResumeRefused(rid, problem)
    if not _wait_gone(run, 10.0):
        raise LaunchError(f"run: {rid} still has a live process (pid {run['pid']}); try again")
    holder = lock_holder(st.run_dir(rid))
    if holder is not None:
        raise LaunchError(
            f"run: {rid} is still being written by pid {holder.get('pid', '?')}; "
            "stop that process first"
        )
    _check_resumable_folder(st.run_dir(rid))
    where = f"checkpoint {start.stem}" if start else "the start (no checkpoint)"
    ok = st.lifecycle(rid).requeue(
        event=("resume", f"resume requested from {where}"),
        queued_at=time.time(),
        resume_pending=1,
        **_REQUEUE_CLEARS,
    )
    if not ok:
        raise LaunchError(f"run: {rid} changed status while resuming; try again")
    dispatch(st)
    return rid


def _check_resumable_folder(run_dir: Path) -> None:
    """What a resumed trainer needs of its folder, checked before the resume is
    accepted: its config reads back, the folder (and its checkpoints) can be written,
    and the disk has room for one more checkpoint."""
    from comera_engine.config import load_config

    try:
        load_config(run_dir / CONFIG_FILENAME)
    except ConfigError as e:
        raise LaunchError(f"run: {run_dir / CONFIG_FILENAME} no longer reads back "
                          f"({e}); restore it (it is the run's resolved config)") from None
    for folder in (run_dir, run_dir / "checkpoints"):
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            raise LaunchError(f"run: {folder} is read-only; make it writable "
                              f"(chmod u+w {folder}) to resume")
    try:  # access() says yes to root on a read-only mount: try it
        probe = run_dir / ".resume-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        if is_disk_full(e):
            raise LaunchError(f"run: {disk_full_text(run_dir, exc=e)}") from None
        raise LaunchError(f"run: cannot write in {run_dir} ({e.strerror or e}); make it "
                          "writable to resume") from None
    check_free_space(run_dir, checkpoint_bytes(run_dir / "checkpoints"), "run")
