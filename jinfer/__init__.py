"""jinfer: an LLM inference engine in JAX.

Public API (everything else is internal):
    LLM, SamplingParams, Completion, load_tokenizer, ModelConfig
"""

from jinfer.config import ModelConfig
from jinfer.llm import LLM, Completion
from jinfer.loading import load_tokenizer
from jinfer.sampling import SamplingParams

__all__ = ["LLM", "Completion", "ModelConfig", "SamplingParams", "load_tokenizer"]
