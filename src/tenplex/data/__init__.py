"""Training data: the corpus builder and the dataset PTC (the elastic, exactly-once sampler)."""

from .corpus import Corpus, CorpusError, TokenWindows, build_corpus, cache_dir
from .sampler import ElasticSampler, SamplerError, SamplerState, split_bounds

__all__ = [
    "Corpus",
    "CorpusError",
    "ElasticSampler",
    "SamplerError",
    "SamplerState",
    "TokenWindows",
    "build_corpus",
    "cache_dir",
    "split_bounds",
]
