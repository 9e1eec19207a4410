"""Multi-token prediction (DeepSeek-V3 §2.2): model.mtp_depth = D sequential modules after the last layer.

Depth k (1..D) predicts token i + k + 1 from position i: h_k = Block_k(W_k [RMSNorm(h_{k-1}); RMSNorm(Emb(t_{i+k}))]),
h_0 the main model's last hidden state, then its own RMSNorm and the model's (shared) output projection. The loss
of depth k is the cross-entropy of those logits against targets shifted by k, over the positions whose target
is real: inside the row, in the same document (packing) and weighted as the batch weights that target (SFT
masks); the training loss adds model.mtp_weight (λ) times the mean over depths. The modules run only in
training (the `mtp` collection mutable); sampling and evaluation use the main head alone, and the parameters
stay in the tree (checkpoints, init_from).

Letters as in model.py. `m` below is a model.ModelConfig, read by field (model.py imports this module).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

COLLECTION = 'mtp'  # the Flax collection the decoder sows the depths' logits into: (D, B, T, V)


def shift(x, k: int, fill=0):
  """x (B, T, ...) moved k positions to the left along T, the last k filled with `fill`."""
  return jnp.concatenate([x[:, k:], jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)], axis=1)


class MTP(nn.Module):
  """The D modules; returns each depth's normed hidden state (B, T, D) for the model's output projection.

  `block` and `norm`: model.Block and model.Norm, passed in (this module does not import model.py). Each depth's
  block is of the last layer's kind, `moe` (DeepSeek-V3's, stored as layer L of its checkpoint, is a mixture of
  experts); its routing statistics join the main layers' (moe.per_layer numbers depth k as layer L + k - 1).
  """
  config: Any
  block: Any
  norm: Any
  moe: bool = False

  @nn.compact
  def __call__(self, h, table, inputs, segment_ids, positions, deterministic: bool = True):
    m = self.config
    D = m.d_model
    init = nn.with_logical_partitioning(nn.initializers.normal((2 * D) ** -0.5), ('mlp', 'embed'))
    out = []
    for k in range(1, m.mtp_depth + 1):
      e = jnp.take(table, shift(inputs, k), axis=0).astype(m.dtype)  # Emb(t_{i+k}) (B, T, D)
      if m.embed_scale:
        e = e * jnp.asarray(D ** 0.5, m.dtype)
      both = jnp.concatenate([self.norm(m, rms=True, name=f'hidden_norm_{k}')(h),
                              self.norm(m, rms=True, name=f'embed_norm_{k}')(e)], -1)  # (B, T, 2D)
      # The (2D, D) projection's input axis is named `mlp` (tensor): `embed` is its output's, and one spec may
      # name a mesh axis once.
      w = self.param(f'proj_{k}', init, (2 * D, D), jnp.dtype(m.param_dtype)).astype(m.dtype)
      h = jnp.einsum('BTI,ID->BTD', both, w)
      h, _ = self.block(m, deterministic, moe=self.moe, name=f'block_{k}')(h, segment_ids, positions, False)
      out.append(self.norm(m, rms=True, name=f'norm_{k}')(h))
    return out


def target_weights(batch: dict, depth: int):
  """(D, B, T) float32: each depth's weight per position, the batch's weight of its shifted target, zero past the
  row's end or across a document boundary."""
  w, seg = batch['weights'].astype(jnp.float32), batch['segment_ids']
  return jnp.stack([shift(w, k) * (shift(seg, k) == seg) for k in range(1, depth + 1)])


def loss(logits, batch: dict, weight: float, denominators):
  """(λ · mean over depths of their cross-entropies, {mtp_loss_k: depth k's}); logits (D, B, T, V) as sown,
  `denominators` (D,): each depth's weight sum over the whole batch (microbatches add up to it)."""
  depth = logits.shape[0]
  weights = target_weights(batch, depth)  # (D, B, T)
  targets = jnp.stack([shift(batch['targets'], k) for k in range(1, depth + 1)])  # (D, B, T)
  logits = logits.astype(jnp.float32)
  nll = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  per_depth = (nll * weights).sum((1, 2)) / denominators  # (D,)
  return weight * per_depth.mean(), {f'mtp_loss_{k + 1}': per_depth[k] for k in range(depth)}


def mtp_errors(model_cfg, stages: int = 1) -> list[str]:
  """config.validate's checks of model.mtp_depth and model.mtp_weight."""
  depth, weight = model_cfg.get('mtp_depth', 0), model_cfg.get('mtp_weight', 0.3)
  e = [f'model.mtp_depth={depth} must be >= 0 (0 = off).'] if depth < 0 else []
  if weight < 0:
    e.append(f'model.mtp_weight={weight} must be >= 0.')
  if depth > 0 and stages > 1:
    e.append(f'model.mtp_depth={depth} with mesh.stage={stages}: the prediction modules run after the last '
             f'stage, which the pipeline does not build; set mesh.stage=1.')
  return e
