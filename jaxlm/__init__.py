"""jaxlm: a small, readable JAX/Flax trainer for PaLM-style language models."""

import os as _os

from jaxlm import malloc as _host

if _host.libtpu_without_tpu():  # a CPU machine with the test extra: run on the CPU, quietly (a user's setting wins)
  _os.environ.setdefault('JAX_PLATFORMS', 'cpu')

# Before anything imports JAX: XLA:CPU's per-step temporaries then come from reused heap memory (see malloc.py).
HOST_MEMORY_KEPT = _host.keep_freed_memory()
