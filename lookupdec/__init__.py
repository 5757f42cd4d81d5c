"""lookupdec: lossless lookup-based speculative decoding for Hugging Face causal LMs."""
from lookupdec.config import EngineConfig, NgramConfig
from lookupdec.engine import Engine, Generation, GenerationStats

__all__ = ["Engine", "EngineConfig", "Generation", "GenerationStats", "NgramConfig"]
__version__ = "0.1.0"
