"""The health check: healthy devices pass; an injected slow or wrong device (or slow host) is named and fails.

The injected delay is 50 ms against sub-millisecond CPU matmuls; a slow factor of 10 keeps the scheduling noise of
a shared CPU (two processes on two cores) from flagging healthy devices.
"""

import subprocess
import sys

import numpy as np
import pytest

from jaxlm import malloc
from jaxlm.cluster import healthcheck
from tests.conftest import ROOT
from tests.helpers import run_cli, train_env


def test_eight_healthy_devices_pass():
  report = healthcheck.check(iters=5, slow_factor=10.0)
  assert report.healthy, report.lines
  assert report.summary.startswith('8 devices on 1 hosts')


@pytest.mark.parametrize('inject, expected', [('slow:5', 'device 5: SLOW matmul'),
                                              ('wrong:2', 'device 2: WRONG matmul result')])
def test_an_injected_bad_device_is_named(inject, expected):
  report = healthcheck.check(iters=5, slow_factor=10.0, inject=inject)
  assert len(report.lines) == 1 and expected in report.lines[0], report.lines


def test_judge_compares_with_the_median():
  times = np.array([[1.0, 1.1, 0.9, 10.0], [1.0, 1.0, 1.2, 0.95]])  # (processes, devices)
  sums = np.ones((2, 4, 3))
  sums[1, 2, 0] = np.nan  # a device that produced NaN
  report = healthcheck.judge(['a', 'b'], np.arange(8).reshape(2, 4), times, sums, np.array([1.0, 5.0]),
                             np.array([True, False]), slow_factor=3.0, rtol=1e-3)
  assert [line.split(':')[0] for line in report.lines] == [
      'process 0 (a) device 3', 'process 1 (b) device 6', 'process 1 (b)', 'process 1 (b)']
  assert 'SLOW matmul' in report.lines[0] and 'WRONG matmul' in report.lines[1]
  assert 'SLOW all-reduce' in report.lines[2] and 'WRONG result from the all-reduce' in report.lines[3]


def test_cli_exit_code_and_message():
  result = run_cli('jaxlm.cluster.healthcheck', '--iters=5', '--slow_factor=10', '--inject=slow:7', timeout=120)
  assert result.returncode == 1, result.stderr
  assert 'healthcheck: BAD process 0' in result.stdout and 'device 7: SLOW matmul' in result.stdout


@pytest.mark.slow(reason='two launched processes each start JAX and time their devices')
def test_two_processes_name_the_slow_host(tmp_path):
  # With a compilation cache asked for by the environment (and the scheduler setting that makes one process safe):
  # processes of one job on a CPU mesh neither read nor write it (jaxlm/distributed.py).
  cache = tmp_path / 'xla'
  env = dict(train_env(4), JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0')
  if malloc.CPU_MESH_XLA_FLAG not in env['XLA_FLAGS']:  # train_env adds it unless JAXLM_TEST_XLA_CACHE=0
    env['XLA_FLAGS'] += f' {malloc.CPU_MESH_XLA_FLAG}'
  result = subprocess.run(['launch/local.sh', '-n', '2', '-d', '4', '--', sys.executable, '-m', 'jaxlm.cluster.healthcheck',
                           '--iters=5', '--slow_factor=10',
                           '--inject=slowhost:1'], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
  assert result.returncode == 1, result.stderr[-3000:]
  assert '8 devices on 2 hosts' in result.stdout
  assert 'BAD process 1' in result.stdout and 'SLOW all-reduce over its devices' in result.stdout
  assert 'BAD process 0' not in result.stdout
  assert not (cache.exists() and [p.name for p in cache.iterdir() if p.name.endswith('-cache')])
