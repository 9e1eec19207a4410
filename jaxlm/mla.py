"""Multi-head latent attention (DeepSeek-V2 §2.1, used by DeepSeek-V3): the training form, and decoding from a cache
of latents in the absorbed form.

Keys and values come from one small latent per token: c = RMSNorm(x·W_dkv) (R = kv_lora_rank numbers), up-projected
per head to a key part without positions (En = qk_nope_head_dim) and a value (Ev = v_head_dim). Position enters
through a separate rotary key of Er = qk_rope_head_dim numbers, x·W_kr, shared by all heads ("decoupled RoPE":
RoPE on the up-projected key would stop W_uk from being absorbed into the query at decode time). Queries go
through their own latent (q_lora_rank > 0, with its norm) or a plain projection (q_lora_rank = 0, V2-Lite).
Head h scores [q_nope_h, rope(q_rot_h)]·[k_nope_h, rope(k_rot)] / sqrt(En + Er), times DeepSeek's YaRN correction
(rope.softmax_mscale, model.rope_mscale_all_dim) when set.

Letters beyond model.py's: R kv latent (kv_lora_rank), Rq query latent (q_lora_rank), En, Er, Ev as above.
`m` below is a model.ModelConfig (read by field: this module sits below model.py and does not import it).
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlm import attention as attention_lib
from jaxlm import blocks
from jaxlm import lora as lora_lib
from jaxlm.rope import rope, rope_frequencies, softmax_mscale

# MlaConfig's field -> its flat cfg.model key (the names DeepSeek's config.json uses).
_KEYS = ('q_lora_rank', 'kv_lora_rank', 'qk_nope_head_dim', 'qk_rope_head_dim', 'v_head_dim')


@dataclasses.dataclass(frozen=True)
class MlaConfig:
  """model.kv_lora_rank > 0 turns a layer's attention into MLA; the other keys are read only then."""
  q_lora_rank: int = 0  # Rq: the query latent; 0 = a plain query projection (DeepSeek-V2-Lite)
  kv_lora_rank: int = 0  # R: the key/value latent; 0 = MLA off (model.Attention)
  qk_nope_head_dim: int = 128  # En: each head's key/query part without RoPE
  qk_rope_head_dim: int = 64  # Er: the rotary part; the key's is one vector shared by every head
  v_head_dim: int = 128  # Ev: each head's value (and output) size

  @classmethod
  def from_config(cls, model_cfg) -> 'MlaConfig':
    """From cfg.model's flat keys (a key a saved config lacks: its default)."""
    return cls(**{k: model_cfg.get(k, getattr(cls, k)) for k in _KEYS})


def mla_errors(model_cfg) -> list[str]:
  """config.validate's checks of MLA's keys, each naming its field."""
  g = lambda key: model_cfg.get(key, getattr(MlaConfig, key))  # noqa: E731  a saved config may predate a key
  if not g('kv_lora_rank'):
    return [] if g('kv_lora_rank') == 0 else [f'model.kv_lora_rank={g("kv_lora_rank")} must be >= 0 (0 = off).']
  e = [f'model.{k}={g(k)} must be > 0 with model.kv_lora_rank > 0.' for k in _KEYS[1:] if g(k) <= 0]
  if g('q_lora_rank') < 0:
    e.append(f'model.q_lora_rank={g("q_lora_rank")} must be >= 0 (0 = a plain query projection).')
  if g('qk_rope_head_dim') % 2:
    e.append(f'model.qk_rope_head_dim={g("qk_rope_head_dim")} must be even (RoPE rotates pairs).')
  if model_cfg.get('attention', 'xla') in ('cudnn', 'splash'):
    e.append(f'model.attention={model_cfg.get("attention")} with MLA: queries and keys are En + Er wide and values '
             f'Ev, which the fused kernels here do not take; set model.attention=xla.')
  for key, off in (('attention_window', 0), ('attention_sinks', False), ('qk_norm', 'none'),
                   ('attention_bias', False)):
    if model_cfg.get(key, off) != off:
      e.append(f'model.{key}={model_cfg.get(key)} with MLA (model.kv_lora_rank > 0) is not supported; set it to {off!r}.')
  return e


def kernel_reason(model_cfg) -> str | None:
  """The trainer's start-up line on the attention kernel when MLA decides it (always xla: model.attention=auto
  would otherwise report the fused kernel it picks for other models), else None."""
  if not model_cfg.get('kv_lora_rank', 0):
    return None
  return (f'xla attention: multi-head latent attention (model.kv_lora_rank > 0) has values narrower than its '
          f'queries and keys, which the fused kernels do not take (model.attention={model_cfg.get("attention")})')


def attention_params(m) -> int:
  """MLA's parameters per layer: the query and latent projections, their norms, the up-projections, the output."""
  c, D, H = m.mla, m.d_model, m.num_heads
  qk = c.qk_nope_head_dim + c.qk_rope_head_dim
  query = (D + 1) * c.q_lora_rank + c.q_lora_rank * H * qk if c.q_lora_rank else D * H * qk
  latent = D * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank  # + its norm
  return query + latent + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim) + H * c.v_head_dim * D


def _rms(scale, x, m):
  """A latent's RMSNorm (B, T, R) in float32 with its (R,) scale, plain w as DeepSeek's (model.norm_offset not read)."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + m.norms.eps)
  return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


# LoRA (model.lora.targets) on MLA's projections: `query` (q_proj, or q_b_proj behind the query latent) and `out`
# as in every attention, and MLA's own (lora.MLA_TARGETS) `query_a` (into the query latent), `kv_a` (into the
# key/value latent and the rotary key) and `kv_b` (the latent's per-head up-projection); `key` and `value` name
# nothing here.


class MLA(nn.Module):
  """Multi-head latent attention in place of model.Attention (same call); `project`: model.project, passed in
  (this module does not import model.py) so fp8 matmuls and LoRA branches apply to its projections as to the
  others'."""
  config: Any
  project: Callable

  def _weight(self, name, names, shape, std):
    m = self.config
    return self.param(name, nn.with_logical_partitioning(nn.initializers.normal(std), names), shape,
                      jnp.dtype(m.lora.base_dtype if m.lora.rank else m.param_dtype)).astype(m.dtype)

  def _scale(self, name, size):
    return self.param(name, nn.with_logical_partitioning(nn.initializers.ones, ('latent',)), (size,),
                      jnp.dtype(self.config.param_dtype))

  def _weights(self):
    """Every base parameter, created in one fixed order before any adapter (so their initial values do not depend
    on model.lora), then the adapters of model.lora.targets: name -> (weight, its (A, B) or None)."""
    m, c = self.config, self.config.mla
    D, H = m.d_model, m.num_heads
    R, Rq, En, Er, Ev = c.kv_lora_rank, c.q_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    shapes = {}  # weight -> (target, its input axes, its output axes)
    w = {}
    if Rq:
      shapes['query_a'] = ('query_a', ((D, 'embed'),), ((Rq, 'latent'),))
      w['query_a'] = self._weight('query_a', ('embed', 'latent'), (D, Rq), D ** -0.5)
      w['query_norm'] = self._scale('query_norm', Rq)
      shapes['query_b'] = ('query', ((Rq, 'latent'),), ((H, 'heads'), (En + Er, 'kv')))
      w['query_b'] = self._weight('query_b', ('latent', 'heads', 'kv'), (Rq, H, En + Er), Rq ** -0.5)
    else:
      shapes['query'] = ('query', ((D, 'embed'),), ((H, 'heads'), (En + Er, 'kv')))
      w['query'] = self._weight('query', ('embed', 'heads', 'kv'), (D, H, En + Er), D ** -0.5)
    shapes['kv_a'] = ('kv_a', ((D, 'embed'),), ((R + Er, 'latent'),))
    w['kv_a'] = self._weight('kv_a', ('embed', 'latent'), (D, R + Er), D ** -0.5)
    w['kv_norm'] = self._scale('kv_norm', R)
    shapes['kv_b'] = ('kv_b', ((R, 'latent'),), ((H, 'heads'), (En + Ev, 'kv')))
    w['kv_b'] = self._weight('kv_b', ('latent', 'heads', 'kv'), (R, H, En + Ev), R ** -0.5)
    shapes['out'] = ('out', ((H, 'heads'), (Ev, 'kv')), ((D, 'embed'),))
    w['out'] = self._weight('out', ('heads', 'kv', 'embed'), (H, Ev, D), (H * Ev) ** -0.5)
    adapters = {name: lora_lib.adapter(self, name, inputs, outputs, m.lora, m.param_dtype, target=target)
                for name, (target, inputs, outputs) in shapes.items()}
    return w, adapters

  @nn.compact
  def __call__(self, x, segment_ids, positions, local=False):  # x: (B, T, D); `local` unused (validation)
    m, c = self.config, self.config.mla
    D, H, B, T = m.d_model, m.num_heads, x.shape[0], x.shape[1]
    R, En, Er, Ev = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    w, lora = self._weights()
    proj = lambda h, name: self.project(h, w[name].reshape(h.shape[-1], -1), name, m, lora.get(name))  # noqa: E731
    x = blocks.tokens(x)  # (N, D): one token axis for every weight matmul ((B, T, D) under context)
    if c.q_lora_rank:
      q = proj(_rms(w['query_norm'], proj(x, 'query_a'), m), 'query_b')
    else:
      q = proj(x, 'query')
    q = q.reshape(B, T, H, En + Er)
    ckv = proj(x, 'kv_a')  # (N, R + Er)
    latent = _rms(w['kv_norm'], ckv[..., :R], m).reshape(B, T, R)
    frequencies = None if m.rope_scaling == 'none' else rope_frequencies(dataclasses.replace(m, head_dim=Er))
    k_rot = rope(ckv[..., R:].reshape(B, T, 1, Er), positions, m.rope_theta, frequencies)  # (B, T, 1, Er)
    q = jnp.concatenate([q[..., :En], rope(q[..., En:], positions, m.rope_theta, frequencies)], -1)
    q = nn.with_logical_constraint(q, ('act_batch', 'act_seq', 'act_heads', 'act_kv'))

    def expand(latent, k_rot):  # (B, S, R), (B, S, 1, Er) -> keys (B, S, H, En + Er), values (B, S, H, Ev)
      S = latent.shape[1]
      kv = proj(blocks.tokens(latent), 'kv_b').reshape(B, S, H, En + Ev)
      k = jnp.concatenate([kv[..., :En], jnp.broadcast_to(k_rot, (B, S, H, Er)).astype(kv.dtype)], -1)
      k = nn.with_logical_constraint(k, ('act_batch', 'act_seq', 'act_heads', 'act_kv'))
      return k, nn.with_logical_constraint(kv[..., En:], ('act_batch', 'act_seq', 'act_heads', 'act_kv'))

    scores = blocks.scores_config(m, False)
    if softmax_mscale(m) != 1.0:  # DeepSeek's YaRN: the whole head's scale too (rope.softmax_mscale)
      scores = dataclasses.replace(scores, scale=(scores.scale or (En + Er) ** -0.5) * softmax_mscale(m))
    if self.is_mutable_collection('cache'):  # decoding (jaxlm/generate.py): latents cached, attended absorbed
      w_up = w['kv_b']
      if lora['kv_b'] is not None:  # absorbed, so the adapter goes into the up-projection: W + (alpha/r)·A·B
        a, b = lora['kv_b']
        w_up = w_up + (a.astype(m.dtype) @ b.astype(m.dtype) * m.lora.scale).reshape(w_up.shape)
      out = self.cached_attention(q, latent, k_rot, segment_ids, w_up, scores)
    else:
      k, v = expand(latent, k_rot)
      # auto would pick a fused kernel by the query's width alone; the values' differs (validation refuses the
      # fused kernels by name), so MLA runs the xla kernel.
      out = attention_lib.attention(q, k, v, segment_ids, 'xla', m.attention.block_q,
                                    scores_cfg=scores)  # (B, T, H, Ev)
    out = nn.with_logical_constraint(out, ('act_batch', 'act_seq', 'act_heads', 'act_kv'))
    return proj(blocks.tokens(out.reshape(B, T, H * Ev)), 'out').reshape(B, T, D)

  def cached_attention(self, q, latent, k_rot, segment_ids, w_up, scores):
    """q (B, T, H, En + Er) over this layer's cache of R + Er numbers per token (the normed latent and the rotated
    shared key), written at its next T slots, in the latent space (DeepSeek-V2 §2.1.3): W_uk is absorbed into the
    query and W_uv applied after, so no per-head key or value is ever formed and the cache does not grow with H.

    score_h(s) = q_nope_h·(W_uk_h c_s) + q_rot_h·k_rot_s = (W_uk_hᵀ q_nope_h)·c_s + q_rot_h·k_rot_s: one key head
    [c_s, k_rot_s] of R + Er numbers shared by every query head (multi-query attention), its value c_s itself.
    """
    c = self.config.mla
    B, T, R = latent.shape
    En, Er = c.qk_nope_head_dim, c.qk_rope_head_dim
    cache = {name: self.variable('cache', name, jnp.zeros, shape, dtype) for name, shape, dtype in (
        ('latent', (B, T, R), latent.dtype), ('rope_key', (B, T, 1, Er), k_rot.dtype),
        ('segment_ids', (B, T), jnp.int32))}
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    i = index.value
    for name, new in (('latent', latent), ('rope_key', k_rot), ('segment_ids', segment_ids.astype(jnp.int32))):
      v = cache[name]
      v.value = jax.lax.dynamic_update_slice(v.value, new.astype(v.value.dtype), (0, i) + (0,) * (new.ndim - 2))
    index.value = i + T
    w_uk, w_uv = w_up[..., :En], w_up[..., En:]  # (R, H, En), (R, H, Ev)
    q_latent = jnp.einsum('BTHn,RHn->BTHR', q[..., :En], w_uk)  # (B, T, H, R)
    keys = jnp.concatenate([cache['latent'].value[:, :, None], cache['rope_key'].value.astype(latent.dtype)], -1)
    S = keys.shape[1]
    # The scores keep the full head's scale, 1/sqrt(En + Er), not that of the R + Er wide latent query.
    scores = dataclasses.replace(scores, scale=scores.scale or (En + Er) ** -0.5)
    out = attention_lib.attention(jnp.concatenate([q_latent, q[..., En:]], -1), keys,
                                  cache['latent'].value[:, :, None], segment_ids,
                                  kv_segment_ids=cache['segment_ids'].value, order=i + jnp.arange(T),
                                  kv_order=jnp.arange(S), scores_cfg=scores)  # (B, T, H, R)
    return jnp.einsum('BTHR,RHv->BTHv', out, w_uv)  # (B, T, H, Ev)
