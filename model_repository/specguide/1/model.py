"""Triton entry point; all logic lives in the installed `specguide` package (backend_src/)."""
from specguide.triton.adapter import TritonPythonModel  # noqa: F401
