"""The engine core: token ids in, one iteration at a time, token ids out.

request.py (a request's state and the token-level stop rules), scheduler.py (Orca's Algorithm 1 over the
paged pool), block_manager.py (K/V block accounting), plan.py (the plain data between the core and the
workers), engine.py (EngineCore: schedule -> plan -> submit -> collect -> complete, deltas out),
engine_loop.py (the core on its own thread: the Triton model's scheduler thread), timeline.py (the
iteration timeline). No tensors, no text, nothing of Triton: the workers own the device
(orca/executor, orca/worker), the front end owns text and accumulated outputs (orca/frontend).
"""
