"""Rollout engine: paged KV pool, page allocator, paged forward, sampling, continuous batching."""

from rhyme_jax.rollout.engine import (EngineConfig, EngineConfigError, PromptTooLongError, RolloutEngine, RolloutResult,
                                      SamplingParams)
from rhyme_jax.rollout.forward import RaggedMeta, paged_forward
from rhyme_jax.rollout.kv_cache import KVCache
from rhyme_jax.rollout.page_allocator import PageAllocationError, PageAllocator
from rhyme_jax.rollout.sampling import SamplingError, processed_logprobs, sample

__all__ = ["EngineConfig", "EngineConfigError", "KVCache", "PageAllocationError", "PageAllocator", "PromptTooLongError",
           "RaggedMeta", "RolloutEngine", "RolloutResult", "SamplingError", "SamplingParams",
           "paged_forward", "processed_logprobs", "sample"]
