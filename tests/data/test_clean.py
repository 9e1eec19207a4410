"""`python -m jaxlm.data.clean`: datatrove's language, quality and MinHash stages on a planted corpus."""

import collections
import functools
import glob
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from jaxlm.data import clean as clean_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import readers
from tests.cluster.test_slurm import slurm  # noqa: F401  pylint: disable=unused-import
from tests.conftest import ROOT
from tests.data import clean_corpus
from tests.helpers import assert_fails_with

pytest.importorskip('datatrove')
pytest.importorskip('py3langid')


def _kept(out) -> list[dict]:
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  return [r for p in sorted(glob.glob(f'{out}/*.parquet')) for r in pq.read_table(p, columns=['id', 'text'])
          .to_pylist()]


@pytest.fixture(scope='session')
def cleaned(tmp_path_factory):
  """The planted corpus, and its local clean: (root, corpus info, output directory)."""
  root = tmp_path_factory.mktemp('clean')
  info = clean_corpus.write(root / 'raw')
  clean_lib.clean(readers.expand_inputs([str(root / 'raw')]), str(root / 'local'), languages=['en'],
                  lid='py3langid', workers=1, tasks=2)
  return root, info, root / 'local'


@pytest.mark.e2e  # datatrove's stages over the planted corpus: seconds, not a unit's time
def test_clean_drops_foreign_and_copies_and_keeps_english(cleaned):
  _, info, out = cleaned
  rows = _kept(out)
  ids = collections.Counter(r['id'] for r in rows)
  texts = collections.Counter(r['text'] for r in rows)
  english, copies = info['english'], info['copies']
  assert not [i for i in ids if not i.startswith('en-')]  # foreign kept: 0
  clusters = {f'en-{i}': [k for k in ids if k == f'en-{i}' or k.startswith(f'en-{i}-')] for i in range(english)}
  dropped = [c for c, kept in clusters.items() if not kept]
  assert len(dropped) <= 0.01 * english, dropped  # English dropped <= 1 %
  assert max(texts.values()) == 1  # exact duplicates left: 0
  near = [f'en-{copies + i}' for i in range(copies)]
  assert sum(len(clusters[c]) > 1 for c in near) <= 0.03 * len(near)  # near-duplicate clusters kept twice
  assert len(rows) == english  # and nothing else was lost: one survivor per document and its copies


@pytest.mark.e2e  # datatrove's stages over the planted corpus: seconds, not a unit's time
def test_prepare_reads_the_cleaned_output(cleaned, tmp_path):
  root, info, out = cleaned
  meta = prepare_lib.prepare(readers.expand_inputs([str(out)]), str(tmp_path / 'prep'), vocab_size=320,
                             workers=1, shard_docs=16, eval_fraction=0.1, progress=False)
  assert meta['documents'] == info['english']


@pytest.mark.e2e
@pytest.mark.slow(reason='five datatrove stages, each a Ray actor that imports datatrove and spaCy')
def test_ray_executor_keeps_the_same_documents(cleaned, ray_cluster):
  import ray  # pylint: disable=g-import-not-at-top
  root, _, out = cleaned
  run = functools.partial(clean_lib.clean, readers.expand_inputs([str(root / 'raw')]), str(root / 'ray'),
                          languages=['en'], executor='ray', lid='py3langid', tasks=2, tasks_per_job=16)

  @ray.remote
  def sigterm_a_fork() -> tuple[int | None, bool]:
    """Forks a child that waits on a held lock, as a rank pool's idle worker does, and SIGTERMs it: its exit code
    (None: alive after 30 s), and whether this Ray worker still has a SIGTERM handler of its own. Defined here so
    that Ray ships it by value, without importing this module."""
    import multiprocessing  # pylint: disable=g-import-not-at-top
    import time  # pylint: disable=g-import-not-at-top
    ctx = multiprocessing.get_context('fork')
    lock = ctx.Lock()
    lock.acquire()
    child = ctx.Process(target=lock.acquire)
    child.start()
    time.sleep(0.5)
    child.terminate()
    child.join(30)
    code = child.exitcode
    if code is None:
      child.kill()
      child.join()
    return code, signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)

  ray.init(address=ray_cluster, include_dashboard=False, log_to_driver=False)  # a caller's job, without the hook
  try:
    with pytest.raises(clean_lib.CleanError, match='without a worker setup hook'):
      run()
    code, handled = ray.get(sigterm_a_fork.remote())
    assert code != -signal.SIGTERM and handled  # the child inherits the Ray worker's own handler
  finally:
    ray.shutdown()
  ray.init(address=ray_cluster, include_dashboard=False, log_to_driver=False,
           runtime_env=clean_lib.ray_runtime_env())
  try:
    # What ends a rank pool's workers at its exit: SIGTERM's default action in a process a Ray worker forked; the
    # Ray worker keeps its handler.
    assert ray.get(sigterm_a_fork.remote()) == (-signal.SIGTERM, True)
    run()
  finally:
    ray.shutdown()
  assert sorted(r['id'] for r in _kept(root / 'ray')) == sorted(r['id'] for r in _kept(out))


def test_missing_datatrove_is_one_line(tmp_path):
  code = 'import sys; sys.modules["datatrove"] = None; from jaxlm.data import clean; clean.console()'
  out = subprocess.run([sys.executable, '-c', code, f'--inputs={ROOT / "README.md"}', f'--out={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert 'jaxlm[clean]' in assert_fails_with(out, 2)


def test_a_ray_address_nobody_answers_at_is_one_line_in_seconds(tmp_path):
  pytest.importorskip('ray')
  with socket.socket() as s:  # a port bound and not listening: nobody answers there
    s.bind(('127.0.0.1', 0))
    env = dict(os.environ, RAY_ADDRESS=f'127.0.0.1:{s.getsockname()[1]}')
    start = time.monotonic()
    out = subprocess.run([sys.executable, '-m', 'jaxlm.data.clean', f'--inputs={ROOT / "README.md"}',
                          f'--out={tmp_path}', '--executor=ray', '--lid=py3langid'],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert time.monotonic() - start < 60  # ray.init alone retried for over 5 minutes
  assert_fails_with(out, 3, 'cannot reach the Ray cluster at 127.0.0.1:', 'check RAY_ADDRESS')


@pytest.mark.e2e
@pytest.mark.slow(reason='the datatrove stages as dependent Slurm job arrays on a one-node cluster on localhost')
def test_slurm_executor_keeps_the_same_documents(cleaned, slurm, tmp_path, monkeypatch):
  root, _, out = cleaned
  for name in ('SLURM_CONF', 'PATH'):  # sbatch, and the jobs it queues, see this process's environment
    monkeypatch.setenv(name, slurm[name])
  monkeypatch.setenv('PYTHONPATH', str(ROOT))  # the jobs unpickle the stages, which name jaxlm's modules
  target = tmp_path / 'slurm'
  clean_lib.clean(readers.expand_inputs([str(root / 'raw')]), str(target), languages=['en'], lid='py3langid',
                  executor='slurm', tasks=2, slurm={'partition': 'debug', 'time': '00:30:00'})
  # The command returns once the stages are queued, each depending on the one before: wait for the last's tasks.
  deadline = time.time() + 600
  while len(glob.glob(f'{target}/.work/logs/write/completions/*')) < 2:
    queued = subprocess.run(['squeue', '-h'], capture_output=True, text=True, check=True).stdout.strip()
    logs = {p: open(p).read()[-1500:] for p in sorted(glob.glob(f'{target}/.work/logs/*/slurm_logs/*.out'))}
    assert queued and time.time() < deadline, logs  # no job left, the output unfinished: a stage failed
    time.sleep(2)
  assert sorted(r['id'] for r in _kept(target)) == sorted(r['id'] for r in _kept(out))
