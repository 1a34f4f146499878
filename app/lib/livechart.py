"""A Plotly chart that updates in place: for pages redrawn every second.

``st.plotly_chart`` gives each chart an identity that hashes its figure, so a chart whose
data changed is a new element: the browser mounts a fresh, empty plot and draws it
again, and for that moment the chart is blank. This chart is a small Streamlit
component keyed by name: its identity stays, and each refresh hands the new figure to
the same plot, which ``Plotly.react`` updates in place.

A chart is given as a Plotly spec (:data:`app.lib.plots.Spec`, a plain dict: nothing is
validated per refresh) or a ``go.Figure``. The charts' template (Plotly's default in the
dashboard, ``plotly_white``) is written once into the component's page, not sent with
every chart every second.

The component's two files live in ``<run store>/.ui/live-chart-<plotly version>/``: the
page below and ``plotly.min.js`` copied from the installed ``plotly`` package (nothing is
downloaded).
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import plotly
import plotly.graph_objects as go
import plotly.io as pio

from app.lib import plots, runs

__all__ = ["live_chart", "spec_of"]

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><script src="plotly.min.js"></script>
<style>html, body { margin: 0; padding: 0; overflow: hidden; background: transparent; }</style>
</head><body><div id="chart" class="live-chart"></div><script>
const TEMPLATE = __TEMPLATE__;
const chart = document.getElementById("chart");
function send(type, data) {
  window.parent.postMessage(Object.assign({isStreamlitMessage: true, type: type}, data), "*");
}
window.addEventListener("message", function (event) {
  const msg = event.data;
  if (!msg || msg.type !== "streamlit:render") return;
  const spec = JSON.parse(msg.args.spec);
  const height = msg.args.height;
  chart.style.height = height + "px";
  const layout = Object.assign({template: TEMPLATE}, spec.layout,
                               {height: height, autosize: true});
  const theme = msg.theme;  // the page's theme (light, dark, or the OS's): its colours
  if (theme && theme.textColor) {
    const grid = theme.base === "dark" ? "rgba(250,250,250,0.12)" : "rgba(49,51,63,0.12)";
    layout.font = Object.assign({}, layout.font, {color: theme.textColor});
    layout.paper_bgcolor = "rgba(0,0,0,0)";
    layout.plot_bgcolor = "rgba(0,0,0,0)";
    for (const axis of Object.keys(layout).filter(k => /^[xy]axis[0-9]*$/.test(k))) {
      layout[axis] = Object.assign({}, layout[axis], {gridcolor: grid, zerolinecolor: grid});
    }
    if (!layout.xaxis) layout.xaxis = {gridcolor: grid, zerolinecolor: grid};
    if (!layout.yaxis) layout.yaxis = {gridcolor: grid, zerolinecolor: grid};
  }
  Plotly.react(chart, spec.data, layout, {displaylogo: false, responsive: true});
  send("streamlit:setFrameHeight", {height: height});
});
send("streamlit:componentReady", {apiVersion: 1});
</script></body></html>
"""


def page() -> str:
    """The component's page, with Plotly's default template (``plotly_white``: set by
    :mod:`app.lib.plots`) as Plotly writes it into a figure."""
    template = go.Figure(layout={"template": pio.templates[pio.templates.default]})
    return PAGE.replace("__TEMPLATE__",
                        json.dumps(json.loads(template.to_json())["layout"]["template"]))


@functools.cache
def _folder() -> Path:
    """The component's folder, written once per plotly version and server."""
    folder = runs.store_path().parent / ".ui" / f"live-chart-{plotly.__version__}"
    index = folder / "index.html"
    lib = folder / "plotly.min.js"
    text = page()
    if not (index.is_file() and lib.is_file() and index.read_text() == text):
        folder.mkdir(parents=True, exist_ok=True)
        source = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
        tmp = folder / f".plotly.min.js.{id(folder)}"
        shutil.copyfile(source, tmp)
        tmp.replace(lib)
        index.write_text(text)
    return folder


def spec_of(fig: plots.Spec | go.Figure) -> str:
    """The figure as Plotly JSON (what the chart draws); a spec's non-finite numbers as
    ``null`` and NumPy numbers as numbers, as Plotly writes them."""
    if isinstance(fig, go.Figure):
        return fig.to_json(validate=False)
    try:
        return json.dumps(fig, allow_nan=False, separators=(",", ":"))
    except (ValueError, TypeError):  # a NaN, an infinity or a NumPy number: Plotly's encoder
        return pio.to_json(fig, validate=False)


def live_chart(fig: plots.Spec | go.Figure, key: str) -> None:
    """Draw ``fig`` as the in-place chart ``key`` (its height is the figure's)."""
    from streamlit.components.v1 import declare_component

    component = declare_component("live_chart", path=str(_folder()))
    layout = fig["layout"] if isinstance(fig, dict) else fig.layout
    height = int(layout["height"] or 300)
    component(spec=spec_of(fig), height=height, key=key, default=None)


def figure_of(json_args: str) -> dict[str, Any]:
    """The Plotly figure (``data``, ``layout``) a live chart element was given (tests)."""
    return json.loads(json.loads(json_args)["spec"])
