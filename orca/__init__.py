"""Orca: iteration-level scheduling and selective batching for generative transformers.

core/ (the token-only engine core), executor/ and worker/ (where plans run), models/, frontend/ (text and
outputs around the core; LLMEngine and LLM). The engine package knows nothing of Triton: orca_triton/ and
model_repository/*/1/model.py adapt it.
"""

from orca.checkpoint import ModelConfig
from orca.config import EngineConfig
from orca.core.engine import EngineCore
from orca.core.errors import EngineFailedError, QueueFullError
from orca.core.outputs import EngineCoreOutput, IterationStats
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
