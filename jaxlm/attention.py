"""Attention kernels behind one function: `xla` is the reference; others are selected by `cfg.model.attention`.

Shapes: q (B, T, H, E); k, v (B, S, K, E) with H a multiple of K; segment_ids (B, T), 0 = padding.
"""

import math

import jax
import jax.numpy as jnp


def attention_mask(segment_ids):
  """(B, 1, 1, T, S) boolean: causal, within one document, and never from padding (segment 0)."""
  T = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((T, T), bool))  # (T, S)
  same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]  # (B, T, S)
  real = (segment_ids != 0)[:, :, None]  # (B, T, 1)
  return (causal & same_doc & real)[:, None, None]


def xla_attention(q, k, v, segment_ids):
  """Reference attention: einsum scores, softmax in float32. q: (B,T,H,E); k, v: (B,S,K,E) -> (B,T,H,E)."""
  B, T, H, E = q.shape
  K = k.shape[2]
  q = q.reshape(B, T, K, H // K, E)  # (B, T, K, G, E): each kv head serves G query heads
  scores = jnp.einsum('BTKGE,BSKE->BKGTS', q, k).astype(jnp.float32) / math.sqrt(E)
  # Finite fill, not -inf: a fully masked (padding) row then gives a uniform softmax rather than NaN.
  scores = jnp.where(attention_mask(segment_ids), scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum('BKGTS,BSKE->BTKGE', probs, v).reshape(B, T, H, E)



def attention(q, k, v, segment_ids, impl: str = 'xla'):
  """Causal, document-masked attention with the chosen kernel."""
  del impl  # only the reference kernel so far
  return xla_attention(q, k, v, segment_ids)
