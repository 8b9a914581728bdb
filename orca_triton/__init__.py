"""The Triton adapter: what the Python models in model_repository/ are thin shells over.

generate.py: the generate interface's request parsing and response tensors (numpy in, numpy out; no
Triton import, unit-tested without a server). metrics.py: orca_gpt's custom metrics. lifecycle.py:
tritonserver's shutdown and death, seen from the stub. Only the stub imports metrics.py (it needs
triton_python_backend_utils); the engine (orca/) imports nothing from here.
"""
