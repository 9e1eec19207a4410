"""One way to fail: every entry point ends an expected failure with one `jaxlm: <what>; <fix>` line and its code."""

import pytest

from tests.conftest import ROOT
from tests.helpers import assert_fails_with, run_cli, train_env

TINY = '--config=configs/palm_tiny.py'


@pytest.mark.parametrize('module, args, code, says', [
    ('jaxlm.train', [TINY, '--config.train.stepz=3'], 2, 'has no key train.stepz; did you mean config.train.steps'),
    ('jaxlm.train', ['--config=configs/no_such_config.py'], 2, 'config file configs/no_such_config.py does not exist'),
    ('jaxlm.train', [TINY, '--workdir=/proc/jaxlm/run'], 3, 'cannot write /proc/jaxlm/run'),
    ('jaxlm.train', [TINY, '--config.train.steps=abc'], 2, 'bad command line'),
    ('jaxlm.tools.eval', [], 2, 'missing --workdir'),
    ('jaxlm.tools.report', ['--workdir=/nonexistent/run'], 2, 'no metrics.jsonl in /nonexistent/run'),
    ('jaxlm.hf.export', ['--workdir=/nonexistent/run', '--out=/tmp/jaxlm_export_never'], 2, 'holds no checkpoint'),
    ('jaxlm.data.prepare', [], 2, '--inputs and --out are required'),
    ('jaxlm.tools.size', [TINY, '--config.model.d_model=60'], 2, 'invalid config'),
    ('jaxlm.tools.sweep', [TINY, '--grid=model.no_such_key=1,2'], 2, 'no_such_key'),
])
def test_entry_points_fail_with_one_line_and_their_code(module, args, code, says):
  assert_fails_with(run_cli(module, *args, timeout=300), code, says)


def test_a_fatal_signal_dumps_the_signalled_thread_only(tmp_path):
  """faulthandler walking other threads' frames while they run can crash inside an abort's dump (and the process
  then dies of SIGSEGV, not the SIGABRT its watcher maps to a restart): a command dumps its own thread only."""
  import os
  import subprocess
  import sys
  script = tmp_path / 'aborts.py'
  script.write_text('\n'.join([
      'import os, threading, time',
      'from jaxlm import cli',
      'def busy():',
      '  while True: time.sleep(0.001)',
      'def main(argv):',
      '  threading.Thread(target=busy, daemon=True).start()',
      '  time.sleep(0.1)',
      '  os.abort()',
      'cli.run(main)']))
  out = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, 'PYTHONPATH': str(ROOT)})  # the checkout's jaxlm, installed or not
  assert out.returncode == -6, (out.returncode, out.stderr[-2000:])  # SIGABRT, as the watcher expects
  assert 'Fatal Python error: Aborted' in out.stderr and 'in main' in out.stderr, out.stderr[-2000:]
  assert 'in busy' not in out.stderr, out.stderr[-2000:]  # the other thread is not walked


def test_a_process_that_cannot_join_its_job_fails_with_the_distributed_code():
  env = dict(train_env(), JAX_COORDINATOR_ADDRESS='127.0.0.1:9', JAX_NUM_PROCESSES='2', JAX_PROCESS_ID='1')
  out = run_cli('jaxlm.train', TINY, '--config.dist.init_timeout_s=3', env=env, timeout=300)
  assert_fails_with(out, 75, 'could not reach the coordinator 127.0.0.1:9')


def test_the_jaxlm_line_stays_last_when_shutdown_finds_library_leftovers(tmp_path):
  """A coroutine never awaited and a file never closed, as a failed async save on a full disk leaves them: what
  shutdown says of them must not print below the jaxlm line."""
  script = tmp_path / 'leftovers.py'
  script.write_text('\n'.join([
      'import sys',
      'from jaxlm import cli, errors',
      'async def save(): pass',
      'class Writer:',
      '  def __del__(self): raise OSError(28, "No space left on device")',
      'pending = [save(), open(sys.argv[0]), Writer()]  # reachable until interpreter shutdown',
      'cli.fail(errors.JaxlmError("cannot write /disk; free space"))',
  ]))
  import subprocess
  import sys
  out = subprocess.run([sys.executable, '-W', 'default', str(script)], capture_output=True, text=True, timeout=120,
                       env=dict(train_env(), PYTHONPATH=str(ROOT)))
  assert out.returncode == 1, out.stderr
  assert out.stderr.strip().splitlines()[-1] == 'jaxlm: cannot write /disk; free space', out.stderr
