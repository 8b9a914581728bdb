"""Helpers to run NVIDIA Triton (the binary shipped in the ``nvidia-pytriton`` wheel).

The wheel carries a complete ``tritonserver`` plus its Python backend, but only
PyTriton's own Python API knows how to wire them together.  We serve a plain
Triton model repository instead, so this package does that wiring (backend
directory, library path, Python path) without importing PyTriton:

* :mod:`orca_server.wheel`: the wheel's layout (binary, Python backend, stub,
  bundled libs), the backend directory and the environment the stub needs;
* :mod:`orca_server.server`: the ``tritonserver`` process (command line, ports,
  :class:`~orca_server.server.TritonServer` for tests and benchmarks, the run
  beside the OpenAI-compatible front end);
* :mod:`orca_server.launcher`: the CLI, ``python -m orca_server.launcher``.

Import from those modules directly; this package ``__init__`` stays empty on
purpose so that ``python -m orca_server.launcher`` does not import the module
twice (runpy warns when the package already imported it).
"""
