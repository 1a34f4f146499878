"""Start the supervisor without importing the ``comera_engine`` package's ``__init__``
(which loads torch): ``python .../comera_engine/launch/supervise.py --store DB --run-id ID``.

The supervisor lives as long as its run, so it should stay small; it needs only the
store and the launcher modules.
"""

import os
import sys
import types

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        del sys.path[0]  # never import siblings as top-level modules
    pkg_dir = os.path.dirname(here)
    if "comera_engine" not in sys.modules:
        pkg = types.ModuleType("comera_engine")
        pkg.__path__ = [pkg_dir]
        pkg.__file__ = os.path.join(pkg_dir, "__init__.py")
        sys.modules["comera_engine"] = pkg
    from comera_engine.launch.supervisor import main

    sys.exit(main(sys.argv[1:]))
