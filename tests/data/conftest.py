"""Fixtures shared by the data tests: a 2-node Ray cluster on the loopback for the Ray tests of a module."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.2', 0))
    return s.getsockname()[1]


# Per module, not per session: an idle cluster's daemons cost ~6 % of a core (1.8 CPU s in 30 s, against 7.6 CPU s to
# start one), and a session's cluster, started by the first Ray test, idled to the end of the run (~860 s in one).
@pytest.fixture(scope='module')
def ray_cluster(tmp_path_factory):
  """A head and a worker node (1 CPU each) on the loopback, started here and stopped by pid: the address.

  127.0.0.2 and .3, not .1: Ray replaces 127.0.0.1 by the host's routable address (unless multi-node is off);
  the whole 127/8 is the loopback interface, so nothing listens beyond this machine either way.
  """
  pytest.importorskip('ray')
  port = _free_port()
  # PYTHONPATH: workers import this tree's jaxlm. RAY_AUTH_MODE: Ray turns token auth on where the variable is unset
  # and ~/.ray/auth_token exists (any local ray.init writes one); this cluster's nodes must agree, so: off.
  env = dict(os.environ, RAY_USAGE_STATS_ENABLED='0', PYTHONPATH=str(ROOT), RAY_AUTH_MODE='disabled')
  logs = tmp_path_factory.mktemp('ray')
  common = ['--block', '--num-cpus=1', '--object-store-memory=100000000', '--disable-usage-stats']
  ray_bin = os.path.join(os.path.dirname(sys.executable), 'ray')
  nodes = [subprocess.Popen([ray_bin, 'start', '--head', f'--port={port}', '--include-dashboard=false',
                             '--node-ip-address=127.0.0.2', *common],
                            env=env, stdout=open(logs / 'head.log', 'w'), stderr=subprocess.STDOUT,
                            start_new_session=True)]
  address = f'127.0.0.2:{port}'
  try:
    deadline = time.time() + 90
    while 'Ray runtime started' not in (logs / 'head.log').read_text():
      assert time.time() < deadline and nodes[0].poll() is None, (logs / 'head.log').read_text()[-3000:]
      time.sleep(0.2)
    nodes.append(subprocess.Popen([ray_bin, 'start', f'--address={address}', '--node-ip-address=127.0.0.3', *common],
                                  env=env,
                                  stdout=open(logs / 'worker.log', 'w'), stderr=subprocess.STDOUT,
                                  start_new_session=True))
    while 'Ray runtime started' not in (logs / 'worker.log').read_text():
      assert time.time() < deadline and nodes[1].poll() is None, (logs / 'worker.log').read_text()[-3000:]
      time.sleep(0.2)
    yield address
  finally:
    for p in nodes:  # each node's processes are in its own session, led by `ray start --block`
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait(30)


