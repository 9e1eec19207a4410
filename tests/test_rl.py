"""RL with verifiable rewards (jaxlm/rl.py): the sampler's log-probs == the trainer's, the loss and advantages ==
TRL's GRPOTrainer, exact microbatch / device equivalence, a policy that learns a prompt-dependent task, and a
resume after kill -9 that replays the same samples."""

import functools
import json

import jax
import numpy as np
import pytest

from jaxlm import generate as generate_lib
from jaxlm import rl
from jaxlm import sharding
from jaxlm import step as step_lib
from tests.helpers import load_config

VOCAB = 32  # ids: 0 the end of text, 1..31 words w1..w31


def tiny_config(**rl_overrides):
  """palm_tiny shrunk further (D 16, one layer, vocab 32, 12-token rows) with an `rl` section."""
  c = load_config('palm_tiny')
  c.model.update(vocab_size=VOCAB, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, mlp_dim=32,
                 dtype='float32', z_loss=0.0)
  c.data.seq_len = 12
  c.train.update(steps=100, batch_size=32, log_every=1, seed=0)
  c.optim.update(lr=2e-2, warmup_steps=5, weight_decay=0.0, schedule='constant')
  c.mesh.update(fsdp=1, data=-1)
  c.checkpoint.update(every=0, keep=2, async_save=False)
  c.log.tensorboard = False
  c.rl.update(**{**dict(num_generations=8, max_new_tokens=2, temperature=1.0, loss_type='dapo'), **rl_overrides})
  return c


class Words:
  """A tokenizer for the tests: word i is 'w<i>', id 0 ends the text (jaxlm.data.tokenizer's interface)."""
  eos_id = separator_id = 0
  special_tokens = {}
  vocab_size = VOCAB

  def encode(self, text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]

  def decode(self, ids) -> str:
    return ' '.join(f'w{i}' for i in ids)


def mesh_of(devices: int):
  cfg = tiny_config()
  cfg.mesh.update(data=devices, fsdp=1)
  return sharding.make_mesh(cfg.mesh, jax.devices()[:devices])


# ------------------------------------------------------------------------------------ sampler == trainer

@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_sampler_logprobs_equal_the_trainers(temperature):
  """Left-padded prompts of different lengths: the decode loop's log-probs of its tokens == the train step's."""
  cfg = tiny_config(temperature=temperature, max_new_tokens=5)
  cfg.model.update(num_layers=2, d_model=32)
  cfg.train.batch_size = 8
  mesh = mesh_of(8)
  program = step_lib.build_program(cfg, mesh, objective=rl.objective_of(cfg.rl))
  state = program.init()
  params = jax.tree.map(lambda x: x * 4.0, state.params)  # a peaked distribution: log-probs far from uniform
  prompts = [[3, 17, 5, 9, 2], [11], [7, 8, 9, 10, 11, 12, 2], [4, 30, 1]] * 2
  out = generate_lib.generate(program.model.config, params, prompts, 5, eos_id=0, mesh=mesh, max_len=12, seed=3,
                              sampling=generate_lib.Sampling(temperature=temperature))
  completions = [t + [0] * (why == 'eos') for t, why in zip(out.tokens, out.finish_reasons)]
  assert {len(c) for c in completions} != {5} or temperature == 0.7  # some rows end early (eos scored too)
  batch = rl.train_batch(prompts, completions, out.logprobs, np.ones(8), np.ones(8, bool), seq_len=12,
                         max_new_tokens=5, loss_type='dapo')
  placed = step_lib.global_batch(batch, program.batch_sharding)
  trainer = np.asarray(program.score(params, placed))
  mask = batch['token_share'] > 0
  assert mask.sum() == sum(map(len, completions))
  np.testing.assert_allclose(trainer[mask], batch['old_logps'][mask], atol=1e-5, rtol=0)
  assert np.abs(batch['old_logps'][mask]).max() > 0.5  # not trivially ~0
  # The train step's own forward (the training model, sharded as trained) sees the same numbers.
  state = state.replace(params=params)
  _, metrics = program.train_step(state, placed)
  assert float(metrics['logprob_mismatch']) < 1e-5


# ------------------------------------------------------------------------------------ a task that needs the prompt

TARGETS = {p: [8 + 2 * p, 9 + 2 * p] for p in range(1, 5)}  # prompt 'w<p>' is rewarded for its own two words


def prompts_file(tmp_path) -> str:
  path = tmp_path / 'prompts.jsonl'
  path.write_text(''.join(json.dumps({'prompt': f'w{p}', 'targets': t}) + '\n' for p, t in TARGETS.items()))
  return str(path)


def match(prompts, completions, completion_ids, finish_reasons, targets, **fields):
  """The share of the two completion slots holding one of the prompt's target words (the end of text scores 0).

  The four prompts' target sets are disjoint: a policy blind to the prompt scores at most 1/4 on average.
  """
  return [sum(t in want for t in ids) / 2 for ids, want in zip(completion_ids, targets)]


def negated(prompts, completions, completion_ids, finish_reasons, targets, **fields):
  return [-x for x in match(prompts, completions, completion_ids, finish_reasons, targets)]


def rl_run(cfg, workdir, rewards=(('match', match),)):
  """A run in this process (programs compiled once per session: rl.program_for); its train records."""
  cfg.rl.prompts = prompts_file(workdir)
  rl.run(cfg, str(workdir), list(rewards), tokenizer=Words(), devices=jax.devices()[:cfg.mesh.data])
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()
          if json.loads(line).get('kind') == 'train']


def greedy_score(cfg, workdir) -> float:
  """Greedy decoding's mean reward over the four prompts with the run's final parameters."""
  from jaxlm import checkpoint as checkpoint_lib
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  program, _, _ = rl.program_for(cfg, mesh)
  params = checkpoint_lib.load_params(str(workdir / 'checkpoints'), program.abstract_state.params,
                                      program.state_shardings.params)
  prompts = [[p] for p in TARGETS]
  out = generate_lib.generate(program.model.config, params, prompts, 2, eos_id=0, mesh=mesh, max_len=12)
  return float(np.mean(match(None, None, out.tokens, None, list(TARGETS.values()))))


def one_device(cfg):
  cfg.mesh.update(data=1, fsdp=1)
  return cfg


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_it_learns_a_task_that_needs_the_prompt(tmp_path, seed):
  cfg = one_device(tiny_config())
  cfg.train.seed = seed
  records = rl_run(cfg, tmp_path)
  rewards = [r['reward'] for r in records]
  assert np.mean(rewards[:10]) < 0.3 and np.mean(rewards[-10:]) >= 0.9, rewards
  assert greedy_score(cfg, tmp_path) == 1.0
  assert max(r['logprob_mismatch'] for r in records) < 1e-5  # sampler vs trainer, every step
  events = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()
            if json.loads(line).get('kind') == 'event']
  assert not [e for e in events if e['event'] in ('spike', 'rollback')]  # the RL guard leaves a correct run alone
