"""jaxlm.tools.generate on a tiny trained run, and train.sample_prompts: samples at each evaluation, the losses
unchanged. One short training with samples and one without (tests/tools/test_eval.py's run, made once for the
whole run), shared by every test here."""

import json
import pathlib

import pytest

from jaxlm import rundir
from tests.helpers import assert_fails_with, load_config, read_records, run_cli

SAMPLE_PROMPTS = ('def ', 'import ')


@pytest.fixture(scope='module')
def sampled_run(tmp_path_factory, data_cache):
  """(workdir of a palm_tiny run that samples at each evaluation, workdir of the same run without)."""
  from tests.tools.test_eval import shared_tiny_run, train_tiny_run
  with_samples = tmp_path_factory.mktemp('sampled_run')
  train_tiny_run(with_samples, data_cache, SAMPLE_PROMPTS)
  plain, _ = shared_tiny_run(tmp_path_factory, data_cache)  # the same run without samples (read only)
  return str(with_samples), plain


def _generate(*args, timeout=300):
  return run_cli('jaxlm.tools.generate', *args, timeout=timeout)


def test_training_logs_greedy_samples_at_each_evaluation_and_keeps_the_loss_trajectory(sampled_run, tmp_path):
  workdir, plain = sampled_run
  events = [r for r in read_records(workdir, 'event') if r['event'] == 'sample']
  assert [(e['step'], e['prompt']) for e in events] == [(s, p) for s in (3, 6) for p in SAMPLE_PROMPTS]
  assert all(isinstance(e['completion'], str) for e in events)
  # TensorBoard has them as text.
  tb = b''.join(p.read_bytes() for p in pathlib.Path(workdir, rundir.TENSORBOARD).glob('events.out.tfevents.*'))
  assert b'**sample**' in tb and repr(events[-1]['completion']).encode()[:8] in tb
  # Sampling reads the parameters and leaves the run alone: the same losses, bit for bit.
  losses = lambda w: [(r['step'], r['loss']) for r in read_records(w, 'train')]
  assert len(losses(workdir)) == 6 and losses(workdir) == losses(plain)
  assert [r['eval_loss'] for r in read_records(workdir, 'eval')] == [r['eval_loss'] for r in read_records(plain, 'eval')]
  # The command, greedy from the final checkpoint, writes what the run logged at its last evaluation.
  out = _generate(f'--workdir={workdir}', f'--prompt={SAMPLE_PROMPTS[0]}', '--temperature=0',
                  '--max_new_tokens=8', f'--output={tmp_path}/greedy.jsonl')
  assert out.returncode == 0, out.stderr[-3000:]
  (record,) = [json.loads(line) for line in (tmp_path / 'greedy.jsonl').read_text().splitlines()]
  assert record['completion'] == events[-2]['completion']  # step 6, 'def '


def test_generate_command_writes_one_record_per_sample_and_the_throughput(sampled_run, tmp_path):
  workdir, _ = sampled_run
  prompts = tmp_path / 'prompts.jsonl'
  prompts.write_text(json.dumps({'prompt': 'class A:'}) + '\n' + json.dumps({'prompt': 'x = '}) + '\n')
  args = [f'--workdir={workdir}', f'--prompts={prompts}', '--num_samples=2', '--temperature=1.0', '--top_k=20',
          '--top_p=0.95', '--seed=1', '--max_new_tokens=12']
  out = _generate(*args, f'--output={tmp_path}/a.jsonl')
  assert out.returncode == 0, out.stderr[-3000:]
  records = [json.loads(line) for line in (tmp_path / 'a.jsonl').read_text().splitlines()]
  assert [(r['prompt'], r['sample']) for r in records] == [('class A:', 0), ('class A:', 1), ('x = ', 0),
                                                           ('x = ', 1)]
  for r in records:
    assert r['finish_reason'] in ('eos', 'length')
    assert len(r['completion_ids']) == 12 if r['finish_reason'] == 'length' else len(r['completion_ids']) < 12
    assert r['completion'] in out.stdout
  lines = out.stdout.strip().splitlines()
  assert lines[-2].startswith('prefill: ') and 'tokens/s' in lines[-2]
  assert lines[-1].startswith('decode: ') and 'tokens/s' in lines[-1]
  # A fixed seed gives the same samples; a text file of prompts (one per line) reads as the jsonl did.
  (tmp_path / 'prompts.txt').write_text('class A:\n\nx = \n')
  again = _generate(*[a.replace('prompts.jsonl', 'prompts.txt') for a in args], f'--output={tmp_path}/b.jsonl')
  assert again.returncode == 0, again.stderr[-3000:]
  b = [json.loads(line) for line in (tmp_path / 'b.jsonl').read_text().splitlines()]
  assert [r['completion_ids'] for r in b] == [r['completion_ids'] for r in records]


@pytest.mark.parametrize('args, says', [
    (['--prompt='], 'empty prompt'),
    (['--prompt=def ', '--max_new_tokens=100'], 'beyond the 64 the cache is sized for'),
    (['--prompt=def ', '--chat'], 'no chat template'),
    (['--prompt=def ', '--prompts=p.txt'], 'give exactly one of --prompt'),
], ids=['empty', 'too-long', 'chat-without-template', 'two-prompt-flags'])
def test_generate_refusals_end_with_one_line_and_exit_2(sampled_run, args, says):
  workdir, _ = sampled_run
  assert_fails_with(_generate(f'--workdir={workdir}', *args, timeout=120), 2, says)


def test_generate_refuses_a_run_without_a_checkpoint(tmp_path):
  assert_fails_with(_generate(f'--workdir={tmp_path}', '--prompt=def ', timeout=120), 2, 'holds no checkpoint')


def test_sampling_mesh_folds_pipeline_stages_and_context_into_fsdp():
  from jaxlm import sharding
  from jaxlm.tools import generate as tool
  cfg = load_config('palm_tiny')
  cfg.mesh.update(data=1, fsdp=2, tensor=2, stage=2)  # a pipelined run: its stage devices become fsdp ones
  mesh_cfg = tool._mesh_cfg(cfg)
  assert mesh_cfg.stage == 1 and sharding.MeshShape.resolve(mesh_cfg, 8).sizes == (1, 4, 2, 1)
  cfg = load_config('palm_tiny')
  cfg.mesh.update(data=1, fsdp=2, tensor=2, context=2)  # context parallelism: sampling splits rows, not sequences
  mesh_cfg = tool._mesh_cfg(cfg)
  assert mesh_cfg.context == 1 and sharding.MeshShape.resolve(mesh_cfg, 8).sizes == (1, 4, 2, 1)


def test_an_imported_run_samples_with_the_tokenizer_import_put_beside_it(tmp_path):
  from jaxlm.data import tokenizer as tokenizer_lib
  lines = [f'def f{i}(x):\n    return x * {i} + "{chr(97 + i % 26)}"' for i in range(300)]
  tokenizer_lib.train(lines, str(tmp_path / 'tokenizer.model'), vocab_size=400)  # where import_llama copies it
  cfg = load_config('palm_tiny')
  cfg.data.source = 'nowhere'  # an import has no prepared data to find a tokenizer in
  tok = rundir.load_tokenizer(cfg, str(tmp_path))
  assert tok.encode('def f1(x):') == tokenizer_lib.load(str(tmp_path / 'tokenizer.model')).encode('def f1(x):')
