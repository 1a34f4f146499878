"""Detached launcher: start, stop, resume and follow training runs.

The dashboard never owns a training process. :func:`launch` validates the config, writes
``<run_dir>/config.toml``, records the run as ``queued`` and starts a small detached
supervisor (``python -m comera_engine.launch.supervisor``, its own session) that runs the
trainer (``python -m comera_engine.cli train <run_dir>/config.toml --store DB --run-id ID
[--resume]``, or the same through ``torchrun`` for several GPUs), with stdout/stderr
appended to ``<run_dir>/train.log``. The supervisor records a trainer that exits without
a final status as ``crashed`` (``failed`` for a Python traceback), escalates a stop to
SIGKILL after its timeout, and starts queued runs when a slot frees up.

Lifecycle: ``queued → running → (stopping →) finished | stopped | failed | diverged |
crashed``; ``stopped``, ``crashed`` and ``failed`` runs can be resumed as the same run,
from their newest checkpoint that reads back whole. A run has one writer
(:mod:`comera_engine.launch.owner`): a resume of a run whose folder is still locked by a
live trainer is refused.

Phase: while it runs, a run's row also says what its trainer is doing (``runs.phase``,
one of :data:`comera_engine.store.PHASES`: preparing data → training tokenizer →
building → training ⇄ evaluating / checkpointing → done) and how far along a long phase
is (``runs.phase_progress``, 0..1, or NULL when unknown: evaluation reports it per eval
batch, written at most every 0.5 s). A launched trainer reports from its first moment
(the data preparation before it takes the run); a foreground ``comera train`` from its
row's creation (building on). ``comera runs`` shows it beside the status (``running ·
evaluating 40%``), the Live run page as a progress bar. The phase a run failed or
crashed in stays in its row; a resume clears it.

This package's ``__init__`` only gathers the public names: launching, stopping and
resuming are ``runs.py``, the launch environment ``env.py``, the signals to a trainer
``signals.py``, a run's log ``logs.py``, the one writer per run ``owner.py``, liveness
and crash reaping ``liveness.py``, the thread budget ``threads.py``; the scheduler
(``scheduler.py``) with its executors (``supervisor.py``, ``ray_backend.py``), sweeps
(``sweep.py``) and the ``comera`` subcommands (``cli.py``, ``sweep_cli.py``).
"""

from comera_engine.launch.env import (
    ENV_FILENAME,
    assign_threads,
    child_env,
    recorded_env,
    run_env,
)
from comera_engine.launch.liveness import reap
from comera_engine.launch.logs import logs
from comera_engine.launch.runs import (
    CONFIG_FILENAME,
    DEFAULT_STOP_TIMEOUT,
    LaunchError,
    checkpoint_steps,
    dispatch,
    housekeeping,
    is_ray_cell,
    launch,
    open_store,
    queue_run,
    resolve_config,
    resume,
    run_folder_of,
    set_max_concurrent,
    stop,
    stop_folder,
)
from comera_engine.launch.signals import send_stop_signal, signal_group, wake

__all__ = [
    "CONFIG_FILENAME",
    "DEFAULT_STOP_TIMEOUT",
    "ENV_FILENAME",
    "LaunchError",
    "assign_threads",
    "checkpoint_steps",
    "child_env",
    "dispatch",
    "housekeeping",
    "is_ray_cell",
    "launch",
    "logs",
    "open_store",
    "queue_run",
    "reap",
    "recorded_env",
    "resolve_config",
    "resume",
    "run_env",
    "run_folder_of",
    "send_stop_signal",
    "set_max_concurrent",
    "signal_group",
    "stop",
    "stop_folder",
    "wake",
]
