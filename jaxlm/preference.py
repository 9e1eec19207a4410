"""Preference tuning: DPO-family losses over chosen / rejected completions, and the reference they compare with.

A preference batch is an ordinary packed batch (inputs, targets, segment ids, positions, loss weights) plus
`pairs` (B, T) int32: +k on the tokens of row-local pair k's chosen completion's segment, -k on its rejected
one's, 0 elsewhere (data/stream.py packs each pair as one unit, chosen and rejected as adjacent segments). The
weights are 1 on each completion's tokens and its end-of-turn token only, so a completion's log-probability is
the weighted sum of its tokens' log-probabilities, as TRL's DPOTrainer sums them over its completion mask.
`ref_logps` (B, T) float32, when present, holds the reference model's per-token log-probabilities
(`reference=cached`, jaxlm/tools/reference.py).

Loss types (TRL's definitions, so a run compares with a TRL one; π = policy, r = reference log-probabilities of
a completion, |y| its weighted token count, Δ = π - r):
  sigmoid       DPO (Rafailov et al. 2023): -log σ(β·(Δ_c - Δ_r))
  ipo           IPO (Azar et al. 2023), length-normalised as TRL: (Δ_c/|y_c| - Δ_r/|y_r| - 1/(2β))²
  sigmoid_norm  length-normalised DPO: -log σ(β·(Δ_c/|y_c| - Δ_r/|y_r|))
  simpo         SimPO (Meng et al. 2024), reference-free: -log σ(β·(π_c/|y_c| - π_r/|y_r|) - γ)
Every type is a sum over pairs divided by the whole batch's pair count, so microbatches and processes add up to
the global batch's mean exactly. Metrics carry TRL's names (rewards/*, logps/*) so dashboards compare.
"""

import json
import os

import jax
import jax.numpy as jnp

from jaxlm import errors
from jaxlm import lora as lora_lib

LOSS_TYPES = ('sigmoid', 'ipo', 'sigmoid_norm', 'simpo')  # preference.loss_type
REFERENCES = ('base', 'copy', 'cached')  # preference.reference
REFERENCE_DTYPES = ('float32', 'bfloat16')  # preference.reference_dtype (reference=copy)
CACHE_DIRECTORY, CACHE_MANIFEST = 'reference', 'reference.json'  # reference=cached: beside the prepared pairs
METRICS = ('rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'rewards/margins', 'logps/chosen',
           'logps/rejected')


def needs_reference(pref_cfg) -> bool:
  """Whether the loss compares with a reference model (SimPO does not)."""
  return pref_cfg.loss_type != 'simpo'


def reads_cached(train_cfg, pref_cfg) -> bool:
  """Whether the run's batches carry the cached reference log-probabilities (`ref_logps`): under
  preference.reference=cached, by a loss that compares with a reference. The one switch: no data setting."""
  return (train_cfg.get('objective', 'lm') == 'preference' and pref_cfg.reference == 'cached'
          and needs_reference(pref_cfg))


def reference_params(kind: str, params, reference):
  """The parameters the reference forward runs with: under `base` the LoRA model's base (its adapters off, no
  memory beyond B's), under `copy` the frozen copy in TrainState.reference; None for `cached` (the batch holds
  the reference's log-probabilities)."""
  if kind == 'base':
    return lora_lib.adapters_off(params)
  if kind == 'copy':
    return reference
  return None


def copy_reference(params, dtype: str):
  """The frozen reference of `reference=copy`: the initial parameters, in `dtype` (a fresh buffer each)."""
  return jax.tree.map(lambda x: jnp.copy(x).astype(dtype), params)


def token_logps(logits, targets):
  """log p(target) per token (B, T), in float32."""
  logits = logits.astype(jnp.float32)
  target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return target - jax.nn.logsumexp(logits, axis=-1)


def pair_sums(values, batch: dict):
  """(chosen, rejected) sums of `values` (B, T) over each row's pairs' weighted tokens: each (B, P), P = T // 2."""
  B, T = values.shape
  P = T // 2
  pairs, w = batch['pairs'], batch['weights']
  ids = jnp.where(pairs > 0, pairs - 1, jnp.where(pairs < 0, -pairs - 1 + P, 2 * P))  # chosen k, rejected P + k
  ids = ids + jnp.arange(B)[:, None] * (2 * P + 1)
  sums = jax.ops.segment_sum((values * w).reshape(-1), ids.reshape(-1), num_segments=B * (2 * P + 1))
  sums = sums.reshape(B, 2 * P + 1)
  return sums[:, :P], sums[:, P:2 * P]


def count_pairs(batch: dict):
  """Pairs in `batch` with a weighted token on both sides (float32 scalar)."""
  ones = jnp.ones(batch['pairs'].shape, jnp.float32)
  chosen, rejected = pair_sums(ones, batch)
  return ((chosen > 0) & (rejected > 0)).sum().astype(jnp.float32)


def loss(logits, batch: dict, ref_logps, pref_cfg, num_pairs):
  """(loss summed over `batch`'s pairs / num_pairs, metrics likewise) from the policy's logits (B, T, V) and the
  reference's per-token log-probabilities (B, T) (None for SimPO)."""
  policy = token_logps(logits, batch['targets'])
  pi_c, pi_r = pair_sums(policy, batch)
  len_c, len_r = pair_sums(jnp.ones_like(policy), batch)
  valid = (len_c > 0) & (len_r > 0)
  len_c, len_r = jnp.maximum(len_c, 1.0), jnp.maximum(len_r, 1.0)
  beta = pref_cfg.beta
  if pref_cfg.loss_type == 'simpo':
    avg_c, avg_r = pi_c / len_c, pi_r / len_r
    per_pair = -jax.nn.log_sigmoid(beta * (avg_c - avg_r) - pref_cfg.gamma)
    reward_c, reward_r = beta * avg_c, beta * avg_r
  else:
    ref_c, ref_r = pair_sums(jax.lax.stop_gradient(ref_logps.astype(jnp.float32)), batch)
    delta_c, delta_r = pi_c - ref_c, pi_r - ref_r
    if pref_cfg.loss_type == 'sigmoid':
      per_pair = -jax.nn.log_sigmoid(beta * (delta_c - delta_r))
    elif pref_cfg.loss_type == 'sigmoid_norm':
      per_pair = -jax.nn.log_sigmoid(beta * (delta_c / len_c - delta_r / len_r))
    else:  # ipo
      per_pair = jnp.square(delta_c / len_c - delta_r / len_r - 1 / (2 * beta))
    reward_c, reward_r = beta * delta_c, beta * delta_r
  reward_c, reward_r = jax.lax.stop_gradient(reward_c), jax.lax.stop_gradient(reward_r)
  mean = lambda x: jnp.where(valid, x, 0.0).sum() / num_pairs  # noqa: E731
  total = mean(per_pair)
  metrics = {'loss': total, 'rewards/chosen': mean(reward_c), 'rewards/rejected': mean(reward_r),
             'rewards/accuracies': mean((reward_c > reward_r).astype(jnp.float32)),
             'rewards/margins': mean(reward_c - reward_r),
             'logps/chosen': mean(jax.lax.stop_gradient(pi_c)), 'logps/rejected': mean(jax.lax.stop_gradient(pi_r))}
  return total, metrics


# reference=cached: the log-probabilities jaxlm.tools.reference wrote beside the pairs, and what they belong to.


class ReferenceError(errors.ConfigError):
  """Cached reference log-probabilities that do not belong to this run or data; the message says what to do."""


def cached_identity(step_dir: str, meta: dict) -> dict:
  """What cached log-probabilities belong to: the checkpoint, and the data's tokenizer and chat template (the
  sha256 of the template text the pairs were rendered with, which a tokenizer's own template changes without
  changing its tokenizer.json; the --chat_template name for pairs prepared before it was recorded)."""
  template = meta.get('chat_template_sha256') or meta.get('settings', {}).get('chat_template', '')
  return {'checkpoint': os.path.abspath(step_dir), 'tokenizer_sha256': meta['tokenizer_sha256'],
          'chat_template': template, 'pairs': meta['documents']}


def read_pairs_meta(data: str) -> dict:
  """metadata.json of prepared preference pairs; ReferenceError for anything else."""
  try:
    with open(os.path.join(data, 'metadata.json')) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise ReferenceError(f'--data={data} holds no readable metadata.json ({e}); give the directory '
                         f'`python -m jaxlm.data.prepare --format=preference` wrote.') from e
  if meta.get('content') != 'preference':
    raise ReferenceError(f'--data={data} holds {meta.get("content", "text")} data, not preference pairs; prepare it '
                         f'with --format=preference.')
  return meta


def check_cached(data: str, init_from: str) -> None:
  """Refuses cached log-probabilities that belong to another checkpoint than the run's warm start (`init_from`),
  or to another tokenizer or chat template than the pairs now have."""
  meta = read_pairs_meta(data)
  try:
    with open(os.path.join(data, CACHE_DIRECTORY, CACHE_MANIFEST)) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ReferenceError(f'{data} has no cached reference log-probabilities; compute them with `python -m '
                         f'jaxlm.tools.reference --workdir=<the run you start from> --data={data}`.') from e
  if not init_from:
    raise ReferenceError('preference.reference=cached compares with the model training starts from; set '
                         'checkpoint.init_from to the checkpoint the reference was computed with.')
  from jaxlm import checkpoint  # pylint: disable=g-import-not-at-top
  want = cached_identity(checkpoint.step_dir_of(init_from), meta)  # the step init_from loads
  for key in ('checkpoint', 'tokenizer_sha256', 'chat_template', 'pairs'):
    if saved.get(key) != want[key]:
      raise ReferenceError(f'the cached reference log-probabilities in {data}/{CACHE_DIRECTORY} belong to {key}='
                           f'{saved.get(key)!r}, but this run has {want[key]!r}; compute them again with `python -m '
                           f'jaxlm.tools.reference --workdir=... --data={data}`.')


