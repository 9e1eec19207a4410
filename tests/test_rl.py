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


# ------------------------------------------------------------------------------------ TRL parity

@functools.cache
def hf_policy():
  """A tiny random Llama (saved and read back, so TRL can build its reference from the path) and a word tokenizer."""
  import tempfile
  import torch
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
  words = Tokenizer(models.WordLevel({'<eos>': 0, **{f'w{i}': i for i in range(1, VOCAB)}}, unk_token='<eos>'))
  words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token='<eos>', pad_token='<eos>')
  torch.manual_seed(0)
  model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
  path = tempfile.mkdtemp()
  model.save_pretrained(path)
  model = LlamaForCausalLM.from_pretrained(path).eval()
  with torch.no_grad():  # larger weights: peaked distributions, log-probs far from uniform
    for p in model.parameters():
      p.mul_(8.0)
  return model, tokenizer


def trl_trainer(tmp_path, **args):
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer
  model, tokenizer = hf_policy()
  config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=5, bf16=False, report_to=[], use_cpu=True, **args)
  return GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=config,
                     train_dataset=Dataset.from_list([{'prompt': 'w1'}] * 8), processing_class=tokenizer)


def fixed_inputs():
  """8 rows: left-padded prompts of 1-3 tokens, completions of 2-5 tokens (some ending at eos), ratios off 1."""
  import torch
  rng = np.random.default_rng(0)
  prompt_lens, completion_lens = [3, 1, 2, 3, 1, 2, 3, 2], [5, 2, 4, 5, 3, 5, 2, 4]
  prompt_ids, prompt_mask = np.zeros((8, 3), np.int64), np.zeros((8, 3), np.int64)
  completion_ids, completion_mask = np.zeros((8, 5), np.int64), np.zeros((8, 5), np.int64)
  for r, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
    prompt_ids[r, 3 - p:] = rng.integers(1, VOCAB, p)
    prompt_mask[r, 3 - p:] = 1
    completion_ids[r, :c] = rng.integers(1, VOCAB, c)
    completion_ids[r, c - 1] = 0 if c < 5 else completion_ids[r, c - 1]  # ended at eos, or cut at 5
    completion_mask[r, :c] = 1
  advantages = rng.standard_normal(8).astype(np.float32)
  shift = rng.uniform(-0.6, 0.6, (8, 5)).astype(np.float32)  # old = new + shift: ratios in [0.55, 1.8]
  ref_shift = rng.uniform(-1.0, 1.0, (8, 5)).astype(np.float32)
  t = lambda x: torch.from_numpy(x)  # noqa: E731
  return dict(prompt_ids=t(prompt_ids), prompt_mask=t(prompt_mask), completion_ids=t(completion_ids),
              completion_mask=t(completion_mask), advantages=t(advantages)), shift, ref_shift


@pytest.mark.parametrize('beta', [0.0, 0.04])
@pytest.mark.parametrize('loss_type', rl.LOSS_TYPES)
def test_loss_equals_trls(tmp_path, loss_type, beta):
  """jaxlm's per-token weights and PolicyObjective == GRPOTrainer.compute_loss on the same logits and inputs."""
  import torch
  temperature, epsilon, epsilon_high = 0.7, 0.2, 0.28
  trainer = trl_trainer(tmp_path, loss_type=loss_type, beta=beta, temperature=temperature, epsilon=epsilon,
                        epsilon_high=epsilon_high)
  model, _ = hf_policy()
  inputs, shift, ref_shift = fixed_inputs()
  ids = torch.cat([inputs['prompt_ids'], inputs['completion_ids']], 1)
  with torch.no_grad():
    logits = model(input_ids=ids, attention_mask=torch.cat([inputs['prompt_mask'], inputs['completion_mask']], 1)
                   ).logits[:, 2:-1].numpy()  # (8, 5, V): the completion's predicting positions
  objective = step_lib.PolicyObjective(temperature=temperature, epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)
  targets = inputs['completion_ids'].numpy().astype(np.int32)
  logps = np.asarray(objective.logprobs(logits, targets))
  mask = inputs['completion_mask'].numpy().astype(np.float32)
  old, ref = logps + shift, logps + ref_shift
  inputs.update(old_per_token_logps=torch.from_numpy(old), ref_per_token_logps=torch.from_numpy(ref),
                num_items_in_batch=torch.tensor(mask.sum()))
  theirs = float(trainer.compute_loss(model, inputs))
  batch = dict(targets=targets, segment_ids=np.ones_like(targets), weights=rl.token_weights(mask, loss_type, 5),
               old_logps=old, advantages=inputs['advantages'].numpy()[:, None] * mask, token_share=mask / mask.sum(),
               ref_logps=ref)
  ours, aux = objective.loss(logits, batch)
  np.testing.assert_allclose(float(ours), theirs, atol=1e-6, rtol=0)
  ratio = np.exp(logps - old)[mask > 0]
  assert ratio.min() < 1 - epsilon and ratio.max() > 1 + epsilon_high  # clipping acts on both sides
  logged = {k: v[-1] for k, v in trainer._metrics['eval'].items()}  # what TRL logs for this call
  for name in ('entropy', 'clip_ratio/low_mean', 'clip_ratio/high_mean', 'clip_ratio/region_mean') + (
      ('kl',) if beta else ()):
    np.testing.assert_allclose(float(aux[name]), logged[name], atol=1e-5, err_msg=name)


@pytest.mark.parametrize('scale', rl.SCALE_REWARDS)
def test_advantages_equal_trls(tmp_path, scale):
  """Two weighted reward functions, None (unscorable) entries and an all-equal group: jaxlm's == TRL's."""
  from datasets import Dataset
  from trl import GRPOConfig, GRPOTrainer
  first = [1.0, 0.0, 0.5, None, 2.0, 2.0, 2.0, 2.0]  # groups of 4: the second is all equal
  second = [0.3, None, 0.1, None, 1.0, 1.0, 1.0, 1.0]  # row 3: unscorable by both
  model, tokenizer = hf_policy()
  config = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=3, bf16=False, report_to=[], use_cpu=True, scale_rewards=scale,
                      reward_weights=[1.0, 0.5])
  fns = [lambda completions, **_: first, lambda completions, **_: second]
  for fn, name in zip(fns, ('first', 'second')):
    fn.__name__ = name
  trainer = GRPOTrainer(model=model, reward_funcs=fns, args=config, processing_class=tokenizer,
                        train_dataset=Dataset.from_list([{'prompt': 'w1'}] * 8))
  trainer.model.eval()
  theirs = trainer._generate_and_score_completions([{'prompt': 'w1'}] * 4 + [{'prompt': 'w2'}] * 4)['advantages']
  per_func = np.array([[np.nan if v is None else v for v in first], [np.nan if v is None else v for v in second]]).T
  ours, rewards, zero_std = rl.advantages(per_func, np.array([1.0, 0.5]), 4, scale)
  np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-6)
  assert np.all(np.isfinite(ours)) and ours[3] == 0.0 and np.all(ours[4:] == 0.0)
  assert zero_std[4:].all() == (scale != 'batch') and np.isnan(rewards[3])
