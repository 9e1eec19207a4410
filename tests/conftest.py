"""Test set-up: 8 fake CPU devices, made before JAX is imported anywhere."""

import contextlib
import os
import pathlib
import shutil
import sys

# The tests check what programs compute, not how fast their machine code runs: LLVM's cheapest pipeline, XLA:CPU's
# older elemental emitters instead of its MLIR fusion emitters (whose compiles cost about twice the CPU time) and
# one codegen thread (2 cores are shared by 2 workers) cut the CPU time of the suite's compiles, about half of
# its time, by more than half (bench/RESULTS.md, "Test suite"). Every process of the suite, trainer
# subprocesses included (tests/helpers.py: train_env), compiles this way.
FAST_COMPILE_XLA_FLAGS = ('--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true '
                          '--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1')

# One thread for OpenMP (torch), OpenBLAS (numpy) and MKL, here and in every subprocess: their pools spin while they
# wait for work, and on the suite's 2 cores, shared by 3 workers and their trainers, a 2-thread pool spun away
# 12-15x the CPU time of its work (a transformers forward, a numpy matmul; bench/RESULTS.md, "Test suite"). Set
# before numpy or torch is first imported: each reads it once, when it loads.
for _var in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
  os.environ.setdefault(_var, '1')

# Python's bytecode cache even where the environment turns it off (PYTHONDONTWRITEBYTECODE, which the CI image
# sets): without it each of the suite's Python processes, every trainer and tool subprocess, compiles jaxlm's
# sources again (~0.2 CPU s a process; a collection 3.5 -> 2.4 CPU s). The caches go to __pycache__/ (git ignores
# it); Python writes each file whole (a rename), so processes writing at once are safe.
os.environ.pop('PYTHONDONTWRITEBYTECODE', None)
sys.dont_write_bytecode = False

# Must run before `import jax`: XLA reads the flag once, when the CPU backend starts.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8 '
                           + FAST_COMPILE_XLA_FLAGS).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# No Python tracebacks in the locations of lowered programs (only read in HLO dumps): ~10 % of tracing and lowering,
# here and in every subprocess (they inherit the environment).
os.environ.setdefault('JAX_TRACEBACK_IN_LOCATIONS_LIMIT', '0')
os.environ.setdefault('JAX_INCLUDE_FULL_TRACEBACKS_IN_LOCATIONS', 'false')

SUBPROCESS_CACHE_ENV = 'JAXLM_TEST_XLA_CACHE'  # see pytest_configure

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gc  # noqa: E402

from jaxlm import cli  # noqa: E402  (no JAX import)
from tests import timing  # noqa: E402  (no JAX import)

# The commands' garbage-collector setting (cli.quiet_gc) for the test processes too, from before their imports:
# with Python's default, 5-6 % of an in-process test file's time went to collections (bench/RESULTS.md).
gc.set_threshold(*cli.GC_THRESHOLD)

import jax  # noqa: E402
import pytest  # noqa: E402

# The bulk of the suite compares sharded against unsharded numbers: keep matmuls exact on the CPU.
jax.config.update('jax_default_matmul_precision', 'highest')


@pytest.fixture
def root() -> pathlib.Path:
  """The repository root (configs/ lives there)."""
  return ROOT


def suite_dir(tmp_path_factory, name: str) -> pathlib.Path:
  """A directory shared by every process of this pytest run: the xdist workers' base temp dirs are siblings."""
  base = tmp_path_factory.getbasetemp()
  return (base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base) / name


@contextlib.contextmanager
def made_once(tmp_path_factory, name: str):
  """Yields (path, None) once for the whole run, xdist workers included, to fill `path`; later callers (path, True).

  For a costly fixture (a trained run, a prepared corpus) that tests of several modules share: the first worker
  builds it under a file lock while the others wait; a build that raised is not marked done, so the next caller
  builds it again and sees the error itself.
  """
  import filelock
  path = suite_dir(tmp_path_factory, name)
  with filelock.FileLock(f'{path}.lock'):
    if (path / '.done').exists():
      yield path, True
      return
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    yield path, None
    (path / '.done').touch()


@pytest.fixture(scope='session')
def data_cache(tmp_path_factory) -> pathlib.Path:
  """One prepared copy of the stdlib corpus for every test of the run, every xdist worker included
  (`--config.data.cache_dir`; jaxlm.data.prepare locks it while the first process prepares it)."""
  path = suite_dir(tmp_path_factory, 'data_cache')
  path.mkdir(parents=True, exist_ok=True)
  return path


def train_tiny(workdir, data_cache, steps: int, seed: int, devices=None, **train_overrides) -> None:
  """palm_tiny trained in this process on the stdlib corpus (lr 1e-2), saved once at its end; on `devices`
  (default: all of them)."""
  from jaxlm import train
  from tests.helpers import load_config
  cfg = load_config('palm_tiny')
  cfg.data.cache_dir = str(data_cache)
  cfg.train.update(steps=steps, seed=seed, eval_batches=8, log_every=steps, **train_overrides)
  cfg.optim.update(lr=1e-2, warmup_steps=10)
  cfg.checkpoint.update(every=0, async_save=False)
  cfg.log.update(tensorboard=False, compilation_cache='')
  train.run(cfg, str(workdir), devices=devices)


@pytest.fixture(scope='session')
def trained_tiny(tmp_path_factory, data_cache) -> str:
  """A palm_tiny run trained 300 steps (seed 1), made once for the whole run, every xdist worker included: the
  generation tests' judge (tests/test_textgen.py) and the distillation tests' teacher (tests/test_distill_train.py)
  share it instead of training one each."""
  with made_once(tmp_path_factory, 'trained_tiny') as (path, done):
    if not done:
      # On one device: what this run is for is a trained model, not its sharding, and palm_tiny's 300 steps cost
      # half the CPU there that 8 fake devices' collectives add (8.9 against 17.4 s; the same losses to 1e-6). The
      # saved config keeps fsdp=-1, so whoever loads the run shards it over the devices it has.
      import jax
      train_tiny(path / 'run', data_cache, 300, 1, devices=jax.devices()[:1])
  return str(path / 'run')


# `e2e`: a test that starts a subprocess or runs the whole trainer, itself or through a fixture. Marked here from
# the source, so a new test cannot forget it; `pytest -m 'not e2e'` is the fast loop.
_E2E_CALLS = ('subprocess.', 'train.run(', 'Popen(', 'local_command(', '_run(', '_start(', 'run_cli(')


def _starts_processes(fn, seen) -> bool:
  """Whether `fn`, or a function of the tests it calls (followed by name), starts processes or the trainer."""
  import inspect
  import re
  if fn in seen:
    return False
  seen.add(fn)
  try:
    source = inspect.getsource(fn)
  except (OSError, TypeError):
    return False
  if any(call in source for call in _E2E_CALLS):
    return True
  scope = vars(sys.modules.get(fn.__module__, object))
  called = (scope.get(name) for name in set(re.findall(r'\b(\w+)\(', source)))
  return any(_starts_processes(f, seen) for f in called
             if inspect.isfunction(f) and f.__module__.startswith('tests'))


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.get_closest_marker('e2e'):
      continue
    seen = set()
    fixtures = getattr(item, '_fixtureinfo', None)
    defs = [d.func for name in (fixtures.names_closure if fixtures else ())
            for d in (fixtures.name2fixturedefs.get(name) or ())]
    if any(_starts_processes(f, seen) for f in [getattr(item, 'function', None), *defs] if f is not None):
      item.add_marker(pytest.mark.e2e)


def pytest_configure(config):
  """No persistent compilation cache in the test processes: on this 8-device CPU mesh an executable read back
  from it can run one device's collectives concurrently and deadlock (jaxlm/perf.py, CPU_MESH_CACHE_OFF; issue
  #32). The flag that makes it safe (jaxlm/malloc.py: CPU_MESH_XLA_FLAG) slowed the in-process grids' compiles and
  steps more than the cache saved, whose programs are mostly compiled once each (issue #38; bench/RESULTS.md).

  Trainer and tool subprocesses share one cache for the run, with that flag (tests/helpers.py: train_env): a kill
  -9 drill starts the same program three or four times. The directory is made here, by the process that starts
  the xdist workers (they inherit the variable), and removed at the end; JAXLM_TEST_XLA_CACHE=DIR names one
  instead, JAXLM_TEST_XLA_CACHE=0 turns it off."""
  jax.config.update('jax_enable_compilation_cache', False)
  # The suite's budget a test (tests/timing.py: Budget; README, Testing): over it is reported by name at the end of
  # every run, and fails only under JAXLM_TEST_BUDGET_STRICT=1 or a developer's `bench/suite.py --budget`.
  config.pluginmanager.register(timing.Budget.from_env(), 'jaxlm-budget')
  if not os.environ.get('PYTEST_XDIST_WORKER') and not os.environ.get(SUBPROCESS_CACHE_ENV):
    import tempfile
    config.subprocess_cache = os.environ[SUBPROCESS_CACHE_ENV] = tempfile.mkdtemp(prefix='jaxlm-test-xla-')


def pytest_collection_finish(session):
  """What imports and collection made lives as long as the worker: out of every later collection."""
  cli.quiet_gc()


def pytest_unconfigure(config):
  # pytest ends a session with five full collections, to surface exceptions raised in finalizers; after hundreds of
  # compiled programs each walked JAX's caches for about a second. One here, with pytest's hook still listening,
  # finds the same; frozen afterwards, the survivors are not walked four more times.
  gc.collect()
  cli.quiet_gc()
  if made := getattr(config, 'subprocess_cache', None):
    shutil.rmtree(made, ignore_errors=True)
    del os.environ[SUBPROCESS_CACHE_ENV]
