"""jaxlm: a small, readable JAX/Flax trainer for PaLM-style language models."""
