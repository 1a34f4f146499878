"""Streamlit pieces shared by the pages: the cached store, empty states, navigation."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import streamlit as st

from app.lib import fmt, runs
from app.lib.defaults import default_config
from app.lib.form import auto_run_name
from comera_engine.launch import reap as reap_dead_runs
from comera_engine.store import RunStore, StoreError

#: held while a page run imports pandas and Plotly (app/Home.py): two first runs of a
#: fresh server (the page opened and a click at once) imported them side by side, and one
#: met the other's half-made pandas ("partially initialized module 'pandas'")
FIRST_IMPORTS = threading.Lock()

HOME_PAGE = "views/overview.py"
NEW_PAGE = "views/new_experiment.py"
LIVE_PAGE = "views/live_run.py"
COMPARE_PAGE = "views/compare.py"
SWEEPS_PAGE = "views/sweeps.py"
LEARN_PAGE = "views/learn.py"
EXPORT_PAGE = "views/export.py"

#: Token of the empty-state "launch the default experiment" button: shared by every
#: session, so two sessions pressing it at once start one run.
DEFAULT_LAUNCH_TOKEN = "empty-store:default-experiment"


#: The most metric tiles side by side: in a row of more, a tile on a 1024 px screen with
#: the sidebar open is under 90 px wide, and a value such as "430 MiB" wraps.
TILES_PER_ROW = 3

#: Every page's style. A tile's value and label wrap instead of ending in "…" (Streamlit
#: cuts them to one line: a Learn page rank list "4-16-24-24-2…" hid its last bonds), and
#: a value's type shrinks with its tile (each tile a size container; from 36 px down to
#: 24 px, at 22 % of the tile's width), so a figure fits on one line in a narrow tile.
PAGE_CSS = (
    "<style>[data-testid='stMetric'] { container-type: inline-size; }"
    " [data-testid='stMetricValue'] { font-size: clamp(1.5rem, 22cqi, 2.25rem) !important; }"
    " [data-testid='stMetricValue'], [data-testid='stMetricValue'] *, "
    "[data-testid='stMetricLabel'], [data-testid='stMetricLabel'] * {"
    " white-space: normal !important; overflow: visible !important;"
    " text-overflow: clip !important; overflow-wrap: anywhere; }</style>"
)


def tile_columns(n: int, per_row: int = TILES_PER_ROW) -> list[Any]:
    """Slots for ``n`` metric tiles in as few rows as ``per_row`` allows, the rows as even
    as they can be (6 tiles: 3 + 3; 4 tiles by 2: 2 + 2; 5: 3 + 2) and every column of
    the same width, so a tile is never narrower than a row of ``per_row`` gives it."""
    rows = max(1, math.ceil(n / per_row))
    cols = math.ceil(n / rows)
    slots: list[Any] = []
    while len(slots) < n:
        slots += st.columns(cols)[: n - len(slots)]
    return slots


#: Session-state entry holding the New-experiment form's values between visits.
FORM_VALUES = "_form_values"


def restore_form(prefixes: tuple[str, ...] = ()) -> dict[str, object]:
    """Put the saved values of the New-experiment widgets back before they are drawn
    (Streamlit forgets the state of widgets that were not on the page just run).
    Returns the saved-values dict to update with :func:`save_form`."""
    saved: dict[str, object] = st.session_state.setdefault(FORM_VALUES, {})
    for key, value in saved.items():
        if key not in st.session_state:
            st.session_state[key] = value
    return saved


def save_form(saved: dict[str, object], keys: set[str]) -> None:
    for key in keys:
        if key in st.session_state:
            saved[key] = st.session_state[key]


@st.cache_resource(show_spinner=False)
def _store_for(path: str) -> RunStore:
    return RunStore(path)


def get_store() -> RunStore:
    """The server's run store (one connection per store path, shared by sessions)."""
    return _store_for(str(runs.store_path()))


def require_store() -> RunStore:
    """The store, or an explanation and a stopped page when it cannot be opened. Also
    follows a launch made by a button callback to the live page."""
    follow_launch()
    try:
        return get_store()
    except Exception as e:  # noqa: BLE001 - foreign or corrupt file, permissions
        st.error(
            f"The run store cannot be opened: {e}\n\nA damaged store is rebuilt from the "
            "run folders by `comera repair`; or set `COMERA_HOME` to a folder for a fresh "
            "store and restart the dashboard."
        )
        st.stop()
        raise  # pragma: no cover - st.stop() raises


REAP_WAIT_S = 1.0
"""How long a page waits for the store's write lock to mark vanished runs crashed. A
process frozen in the middle of a write (a SIGSTOPped trainer) holds the lock: the page
then renders from what is recorded, and a later rerun tries again."""


def reap(store: RunStore, every: float = 5.0) -> None:
    """Mark runs whose process vanished as crashed (at most every ``every`` seconds per
    session), waiting at most :data:`REAP_WAIT_S` for the store's write lock."""
    now = time.monotonic()
    last = st.session_state.get("_last_reap", 0.0)
    if now - last >= every:
        st.session_state["_last_reap"] = now
        brief = None
        try:
            brief = RunStore(store.path, create=False, busy_timeout=REAP_WAIT_S)
            reap_dead_runs(brief)
        except Exception:  # noqa: BLE001 - a busy store must not break a page
            pass
        finally:
            if brief is not None:
                brief.close()


def go_live(run_id: str) -> None:
    st.switch_page(LIVE_PAGE, query_params={"run": run_id})


def go_sweep(sweep_id: str) -> None:
    st.switch_page(SWEEPS_PAGE, query_params={"sweep": sweep_id})


GO_LIVE = "_go_live"


def _launch_default_clicked(store: RunStore) -> None:
    """Button callback: runs before the next script run, so a second session's click is
    honoured even though its page no longer shows the empty state."""
    config = default_config()  # named as the form names it: "digits-tt-mlp · 60×", ...
    config["name"] = auto_run_name(config, None, False,
                                   (config.get("comera") or {}).get("target_compression"))
    try:
        rid, started = runs.guarded_launch(store, config, DEFAULT_LAUNCH_TOKEN, unique=True)
    except Exception as e:  # noqa: BLE001 - shown on the page
        st.session_state["_launch_error"] = str(e)
        return
    st.session_state[GO_LIVE] = rid
    st.session_state["_launch_note"] = (
        f"Launched the default experiment as run `{rid}`." if started else
        f"The default experiment was already launched (run `{rid}`); showing it."
    )


def follow_launch() -> None:
    """After a launch callback: go to the live page of its run (call before the page)."""
    err = st.session_state.pop("_launch_error", None)
    if err:
        st.error(f"Launch failed: {err}")
    rid = st.session_state.pop(GO_LIVE, None)
    if rid:
        go_live(rid)


def launch_note() -> None:
    note = st.session_state.pop("_launch_note", None)
    if note:
        st.toast(note, icon=":material/rocket_launch:")


def empty_state(store: RunStore, what: str, key: str) -> None:
    """The no-runs-yet panel: what to do, and a button that launches the default."""
    with st.container(border=True):
        st.markdown(f"#### :material/rocket_launch: No runs yet\n{what}")
        st.markdown(
            "Start with the **default experiment**: a tiny TT-MLP on scikit-learn's 8×8 "
            "digits that trains on a CPU in well under a minute, learning its TT ranks "
            "while it trains. Or design your own on **New experiment**."
        )
        c1, c2, _ = st.columns([1.3, 1, 2])
        c1.button("Launch the default experiment", type="primary", key=f"{key}-default",
                  icon=":material/play_arrow:", on_click=_launch_default_clicked,
                  args=(store,))
        if c2.button("Design an experiment", key=f"{key}-new", icon=":material/tune:"):
            st.switch_page(NEW_PAGE)


def sidebar(store: RunStore | None) -> None:
    with st.sidebar:
        if store is None:
            return
        try:
            all_runs = store.list_runs()
        except Exception as e:  # noqa: BLE001
            st.error(f"Run store unavailable: {e}")
            return
        live = [r for r in all_runs if runs.is_live(r)]
        st.caption(
            f"**{len(all_runs)}** runs · **{len(live)}** live  \n"
            f"Run store: `{runs.env_store_hint()}`"
        )


def page_header(title: str, subtitle: str, icon: str | None = None) -> None:
    st.title(f"{icon} {title}" if icon else title, anchor=False)
    st.caption(subtitle)


def store_page(title: str, subtitle: str, icon: str) -> RunStore:
    """How a page on the run store starts: the store (:func:`require_store`), runs whose
    process vanished marked as crashed (:func:`reap`), and the page's header."""
    store = require_store()
    reap(store)
    page_header(title, subtitle, icon)
    return store


def runs_or_stop(store: RunStore, what: str, key: str) -> list[dict[str, Any]]:
    """Every run in the store; where there is none, the no-runs-yet panel
    (:func:`empty_state` with ``what`` and ``key``) and the page stops there."""
    all_runs = store.list_runs()
    if not all_runs:
        empty_state(store, what, key)
        st.stop()
    return all_runs


def unarchived(all_runs: list[dict[str, Any]], key: str,
               on_change: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """The runs a list offers: archived ones only when the "Show archived" toggle (drawn
    here, under ``key``; off by default, disabled when none is archived; ``on_change``
    its callback) is on."""
    archived = [r for r in all_runs if r.get("archived_at")]
    shown = st.toggle(f"Show archived ({len(archived)})", key=key, disabled=not archived,
                      on_change=on_change,
                      help="Runs archived on Live run (Name, notes and tags); restore them "
                           "there.")
    return all_runs if shown else [r for r in all_runs if not r.get("archived_at")]


def table(data: Any, **kwargs: Any) -> Any:
    """``st.dataframe`` as every page draws one: full width, no index, and a value a run
    did not log (``None``, NaN) shown as a blank cell (the grid otherwise writes "None");
    numeric columns stay numbers, so they sort as numbers. ``kwargs`` go to
    ``st.dataframe`` (``column_config``, ``on_select``, ...)."""
    kwargs.setdefault("hide_index", True)
    kwargs.setdefault("width", "stretch")
    return st.dataframe(data, placeholder="", **kwargs)


def messages(msgs: dict[str, list[tuple[str, str]]], field: str) -> None:
    """Errors / warnings / notes about one form field, right below it."""
    for level, text in msgs.get(field, []):
        if level == "error":
            st.error(text, icon=":material/error:")
        elif level == "warning":
            st.warning(text, icon=":material/warning:")
        else:
            st.caption(f":material/info: {text}")


def relabel(key: str, options: list[Any], index: int, label: Callable[[Any], str]) -> int:
    """Call before drawing the selectbox ``key`` over ``options`` (``index``: its choice
    when it is first drawn; ``label``: its ``format_func``); returns the ``index`` to draw
    it with. The browser shows a closed selectbox's choice by the label it had when it was
    chosen, and Streamlit sends a changed label only in the list of options: a sweep that
    ended still read "running", a renamed run its old name. When the chosen option's label
    changed since the last pass, the choice is handed to the widget again, which sends
    the browser the new label; otherwise nothing is set (a picker the user is typing in
    is left alone)."""
    seen: dict[str, str] = st.session_state.setdefault("_picker_labels", {})
    current = st.session_state.get(key)
    chosen = current if current in options else options[index]
    now = label(chosen)
    if key in st.session_state and seen.get(key) not in (None, now):
        st.session_state[key] = chosen
        index = 0  # the state says the choice; no default beside it (Streamlit warns)
    seen[key] = now
    return index


def pick_run(store: RunStore, label: str, key: str, runs_list: list[dict[str, Any]],
             default_id: str | None = None, offered: str = "runs") -> dict[str, Any] | None:
    """A run selectbox (newest first) that remembers the choice in ``?run=``, its closed
    label the chosen run's name as it is now (:func:`relabel`). A ``?run=`` this page
    does not offer (an old or mistyped link; ``offered`` says what the page lists) is
    named in a notice above the newest run, and stays in the address until a run is
    picked, so the notice stays while the page refreshes."""
    if not runs_list:
        return None
    ids = [r["id"] for r in runs_list]
    wanted = default_id or st.query_params.get("run")
    by_id = {r["id"]: r for r in runs_list}
    picked = f"{key}-picked"  # the user chose in the selectbox since the page opened
    missing = wanted if wanted and wanted not in ids and not st.session_state.get(
        picked) else None
    if missing:
        shown = "".join(c for c in str(missing)[:40] if c.isalnum() or c in "-_.")
        known = store.get_run(missing) if shown == missing else None
        st.warning((f"Run `{shown}` ({fmt.literal(known['name'])}) is not among the {offered}"
                    if known else f"No run `{shown}` in the run store (an old or mistyped "
                                  "link)") + ": showing the newest. Pick a run below.",
                   icon=":material/link_off:")

    def name(i: str) -> str:
        return f"{by_id[i]['name']} · {i}"

    index = relabel(key, ids, ids.index(wanted) if wanted in ids else 0, name)
    rid = st.selectbox(label, ids, index=index, key=key, format_func=name,
                       on_change=lambda: st.session_state.__setitem__(picked, True))
    if not missing and st.query_params.get("run") != rid:
        st.query_params["run"] = rid
    return by_id[rid]


class SteadyReads:
    """The run store's read methods, each answer remembered for this session: when the
    store is busy (:class:`StoreError`, another process holding its lock), a read gives
    its last answer instead of failing, so a page that refreshes every second redraws
    what it showed rather than dropping its charts for a warning. ``busy`` counts the
    reads answered so in the last pass."""

    def __init__(self, store: RunStore, memo: dict[str, Any]) -> None:
        self._store = store
        self._memo = memo
        self.busy = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def read(*args: Any, **kwargs: Any) -> Any:
            key = repr((name, args, sorted(kwargs.items())))
            try:
                self._memo[key] = method(*args, **kwargs)
            except StoreError:
                if key not in self._memo:
                    raise
                self.busy += 1
            return self._memo[key]

        return read


def steady(store: RunStore, page: str) -> SteadyReads:
    """:class:`SteadyReads` of ``store`` for ``page`` in this session."""
    return SteadyReads(store, st.session_state.setdefault(f"_steady:{page}", {}))
