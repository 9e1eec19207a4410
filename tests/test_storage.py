"""Runs on object storage: the same checkpoints, logs and guarantees on gs://, s3:// and a local directory.

Each test runs for the three stores with the same assertions, against emulators on 127.0.0.1 (tests/stores.py).
"""

import json
import os
import signal
import subprocess
import time
import uuid

import grain
import jax
import numpy as np
import pytest

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import integrity
from jaxlm import errors
from jaxlm import metrics as metrics_lib
from jaxlm import rundir, sharding
from jaxlm.data import storage
from tests.conftest import ROOT
from tests.hf.test_export import _hf_llama, hf, spm_model  # noqa: F401  pylint: disable=unused-import
from tests.helpers import load_config
from tests.helpers import assert_fails_with, run_cli, train_env
from tests.stores import checkpoint_store, gcs_emulator, refusing_gcs, s3_emulator, s3_emulator_checking_keys, store  # noqa: F401  pylint: disable=unused-import
from tests.stores import BUCKET, free_port, store_env
from tests.test_checkpoint import reference  # noqa: F401  pylint: disable=unused-import  (the uninterrupted run)


def _state(seed: int):
  """A state of every kind a training state holds: sharded params, optimizer moments, an RNG key, a step."""
  mesh = sharding.make_mesh(load_config('palm_tiny').mesh)
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('fsdp'))
  whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rng = np.random.default_rng(seed)
  put = lambda x, s=split: jax.device_put(x, s)
  return {'params': {'w': put(rng.standard_normal((16, 24)).astype(np.float32)),
                     'b': put(rng.standard_normal(16).astype(jax.numpy.bfloat16))},
          'opt_state': {'mu': put(rng.standard_normal((16, 24)).astype(np.float32)),
                        'count': put(np.int32(seed), whole)},
          'rng': put(jax.random.key_data(jax.random.key(seed)), whole),
          'step': put(np.int32(seed), whole)}


def _abstract(state):
  return (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state),
          jax.tree.map(lambda x: x.sharding, state))


def _data(position: int):
  """A Grain iterator moved `position` elements on (its state is the data position a checkpoint keeps)."""
  it = iter(grain.MapDataset.range(1000).to_iter_dataset())
  for _ in range(position):
    next(it)
  return it


def _checkpointer(directory, events=None, keep=2):
  cfg = load_config('palm_tiny').checkpoint
  cfg.keep, cfg.async_save = keep, True
  sink = (lambda step, name, message, **k: events.append((step, name, message))) if events is not None else \
      (lambda *a, **k: None)
  return checkpoint_lib.Checkpointer(directory, cfg, sink)


def _equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _save_steps(directory, steps, keep=2):
  ckpt = _checkpointer(directory, keep=keep)
  for step in steps:
    ckpt.save(step, _state(step), _data(step * 10), {'note': 'env'}, {'history': [float(step)]})
  ckpt.close()


def test_three_async_saves_keep_two_and_restore_bit_exact(checkpoint_store):
  directory = storage.join(checkpoint_store, 'checkpoints')
  _save_steps(directory, (2, 4, 6))
  assert rundir.checkpoint_steps(checkpoint_store) == [4, 6]
  for step in (4, 6):  # checksums from the store's own hashes (local: sha256 of the bytes)
    recorded = storage.read_json(storage.join(directory, str(step), integrity.CHECKSUMS))
    algorithm = {'local': 'sha256', 'gs': 'crc32c', 's3': 'etag'}[storage.scheme(checkpoint_store) or 'local']
    assert recorded[algorithm] and integrity.verify_checksums(storage.join(directory, str(step))) is None
  ckpt = _checkpointer(directory)
  data = _data(0)
  state, guard = ckpt.restore(*_abstract(_state(6)), data)
  ckpt.close()
  _equal(state, _state(6))
  assert guard == {'history': [6.0]} and next(data) == 60  # the data position and the guard, as saved
  assert jax.tree.leaves(state)[0].sharding == jax.tree.leaves(_state(6))[0].sharding
  # What checkpoint.init_from, eval, generate and export read: the newest step's parameters, from the store.
  abstract, shardings = _abstract(_state(6)['params'])
  _equal(checkpoint_lib.load_params(directory, abstract, shardings), _state(6)['params'])
  _equal(rundir.read_params(rundir.step_dir(checkpoint_store)), _state(6)['params'])


def test_a_save_killed_half_way_is_never_listed_then_cleared_and_saved_again(checkpoint_store):
  directory = storage.join(checkpoint_store, 'checkpoints')
  _save_steps(directory, (2, 4), keep=3)
  # What a kill -9 in the middle of saving step 4 leaves: every file but the marker that commits it (a bucket),
  # or the temporary directory Orbax renames only when complete (a local disk).
  step_dir = storage.join(directory, '4')
  if storage.is_url(checkpoint_store):
    for name, _ in storage.hashes(step_dir)[1].items():
      if name.endswith('commit_success.txt'):
        storage.remove(storage.join(step_dir, name))
  else:
    storage.move(step_dir, storage.join(directory, '4.orbax-checkpoint-tmp-1234'))
  assert rundir.checkpoint_steps(checkpoint_store) == [2]
  ckpt = _checkpointer(directory)
  assert ckpt.manager.all_steps() == [2]
  assert storage.listdir(directory) == ['2']  # the half-saved step is cleared before it is saved again
  data = _data(0)
  state, _ = ckpt.restore(*_abstract(_state(2)), data)
  _equal(state, _state(2))
  ckpt.save(4, _state(4), _data(40), {}, {})  # the same step, saved again, and resumed from
  ckpt.close()
  ckpt = _checkpointer(directory)
  state, _ = ckpt.restore(*_abstract(_state(4)), data)
  ckpt.close()
  _equal(state, _state(4))
  assert next(data) == 40 and rundir.checkpoint_steps(checkpoint_store) == [2, 4]


def test_a_replaced_object_is_reported_moved_aside_and_the_step_before_used(checkpoint_store):
  directory = storage.join(checkpoint_store, 'checkpoints')
  _save_steps(directory, (2, 4))
  step_dir = storage.join(directory, '4')
  _, sums = storage.hashes(step_dir)
  victim = max((n for n in sums if n.startswith('state/') and '/d/' in n), key=len)  # an array data file
  original = storage.read_bytes(storage.join(step_dir, victim))
  storage.write_bytes(storage.join(step_dir, victim), bytes(b ^ 0xFF for b in original))  # same size, new bytes
  events = []
  ckpt = _checkpointer(directory, events)
  data = _data(0)
  state, _ = ckpt.restore(*_abstract(_state(4)), data)
  ckpt.close()
  _equal(state, _state(2))
  assert next(data) == 20
  [(step, name, message)] = events
  assert step == 4 and name == 'checkpoint_unreadable' and 'differ from the checksums' in message
  aside = storage.listdir(f'{directory}.unreadable')
  assert len(aside) == 1 and aside[0].startswith('4-')  # kept for inspection, out of the listing
  assert storage.read_bytes(storage.join(f'{directory}.unreadable', aside[0], victim)) != original
  assert rundir.checkpoint_steps(checkpoint_store) == [2] and storage.listdir(directory) == ['2']


def test_checkpoints_on_s3_are_refused_with_the_route_to_take(s3_emulator, monkeypatch):
  for name, value in store_env('s3', s3=s3_emulator).items():
    monkeypatch.setenv(name, value)
  with pytest.raises(checkpoint_lib.ConfigError, match='mount the bucket') as e:
    _checkpointer(f's3://{BUCKET}/run/checkpoints')
  assert 'Orbax writes checkpoints to gs:// and local paths only' in str(e.value)


def _records(logger, steps):
  for step in steps:
    logger.write(step, {'loss': 1.0 / step, 'lr': 0.1, 'grad_norm': 2.0, 'tokens_per_s': 10.0})


def test_metrics_and_tensorboard_survive_a_crash_and_a_resume(store, tmp_path):
  """A logger that dies without closing (a kill -9 runs no close), then a resumed one redoing steps 4-5: every
  record written is read back once, by rundir.read_metrics and by TensorBoard's event loader."""
  from tensorboard.backend.event_processing import event_accumulator  # pylint: disable=import-outside-toplevel
  cfg = load_config('palm_tiny').log
  crashed = metrics_lib.MetricsLogger(store, cfg, total_steps=8)
  _records(crashed, range(1, 6))
  crashed.event(5, 'checkpoint_failed', 'a warning before the crash')
  # No close(): what is on the store now is what a kill -9 would leave.
  resumed = metrics_lib.MetricsLogger(store, cfg, total_steps=8)
  _records(resumed, range(4, 9))
  resumed.close()
  records = rundir.read_metrics(store)
  assert [r['step'] for r in records if r['kind'] == 'train'] == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
  assert [r['message'] for r in records if r['kind'] == 'event'] == ['a warning before the crash']
  assert [r['step'] for r in rundir.latest_by_step(records, 'train')] == list(range(1, 9))
  if storage.is_url(store):
    assert not storage.exists(storage.join(store, rundir.METRICS))  # segments only: a bucket cannot append
    assert len(storage.listdir(storage.join(store, rundir.METRICS + '.d'))) == 2  # one per process
  local = tmp_path / 'tb'
  local.mkdir()
  for name in storage.listdir(storage.join(store, 'tb')):
    (local / name).write_bytes(storage.read_bytes(storage.join(store, 'tb', name)))
  steps = []
  # One event file per writer, in the order written: events.out.tfevents.<time>.<host>.<pid>.<n>, where <n> counts
  # the writers of one process. Both loggers here are one process, often in one second: by name, writer 10 would
  # come before writer 9 (seen in a whole-suite run).
  written = lambda name: (int(name.split('.')[3]), int(name.split('.')[-2]), int(name.split('.')[-1]))
  for name in sorted((p.name for p in local.iterdir()), key=written):
    acc = event_accumulator.EventAccumulator(str(local / name))
    acc.Reload()
    steps += [e.step for e in acc.Scalars('train/loss')]
  assert steps == [1, 2, 3, 4, 5, 4, 5, 6, 7, 8]


def test_a_closed_port_as_endpoint_stops_in_seconds_with_exit_3(tmp_path):
  port = free_port()  # bound and released: nothing listens there
  env = {**train_env(), 'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{port}'}
  start = time.monotonic()
  out = run_cli('jaxlm.train', '--config=configs/palm_tiny.py', f'--workdir=gs://{BUCKET}/run', env=env, timeout=60)
  elapsed = time.monotonic() - start
  assert_fails_with(out, 3, f'cannot reach 127.0.0.1:{port}', 'STORAGE_EMULATOR_HOST')
  assert elapsed < 2 * 15, elapsed  # the product's 15 s (start, 3 s connect probe), x2 for a busy box (18.9 s seen)


def test_a_missing_bucket_is_one_line_and_exit_3(store):
  if not storage.is_url(store):
    pytest.skip('a local directory is created, not looked up')
  missing = store.replace(BUCKET, 'no-such-bucket')
  with pytest.raises(errors.StorageError) as e:
    storage.check(missing)
  assert e.value.exit_code == 3 and str(e.value) == (
      f'--workdir={missing}: bucket no-such-bucket does not exist (or these credentials cannot see it); create it '
      f'or fix the URL')

E2E = ('--config.train.steps=12', '--config.train.log_every=1', '--config.checkpoint.every=4',
       '--config.stability.spike_window=4', '--config.data.source=prepared')


@pytest.mark.slow(reason='four trainer processes against the GCS emulator: uninterrupted local, SIGTERM, kill -9, resume')
def test_sigterm_kill_9_and_resume_on_a_bucket_match_an_uninterrupted_local_run(gcs_emulator, tmp_path, prepared,
                                                                                monkeypatch):
  """The run directory and its prepared data on the bucket; the reference reads the same data from a local disk."""
  import psutil  # pylint: disable=import-outside-toplevel
  from jaxlm.data import prepare as prepare_lib  # pylint: disable=import-outside-toplevel
  from tests.helpers import train_command  # pylint: disable=import-outside-toplevel
  for name, value in store_env('gs', gcs=gcs_emulator).items():
    monkeypatch.setenv(name, value)
  base = f'gs://{BUCKET}/{uuid.uuid4().hex[:12]}'
  prepare_lib.upload_prepared(str(prepared), storage.join(base, 'data'))
  cache = f'--config.data.cache_dir={tmp_path / "cache"}'
  reference = subprocess.run(train_command(tmp_path / 'local', *E2E, cache, f'--config.data.paths={prepared}'),
                             cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=600)
  assert reference.returncode == 0, reference.stderr[-3000:]
  workdir, env = storage.join(base, 'run'), {**train_env(), **store_env('gs', gcs=gcs_emulator)}
  command = train_command(workdir, *E2E, cache, f'--config.data.paths={storage.join(base, "data")}')
  logged = lambda: max((r['step'] for r in rundir.read_metrics(workdir) if r.get('kind') == 'train'), default=0)

  def start_until(step):
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while logged() < step:
      assert proc.poll() is None and time.time() < deadline, proc.stdout.read()[-3000:]
      time.sleep(0.2)
    return proc

  proc = start_until(3)
  proc.send_signal(signal.SIGTERM)  # a preemption notice: the step finishes, a checkpoint is saved, exit 0
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  stopped = [r for r in rundir.read_metrics(workdir) if r.get('event') == 'preempted'][-1]['step']
  assert stopped in rundir.checkpoint_steps(workdir) and stopped < 8  # the preemption save
  proc = start_until(stopped + 1)
  trainer = psutil.Process(proc.pid).children()  # the watcher's training process (cli.run_watched)
  proc.send_signal(signal.SIGKILL)  # no warning: whatever was in flight is lost
  proc.wait()
  psutil.wait_procs(trainer, timeout=10)
  assert logged() < 12, 'the run ended before the kill -9'
  again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert again.returncode == 0 and 'resumed from checkpoint step' in again.stdout, again.stderr[-3000:]
  want = {r['step']: r['loss'] for r in rundir.read_metrics(tmp_path / 'local') if r['kind'] == 'train'}
  got = [(r['step'], r['loss']) for r in rundir.read_metrics(workdir) if r['kind'] == 'train']
  assert sorted({s for s, _ in got}) == list(range(1, 13))
  for step, loss in got:  # every logged loss, redone steps included, bit for bit the uninterrupted local run's
    assert loss == want[step], step
  assert rundir.checkpoint_steps(workdir)[-1] == 12
  # The tools read a bucket run as a local one: the same held-out loss and greedy sample, to the printed digit.
  evals = [run_cli('jaxlm.tools.eval', f'--workdir={w}', '--batches=1', '--prompt=def', '--max_tokens=4',
                   '--temperature=0', env=env, timeout=300) for w in (tmp_path / 'local', workdir)]
  assert all(e.returncode == 0 for e in evals) and 'loss ' in evals[0].stdout, evals[1].stderr[-3000:]
  assert evals[1].stdout == evals[0].stdout
  samples = [run_cli('jaxlm.tools.generate', f'--workdir={w}', '--prompt=def', '--max_new_tokens=6',
                     '--temperature=0', f'--output={tmp_path / f"{i}.jsonl"}', env=env, timeout=300)
             for i, w in enumerate((tmp_path / 'local', workdir))]
  assert all(g.returncode == 0 for g in samples), samples[1].stderr[-3000:]
  assert (tmp_path / '1.jsonl').read_text() == (tmp_path / '0.jsonl').read_text()
  # checkpoint.init_from's loader reads the bucket run's newest parameters as the local run's, bit for bit.
  from tests.helpers import plain_program  # pylint: disable=import-outside-toplevel
  cfg = load_config('palm_tiny')
  program = plain_program(cfg, sharding.make_mesh(cfg.mesh))
  a, b = (checkpoint_lib.load_params(str(w), program.abstract_state.params, program.state_shardings.params)
          for w in (tmp_path / 'local' / 'checkpoints', storage.join(workdir, 'checkpoints')))
  _equal(a, b)


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
  """A small dataset prepared on a local disk (the staging directory of `prepare --out=<bucket>`)."""
  from jaxlm.data import prepare as prepare_lib  # pylint: disable=import-outside-toplevel
  from tests.data.test_prepare import TEXTS, VOCAB  # pylint: disable=import-outside-toplevel
  corpus = tmp_path_factory.mktemp('corpus')
  for i, text in enumerate(TEXTS * 3):
    (corpus / f'{i}.txt').write_text(text)
  out = tmp_path_factory.mktemp('prepared')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(corpus)]), str(out), vocab_size=VOCAB, workers=1,
                      shard_docs=8, eval_fraction=0.2, progress=False)
  return out


def test_data_prepared_to_a_bucket_is_read_back_verified_and_the_same(store, prepared, tmp_path):
  from jaxlm.data import pipeline, prepare as prepare_lib  # pylint: disable=import-outside-toplevel
  from tests.data.test_prepare import VOCAB  # pylint: disable=import-outside-toplevel
  url = storage.join(store, 'data')
  cfg = load_config('palm_tiny').data
  cfg.update(source='prepared', paths=url, cache_dir=str(tmp_path / 'cache'))
  if storage.is_url(store):
    with pytest.raises(pipeline.DataError, match='no metadata.json'):  # nothing uploaded yet: not a dataset
      pipeline.dataset_dirs(cfg, VOCAB)
  prepare_lib.upload_prepared(str(prepared), url)
  [local] = pipeline.dataset_dirs(cfg, VOCAB)
  a, b = pipeline.open_prepared(str(prepared), VOCAB), pipeline.open_prepared(local, VOCAB)
  assert a.meta == b.meta and a.shards('train') and len(a.shards('train')) == len(b.shards('train'))
  for x, y in zip(a.shards('train') + a.shards('eval'), b.shards('train') + b.shards('eval')):
    assert open(x, 'rb').read() == open(y, 'rb').read()
  if storage.is_url(store):  # a shard replaced on the bucket is fetched again (its store hash changed)
    shard = storage.basename(b.shards('train')[0])
    storage.write_bytes(storage.join(url, shard), b'replaced')
    [again] = pipeline.dataset_dirs(cfg, VOCAB)
    assert again == local and open(storage.join(local, shard), 'rb').read() == b'replaced'


def test_import_and_export_with_bucket_paths_are_bit_exact(store, tmp_path, hf, spm_model):
  from safetensors.numpy import load_file  # pylint: disable=import-outside-toplevel
  from jaxlm.hf import export, import_llama  # pylint: disable=import-outside-toplevel
  _hf_llama(hf, str(tmp_path / 'hf'), tied=False, spm_model=spm_model)
  source, run, back = storage.join(store, 'hf'), storage.join(store, 'run'), storage.join(store, 'back')
  storage.upload(str(tmp_path / 'hf'), source)
  if storage.checkpoints_unsupported(run):  # s3: refused before any work, with the route to take
    with pytest.raises(import_llama.HFImportError, match='mount the bucket'):
      import_llama.import_hf(source, run, cache_dir=str(tmp_path / 'cache'))
    assert not storage.exists(run)
    run = str(tmp_path / 'run')
  result = import_llama.import_hf(source, run, cache_dir=str(tmp_path / 'cache'))
  assert result['checkpoint'] == storage.join(run, 'checkpoints', '0') and storage.isdir(result['checkpoint'])
  assert 'tokenizer.model' in result['tokenizer_files']
  for name in result['tokenizer_files']:  # beside the checkpoints, where export looks first
    assert storage.read_bytes(storage.join(run, name)) == (tmp_path / 'hf' / name).read_bytes(), name

  summary = export.export(run, back)
  assert summary['out'] == (back if storage.is_url(back) else os.path.abspath(back))
  assert sorted(storage.listdir(back)) == sorted(summary['files']) and 'tokenizer.model' in summary['files']
  assert storage.read_bytes(storage.join(back, 'tokenizer.model')) == open(spm_model, 'rb').read()
  storage.download(storage.join(back, 'model.safetensors'), str(tmp_path / 'back.safetensors'))
  before = {k: v for f in os.listdir(tmp_path / 'hf') if f.endswith('.safetensors')
            for k, v in load_file(str(tmp_path / 'hf' / f)).items()}
  after = load_file(str(tmp_path / 'back.safetensors'))
  assert sorted(before) == sorted(after)
  for name in before:  # bucket → jaxlm checkpoint → bucket: every tensor bit for bit
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.parametrize('keys', ['wrong', 'none'])
def test_wrong_or_missing_s3_credentials_stop_in_seconds_with_exit_3(s3_emulator_checking_keys, tmp_path, keys):
  (tmp_path / 'in').mkdir()
  (tmp_path / 'in' / 'a.txt').write_text('some text\n')
  env = {k: v for k, v in train_env().items() if not k.startswith('AWS_')}
  env.update(AWS_ENDPOINT_URL=s3_emulator_checking_keys, AWS_REGION='us-east-1')
  if keys == 'wrong':
    env.update(AWS_ACCESS_KEY_ID='AKIAWRONGWRONGWRONG0', AWS_SECRET_ACCESS_KEY='wrong')
  else:  # nowhere botocore looks: no variables, no profile files, no instance role
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / 'none'), AWS_CONFIG_FILE=str(tmp_path / 'none'),
               AWS_EC2_METADATA_DISABLED='true')
  start = time.monotonic()
  out = run_cli('jaxlm.data.prepare', f'--inputs={tmp_path / "in"}', f'--out=s3://{BUCKET}/data', env=env,
                timeout=60)
  assert time.monotonic() - start < 2 * 15  # the product's 15 s (start, 3 s connect, 3 attempts), x2 for a busy box
  expected = ('PermissionError: Forbidden; check the credentials' if keys == 'wrong' else
              'no S3 credentials were found; set them')
  assert_fails_with(out, 3, f'--out=s3://{BUCKET}/data: {expected}', 'AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY')


def test_inputs_on_a_bucket_are_read_in_place_into_the_same_shards(store, tmp_path):
  from jaxlm.data import prepare as prepare_lib, readers  # pylint: disable=import-outside-toplevel
  from tests.data import scale_corpus  # pylint: disable=import-outside-toplevel
  from tests.data.test_prepare_scale import SETTINGS  # pylint: disable=import-outside-toplevel
  scale_corpus.write(tmp_path / 'corpus')  # parquet row groups, jsonl ranges, a .jsonl.gz, a txt, bad records
  url = storage.join(store, 'corpus')
  storage.upload(str(tmp_path / 'corpus'), url)
  sources = readers.expand_inputs([url])
  assert [s.key for s in sources] == [s.key for s in readers.expand_inputs([str(tmp_path / 'corpus')])]
  prepare_lib.prepare(readers.expand_inputs([str(tmp_path / 'corpus')]), str(tmp_path / 'a'), **SETTINGS)
  prepare_lib.prepare(sources, str(tmp_path / 'b'), block_bytes=1000, **SETTINGS)  # ranged reads of the objects
  skip = ('runs.jsonl', 'plan.json', 'metadata.json')  # the last two name where the inputs were
  files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name not in skip}
  assert files(tmp_path / 'b') == files(tmp_path / 'a') and any(n.endswith('.arrayrecord') for n in files(tmp_path / 'a'))
  meta = [json.loads((tmp_path / d / 'metadata.json').read_text()) for d in 'ab']
  paths = [[s.pop('path') for s in m['sources']] for m in meta]
  assert meta[1] == meta[0] and paths[1] == [storage.join(url, s.key) for s in sources]
  storage.write_bytes(storage.join(url, 'j2.jsonl'), (tmp_path / 'corpus' / 'j2.jsonl').read_text() + '{"text": "x"}\n')
  with pytest.raises(readers.PrepareError, match='input j2.jsonl changed'):  # the store's hash says so
    prepare_lib.prepare(readers.expand_inputs([url]), str(tmp_path / 'b'), block_bytes=1000, **SETTINGS)


def test_streaming_from_a_bucket_gives_the_rows_of_the_local_files(store, tmp_path):
  from tests.data import test_stream_lanes as lanes_test  # pylint: disable=import-outside-toplevel
  from tests.data import scale_corpus  # pylint: disable=import-outside-toplevel
  from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  docs = scale_corpus.write(tmp_path / 'corpus')['docs']
  tokenizer_lib.train(iter(docs), str(tmp_path / 'tok.model'), vocab_size=320)
  url = storage.join(store, 'corpus')
  storage.upload(str(tmp_path / 'corpus'), url)
  cfg = load_config().data
  cfg.update(source='stream', paths=str(tmp_path / 'corpus'), tokenizer=str(tmp_path / 'tok.model'),
             seq_len=lanes_test.SEQ, stream_lanes=lanes_test.LANES)
  local = lanes_test._global_rows(lanes_test._iterators(cfg, 1), 12)  # pylint: disable=protected-access
  cfg.paths = url
  two = lanes_test._iterators(cfg, 2)  # pylint: disable=protected-access
  assert lanes_test._global_rows(two, 12) == local  # pylint: disable=protected-access


@pytest.mark.slow(reason='a trainer whose bucket refuses its final save, then the same command again')
def test_a_bucket_refusing_the_final_save_exits_3_and_the_rerun_ends_as_the_uninterrupted_run(
    refusing_gcs, tmp_path, data_cache, reference):
  """The quota drill at the last step: one refused save, the final one, ends the run with exit 3 and the line that
  says which step was not written and what a rerun resumes from (never 0); the rerun, the bucket writable again,
  ends with the uninterrupted run's parameters (issue #57)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from tests.test_checkpoint import STEPS, _args, _final_params  # pylint: disable=import-outside-toplevel
  from tests.helpers import train_command  # pylint: disable=import-outside-toplevel
  url, refuse = refusing_gcs
  env = {**train_env(), 'STORAGE_EMULATOR_HOST': url}
  workdir = f'gs://{BUCKET}/{uuid.uuid4().hex[:12]}/run'
  command = train_command(workdir, *_args(data_cache, f'--config.checkpoint.every={STEPS // 2}'))
  refuse.set(matching=f'checkpoints/{STEPS}')  # the save half way is written; the last one, step STEPS's, refused
  os.environ['STORAGE_EMULATOR_HOST'] = url
  try:
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert_fails_with(out, 3, f'checkpoint of step {STEPS} was not written', 'Forbidden',
                      f'a rerun resumes from step {STEPS // 2}, the newest good checkpoint', "fix: the bucket's quota")
    assert rundir.checkpoint_steps(workdir) == [STEPS // 2]
    refuse.clear()
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f'resumed from checkpoint step {STEPS // 2}' in again.stdout, again.stderr[-3000:]
    final = ocp.StandardCheckpointer().restore(f'{workdir}/checkpoints/{STEPS}/state')['params']
    jax.tree.map(np.testing.assert_array_equal, final, _final_params(reference))
  finally:
    os.environ.pop('STORAGE_EMULATOR_HOST', None)


@pytest.mark.slow(reason='a trainer against a bucket that starts refusing writes mid-run, then the same command again')
def test_a_bucket_over_its_quota_stops_the_run_like_a_full_disk_and_loses_nothing(refusing_gcs, tmp_path,
                                                                                  data_cache):
  from tests.helpers import train_command  # pylint: disable=import-outside-toplevel
  url, refuse = refusing_gcs
  env = {**train_env(), 'STORAGE_EMULATOR_HOST': url}
  workdir = f'gs://{BUCKET}/{uuid.uuid4().hex[:12]}/run'
  command = train_command(workdir, '--config.train.steps=8', '--config.train.log_every=1',
                          '--config.checkpoint.every=2', '--config.stability.spike_window=4',
                          f'--config.data.cache_dir={data_cache}')
  os.environ['STORAGE_EMULATOR_HOST'] = url
  try:
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while not rundir.checkpoint_steps(workdir):  # a committed checkpoint to resume from
      assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
      time.sleep(0.2)
    logged = max(r['step'] for r in rundir.read_metrics(workdir) if r.get('kind') == 'train')
    refuse.set()  # every write from now on: 403 quotaExceeded
    start = time.monotonic()
    out, err = proc.communicate(timeout=300)
    elapsed = time.monotonic() - start
    refuse.clear()
    assert_fails_with(subprocess.CompletedProcess(command, proc.returncode, out, err), 3, 'Forbidden',
                      'the store refused the write', 'quota')
    assert elapsed < 60, elapsed  # at the next write, not after minutes of retries
    steps = [r['step'] for r in rundir.read_metrics(workdir) if r.get('kind') == 'train']
    assert steps[:logged] == list(range(1, logged + 1))  # nothing written before the refusal was lost
    committed = rundir.checkpoint_steps(workdir)[-1]
    again = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and f'resumed from checkpoint step {committed}' in again.stdout, \
        again.stderr[-3000:]
    assert sorted({r['step'] for r in rundir.read_metrics(workdir) if r.get('kind') == 'train'}) == list(range(1, 9))
  finally:
    os.environ.pop('STORAGE_EMULATOR_HOST', None)
