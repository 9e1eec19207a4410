"""launch/local.sh itself: a preempted job (SIGTERM to the launcher) checkpoints and the launcher exits 0."""

import os
import signal
import subprocess

import pytest

from tests.conftest import ROOT
from tests.helpers import read_records, train_env
from tests.test_multihost import DEVICES, local_command, overrides, wait_for


@pytest.mark.slow(reason='the launcher starts two trainers that compile, train, checkpoint on SIGTERM and exit')
def test_sigterm_to_the_launcher_checkpoints_every_process_and_exits_0(tmp_path, data_cache):
  # What a scheduler does on preemption: SIGTERM to the launcher only, which passes it on to its processes.
  # Its `wait -n` is interrupted by the trap then, and must wait again rather than trip over `set -u`.
  workdir = tmp_path / 'run'
  launcher = subprocess.Popen(
      local_command(workdir, *overrides(data_cache, '--config.train.steps=100000', '--config.train.log_every=1')),
      cwd=ROOT, env=train_env(DEVICES), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      start_new_session=True)
  try:
    wait_for(lambda: len(read_records(workdir)) >= 2, 300, 'training steps in metrics.jsonl')
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=120)
  finally:
    if launcher.poll() is None:
      os.killpg(launcher.pid, signal.SIGKILL)  # never leave training processes behind
  assert 'unbound variable' not in err, err[-3000:]
  assert launcher.returncode == 0, (out + err)[-5000:]
  [event] = [r for r in read_records(workdir, 'event') if r['event'] == 'preempted']
  assert 'checkpoint saved' in event['message'], event
  saved = workdir / 'checkpoints' / str(event['step'])
  assert sorted(p.name for p in (saved / 'data').glob('process_*')) == ['process_0-of-2.json', 'process_1-of-2.json']


def test_a_process_aborted_by_jax_for_a_lost_peer_is_reported_as_jaxlms_lost_peer_failure():
  """JAX's coordination service ends the survivors of a lost peer with SIGABRT (134) from C++: local.sh maps it."""
  abort = 'import os, sys, time; time.sleep(0.2 * int(os.environ["JAX_PROCESS_ID"])); os.abort()'
  out = subprocess.run(['launch/local.sh', '-n', '2', '-d', '1', '--', 'python3', '-c', abort], cwd=ROOT,
                       env=dict(os.environ, LOCAL_GRACE_S='5'), capture_output=True, text=True, timeout=60)
  assert out.returncode == 75, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxlm: process 0 was aborted by JAX') and '; restart the job' in last
