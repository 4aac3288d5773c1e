"""k26jax: Kimi K2.6 in JAX/Flax with DDTree speculative decoding."""

from k26jax.api import Model, load
from k26jax.config import ConfigError, ModelConfig
from k26jax.generation import Result, generate

__all__ = ["ConfigError", "Model", "ModelConfig", "Result", "generate", "load"]
