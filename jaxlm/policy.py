"""RL's objective: the clipped policy-gradient loss of GRPO and its variants, plugged into the one step builder
(jaxlm.step.build_program(..., objective=PolicyObjective(...))) as preference.py's and distill.py's losses are.

jaxlm/rl.py builds its batches: the rollout source samples, rewards and turns advantages into the per-token
weights this loss sums over. The choice lists (rl.loss_type, rl.scale_rewards) are declared here, where the loss
and its weights act on them; config validation reads them from here.
"""

import dataclasses

import jax
import jax.numpy as jnp

LOSS_TYPES = ('grpo', 'bnpo', 'dr_grpo', 'dapo')  # rl.loss_type: how per-token losses are averaged (rl.token_weights)
SCALE_REWARDS = ('group', 'batch', 'none')  # rl.scale_rewards: advantages divided by the group's / batch's std
POLICY_KEYS = ('old_logps', 'advantages', 'token_share')  # with inputs, targets, segment_ids, positions, weights


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
  """GRPO / BNPO / Dr.GRPO / DAPO's loss (TRL's GRPOTrainer._compute_loss), one per-token weight apart.

  The loss types differ only in how per-token losses are averaged, so the host folds that into `weights`
  (jaxlm.rl.token_weights, normalised over the global batch): the step's loss is Σ weights · per-token loss, and
  microbatches and processes add up exactly. `token_share` is each completion token's share of the batch's
  completion tokens (1 / their count), for metrics that are means over tokens.
  """
  temperature: float = 1.0  # logits are divided by the sampling temperature, as the sampler's log-probs were
  epsilon: float = 0.2  # the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
  epsilon_high: float = 0.2
  beta: float = 0.0  # k3 KL to the reference (batch['ref_logps']) when > 0

  @property
  def batch_keys(self) -> tuple[str, ...]:
    """The float32 (B, T) keys its batch carries besides the language-model batch's."""
    return POLICY_KEYS + (('ref_logps',) if self.beta else ())

  def logprobs(self, logits, targets):
    """Float32 (B, T) log-probabilities of `targets` under logits / temperature (generate.token_logprobs)."""
    from jaxlm import generate  # pylint: disable=import-outside-toplevel  # the sampler's one definition
    return generate.token_logprobs(logits, targets, self.temperature)

  def loss(self, logits, batch: dict):
    """(Σ weights · per-token loss, metrics that add over microbatches) for logits (B, T, V)."""
    return policy_loss(logits, batch, temperature=self.temperature, epsilon=self.epsilon,
                       epsilon_high=self.epsilon_high, beta=self.beta)


def policy_loss(logits, batch: dict, *, temperature: float, epsilon: float, epsilon_high: float, beta: float):
  """The clipped surrogate -min(r·A, clip(r)·A) (+ beta·k3 KL) per token, weighted by batch['weights'].

  r = exp(logp - old_logp) with old_logp the sampler's (equal parameters: r is 1 up to rounding, and its
  gradient is the policy gradient); k3 = exp(ref - logp) - (ref - logp) - 1 (Schulman's estimator), times r as TRL's
  use_bias_correction_kl (DeepSeek-V3.2) does by default.
  """
  scaled = logits.astype(jnp.float32) / (temperature or 1.0)  # (B, T, V)
  log_z = jax.nn.logsumexp(scaled, axis=-1)  # (B, T)
  logps = jnp.take_along_axis(scaled, batch['targets'][..., None], axis=-1)[..., 0] - log_z
  entropy = log_z - jnp.sum(jax.nn.softmax(scaled, axis=-1) * scaled, axis=-1)
  advantages, share = batch['advantages'], batch['token_share']
  ratio = jnp.exp(logps - batch['old_logps'])
  clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + epsilon_high)
  per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
  aux = {}
  if beta:
    delta = batch['ref_logps'] - logps
    kl = (jnp.exp(delta) - delta - 1.0) * ratio  # times the ratio: the unbiased reverse-KL gradient (TRL's default)
    per_token = per_token + beta * kl
    aux['kl'] = jnp.sum(share * kl)
  loss = jnp.sum(batch['weights'] * per_token)
  low = (ratio < 1.0 - epsilon) & (advantages < 0)
  high = (ratio > 1.0 + epsilon_high) & (advantages > 0)
  # low_min / high_max as TRL's GRPOTrainer logs them: the min / max over the batch's completions of each one's
  # share of clipped tokens (TRL gathers these per-sequence shares from every process, then nanmin / nanmax). Rows
  # are whole in every microbatch, so a min / max of microbatches' is the batch's; a row with no completion token
  # is left out (TRL: NaN, skipped), and a batch of such rows logs 1 and 0 where TRL logs NaN.
  completion = share > 0  # (B, T)
  tokens = completion.sum(-1)  # (B,)
  row_share = lambda x: jnp.sum(jnp.where(completion, x.astype(jnp.float32), 0.0), -1) / jnp.maximum(tokens, 1)  # noqa: E731
  aux.update({'loss': loss, 'entropy': jnp.sum(share * entropy),
              'clip_ratio/low_mean': jnp.sum(share * low), 'clip_ratio/high_mean': jnp.sum(share * high),
              'clip_ratio/region_mean': jnp.sum(share * (low | high)),
              'clip_ratio/low_min': jnp.min(jnp.where(tokens > 0, row_share(low), 1.0)),
              'clip_ratio/high_max': jnp.max(jnp.where(tokens > 0, row_share(high), 0.0)),
              # sampler vs trainer on the same tokens and parameters: ~0, the first thing to check
              'logprob_mismatch': jnp.sum(share * jnp.abs(logps - batch['old_logps'])),
              'max_logit': logits.max().astype(jnp.float32)})
  return loss, aux
