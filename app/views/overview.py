"""Overview: what CoMERA Studio does, and every run in the store at a glance."""

from __future__ import annotations

import streamlit as st

from app.lib import fmt, runs, ui

store = ui.store_page(
    "CoMERA Studio",
    "Train networks directly in tensor-train form and let the ranks shrink while they "
    "train (CoMERA, arXiv 2405.14377). Launch, watch, compare, learn and export.",
    ":material/view_in_ar:",
)

all_runs = store.list_runs()
if not all_runs:
    ui.empty_state(store, "The run store is empty.", "overview")
    st.divider()
    c1, c2, c3 = st.columns(3)
    with c1.container(border=True):
        st.markdown("**:material/add_circle: New experiment**  \nPick a model, a target "
                    "compression and a rank budget; see the tensorisation before launching.")
    with c2.container(border=True):
        st.markdown("**:material/monitoring: Live run**  \nLoss, accuracy, compression against "
                    "the target and ranks per layer, updating every second.")
    with c3.container(border=True):
        st.markdown("**:material/school: Learn**  \nTT-SVD by hand: cores, ranks, gates and "
                    "why the two-half contraction is cheap.")
    st.stop()

live = [r for r in all_runs if runs.is_live(r)]
queued = [r for r in live if r["status"] == "queued"]
running = [r for r in live if r["status"] != "queued"]
finished = [r for r in all_runs if r["status"] in ("finished", "stopped")]
failed = [r for r in all_runs if r["status"] in ("failed", "crashed", "diverged")]
c = st.columns(5)
c[0].metric("Runs", len(all_runs))
c[1].metric("Running", len(running))
c[2].metric("Queued", len(queued), help="Waiting for a free slot: the launcher starts them "
            "in order as running ones end (New experiment, Advanced: how many at once).")
c[3].metric("Finished / stopped", len(finished))
c[4].metric("Failed / crashed", len(failed))

#: the most running runs drawn as cards; the rest are in the table below
MAX_CARDS = 8
#: seconds between the live cards' redraws while runs are live
REFRESH_S = 2.0
LIVE_AT_START = bool(live)


def live_cards(first: list[list[dict]]) -> None:
    """The running runs' cards: on the page's pass, from the page's own read of the runs
    (``first``, taken once); at every redraw of the cards alone (every :data:`REFRESH_S`
    while a run was live at the page's start), read from the store again. Once none is
    live the whole page is drawn again (its tiles and table too)."""
    now = [r for r in (first.pop() if first else store.list_runs()) if runs.is_live(r)]
    if LIVE_AT_START and not now:
        st.rerun()
    if not now:
        return
    queued = [r for r in now if r["status"] == "queued"]
    running = [r for r in now if r["status"] != "queued"]
    st.subheader("Live now", anchor=False)
    for r in running[:MAX_CARDS]:
        with st.container(border=True):
            a, b, cc = st.columns([3, 2, 1])
            a.markdown(f"**{fmt.literal(r['name'])}** · `{r['id']}` "
                       f"{fmt.status_badge(r['status'])}")
            total = runs.total_steps(r) or 0
            step = r.get("last_step") or 0
            b.progress(min(1.0, step / total) if total else 0.0, text=f"step {step} / {total}")
            if cc.button("Watch", key=f"watch-{r['id']}", icon=":material/monitoring:"):
                ui.go_live(r["id"])
    more = len(running) - MAX_CARDS
    waiting = ""
    if queued:
        sweeps = {r.get("sweep_id") for r in queued if r.get("sweep_id")}
        waiting = (f"{len(queued)} queued"
                   + (f" ({len(sweeps)} sweep{'s' if len(sweeps) > 1 else ''})"
                      if sweeps else "") + ", waiting for a free slot")
    said = "; ".join(part for part in (f"{more} more running" if more > 0 else "", waiting)
                     if part)
    if said:
        st.caption(f":material/hourglass_empty: {said}: in the table below.")


# the page's read, handed to the cards' first draw: one read of the runs per pass
st.fragment(live_cards, run_every=REFRESH_S if LIVE_AT_START else None)([all_runs])

st.subheader("All runs", anchor=False)
listed = ui.unarchived(all_runs, "overview-archived")
tags = sorted({t for r in listed for t in r.get("tags") or []})
wanted = st.multiselect("Tags", tags, key="overview-tags", disabled=not tags,
                        placeholder="Any tag") if tags else []
if wanted:
    listed = [r for r in listed if set(wanted) & set(r.get("tags") or [])]
sweep_names = {s["id"]: s["name"] for s in store.list_sweeps()}
grouped = st.toggle("Group by sweep", key="overview-group",
                    disabled=not any(r.get("sweep_id") for r in listed),
                    help="A sweep's cells together (under its name), then the single runs.")
if grouped:  # by sweep (newest sweep first), then runs outside any sweep; stable order
    order = {sid: i for i, sid in enumerate(sweep_names)}
    listed = sorted(listed, key=lambda r: (r.get("sweep_id") is None,
                                           order.get(r.get("sweep_id"), len(order))))
st.caption("Select a row to open the run on **Live run**.")
by_id = {r["id"]: r for r in listed}
rows = runs.summary_rows(store, listed)
table = [
    {
        "run id": row["run"],
        "name": row["name"],
        **({"sweep": sweep_names.get(by_id[row["run"]].get("sweep_id") or "", "")}
           if grouped else {}),
        "status": row["status"] + (" · archived" if by_id[row["run"]].get("archived_at")
                                   else ""),
        "method": row["method"],
        "progress": min(1.0, row["step"] / row["steps"]) if row["steps"] else None,
        "eval acc": row["eval acc"],
        "compression": row["compression"],
        "scope": row["scope"],
        "target": row["target"],
        "data set": row["data set"],
        "duration": fmt.duration(row["duration"]) if row["duration"] is not None else "",
        "tags": ", ".join(by_id[row["run"]].get("tags") or []),
        "params": row["params"],
        "dense": row["dense"],
        "created": fmt.when(row["created"]) if row["created"] is not None else "",
    }
    for row in rows
]
event = ui.table(
    table,
    on_select="rerun",
    selection_mode="single-row",
    key="overview-runs",
    column_config={
        "progress": st.column_config.ProgressColumn(
            "progress", format="percent", min_value=0.0, max_value=1.0
        ),
        "eval acc": st.column_config.NumberColumn(format="%.1f%%"),
        "compression": st.column_config.NumberColumn(
            "compression", format="%.1f×", help="Dense / effective parameters, measured on "
            "the scope named beside it (the one the run's target is asked in); a dense "
            "baseline has no TT layers: 1× of the whole model."
        ),
        "target": st.column_config.NumberColumn(format="%.0f×"),
        "params": st.column_config.NumberColumn(format="compact"),
        "dense": st.column_config.CheckboxColumn("dense baseline"),
    },
)
selected = event.selection.rows if event is not None else []
if selected:
    ui.go_live(table[selected[0]]["run id"])
