"""Orca: iteration-level scheduling and selective batching for generative transformers.

The engine package knows nothing of Triton: model_repository/orca_gpt/1/model.py adapts it.
"""

from orca.checkpoint import ModelConfig
from orca.config import EngineConfig
from orca.core.engine import EngineCore, EngineCoreOutput, EngineFailedError, IterationStats, QueueFullError
from orca.frontend.llm import LLM, CompletionOutput
from orca.frontend.llm_engine import LLMEngine
from orca.frontend.output_processor import Logprob, OutputProcessor, RequestOutput
from orca.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "EngineCore",
    "EngineCoreOutput",
    "EngineFailedError",
    "IterationStats",
    "LLMEngine",
    "Logprob",
    "ModelConfig",
    "OutputProcessor",
    "QueueFullError",
    "RequestOutput",
    "SamplingParams",
]
