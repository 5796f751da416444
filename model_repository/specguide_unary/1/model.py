"""Triton entry point; a BLS proxy to the `specguide` model (specguide.triton.proxy)."""
import os
import sys

# The 2.51 Python backend stub ignores PYTHONPATH: honour it, so that a checkout's backend_src
# (PYTHONPATH=backend_src) shadows the installed package as it does for a plain interpreter.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

from specguide.triton.proxy import TritonPythonModel  # noqa: E402,F401
