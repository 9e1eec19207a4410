"""RL with verifiable rewards: `python -m jaxlm.rl --config=configs/grpo_example.py --rewards=my_rewards.py:fn[,fn2]
[--workdir=DIR] [--config.a.b=v]`.

One step: B prompts × G completions sampled with jaxlm.generate on the run's mesh (the sampled tokens' log-probs
come back from the decode loop), scored by the user's reward functions, group advantages on the host, then the
ONE train step (jaxlm.step.build_program with a `policy.PolicyObjective`) on per-token weights that encode the loss
type over the global batch. Sampler and trainer are the same Flax model on the same mesh: their log-probs of the
same tokens agree (`logprob_mismatch`, ~0), so the sampler's are the clipped ratio's old log-probs.

There is no second trainer here: `Rollouts` is a batch source of train.py's one loop, so checkpoints, SIGTERM and
kill -9 resume, rollback, LR scaling, evaluation, goodput and the progress line are the loop's. Checkpoints hold
the prompt position; samples are seeded by step, so a resumed run draws the samples the killed one would have.
This module holds rewards, the rollout source, advantages and the command's flags.
"""

if __name__ == '__main__':  # the command runs in a child its watcher waits for; start it before JAX loads (cli.py)
  from jaxlm import cli as _watch
  _watch.run_watched()

import contextlib
import importlib.util
import json
import os
from typing import Any, Callable

from absl import flags
import grain
import jax
import numpy as np

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm import distributed
from jaxlm import errors
from jaxlm import generate as generate_lib
from jaxlm import policy as policy_lib
from jaxlm import preference as preference_lib
from jaxlm import rundir
from jaxlm import sharding
from jaxlm import step as step_lib
from jaxlm import train
# rl.loss_type and rl.scale_rewards: declared beside the objective, where validation reads them too.
from jaxlm.policy import LOSS_TYPES, SCALE_REWARDS  # noqa: F401

STD_EPS = 1e-4  # added to the std before dividing (TRL's)


class RewardError(errors.JaxlmError, ValueError):
  """A reward function that cannot be loaded, raised, or returned the wrong thing."""
  exit_code = 2


# ---------------------------------------------------------------------------------------------------- rewards

def load_rewards(spec: str) -> list[tuple[str, Callable]]:
  """[(name, fn)] of `path.py:fn[,fn2]`: functions (prompts, completions, completion_ids, finish_reasons, **fields)."""
  path, _, names = spec.rpartition(':')
  if not path or not names:
    raise RewardError(f'--rewards={spec!r} must read FILE.py:fn[,fn2]; name the file and its functions')
  if not os.path.isfile(path):
    raise RewardError(f'reward file {path} does not exist (working directory {os.getcwd()}); pass --rewards=FILE.py:fn')
  module_spec = importlib.util.spec_from_file_location(f'jaxlm_rewards_{abs(hash(os.path.abspath(path)))}', path)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except  -- the user's file: say which and why, in one line
    raise RewardError(f'reward file {path} failed to import ({type(e).__name__}: {e}); fix the file') from e
  out = []
  for name in names.split(','):
    fn = getattr(module, name.strip(), None)
    if not callable(fn):
      raise RewardError(f'reward file {path} has no function {name.strip()!r}; define it or fix --rewards')
    out.append((name.strip(), fn))
  return out


def score(rewards: list[tuple[str, Callable]], prompts: list, completions: list[str], completion_ids: list[list[int]],
          finish_reasons: list[str], fields: dict) -> np.ndarray:
  """(N, F) float rewards, NaN where a function returned None (not scorable); a bad function is a RewardError."""
  out = np.full((len(completions), len(rewards)), np.nan)
  for j, (name, fn) in enumerate(rewards):
    try:
      values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids,
                  finish_reasons=finish_reasons, **fields)
    except Exception as e:  # pylint: disable=broad-except  -- the user's code: name it, stop the run cleanly
      raise RewardError(f'reward function {name} raised {type(e).__name__}: {" ".join(str(e).split())[:200]}; '
                        f'fix {name}') from e
    if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(completions):
      got = f'{len(values)} values' if hasattr(values, '__len__') else type(values).__name__
      raise RewardError(f'reward function {name} returned {got} for {len(completions)} completions; return one '
                        f'float (or None) per completion')
    for i, v in enumerate(values):
      if v is not None:
        try:
          out[i, j] = float(v)
        except (TypeError, ValueError):
          raise RewardError(f'reward function {name} returned {v!r} for completion {i}; return a float or None '
                            f'per completion') from None
  return out


def advantages(rewards_per_func: np.ndarray, weights: np.ndarray, num_generations: int, scale: str):
  """(advantages (N,), rewards (N,), zero-std flags (N,)) as TRL's GRPOTrainer makes them (sum_then_normalize).

  A completion whose every function returned None has a NaN reward, is left out of its group's mean and std, and
  gets advantage 0; an all-equal group gets advantage 0 (not NaN).
  """
  unscorable = np.isnan(rewards_per_func).all(axis=1)
  rewards = np.nansum(rewards_per_func * weights[None], axis=1)
  rewards[unscorable] = np.nan
  groups = rewards.reshape(-1, num_generations)
  with np.errstate(invalid='ignore', divide='ignore'), _quiet_nan_warnings():
    mean = np.repeat(np.nanmean(groups, axis=1), num_generations)
    if scale == 'batch':
      std = np.full_like(rewards, _nanstd(rewards))
    else:  # group, and none (only to count the zero-std groups)
      std = np.repeat(_nanstd(groups, axis=1), num_generations)
    adv = rewards - mean
    if scale != 'none':
      adv = adv / (std + STD_EPS)
  return np.nan_to_num(adv, nan=0.0), rewards, np.isclose(std, 0.0)


def _nanstd(x: np.ndarray, axis=None):
  """The unbiased std ignoring NaNs (NaN with fewer than two values), as trl.trainer.utils.nanstd."""
  count = np.sum(~np.isnan(x), axis=axis)
  with _quiet_nan_warnings():
    squares = np.nansum((x - np.nanmean(x, axis=axis, keepdims=True)) ** 2, axis=axis)
  return np.where(count > 1, np.sqrt(squares / np.maximum(count - 1, 1)), np.nan)


@contextlib.contextmanager
def _quiet_nan_warnings():
  import warnings  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)  # an all-None group's mean: NaN, handled above
    yield


def token_weights(mask: np.ndarray, loss_type: str, max_new_tokens: int) -> np.ndarray:
  """Per-token weights (N, T) so that Σ weights · per-token loss is `loss_type`'s loss over the global batch.

  grpo: each sequence's mean, averaged over sequences; bnpo and dapo: the mean over every completion token of the
  batch (TRL's dapo divides by the generation batch's token count, which this batch is); dr_grpo: the sum over
  tokens divided by sequences × max_new_tokens.
  """
  mask = mask.astype(np.float64)
  if loss_type == 'grpo':
    w = mask / np.maximum(mask.sum(1, keepdims=True), 1.0) / mask.shape[0]
  elif loss_type in ('bnpo', 'dapo'):
    w = mask / max(mask.sum(), 1.0)
  elif loss_type == 'dr_grpo':
    w = mask / (mask.shape[0] * max_new_tokens)
  else:
    raise ValueError(f'loss_type {loss_type!r}; use one of {LOSS_TYPES}')
  return w.astype(np.float32)


# ---------------------------------------------------------------------------------------------------- batches

def train_batch(prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]],
                adv: np.ndarray, mask_rows: np.ndarray, *, seq_len: int, max_new_tokens: int, loss_type: str) -> dict:
  """The step's batch (N, T = seq_len): each prompt right-aligned at T - max_new_tokens, its completion after.

  `completions` hold the end-of-text token where the row ended with it (it is scored, as TRL's completion mask
  counts it). The completion's j-th token is the target at slot P - 1 + j, where its old log-prob sits too.
  `mask_rows` False: a row left out of the loss (rl.mask_truncated).
  """
  n, P = len(prompts), seq_len - max_new_tokens
  inputs = np.zeros((n, seq_len), np.int32)
  targets = np.zeros((n, seq_len), np.int32)
  segment_ids = np.zeros((n, seq_len), np.int32)
  positions = np.zeros((n, seq_len), np.int32)
  old = np.zeros((n, seq_len), np.float32)
  mask = np.zeros((n, seq_len), np.float32)
  for r, (p, c, lp) in enumerate(zip(prompts, completions, logprobs)):
    row = list(p) + list(c)
    start = P - len(p)
    inputs[r, start:start + len(row)] = row
    segment_ids[r, start:start + len(row)] = 1
    positions[r, start:start + len(row)] = np.arange(len(row))
    targets[r, P - 1:P - 1 + len(c)] = c
    old[r, P - 1:P - 1 + len(c)] = lp
    mask[r, P - 1:P - 1 + len(c)] = float(mask_rows[r])
  share = mask / max(mask.sum(), 1.0)
  return dict(inputs=inputs, targets=targets, segment_ids=segment_ids, positions=positions,
              weights=token_weights(mask, loss_type, max_new_tokens), old_logps=old,
              advantages=np.repeat(np.asarray(adv, np.float32)[:, None], seq_len, axis=1) * (mask > 0),
              token_share=share.astype(np.float32))


# ---------------------------------------------------------------------------------------------------- prompts

class Prompts(grain.DatasetIterator):
  """The prompts file as an endless stream of records, each epoch in a seeded order; its state is one counter."""

  def __init__(self, records: list[dict], seed: int):
    super().__init__()
    self.records, self.seed = records, seed
    self.position = 0  # records drawn so far

  def _order(self, epoch: int) -> np.ndarray:
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

  def take(self, n: int) -> list[dict]:
    """The next `n` records."""
    out = []
    for i in range(self.position, self.position + n):
      epoch, k = divmod(i, len(self.records))
      out.append(self.records[self._order(epoch)[k]])
    self.position += n
    return out

  def __next__(self) -> dict:
    return self.take(1)[0]

  def get_state(self) -> dict:
    return {'prompts_drawn': self.position, 'prompts': len(self.records)}

  def set_state(self, state: dict) -> None:
    self.position = int(state['prompts_drawn'])


def read_prompts(rl_cfg, tokenizer, prompt_slots: int) -> list[dict]:
  """Records of the prompts file, each with `ids` (its tokens), `prompt` (text or messages) and its other fields."""
  from jaxlm.data import chat  # pylint: disable=import-outside-toplevel
  path = os.path.expanduser(rl_cfg.prompts)
  if not os.path.isfile(path):
    raise errors.DataError(f'rl.prompts={path} does not exist; give a jsonl file with a `prompt` or `messages` '
                           f'field per line')
  template = None
  records = []
  with open(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise errors.DataError(f'{path}:{line_no} is not JSON ({e}); one object per line') from None
      if 'messages' in record:
        template = template or chat.template_of(tokenizer, rl_cfg.chat_template or None)
        if template is None:
          raise errors.DataError(f'{path}:{line_no} has `messages` but the tokenizer has no chat template; set '
                                 f'rl.chat_template=chatml (or llama3)')
        text = chat.render(record['messages'], template, add_generation_prompt=True,
                           special_tokens=tokenizer.special_tokens)
        ids = tokenizer.encode(text)
        prompt = record['messages']
      elif isinstance(record.get('prompt'), str):
        ids, prompt = tokenizer.encode(record['prompt']), record['prompt']
      else:
        raise errors.DataError(f'{path}:{line_no} has neither a `prompt` text nor `messages`; give one of them')
      if not ids or len(ids) > prompt_slots:
        raise errors.DataError(f'{path}:{line_no}: the prompt is {len(ids)} tokens; data.seq_len - rl.max_new_tokens '
                               f'leaves {prompt_slots}; raise data.seq_len or shorten the prompt')
      fields = {k: v for k, v in record.items() if k not in ('prompt', 'messages')}
      records.append({'ids': ids, 'prompt': prompt, 'fields': fields})
  if not records:
    raise errors.DataError(f'rl.prompts={path} holds no prompts')
  return records


# ---------------------------------------------------------------------------------------------------- the rollout source

def objective_of(rl_cfg) -> policy_lib.PolicyObjective:
  """The train step's objective for the `rl` section."""
  return policy_lib.PolicyObjective(temperature=rl_cfg.temperature, epsilon=rl_cfg.epsilon,
                                  epsilon_high=rl_cfg.epsilon_high or rl_cfg.epsilon, beta=rl_cfg.beta)


def rl_stability(cfg):
  """The stability section an RL run judges by: rl.stability_watch and rl.stability_spikes replace the spike rule.

  While a policy learns its loss moves around 0 and its gradient norm rises several-fold; Adam's update size
  relative to the parameters (update_ratio) does not, and jumps when an update blows up.
  """
  y = cfg.stability.copy_and_resolve_references()
  y.spikes = cfg.rl.stability_spikes
  return y


def program_for(cfg, mesh):
  """(program, objective, its train step compiled for train.batch_size): one compile per config in a process, shared
  with the loop's runs (step.cached_program)."""
  objective = objective_of(cfg.rl)
  program, compiled = step_lib.cached_program(cfg, mesh, objective)
  return program, objective, step_lib.compiled_step(program, compiled, cfg.train.batch_size, cfg.data.seq_len)


def reference_kind(cfg) -> str | None:
  """The KL's reference (rl.beta > 0), named as preference.reference names them; None at beta 0.

  `base` under model.lora: the base stays frozen in the parameters, so the model with its adapters off is the
  starting policy (its adapters start at B = 0) and costs no second copy of the weights; a warm start that loads
  trained adapters compares with the base without them, as preference.reference=base does. `copy` otherwise.
  """
  if not cfg.rl.beta:
    return None
  return 'base' if cfg.model.get('lora', {}).get('rank', 0) else 'copy'


def reference_params(initial_state):
  """The `copy` reference: a frozen copy of the starting parameters."""
  return jax.tree.map(lambda x: x.copy(), initial_state.params)


def sample_seed(seed: int, step: int) -> int:
  """The sampler's seed for `step`: a resumed run draws the same samples."""
  return int(jax.random.randint(jax.random.fold_in(jax.random.PRNGKey(seed), step), (), 0, 2**31 - 1))


class Rollouts:
  """The RL batch source of train.py's loop: prompts -> the sampler -> rewards -> advantages -> per-token weights.

  Its checkpointed position is the prompt stream's (`iterator`); samples are seeded by step, so a resumed run draws
  the samples the killed one would have. The train step's objective is the clipped policy gradient
  (policy.PolicyObjective), its program compiled once per config in a process (step.cached_program).
  """
  evaluates = False  # held-out text is scored only when train.eval_every asks for it

  def __init__(self, cfg, rewards: list[tuple[str, Callable]], tokenizer=None):
    self.cfg, self.rewards = cfg, rewards
    self.tokenizer = tokenizer or rundir.load_tokenizer(cfg, path=cfg.rl.tokenizer)  # rl.tokenizer, else the data's
    # Every id the model stops at (main's Tokenizer.stop_ids: generation_config's list, eos, separator).
    self.end_id = getattr(self.tokenizer, 'stop_ids', None) or (
        self.tokenizer.eos_id if self.tokenizer.eos_id >= 0 else self.tokenizer.separator_id)
    records = read_prompts(cfg.rl, self.tokenizer, cfg.data.seq_len - cfg.rl.max_new_tokens)
    self.iterator = Prompts(records, cfg.train.seed)
    self.objective = objective_of(cfg.rl)
    self.reference = None  # beta > 0 without LoRA: the frozen copy of the starting parameters (reference_kind)
    self.run = None  # the loop's Run, once it began

  @staticmethod
  def stability(cfg) -> tuple[Any, tuple[str, ...]]:
    """rl_stability's settings; the guard watches rl.stability_watch."""
    return rl_stability(cfg), tuple(k.strip() for k in cfg.rl.stability_watch.split(',') if k.strip())

  def begin(self, r, state, resumed: bool) -> None:
    """Keeps the run; under a `copy` reference, copies the starting parameters (a resumed run rebuilds them)."""
    self.run = r
    if reference_kind(self.cfg) == 'copy':
      start = train.initial_state(r, say=False) if resumed else state
      self.reference = reference_params(start)

  def skip(self, batches: int, step: int) -> None:
    """Passes over the prompts of `batches` steps (after a rollback)."""
    del step
    self.iterator.take(batches * (self.cfg.train.batch_size // self.cfg.rl.num_generations))

  def next(self, state, step: int, size: int) -> tuple[dict, dict]:
    """Samples, scores and batches the step after `step`: (the global batch, host metrics)."""
    del size  # RL has no batch ramp: always train.batch_size
    r, rl, t = self.run, self.cfg.rl, self.cfg.train
    G = rl.num_generations
    records = self.iterator.take(t.batch_size // G)
    prompt_ids = [rec['ids'] for rec in records for _ in range(G)]
    with r.acct.track('sample'):
      out = generate_lib.generate(
          r.program.model.config, state.params, prompt_ids, rl.max_new_tokens,
          sampling=generate_lib.Sampling(rl.temperature, rl.top_k, rl.top_p), seed=sample_seed(t.seed, step),
          eos_id=self.end_id, mesh=r.mesh, max_len=self.cfg.data.seq_len)
    sample_s = r.acct.last_s
    completions = [ids + [end] * (end is not None) for ids, end in zip(out.tokens, out.ends)]  # the stop id scored
    texts = [self.tokenizer.decode(ids) for ids in out.tokens]
    fields = {k: [rec['fields'].get(k) for rec in records for _ in range(G)]
              for k in sorted({k for rec in records for k in rec['fields']})}
    prompts = [rec['prompt'] for rec in records for _ in range(G)]
    per_func = score(self.rewards, prompts, texts, [list(c) for c in out.tokens], out.finish_reasons, fields)
    adv, rewards, zero_std = advantages(per_func, reward_weights(rl, len(self.rewards)), G, rl.scale_rewards)
    truncated = np.array([why == 'length' for why in out.finish_reasons])
    keep = ~truncated if rl.mask_truncated else np.ones_like(truncated)
    rows = train_batch(prompt_ids, completions, out.logprobs, adv, keep, seq_len=self.cfg.data.seq_len,
                       max_new_tokens=rl.max_new_tokens, loss_type=rl.loss_type)
    # Every process sampled and scored every row (the same seed, the same rewards); each gives the train step its
    # own share of the rows, as a data loader would.
    index, count = sharding.row_share(r.program.batch_sharding)
    share = t.batch_size // count
    batch = step_lib.global_batch({k: v[index * share:(index + 1) * share] for k, v in rows.items()},
                                  r.program.batch_sharding)
    if kind := reference_kind(self.cfg):  # the reference mechanism preference tuning uses (base: adapters off)
      batch['ref_logps'] = r.program.score(preference_lib.reference_params(kind, state.params, self.reference),
                                           batch)
    return batch, host_metrics(self.rewards, per_func, rewards, zero_std, completions, truncated, sample_s)


def host_metrics(reward_fns, per_func, rewards, zero_std, completions, truncated, sample_s: float) -> dict:
  """A step's record beyond the train step's: rewards (per function too), completion lengths, sampling time, and
  the sampled tokens its throughput counts (`step_tokens`)."""
  lengths = np.array([len(c) for c in completions])
  host = {'reward': _nan_none(np.nanmean(rewards)), 'reward_std': _nan_none(_nanstd(rewards)),
          'frac_reward_zero_std': float(zero_std.mean()),
          'completions/mean_length': float(lengths.mean()), 'completions/min_length': float(lengths.min()),
          'completions/max_length': float(lengths.max()), 'completions/clipped_ratio': float(truncated.mean()),
          'sample_s': sample_s, 'step_tokens': int(lengths.sum())}
  for j, (name, _) in enumerate(reward_fns):
    host[f'rewards/{name}/mean'] = _nan_none(np.nanmean(per_func[:, j]) if np.any(~np.isnan(per_func[:, j]))
                                             else np.nan)
    host[f'rewards/{name}/std'] = _nan_none(_nanstd(per_func[:, j]))
  return host


def reward_weights(rl_cfg, n: int) -> np.ndarray:
  """rl.reward_weights as an array (all 1 when empty)."""
  if not rl_cfg.reward_weights:
    return np.ones(n)
  return np.array([float(x) for x in str(rl_cfg.reward_weights).split(',')])


def _nan_none(x) -> float | None:
  x = float(x)
  return None if np.isnan(x) else x


# ---------------------------------------------------------------------------------------------------- command

def _define() -> None:
  from ml_collections import config_flags  # pylint: disable=import-outside-toplevel
  config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/grpo_example.py.', lock_config=True)
  flags.DEFINE_string('rewards', None, 'Reward functions: FILE.py:fn[,fn2].')
  flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, metrics). Default: runs/<name>.')


def main(argv):
  del argv
  cfg = flags.FLAGS.config
  distributed.initialize(cfg.dist)
  config_lib.validate(cfg, jax.device_count(), sharding.num_processes(), sharding.num_slices(), rl=True)
  rewards = load_rewards(flags.FLAGS.rewards)
  if cfg.rl.reward_weights and len(reward_weights(cfg.rl, 0)) != len(rewards):
    raise errors.ConfigError(f'rl.reward_weights has {len(reward_weights(cfg.rl, 0))} entries for {len(rewards)} '
                             f'reward functions; give one weight per function')
  run(cfg, train.make_workdir(flags.FLAGS.workdir, cfg), rewards)


def run(cfg, workdir: str, rewards: list[tuple[str, Callable]], tokenizer=None, devices=None) -> dict:
  """Trains the policy as `cfg` says through the one loop (train.run), writing to `workdir`; returns the last
  logged metrics. tokenizer: any with encode / decode / eos_id (default: rl.tokenizer, else the data's); devices:
  the mesh's (default: all)."""
  return train.run(cfg, workdir, source=Rollouts(cfg, rewards, tokenizer), devices=devices)


def console() -> None:
  """The command line (also the console script `jaxlm-rl`), in a child that a watcher process waits for."""
  cli.run_watched()
  cli.run(main, define=_define, required=('config', 'rewards'))


if __name__ == '__main__':
  console()
