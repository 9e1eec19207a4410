"""A LoRA DPO run through the real entry point: kill -9 resumes bit for bit; export writes merged + peft adapter."""

import signal
import time

import jax
import numpy as np
import pytest

from jaxlm.data import prepare as prepare_lib
from tests.data import chat_fixtures
from tests.data.test_preference_data import _records
from tests.helpers import read_records, run_cli
import orbax.checkpoint as ocp

from tests.test_checkpoint import _run, _start, _trainer_of, _wait_for_step

STEPS = 10
DPO = ('--config.train.objective=preference', '--config.data.source=prepared', '--config.model.lora.rank=4',
       '--config.model.lora.alpha=8', '--config.preference.reference=base', '--config.preference.beta=0.5',
       '--config.train.eval_every=0', '--config.train.eval_batches=1', '--config.stability.policy=skip',
       '--config.checkpoint.every=2', '--config.optim.warmup_steps=1')


@pytest.fixture(scope='module')
def pairs(tmp_path_factory) -> str:
  tmp = tmp_path_factory.mktemp('pairs')
  tok = chat_fixtures.make_tokenizer(str(tmp / 'tok'))
  path = chat_fixtures.write_jsonl(tmp / 'pairs.jsonl', _records(60))
  out = str(tmp / 'data')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(path)]), out, workers=1, eval_fraction=0.2, progress=False,
                      data_format='preference', tokenizer=tok, seq_len=64)
  return out


def _final_state(workdir):
  return ocp.StandardCheckpointer().restore(workdir / 'checkpoints' / str(STEPS) / 'state')


@pytest.mark.slow(reason='a LoRA DPO trainer killed with SIGKILL and resumed, then exported: four processes')
def test_sigkill_of_a_lora_dpo_run_resumes_bit_for_bit_and_exports(pairs, tmp_path, data_cache):
  args = (*DPO, f'--config.data.paths={pairs}', f'--config.train.steps={STEPS}')
  reference = tmp_path / 'reference'
  _run(reference, data_cache, *args)
  killed = tmp_path / 'killed'
  proc = _start(killed, data_cache, *args)
  _wait_for_step(proc, killed, 3, timeout=900)  # past the checkpoint at step 2 ...
  deadline = time.time() + 300
  while not (killed / 'checkpoints' / '2').is_dir() and time.time() < deadline:  # ... once it is finalised
    time.sleep(0.05)
  trainer = _trainer_of(proc)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  trainer.wait(timeout=10)
  out = _run(killed, data_cache, *args)
  assert 'resumed from checkpoint step' in out.stdout
  keys = ('loss', 'rewards/chosen', 'rewards/rejected', 'rewards/margins', 'logps/chosen')
  want = {r['step']: tuple(r[k] for k in keys) for r in read_records(reference)}
  got = [(r['step'], tuple(r[k] for k in keys)) for r in read_records(killed)]
  assert sorted({s for s, _ in got}) == list(range(1, STEPS + 1)) and abs(want[1][0] - np.log(2)) < 1e-5
  for step, values in got:
    assert values == want[step], step
  jax.tree.map(np.testing.assert_array_equal, _final_state(reference)['params'], _final_state(killed)['params'])
  evals = read_records(reference, 'eval')
  assert evals and 'eval_rewards/accuracies' in evals[-1]
  # Export: the merged model and the peft adapter.
  exported = run_cli('jaxlm.hf.export', f'--workdir={reference}', f'--out={tmp_path / "hf"}',
                     f'--adapter_out={tmp_path / "adapter"}')
  assert exported.returncode == 0, exported.stderr[-3000:]
  assert (tmp_path / 'hf' / 'model.safetensors').exists() and (tmp_path / 'adapter' / 'adapter_config.json').exists()

  # reference=cached: the reference run's log-probabilities computed once, beside the pairs, and read in batches.
  from jaxlm import lora as lora_lib, model as model_lib, preference
  from jaxlm.data import pipeline as data_lib
  from jaxlm.tools import reference as reference_tool
  from tests.helpers import load_config
  manifest = reference_tool.compute(str(reference), pairs, batch_size=8)
  preference.check_cached(pairs, f'{reference}/checkpoints')  # the newest step: the one computed with
  with pytest.raises(preference.ReferenceError, match='checkpoint'):
    preference.check_cached(pairs, f'{reference}/checkpoints/6')  # an older step (keep=3: 6, 8 and 10 remain)
  cfg = load_config('base').data
  cfg.update(source='prepared', paths=pairs, seq_len=64)
  rows, _ = data_lib.make_train_rows(cfg, seed=0, vocab_size=512, num_epochs=1, reference_logps=True)
  row = {k: v[None] for k, v in rows[0].items()}
  m = model_lib.ModelConfig.from_config(reference_tool.rundir.read_config(manifest['checkpoint']).model)
  params = lora_lib.merge_adapters(reference_tool.rundir.read_params(manifest['checkpoint']), m.lora)
  plain = model_lib.Decoder(model_lib.dataclasses.replace(m, lora=lora_lib.LoraConfig(), dtype='float32'))
  want = preference.token_logps(plain.apply({'params': params}, row['inputs'], row['segment_ids'], row['positions']),
                                row['targets'])
  at = row['pairs'] != 0
  np.testing.assert_allclose(row['ref_logps'][at], np.asarray(want)[at], atol=2e-5)
