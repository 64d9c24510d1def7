"""Lets ``python -m pytest`` run from this folder against the installed package.

``python -m`` puts the working directory first on ``sys.path``, so from ``python/`` the
source tree's ``remat`` would shadow the one ``pip install ./python`` built; the source tree
has no compiled ``remat._native`` unless ``maturin develop`` put one there. Then the source
folder is dropped from the path and the installed package is used.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "remat")
if not any(name.startswith("_native") for name in os.listdir(_SOURCE)):
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    for name in [m for m in sys.modules if m == "remat" or m.startswith("remat.")]:
        module = sys.modules[name]
        if (getattr(module, "__file__", None) or "").startswith(_SOURCE):
            del sys.modules[name]
