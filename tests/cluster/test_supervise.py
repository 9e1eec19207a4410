"""The supervisor with fake commands: which exit codes restart, the back-off, the cap, signals, the health check."""

import signal
import subprocess
import sys
import time

import pytest

from jaxlm.cluster import supervise
from tests.conftest import ROOT


def fake_job(tmp_path, codes: list[int], name: str = 'job') -> list[str]:
  """A command exiting with codes[i] on its i-th run (the last code repeats); runs are counted in a file."""
  counter = tmp_path / f'{name}.runs'
  script = (f'import pathlib, sys; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() else 0; '
            f'p.write_text(str(n + 1)); codes = {codes!r}; sys.exit(codes[min(n, len(codes) - 1)])')
  return [sys.executable, '-c', script]


def runs(tmp_path, name: str = 'job') -> int:
  path = tmp_path / f'{name}.runs'
  return int(path.read_text()) if path.exists() else 0


def supervisor(command, **kwargs) -> supervise.Supervisor:
  kwargs.setdefault('backoff_s', 0.01)
  return supervise.Supervisor(command, log=lambda m: None, **kwargs)


def test_restarts_crashes_with_exponential_backoff_until_success(tmp_path):
  s = supervisor(fake_job(tmp_path, [1, 137, 134, 0]), max_restarts=5)
  assert s.run() == 0
  assert runs(tmp_path) == 4
  assert s.delays == [0.01, 0.02, 0.04]


def test_gives_up_after_max_restarts_with_the_last_code(tmp_path):
  s = supervisor(fake_job(tmp_path, [75]), max_restarts=2, max_backoff_s=0.015)
  assert s.run() == 75
  assert runs(tmp_path) == 3  # the first run and two restarts
  assert s.delays == [0.01, 0.015]  # doubled, then capped by max_backoff_s


@pytest.mark.parametrize('code', [2, 4])
def test_no_restart_for_errors_a_restart_cannot_fix(tmp_path, code):
  s = supervisor(fake_job(tmp_path, [code, 0]))
  assert s.run() == code
  assert runs(tmp_path) == 1
  assert s.delays == []


def test_a_long_run_resets_the_failure_count(tmp_path):
  # Every run "lasted" longer than reset_after_s: each failure is a first failure, so the cap of 1 is never hit.
  s = supervisor(fake_job(tmp_path, [1, 1, 1, 0]), max_restarts=1, reset_after_s=0.0)
  assert s.run() == 0
  assert runs(tmp_path) == 4
  assert s.delays == [0.01, 0.01, 0.01]


def test_health_check_before_each_relaunch(tmp_path):
  # Run 1 crashes; the first check fails (a failed attempt, backed off); the second passes; run 2 succeeds.
  s = supervisor(fake_job(tmp_path, [1, 0]), healthcheck=fake_job(tmp_path, [1, 0], name='check'))
  assert s.run() == 0
  assert (runs(tmp_path), runs(tmp_path, 'check')) == (2, 2)
  assert s.delays == [0.01, 0.02]


def test_health_check_failing_for_good_stops(tmp_path):
  s = supervisor(fake_job(tmp_path, [1]), healthcheck=fake_job(tmp_path, [1], name='check'), max_restarts=2)
  assert s.run() == 1
  assert runs(tmp_path) == 1  # never relaunched on devices that failed the check


def test_cli_passes_sigterm_to_the_job_and_stops(tmp_path):
  # The job checkpoints on SIGTERM and exits 0 (like jaxlm.train): the supervisor must not restart it.
  marker = tmp_path / 'terminated'
  job = (f'import pathlib, signal, sys, time\n'
         f'signal.signal(signal.SIGTERM, lambda *a: (pathlib.Path({str(marker)!r}).write_text("x"), sys.exit(0)))\n'
         f'print("ready", flush=True)\n'
         f'time.sleep(60)\n')
  proc = subprocess.Popen([sys.executable, '-m', 'jaxlm.cluster.supervise', '--backoff', '0.01', '--', sys.executable, '-c',
                           job], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  assert proc.stdout.readline().strip() == 'ready'
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  assert marker.exists()
  assert 'SIGTERM received' in err and 'attempt 2' not in err


def test_cli_stops_on_bad_config_exit_code(tmp_path):
  start = time.monotonic()
  result = subprocess.run([sys.executable, '-m', 'jaxlm.cluster.supervise', '--backoff', '5', '--',
                           *fake_job(tmp_path, [2])], cwd=ROOT, capture_output=True, text=True, timeout=30)
  assert result.returncode == 2
  assert 'a restart cannot fix that' in result.stderr
  assert time.monotonic() - start < 5  # no back-off taken


def test_describe():
  assert supervise.describe(-9) == 'killed by SIGKILL'
  assert supervise.describe(134) == 'exit code 134 (SIGABRT: JAX aborts a process whose peer was lost)'
  assert supervise.describe(137) == 'exit code 137 (SIGKILL)'
  assert supervise.describe(2) == 'exit code 2 (bad config or input)'
