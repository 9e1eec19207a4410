"""Host-process settings that must be made before JAX starts its threads: glibc's malloc.

`import jaxlm` applies them (jaxlm/__init__.py), so `python -m jaxlm.train` gets them before JAX is imported.
Set JAXLM_KEEP_HOST_MEMORY=0 to leave malloc as it is.
"""

import ctypes
import os

# glibc's <malloc.h> mallopt parameters.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
  """Has glibc keep freed host memory for reuse: one malloc arena, no mmap, no trimming. False without glibc.

  Why: XLA:CPU allocates a step's temporaries as one block (320 MiB for palm_small) from a worker thread's malloc
  arena. A thread arena serves a block that large with a fresh mmap, whatever the thresholds, and munmaps it when
  the step ends, so every step page-faults and zeroes the whole block again: 16 % of the CPU step's time was in
  the kernel (perf), 13 % of the step's wall time. From the main heap, with mmap off, the block is reused. It
  must happen before any thread but the main one allocates (importing JAX starts one), because a thread keeps
  the arena it first got. Costs: the process keeps its peak host memory, and its threads share one arena.
  """
  if os.environ.get('JAXLM_KEEP_HOST_MEMORY', '1') == '0':
    return False
  try:
    mallopt = ctypes.CDLL('libc.so.6').mallopt
  except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
    return False
  return all(mallopt(p, v) == 1 for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))
