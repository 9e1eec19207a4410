"""Dependencies point one way (shared/DESIGN.md): pyproject.toml's import-linter contracts hold for jaxlm/."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint_imports(*args: str) -> subprocess.CompletedProcess:
  """`lint-imports ARGS` from the repository root (its jaxlm/ analysed, not an installed copy), without a cache."""
  command = shutil.which('lint-imports') or os.path.join(os.path.dirname(sys.executable), 'lint-imports')
  if not os.path.exists(command):
    pytest.fail("lint-imports is not installed; pip install -e '.[test]' (import-linter)")
  return subprocess.run([command, '--no-cache', '--no-logo', *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)


def test_imports_keep_the_contracts():
  """Every contract of [tool.importlinter] is kept: layers (tools/hf/cluster > train/rl > the core > data/) and no
  cycles. A broken one names the importer, the imported module and the line."""
  out = _lint_imports()
  assert out.returncode == 0, f'lint-imports found imports against the contracts:\n{out.stdout}{out.stderr}'


def test_a_new_arrow_against_the_layers_is_named(tmp_path):
  """The check catches a forbidden arrow and names it: with model.py put above step.py, step.py's real import of
  model.py breaks the contract."""
  config = tmp_path / 'contracts.toml'
  config.write_text('[tool.importlinter]\nroot_package = "jaxlm"\n\n[[tool.importlinter.contracts]]\n'
                    'name = "model above step"\ntype = "layers"\nlayers = ["jaxlm.model", "jaxlm.step"]\n')
  out = _lint_imports(str(config))
  assert out.returncode != 0, out.stdout
  assert 'jaxlm.step is not allowed to import jaxlm.model' in out.stdout, out.stdout
