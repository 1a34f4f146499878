"""Dashboard pages, routed by ``st.navigation`` in ``app/Home.py``.

The folder is deliberately not called ``pages/``: Streamlit also auto-discovers a
``pages/`` folder beside the entry script, and a deep link (``/live_run?run=…``) as the
first request to a fresh server would then run the page without the router.
"""
