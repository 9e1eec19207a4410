"""Host-process settings that must be made before JAX starts its threads: glibc's malloc.

`import jaxlm` applies them (jaxlm/__init__.py), so `python -m jaxlm.train` gets them before JAX is imported.
JAXLM_KEEP_HOST_MEMORY=0 leaves malloc as it is, =1 tunes it always; unset, it is tuned unless JAX will run on a
GPU or TPU here (there the step's temporaries live in device memory, not in malloc's), XLA_FLAGS fakes several
CPU devices (their threads allocate at once, and one arena serialises them: the 8-device test
mesh ran slower with it; bench/RESULTS.md, "Reaching 1.0×"), or the command only compiles (COMPILE_ONLY_COMMANDS).
"""

import ctypes
import glob
import os
import pkgutil
import re
import sys

# glibc's <malloc.h> mallopt parameters.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


def accelerator_host() -> bool:
  """Whether JAX will run on a GPU or TPU here: a GPU plugin is installed, or libtpu with TPU device nodes.

  libtpu alone is not a TPU: the test extra installs it to compile for TPU targets on CPU machines.
  """
  if os.environ.get('JAX_PLATFORMS', '').strip() == 'cpu':
    return False
  plugins = {m.name for m in pkgutil.iter_modules()}
  if any(name.startswith(('jax_cuda', 'jax_rocm')) for name in plugins):
    return True
  return 'libtpu' in plugins and bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def libtpu_without_tpu() -> bool:
  """libtpu is installed (the test extra has it, to compile for TPU targets) but this host has no TPU and no GPU
  plugin: JAX would otherwise try to start a TPU backend in every process and print libtpu's warnings."""
  plugins = {m.name for m in pkgutil.iter_modules()}
  return ('libtpu' in plugins and not any(name.startswith(('jax_cuda', 'jax_rocm')) for name in plugins)
          and not (glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*')))


def fake_cpu_devices() -> int:
  """How many CPU devices XLA_FLAGS asks XLA to fake (--xla_force_host_platform_device_count; 1 when unset)."""
  found = re.findall(r'xla_force_host_platform_device_count=(\d+)', os.environ.get('XLA_FLAGS', ''))
  return int(found[-1]) if found else 1


# The XLA_FLAGS entry that makes the persistent compilation cache safe on a mesh of fake CPU devices (issues #32,
# #38; bench/RESULTS.md, "CPU-mesh deadlock"): under XLA:CPU's concurrency-optimized scheduler an executable read
# back from the cache let one device wait in two independent collectives at once, each holding one thread of the
# intra-op pool (one per device), so one group of devices could hold every thread while another never reached the
# rendezvous, and XLA aborted the run; without that scheduler cached executables ran clean. Opt-in (the test suite
# sets it): it also makes a CPU mesh's steps slower, since a device's independent work no longer overlaps.
CPU_MESH_XLA_FLAG = '--xla_cpu_enable_concurrency_optimized_scheduler=false'


# Commands that compile and run no step (pre-flight sizing, for this host or a TPU/GPU target it does not have):
# nothing of theirs is reused step after step, and one arena serialises the compiler's threads (a TPU compile of
# tests/test_preflight.py's --fit step took 30 % longer with it: bench/RESULTS.md, "Test suite").
COMPILE_ONLY_COMMANDS = ('jaxlm.tools.size', 'jaxlm-size')


def compile_only_command(argv: list[str] | None = None) -> bool:
  """Whether this process is one of COMPILE_ONLY_COMMANDS (`python -m jaxlm.tools.size`, or its console script)."""
  argv = sys.orig_argv if argv is None else argv
  module = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == '-m'), None)
  return module in COMPILE_ONLY_COMMANDS or any(os.path.basename(a) in COMPILE_ONLY_COMMANDS for a in argv[:2])


def keep_freed_memory() -> bool:
  """Has glibc keep freed host memory for reuse: one malloc arena, no mmap, no trimming. False without glibc.

  Why: XLA:CPU allocates a step's temporaries as one block from a worker thread's malloc arena. A thread arena
  serves a block that large with a fresh mmap, whatever the thresholds, and munmaps it when the step ends, so
  every step page-faults and zeroes the whole block again (the kernel time this cost is measured in
  bench/RESULTS.md, "Reaching 1.0×"). From the main heap, with mmap off, the block is reused. It
  must happen before any thread but the main one allocates (importing JAX starts one), because a thread keeps
  the arena it first got. Costs: the process keeps its peak host memory, and its threads share one arena.
  """
  setting = os.environ.get('JAXLM_KEEP_HOST_MEMORY', '')
  if setting == '0':
    return False
  if setting != '1':
    if fake_cpu_devices() > 1 or compile_only_command():
      return False
    if accelerator_host():
      return False  # nothing to gain there, and one arena would serialise the host's threads
  try:
    mallopt = ctypes.CDLL('libc.so.6').mallopt
  except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to tune
    return False
  return all(mallopt(p, v) == 1 for p, v in ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)))
