"""CoMERA Studio: entry point of the dashboard (``streamlit run app/Home.py``).

Routes between the pages in ``app/views/`` with ``st.navigation``. The run store is
``$COMERA_HOME/comera.db`` (else ``./runs/comera.db``); it is never chosen from the
browser.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # `streamlit run app/Home.py` from a source checkout
    sys.path.insert(0, str(_ROOT))

import streamlit as st  # noqa: E402

from app.lib import ui  # noqa: E402

st.set_page_config(
    page_title="CoMERA Studio",
    page_icon="🧊",  # an emoji is drawn in the page (a :material/: icon is fetched)
    layout="wide",
    initial_sidebar_state="expanded",
)

pages = {
    "": [
        st.Page(ui.HOME_PAGE, title="Overview", icon=":material/dashboard:", default=True),
    ],
    "Train": [
        st.Page(ui.NEW_PAGE, title="New experiment", icon=":material/add_circle:"),
        st.Page(ui.LIVE_PAGE, title="Live run", icon=":material/monitoring:"),
        st.Page(ui.SWEEPS_PAGE, title="Sweeps", icon=":material/grid_view:"),
        st.Page(ui.COMPARE_PAGE, title="Compare", icon=":material/compare_arrows:"),
    ],
    "Understand & ship": [
        st.Page(ui.LEARN_PAGE, title="Learn", icon=":material/school:"),
        st.Page(ui.EXPORT_PAGE, title="Export", icon=":material/download:"),
    ],
}
page = st.navigation(pages)

st.html(ui.PAGE_CSS)  # tiles whose values fit them (app/lib/ui.py)

with st.sidebar:
    st.markdown("### :material/view_in_ar: CoMERA Studio")
    st.caption("Rank-adaptive tensor-train training, live.")

try:
    store = ui.get_store()
except Exception as e:  # noqa: BLE001 - a foreign/corrupt store file: say so, don't crash
    st.error(f"The run store cannot be opened: {e}")
    store = None
ui.sidebar(store)
# the first runs of a fresh server import pandas and Plotly one at a time: side by side,
# an import could meet the other's half-made pandas ("partially initialized module")
with ui.FIRST_IMPORTS:
    import pandas  # noqa: E402, F401

    import app.lib.plots  # noqa: E402, F401
page.run()
