"""Start the dashboard: ``run_app(host, port, store)`` (what ``comera app`` calls).

Replaces the current process with ``streamlit run app/Home.py`` bound to ``host:port``
(``127.0.0.1:8501`` unless told otherwise), with ``COMERA_HOME`` pointing at the run
store so that every page and every launched run use the same store. The user models and
data files ``comera app --models/--data`` registered (``comera_engine.studio``) reach the
dashboard as its script arguments; the folders their modules import from go on
``PYTHONPATH`` (for the dashboard and the runs it launches).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENTRY = Path(__file__).resolve().parent / "Home.py"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8501


def store_home(store: str | os.PathLike[str] | None) -> str | None:
    """The ``COMERA_HOME`` folder for a store given as a folder or a ``.db`` file."""
    if store is None or str(store) == "":
        return None
    p = Path(store).expanduser()
    if p.suffix == ".db" or p.is_file():
        p = p.parent
    return str(p.resolve())


def streamlit_command(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                      headless: bool = True, script_args: Sequence[str] = ()) -> list[str]:
    """The ``python -m streamlit run …`` command line for the dashboard; ``script_args``
    go to ``app/Home.py`` (after ``--``)."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"port: must be an integer in 1..65535, got {port!r}")
    if not host or any(c.isspace() for c in host):
        raise ValueError(f"host: must be a host name or address, got {host!r}")
    return [
        sys.executable, "-m", "streamlit", "run", str(ENTRY),
        "--server.address", host,
        "--server.port", str(port),
        "--server.headless", "true" if headless else "false",
        "--browser.gatherUsageStats", "false",
        "--server.fileWatcherType", "none",
        *(["--", *script_args] if script_args else []),
    ]


def app_env(store: str | os.PathLike[str] | None = None,
            paths: Sequence[str] = ()) -> dict[str, str]:
    """Environment for the dashboard: ``COMERA_HOME`` as an absolute folder (``store``, else
    the current default), and the repository on ``PYTHONPATH`` so ``app`` imports from a
    source checkout, then ``paths`` (where registered model modules import from)."""
    env = dict(os.environ)
    home = store_home(store)
    if home is None:  # pin the default (./runs or $COMERA_HOME) before any chdir
        from comera_engine.store import resolve_store_path

        home = str(resolve_store_path(None).parent)
    env["COMERA_HOME"] = home
    root = str(ENTRY.parents[1])
    current = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    entries = ([] if root in current else [root]) + current
    entries += [p for p in dict.fromkeys(paths) if p not in entries]
    if entries != current:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    return env


def run_app(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
            store: str | os.PathLike[str] | None = None,
            registry: Mapping[str, Any] | None = None) -> None:
    """Exec the dashboard (never returns). ``store``: run-store folder or ``.db`` file
    (default: ``$COMERA_HOME``, else ``./runs``); ``registry``: what ``comera app
    --models/--data`` registered (``comera_engine.studio.build_registry``)."""
    from comera_engine.studio import registry_args

    cmd = streamlit_command(host, port, script_args=registry_args(registry))
    env = app_env(store, (registry or {}).get("paths", ()))
    cwd = ENTRY.parents[1]
    if (cwd / "experiments").is_dir():
        os.chdir(cwd)  # relative data paths in the presets are relative to the repository
    sys.stdout.write(f"CoMERA Studio on http://{host}:{port}  (run store: "
                     f"{env['COMERA_HOME']})\n")
    for kind in ("models", "data", "configs"):
        names = sorted((registry or {}).get(kind) or {})
        if names:
            sys.stdout.write(f"  your {kind}: {', '.join(names)}\n")
    sys.stdout.flush()
    os.execvpe(cmd[0], cmd, env)
