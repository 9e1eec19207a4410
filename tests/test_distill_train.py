"""train.objective=distill through the one trainer: a student distilled (forward KL) from a better teacher beats the
same student on hard labels; a resumed distillation run continues bit for bit (the teacher reloaded, not
checkpointed); a teacher of another vocabulary or tokenizer is refused at validation."""

import pathlib
import shutil

import jax
import ml_collections
import numpy as np
import pytest

from jaxlm import config as config_lib
from jaxlm import errors
from jaxlm import train
from tests.helpers import load_config, read_records, train_command
from tests import stores

STUDENT_STEPS = 30
s3_emulator = stores.s3_emulator  # the session's moto server (skips where moto is missing)


def _student_cfg(data_cache, teacher: str, objective: str = 'distill', steps: int = STUDENT_STEPS):
  """A smaller student (D 32, 1 layer) of the teacher's vocabulary, on shorter rows of the same corpus."""
  c = load_config('palm_tiny')
  c.data.update(cache_dir=str(data_cache), seq_len=32)
  c.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64)
  c.train.update(objective=objective, steps=steps, batch_size=8, log_every=1, eval_every=0, eval_batches=4, seed=1)
  c.optim.update(lr=1e-2, warmup_steps=5)
  c.distill.update(teacher=teacher, beta=0.0, temperature=1.0, alpha=0.0, top_k=0)
  c.checkpoint.update(every=10, keep=5, async_save=False)
  c.log.tensorboard = False
  return c


@pytest.fixture(scope='module')
def teacher(trained_tiny) -> str:
  """The suite's trained palm_tiny (D 64, 2 layers, 300 steps; tests/conftest.py), made once for the whole run."""
  return trained_tiny


@pytest.fixture(scope='module')
def distilled(teacher, data_cache, tmp_path_factory):
  """The uninterrupted distillation run of _student_cfg, trained once for this module: (its workdir, its last
  record). The in-process resume and the command-line kill drill both compare against it."""
  cfg = _student_cfg(data_cache, teacher)
  config_lib.validate(cfg, jax.device_count())
  workdir = tmp_path_factory.mktemp('distilled')
  return workdir, train.run(cfg, str(workdir))


@pytest.mark.e2e  # three trainer runs: seconds of compiles
def test_a_distilled_student_beats_hard_labels_and_resumes_bit_for_bit(teacher, data_cache, distilled, tmp_path):
  """Forward KL from the teacher vs cross-entropy on the same batches, steps, seed and student: the distilled one
  has the lower held-out cross-entropy. A run resumed from its step-10 checkpoint logs the same losses and saves
  the same parameters and optimizer state as the uninterrupted run."""
  import orbax.checkpoint as ocp
  distilled_cfg = _student_cfg(data_cache, teacher)
  distilled_dir, distilled = distilled
  hard = train.run(_student_cfg(data_cache, teacher, objective='lm'), str(tmp_path / 'hard'))
  teacher_loss = read_records(teacher, 'eval')[-1]['eval_loss']
  assert distilled['eval_loss'] < hard['eval_loss'] - 0.02, (distilled['eval_loss'], hard['eval_loss'], teacher_loss)
  assert teacher_loss < distilled['eval_loss']  # the teacher is the better model: there is something to learn

  (tmp_path / 'resumed' / 'checkpoints').mkdir(parents=True)
  shutil.copytree(distilled_dir / 'checkpoints' / '10', tmp_path / 'resumed' / 'checkpoints' / '10')
  train.run(distilled_cfg, str(tmp_path / 'resumed'))
  full, resumed = read_records(distilled_dir), read_records(tmp_path / 'resumed')
  assert [r['step'] for r in resumed] == list(range(11, STUDENT_STEPS + 1))
  keys = ('loss', 'divergence', 'ce', 'grad_norm')
  assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full[10:]]
  want, got = (ocp.StandardCheckpointer().restore(run / 'checkpoints' / str(STUDENT_STEPS) / 'state')
               for run in (distilled_dir, tmp_path / 'resumed'))
  for item in ('params', 'opt_state'):
    jax.tree.map(np.testing.assert_array_equal, got[item], want[item])


def _overrides(cfg) -> list[str]:
  """`--config.<key>=<value>` for each setting of `cfg` that differs from configs/palm_tiny.py's: the same run as a
  user types it."""
  def leaves(d, prefix=''):
    for k, v in d.items():
      yield from leaves(v, f'{prefix}{k}.') if isinstance(v, dict) else [(prefix + k, v)]
  base = dict(leaves(load_config('palm_tiny').to_dict()))
  return [f'--config.{k}={v}' for k, v in leaves(cfg.to_dict()) if base[k] != v]


def test_a_distillation_command_stopped_by_sigterm_then_killed_resumes_bit_for_bit(distilled, teacher, data_cache,
                                                                                     tmp_path):
  """`python -m jaxlm.train` of the module's distillation run: SIGTERM at step 5 saves and exits 0; the rerun is
  killed with SIGKILL past its step-20 checkpoint; the next rerun finishes. Every loss logged, redone steps
  included, and the final parameters and optimizer state are the uninterrupted run's, bit for bit: the teacher's
  targets and the data position come back with the checkpoint."""
  import signal
  import subprocess
  import orbax.checkpoint as ocp
  from tests.conftest import ROOT
  from tests.helpers import train_env
  from tests.test_checkpoint import _trainer_of, _wait_for_step  # the checkpoint tests' drill helpers
  command = train_command(tmp_path, *_overrides(_student_cfg(data_cache, teacher)))
  start = lambda: subprocess.Popen(command, cwd=ROOT, env=train_env(), stdout=subprocess.PIPE,  # noqa: E731
                                   stderr=subprocess.STDOUT, text=True)
  proc = start()
  _wait_for_step(proc, tmp_path, 5)
  proc.send_signal(signal.SIGTERM)
  output = proc.communicate(timeout=300)[0]
  assert proc.returncode == 0, output[-3000:]
  stopped = [r for r in read_records(tmp_path, 'event') if r['event'] == 'preempted'][-1]
  assert 'checkpoint saved' in stopped['message'] and (tmp_path / 'checkpoints' / str(stopped['step'])).is_dir()

  proc = start()
  _wait_for_step(proc, tmp_path, 21)  # past the step-20 checkpoint (saved before step 21 runs): 21.. are redone
  trainer = _trainer_of(proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  trainer.wait(timeout=10)  # it dies with its watcher: nothing trains on behind a kill -9
  out = subprocess.run(command, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0 and 'resumed from checkpoint step 20' in out.stdout, out.stdout[-3000:] + out.stderr

  distilled_dir = distilled[0]
  want = {r['step']: r['loss'] for r in read_records(distilled_dir)}
  got = [(r['step'], r['loss']) for r in read_records(tmp_path)]
  steps = [step for step, _ in got]
  killed = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])  # steps logged before the kill
  # After SIGTERM no step lost or redone; after the kill, 21.. redone.
  assert killed >= 21 and steps == list(range(1, killed + 1)) + list(range(21, STUDENT_STEPS + 1))
  assert [(step, want[step]) for step in steps] == got
  ckpt, final = ocp.StandardCheckpointer(), str(STUDENT_STEPS)
  want, got = (ckpt.restore(run / 'checkpoints' / final / 'state') for run in (distilled_dir, tmp_path))
  for item in ('params', 'opt_state'):
    jax.tree.map(np.testing.assert_array_equal, got[item], want[item])


def _on_policy_cfg(data_cache, teacher):
  """4 steps of which the 4th samples (distill.on_policy=0.5 at seed 1), 8 tokens each, GKD's beta 0.5."""
  cfg = _student_cfg(data_cache, teacher, steps=4)
  cfg.distill.update(on_policy=0.5, max_new_tokens=8, beta=0.5)
  cfg.optim.warmup_steps = 1
  cfg.stability.policy = 'skip'  # no rollback: four steps
  return cfg


@pytest.mark.e2e  # two trainer runs with the sampler: seconds of compiles
def test_on_policy_steps_train_on_the_students_samples_and_resume_bit_for_bit(teacher, data_cache, tmp_path):
  """distill.on_policy=0.5 (seed 1: the 4th step is drawn on-policy): the sampled step is logged as such, and a run
  resumed from step 2 logs the same losses and saves the same parameters as the uninterrupted one."""
  import orbax.checkpoint as ocp
  cfg = _on_policy_cfg(data_cache, teacher)
  cfg.checkpoint.every = 2
  config_lib.validate(cfg, jax.device_count())
  train.run(cfg, str(tmp_path / 'full'))
  (tmp_path / 'resumed' / 'checkpoints').mkdir(parents=True)
  shutil.copytree(tmp_path / 'full' / 'checkpoints' / '2', tmp_path / 'resumed' / 'checkpoints' / '2')
  train.run(cfg, str(tmp_path / 'resumed'))
  full, resumed = read_records(tmp_path / 'full'), read_records(tmp_path / 'resumed')
  assert [r.get('on_policy', 0.0) for r in full] == [0.0, 0.0, 0.0, 1.0]
  keys = ('loss', 'divergence', 'ce', 'grad_norm')
  assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in full[2:]]
  want, got = (ocp.StandardCheckpointer().restore(tmp_path / run / 'checkpoints' / '4' / 'state')
               for run in ('full', 'resumed'))
  jax.tree.map(np.testing.assert_array_equal, got['params'], want['params'])


@pytest.mark.e2e  # 2 processes x 2 devices (launch/local.sh) against 1 process in this one
def test_on_policy_distillation_in_two_processes_trains_as_one(teacher, data_cache, tmp_path):
  """launch/local.sh -n 2 -d 2 (as tests/test_rl.py runs RL): each process gathers the whole batch, samples every
  row alike and trains on its share; every step's losses equal one process's on 4 devices, the on-policy step
  included (its samples are the same, or its divergence would not be)."""
  import subprocess
  from tests.conftest import ROOT
  from tests.helpers import train_env
  cfg = _on_policy_cfg(data_cache, teacher)
  cfg.checkpoint.every = 0
  config_lib.validate(cfg, 4)
  train.run(cfg, str(tmp_path / 'one'), devices=jax.devices()[:4])
  command = ['launch/local.sh', '-n', '2', '-d', '2', '--', *train_command(tmp_path / 'two', *_overrides(cfg))]
  out = subprocess.run(command, cwd=ROOT, env=train_env(devices=2), capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  one, two = read_records(tmp_path / 'one'), read_records(tmp_path / 'two')
  assert [r.get('on_policy', 0.0) for r in two] == [r.get('on_policy', 0.0) for r in one] == [0.0, 0.0, 0.0, 1.0]
  for key in ('loss', 'divergence', 'ce'):
    np.testing.assert_allclose([r[key] for r in two], [r[key] for r in one], rtol=2e-5, err_msg=key)


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused(teacher, data_cache, tmp_path):
  """validate: model.vocab_size 256 against the teacher's 512, and a teacher import whose tokenizer file is not the
  student's data's, each one line naming both; out-of-range settings named by their keys."""
  other_vocab = _student_cfg(data_cache, teacher)
  other_vocab.model.vocab_size = 256
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(other_vocab, jax.device_count())
  assert 'model.vocab_size=512 but the student has model.vocab_size=256' in str(e.value)

  imported = tmp_path / 'import'  # the teacher's saved config, beside a tokenizer file of its own (an import)
  src = sorted((pathlib.Path(teacher) / 'checkpoints').iterdir(), key=lambda p: int(p.name))[-1]
  shutil.copytree(src / 'env', imported / 'checkpoints' / src.name / 'env')
  (imported / 'tokenizer.model').write_bytes(b'another tokenizer')
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(_student_cfg(data_cache, str(imported)), jax.device_count())
  lines = [line for line in str(e.value).splitlines() if 'distill.teacher' in line]
  assert len(lines) == 1 and 'uses sha256 ' in lines[0] and 'stdlib corpus tokenizer of 512 entries' in lines[0]

  other_cap = _student_cfg(data_cache, teacher)  # the stdlib corpus under another cap: another tokenizer of 512
  other_cap.data.stdlib_max_mb = 24
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(other_cap, jax.device_count())
  assert 'data.stdlib_max_mb=2,' in str(e.value) and 'data.stdlib_max_mb=24,' in str(e.value)

  bad = _student_cfg(data_cache, teacher)
  bad.distill.update(beta=1.5, temperature=0.0, top_k=1000, teacher_dtype='int8')
  with pytest.raises(errors.ConfigError) as e:
    config_lib.validate(bad, jax.device_count())
  for key in ('distill.beta=1.5', 'distill.temperature=0.0', 'distill.top_k=1000', "distill.teacher_dtype='int8'"):
    assert key in str(e.value)


# Offline: the teacher's top-K cached by jaxlm.tools.teacher and read beside the batches.


@pytest.fixture(scope='module')
def chat(tmp_path_factory) -> str:
  """Prepared chat data (a byte-level BPE tokenizer of ~400 entries), 20% held out."""
  from jaxlm.data import prepare as prepare_lib
  from tests.data import chat_fixtures
  tmp = tmp_path_factory.mktemp('distill_chat')
  path = chat_fixtures.write_jsonl(tmp / 'chats.jsonl', chat_fixtures.conversations(48))
  out = str(tmp / 'data')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(path)]), out, workers=1, eval_fraction=0.2, progress=False,
                      data_format='chat', tokenizer=chat_fixtures.make_tokenizer(str(tmp / 'tok')), seq_len=64)
  return out


def _chat_cfg(chat: str, steps: int = 2, **distill):
  c = load_config('palm_tiny')
  c.data.update(source='prepared', paths=chat)
  c.model.update(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=64)
  c.train.update(steps=steps, batch_size=8, log_every=1, eval_every=0, eval_batches=1)
  c.optim.update(lr=1e-2, warmup_steps=0)
  c.checkpoint.update(every=0, async_save=False)
  c.log.tensorboard = False
  if distill:
    c.train.objective = 'distill'
    c.distill.update(**distill)
  return c


@pytest.fixture(scope='module')
def cached_teacher(chat, tmp_path_factory):
  """A teacher trained 3 steps on the chat data, its K = V cache at temperature 0.7 (jaxlm.tools.teacher) and a
  2-step student run reading it: (teacher, cache, the cache's manifest, the student's workdir, its last record)."""
  from jaxlm.tools import teacher as teacher_tool
  tmp = tmp_path_factory.mktemp('cached_teacher')
  train.run(_chat_cfg(chat, steps=3), str(tmp / 'teacher'))
  manifest = teacher_tool.compute(str(tmp / 'teacher'), chat, str(tmp / 'cache'), top_k=512, temperature=0.7)
  cfg = _chat_cfg(chat, cached=str(tmp / 'cache'), top_k=512, temperature=0.7, beta=0.5)
  config_lib.validate(cfg, jax.device_count())
  return tmp / 'teacher', tmp / 'cache', manifest, tmp / 'student', train.run(cfg, str(tmp / 'student'))


@pytest.mark.e2e  # two trainer runs and the cache command: seconds of compiles
def test_a_cached_top_v_teacher_feeds_the_full_vocabulary_loss_and_other_caches_are_refused(chat, cached_teacher,
                                                                                           tmp_path):
  """K = V cached at temperature 0.7: the batches' teacher keys give the same loss as the online teacher's full
  log-probabilities on the same batch (1e-5); a run reads them and trains; a cache for another K, temperature,
  data or tokenizer, or an unfinished one, is refused in one line."""
  import json
  from jaxlm import distill, sharding, step as step_lib
  from jaxlm.data import pipeline as data_lib
  teacher, cache, manifest, _, record = cached_teacher
  assert manifest['top_k'] == 512 and (cache / data_lib.TEACHER_MANIFEST).exists()
  cfg = _chat_cfg(chat, cached=str(cache), top_k=512, temperature=0.7, beta=0.5)

  mesh = sharding.make_mesh(cfg.mesh)
  bs = sharding.batch_sharding(mesh)
  it = data_lib.make_train_iterator(cfg.data, batch_size=8, seed=0, vocab_size=512, teacher_cache=str(cache))
  cached = step_lib.global_batch(next(it), bs)
  plain = {k: cached[k] for k in ('inputs', 'targets', 'segment_ids', 'positions', 'weights')}
  online = distill.Teacher(ml_collections.ConfigDict(dict(teacher=str(teacher), temperature=0.7,
                                                          top_k=0, teacher_dtype='float32')), mesh, bs)(plain)
  student = jax.random.normal(jax.random.PRNGKey(3), (8, 64, 512)) * 2
  loss = jax.jit(lambda batch, k: distill.DistillObjective(beta=0.5, temperature=0.7, top_k=k).loss(  # noqa: E731
      student, batch, batch['weights'].sum())[0], static_argnums=1)  # one program each, not one compile an op
  assert float(cached['weights'].sum()) > 50
  np.testing.assert_allclose(float(loss(cached, 512)), float(loss(online, 0)), rtol=1e-5)

  assert np.isfinite(record['loss']) and record['divergence'] > 0
  shutil.copytree(cache, tmp_path / 'cache')  # a copy to spoil below: the module's cache stays whole
  cache = tmp_path / 'cache'

  def refused(cfg, *words):
    with pytest.raises(errors.ConfigError) as e:
      config_lib.validate(cfg, jax.device_count())
    lines = [line for line in str(e.value).splitlines() if 'distill.cached' in line]
    assert len(lines) == 1 and all(w in lines[0] for w in words), str(e.value)

  refused(_chat_cfg(chat, cached=str(cache), top_k=64, temperature=0.7), 'top_k=512', '64')
  refused(_chat_cfg(chat, cached=str(cache), top_k=512, temperature=1.0), 'temperature=0.7')
  shutil.copytree(chat, tmp_path / 'other_data')
  refused(_chat_cfg(str(tmp_path / 'other_data'), cached=str(cache), top_k=512, temperature=0.7), 'data=')
  saved = json.loads((cache / data_lib.TEACHER_MANIFEST).read_text())
  (cache / data_lib.TEACHER_MANIFEST).write_text(json.dumps(dict(saved, tokenizer_sha256='0' * 64)))
  refused(_chat_cfg(chat, cached=str(cache), top_k=512, temperature=0.7), 'tokenizer_sha256=')
  (cache / data_lib.TEACHER_MANIFEST).write_text(json.dumps(dict(saved, complete=False)))
  refused(_chat_cfg(chat, cached=str(cache), top_k=512, temperature=0.7), 'unfinished')


def test_a_teacher_cache_on_a_bucket_is_written_resumed_and_read_as_the_local_one(chat, cached_teacher, s3_emulator,
                                                                                     monkeypatch, tmp_path):
  """jaxlm.tools.teacher --out=s3://... (moto): the local cache's objects byte for byte; resumable there (an
  unfinished manifest is refused, then the same command keeps the finished shard and writes the marker last); a
  run with distill.cached=s3://... reads a verified copy under data.cache_dir and logs the local-cache run's
  losses bit for bit."""
  import os
  import uuid
  from jaxlm.data import pipeline as data_lib, storage
  from jaxlm.tools import teacher as teacher_tool
  for name, value in stores.store_env('s3', s3=s3_emulator).items():
    monkeypatch.setenv(name, value)
  teacher, cache, manifest, local_run, _ = cached_teacher
  url = f's3://{stores.BUCKET}/{uuid.uuid4().hex[:12]}/teacher'
  assert teacher_tool.compute(str(teacher), chat, url, top_k=512, temperature=0.7) == manifest
  names = sorted(os.listdir(cache))
  assert storage.listdir(url) == names and len(names) > 1
  for name in names:
    assert storage.read_bytes(storage.join(url, name)) == (cache / name).read_bytes(), name

  marker = storage.join(url, data_lib.TEACHER_MANIFEST)
  shard = [n for n in names if n != data_lib.TEACHER_MANIFEST][0]
  storage.write_json(marker, dict(manifest, complete=False))  # as a killed command leaves it
  storage.write_bytes(storage.join(url, shard), b'finished before the kill')
  cfg = _chat_cfg(chat, cached=url, top_k=512, temperature=0.7, beta=0.5)
  cfg.data.cache_dir = str(tmp_path / 'data_cache')
  with pytest.raises(errors.ConfigError, match='unfinished'):
    config_lib.validate(cfg, jax.device_count())
  teacher_tool.compute(str(teacher), chat, url, top_k=512, temperature=0.7)
  assert storage.read_bytes(storage.join(url, shard)) == b'finished before the kill'  # kept, not made again
  assert storage.read_json(marker) == dict(manifest, complete=True)
  storage.write_bytes(storage.join(url, shard), (cache / shard).read_bytes())

  config_lib.validate(cfg, jax.device_count())
  train.run(cfg, str(tmp_path / 'student'))
  assert (tmp_path / 'data_cache' / 'remote').is_dir()
  keys = ('step', 'loss', 'divergence', 'ce', 'grad_norm')
  assert [[r[k] for k in keys] for r in read_records(tmp_path / 'student')] == \
      [[r[k] for k in keys] for r in read_records(local_run)]


def test_the_teacher_is_sharded_by_the_rules_table_and_equals_an_unsharded_forward(teacher):
  """On the 8-device mesh the teacher's parameters take the specs the rules table gives a program of its config
  (an eighth of its bytes per device); its top-K keys equal those of a one-device forward of the saved weights."""
  from jaxlm import distill, model as model_lib, rundir, sharding, step as step_lib
  import jax.numpy as jnp
  d = ml_collections.ConfigDict(dict(teacher=teacher, temperature=0.7, top_k=7, teacher_dtype='float32'))
  saved = rundir.read_config(distill.teacher_step_dir(teacher))
  mesh = sharding.make_mesh(saved.mesh)
  assert mesh.shape['fsdp'] == 8
  t = distill.Teacher(d, mesh, sharding.batch_sharding(mesh))
  program = step_lib.build_program(saved, mesh)
  spec = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731
  assert spec(t.shardings) == spec(program.state_shardings.params)
  total = sum(x.size * 4 for x in jax.tree.leaves(t.abstract))
  assert sharding.bytes_per_device(t.abstract, t.shardings) * 8 == total
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 512, (8, 24)).astype(np.int32)
  batch = dict(inputs=tokens, targets=tokens, segment_ids=np.ones_like(tokens),
               positions=np.tile(np.arange(24, dtype=np.int32), (8, 1)), weights=np.ones(tokens.shape, np.float32))
  got = jax.device_get(t(step_lib.global_batch(batch, sharding.batch_sharding(mesh))))
  model = model_lib.Decoder(t.config)
  logits = model.apply({'params': rundir.read_params(t.step_dir)}, jnp.asarray(tokens), jnp.ones_like(tokens),
                       jnp.asarray(batch['positions']))
  want = jax.device_get(distill.teacher_targets(logits, 0.7, 7))
  np.testing.assert_array_equal(got['teacher_ids'], want['teacher_ids'])
  for key in ('teacher_logps', 'teacher_rest'):
    np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)
