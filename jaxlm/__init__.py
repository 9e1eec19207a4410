"""jaxlm: a small, readable JAX/Flax trainer for PaLM-style language models."""

from jaxlm import malloc as _host

# Before anything imports JAX: XLA:CPU's per-step temporaries then come from reused heap memory (see host.py).
HOST_MEMORY_KEPT = _host.keep_freed_memory()
