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
