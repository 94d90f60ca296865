"""rhyme-jax: RL post-training of LLMs in JAX with history-driven rollouts (RhymeRL, arXiv 2508.18588)."""
__version__ = "0.1.0"
