"""Orca: iteration-level scheduling and selective batching for generative transformers.

The engine package knows nothing of Triton: model_repository/orca_gpt/1/model.py adapts it.
"""

from orca.config import EngineConfig, ModelConfig
from orca.engine import EngineFailedError, IterationStats, LLMEngine, QueueFullError, RequestOutput
from orca.llm import LLM, CompletionOutput
from orca.request import Logprob
from orca.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineFailedError",
    "IterationStats",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]
