"""prepare at scale: units, the pure shard plan, engines (local pool, Ray) writing the same bytes, resume."""

import collections
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

from jaxlm.data import plan as plan_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import readers
from tests.conftest import ROOT
from tests.data import scale_corpus
from tests.helpers import assert_fails_with, run_cli

SETTINGS = {'vocab_size': 320, 'shard_docs': 9, 'eval_fraction': 0.2, 'progress': False}


def _prepare(corpus, out, **kw):
  return prepare_lib.prepare(readers.expand_inputs([str(corpus)]), str(out), **{**SETTINGS, **kw})


def _files(out) -> dict:
  """Every output file's bytes, but the run log (timings, engine)."""
  return {p.name: p.read_bytes() for p in sorted(pathlib.Path(out).iterdir()) if p.name != 'runs.jsonl'}


@pytest.fixture(scope='session')
def corpus(tmp_path_factory):
  root = tmp_path_factory.mktemp('scale') / 'corpus'
  return root, scale_corpus.write(root)


@pytest.fixture(scope='session')
def reference(corpus, tmp_path_factory):
  """The corpus prepared in this process, one unit per jsonl file."""
  out = tmp_path_factory.mktemp('scale') / 'reference'
  meta = _prepare(corpus[0], out, workers=1, block_bytes=1 << 30)
  return out, meta


def test_jsonl_ranges_give_every_line_once_with_its_number(corpus):
  source = next(s for s in readers.expand_inputs([str(corpus[0])]) if s.key == 'j1.jsonl')
  whole = list(readers.read_documents(source, collections.Counter()))
  for block in (1, 37, 200, source.size - 1):
    units = readers.units(source, collections.Counter(), block_bytes=block)
    assert len(units) == -(-source.size // block)
    got, offset = [], 0
    for u in units:
      got += [(readers.doc_key(source.key, i), t)
              for i, t in readers.read_unit(u, collections.Counter(), line_offset=offset)]
      offset += readers.line_count(u)
    assert got == whole


def test_units_come_from_footers_and_shards_cross_units_and_files(corpus, reference):
  counts = collections.Counter()
  sources = readers.expand_inputs([str(corpus[0])])
  units = [u for s in sources for u in readers.units(s, counts, block_bytes=500)]
  parquet = [u for u in units if u.kind == 'parquet']
  assert len(parquet) == 3 + 7 * 4 and parquet[2].row_offset == 14 and parquet[6].rows == 1
  assert sum(u.kind == 'jsonl' and u.end > 0 for u in units) > 3  # the jsonl files span several blocks
  reading = plan_lib.Reading(eval_fraction=SETTINGS['eval_fraction'])
  offsets = plan_lib.line_offsets(units, [readers.line_count(u) if plan_lib.needs_line_count(u) else 0
                                           for u in units])
  found = [plan_lib.count_unit(u, reading, o) for u, o in zip(units, offsets)]
  per_unit = [c.split for c in found]
  plan = plan_lib.plan_shards(per_unit, SETTINGS['shard_docs'])
  assert plan == plan_lib.plan_shards(per_unit, SETTINGS['shard_docs'])  # pure
  meta = reference[1]
  for split in plan_lib.SPLITS:
    listed = meta['splits'][split]['shards']
    assert [sum(p.last - p.first for p in shard) for shard in plan[split]] == [s['documents'] for s in listed]
  assert any(len({units[p.unit].source.key for p in shard}) > 1 for shard in plan['train'])  # across files
  assert sum(c.documents for c in found) == meta['documents'] == len(corpus[1]['docs'])
  assert meta['dropped'] == {'bad_json': 12, 'empty': 13}


def test_local_engine_with_workers_and_any_unit_size_writes_the_same_bytes(corpus, reference, tmp_path):
  _prepare(corpus[0], tmp_path / 'w2', workers=2, block_bytes=300)
  assert _files(tmp_path / 'w2') == _files(reference[0])


def test_changed_input_is_refused_naming_it(corpus, tmp_path):
  root = tmp_path / 'in'
  scale_corpus.write(root)
  _prepare(root, tmp_path / 'out', workers=1)
  with open(root / 'j2.jsonl', 'a') as f:
    f.write(json.dumps({'text': 'one more'}) + '\n')
  out = run_cli('jaxlm.data.prepare', f'--inputs={root}', f'--out={tmp_path / "out"}', '--vocab_size=320',
                '--shard_docs=9', '--eval_fraction=0.2', '--workers=1')
  assert 'input j2.jsonl changed' in assert_fails_with(out, 2)


def _shard_task_pids() -> list[int]:
  """Ray workers running a shard task now (Ray titles a worker by the task it runs)."""
  out = []
  for d in os.listdir('/proc'):
    if d.isdigit():
      try:
        with open(f'/proc/{d}/cmdline', 'rb') as f:
          if f.read().startswith(b'ray::shard_task'):
            out.append(int(d))
      except OSError:
        pass
  return out


@pytest.mark.e2e
def test_ray_engine_writes_the_same_bytes_on_both_nodes_and_resumes_after_kills(corpus, reference, ray_cluster,
                                                                                  tmp_path):
  # The driver (a `prepare` process) is killed with -9 after some shards ...
  out = tmp_path / 'ray'
  args = [sys.executable, '-m', 'jaxlm.data.prepare', f'--inputs={corpus[0]}', f'--out={out}', '--vocab_size=320',
          '--shard_docs=9', '--eval_fraction=0.2', '--engine=ray', f'--ray_address={ray_cluster}', '--block_mb=0.0005']
  driver = subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
  total = len(reference[1]['splits']['train']['shards']) + len(reference[1]['splits']['eval']['shards'])
  deadline = time.time() + 60
  while len(list(out.glob('*.arrayrecord'))) < 3:
    assert driver.poll() is None and time.time() < deadline, driver.stdout.read().decode()[-3000:]
    time.sleep(0.01)
  driver.kill()
  driver.wait()
  done = len(list(out.glob('*.arrayrecord')))
  assert 3 <= done < total
  # ... then the same work again, in this process, while one Ray worker is killed with -9 mid-task.
  result, killed = {}, []
  run = threading.Thread(target=lambda: result.update(meta=_prepare(
      corpus[0], out, engine='ray', ray_address=ray_cluster, block_bytes=500, progress=False)))
  run.start()
  while run.is_alive():
    if not killed and (pids := _shard_task_pids()):
      os.kill(pids[0], signal.SIGKILL)
      killed.append(pids[0])
    time.sleep(0.002)
  run.join()
  assert result['meta'] == reference[1]
  assert _files(out) == _files(reference[0])
  last = json.loads((out / 'runs.jsonl').read_text().splitlines()[-1])
  assert last['shards_kept'] >= done and last['engine'] == 'ray'
  assert killed, 'no shard task was running to kill'
  assert len([n for n, k in last['shards_written'].items() if k > 0]) == 2, last  # both nodes wrote shards


def test_ray_engine_without_ray_is_one_line(tmp_path, corpus):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  code = ('import sys; sys.modules["ray"] = None; sys.argv = sys.argv[:1] + sys.argv[1:];'
          'from jaxlm.data import prepare; prepare.console()')
  out = subprocess.run([sys.executable, '-c', code, f'--inputs={corpus[0]}', f'--out={tmp_path / "o"}',
                        '--engine=ray'], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert 'jaxlm[ray]' in assert_fails_with(out, 2)
