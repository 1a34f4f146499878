"""CoMERA Studio: the Streamlit dashboard (``streamlit run app/Home.py`` or ``comera app``).

The dashboard reads the run store and talks to the launcher; it never imports the
training loop. Pages live in ``app/views/`` (not ``pages/``: see its docstring), shared
helpers in ``app/lib/``, and ``app.launcher.run_app`` starts it.
"""
