"""launch/local.sh itself: how it reports a process that JAX aborted.

A preempted job (SIGTERM to the launcher: every process checkpoints, the launcher exits 0) is drilled on a bucket
workdir in tests/test_multihost.py (test_two_processes_on_a_bucket_workdir_...): the same launcher path, one job
fewer to train."""

import os
import subprocess

from tests.conftest import ROOT


def test_a_process_aborted_by_jax_for_a_lost_peer_is_reported_as_jaxlms_lost_peer_failure():
  """JAX's coordination service ends the survivors of a lost peer with SIGABRT (134) from C++: local.sh maps it."""
  abort = 'import os, sys, time; time.sleep(0.2 * int(os.environ["JAX_PROCESS_ID"])); os.abort()'
  out = subprocess.run(['launch/local.sh', '-n', '2', '-d', '1', '--', 'python3', '-c', abort], cwd=ROOT,
                       env=dict(os.environ, LOCAL_GRACE_S='5'), capture_output=True, text=True, timeout=60)
  assert out.returncode == 75, out.stderr[-2000:]
  last = out.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxlm: process 0 was aborted by JAX') and '; restart the job' in last
