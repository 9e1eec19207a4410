"""jaxlm: a small, readable JAX/Flax trainer for PaLM-style language models."""

import os as _os

from jaxlm import malloc as _host

# A CPU machine with the test extra: run on the CPU, quietly. A user's setting wins, and then nothing is looked
# up (listing the installed modules costs ~25 ms of every command's start).
if 'JAX_PLATFORMS' not in _os.environ and _host.libtpu_without_tpu():
  _os.environ['JAX_PLATFORMS'] = 'cpu'

# Before anything imports JAX: XLA:CPU's per-step temporaries then come from reused heap memory (see malloc.py).
HOST_MEMORY_KEPT = _host.keep_freed_memory()
