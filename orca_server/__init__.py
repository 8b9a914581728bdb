"""Helpers to run NVIDIA Triton (the binary shipped in the ``nvidia-pytriton`` wheel).

The wheel carries a complete ``tritonserver`` plus its Python backend, but only
PyTriton's own Python API knows how to wire them together.  We serve a plain
Triton model repository instead, so :mod:`orca_server.launcher` does that wiring
(backend directory, library path, Python path) without importing PyTriton.

Import from :mod:`orca_server.launcher` directly; this package ``__init__`` stays
empty on purpose so that ``python -m orca_server.launcher`` does not import the
module twice (runpy warns when the package already imported it).
"""
