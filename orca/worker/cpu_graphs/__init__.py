"""The CPU graphs runner (runner.py): the forward pass as torch.compile graphs on a CPU. What the graphs
compile (views.py), the decode steps with attention inside (steps.py, decode_attention.py), the compiled
LM head (head.py) and inductor's settings (inductor.py)."""

from orca.worker.cpu_graphs.runner import CPUGraphs

__all__ = ["CPUGraphs"]
