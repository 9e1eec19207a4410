"""Test set-up: 8 fake CPU devices, made before JAX is imported anywhere."""

import os
import pathlib
import sys

# Must run before `import jax`: XLA reads the flag once, when the CPU backend starts.
os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8').strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import pytest  # noqa: E402

# The bulk of the suite compares sharded against unsharded numbers: keep matmuls exact on the CPU.
jax.config.update('jax_default_matmul_precision', 'highest')


@pytest.fixture
def root() -> pathlib.Path:
  """The repository root (configs/ lives there)."""
  return ROOT


@pytest.fixture(scope='session')
def data_cache(tmp_path_factory) -> pathlib.Path:
  """One prepared copy of the stdlib corpus for every test in the session (`--config.data.cache_dir`)."""
  return tmp_path_factory.mktemp('data_cache')


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
  """No persistent compilation cache: on this 8-device CPU mesh an executable read back from it can run one
  device's collectives concurrently and deadlock the test (jaxlm/perf.py, CPU_MESH_CACHE_OFF; issue #32). The
  trainer subprocesses keep it off by the same rule."""
  del config
  jax.config.update('jax_enable_compilation_cache', False)
