"""The block options of the one decoder (model.py), each a small frozen config read from cfg.model's flat keys,
the per-layer choices they make (local or global attention), and config.validate's checks of them.

Functions here take a model.ModelConfig `m` by field (this module sits beside model.py and does not import it).
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlm import attention as attention_lib

NORM_PLACEMENTS = ('pre', 'sandwich', 'post')  # model.norm_placement (Block)
MLP_ACTIVATIONS = ('swiglu', 'geglu', 'clamped')  # model.mlp_activation (SwiGLU, MoE experts: `activation`)


# AttentionConfig's field -> its flat cfg.model key.
_ATTENTION_KEYS = {'kernel': 'attention', 'block_q': 'attention_block_q', 'qk_norm': 'qk_norm',
                   'window': 'attention_window', 'global_every': 'attention_global_every',
                   'local_rope_theta': 'rope_local_theta', 'softcap': 'attention_softcap',
                   'sinks': 'attention_sinks', 'query_scalar': 'query_pre_attn_scalar', 'bias': 'attention_bias'}


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """How a layer's attention runs: the kernel, QK-norm, and the per-layer pattern of local and global layers.

  A local layer (window W > 0) attends to its W most recent keys, itself included (`attention.Scores`); with
  `global_every` n > 0 every n-th layer (n-1, 2n-1, ...) is global (Gemma 3: 6, Gemma 2: 2), with 0 every layer
  is local (Mistral). Local layers rotate with base `local_rope_theta` where it is set (Gemma 3).
  """
  kernel: str = 'xla'  # model.attention: attention.py's kernel choice
  block_q: int = 0  # model.attention_block_q: query rows per block (0 = all at once)
  qk_norm: str = 'none'  # see QKNorm
  window: int = 0  # model.attention_window: W; 0 = every layer global
  global_every: int = 0  # model.attention_global_every
  local_rope_theta: float = 0.0  # model.rope_local_theta: 0 = rope_theta for every layer
  softcap: float = 0.0  # model.attention_softcap: scores -> cap·tanh(scores / cap); 0 = off
  sinks: bool = False  # model.attention_sinks: a learned per-head logit in each softmax's denominator (gpt-oss)
  query_scalar: float = 0.0  # model.query_pre_attn_scalar: scores scaled by its -1/2 power; 0 = head dim
  bias: bool = False  # model.attention_bias: q, k, v and output projections with biases (gpt-oss; `biases`)

  @classmethod
  def from_config(cls, model_cfg) -> 'AttentionConfig':
    """From cfg.model's flat keys (a key a saved config lacks: its default)."""
    return cls(**{f: model_cfg.get(key, getattr(cls, f)) for f, key in _ATTENTION_KEYS.items()})


@dataclasses.dataclass(frozen=True)
class NormsConfig:
  """The layer norms (`Norm`, `QKNorm`) of the sequential block: where they sit and how they scale.

  placement  pre       norm -> sublayer -> add (Llama)
             sandwich  norm -> sublayer -> norm -> add (Gemma 2/3)
             post      sublayer -> norm -> add (OLMo 2)
  offset     scale by (1 + w), w initialised to 0 (Gemma's RMSNorm), instead of by w.
  The parallel (PaLM) block has one LayerNorm whatever these say (config.validate refuses the others with it).
  """
  eps: float = 1e-6  # model.norm_eps
  placement: str = 'pre'  # model.norm_placement
  offset: bool = False  # model.norm_offset

  @classmethod
  def from_config(cls, model_cfg) -> 'NormsConfig':
    """From cfg.model's flat keys (a key a saved config lacks: its default)."""
    return cls(eps=model_cfg.get('norm_eps', cls.eps), placement=model_cfg.get('norm_placement', cls.placement),
               offset=model_cfg.get('norm_offset', cls.offset))


@dataclasses.dataclass(frozen=True)
class MlpConfig:
  """model.mlp_activation: the MLP's gate (dense and experts alike; `activation`).

  swiglu   silu(g)·u (Shazeer 2020).
  geglu    gelu(g)·u, gelu tanh-approximated (Gemma).
  clamped  gpt-oss's: g clamped above at `limit`, u to [-limit, limit], then g·sigmoid(alpha·g)·(u + 1).
  """
  activation: str = 'swiglu'
  limit: float = 7.0  # model.mlp_swiglu_limit: clamped only
  alpha: float = 1.702  # model.mlp_swiglu_alpha: clamped only (1.702: sigmoid(1.702·g)·g ≈ gelu(g))

  @classmethod
  def from_config(cls, model_cfg) -> 'MlpConfig':
    """From cfg.model's flat keys (a key a saved config lacks: its default)."""
    return cls(activation=model_cfg.get('mlp_activation', cls.activation),
               limit=model_cfg.get('mlp_swiglu_limit', cls.limit), alpha=model_cfg.get('mlp_swiglu_alpha', cls.alpha))


def clamped_swiglu(g, u, limit: float, alpha: float):
  """gpt-oss's expert gate: the clamps bound what one token can put through an expert (its activations stay
  finite in low precision). The `+ 1` on u is part of the released weights' function, not a bias jaxlm adds."""
  g = jnp.minimum(g, jnp.asarray(limit, g.dtype))
  u = jnp.clip(u, -limit, limit)
  return g * jax.nn.sigmoid(g * jnp.asarray(alpha, g.dtype)) * (u + 1)


def activation(c: MlpConfig, swiglu):
  """The MLP's gate (g, u) -> h (N, F) for model.mlp_activation; `swiglu`: model.swiglu (its lean backward)."""
  if c.activation == 'geglu':
    return lambda g, u: jax.nn.gelu(g, approximate=True) * u
  if c.activation == 'clamped':
    return functools.partial(clamped_swiglu, limit=c.limit, alpha=c.alpha)
  return swiglu


def biases(module, m, dtype) -> dict | None:
  """model.attention_bias: the query, key, value (per head) and output biases of `module`'s attention, zeros at
  init (gpt-oss); None when off. Added after each projection, in the compute dtype."""
  if not m.attention.bias:
    return None
  H, K, E, D = m.num_heads, m.num_kv_heads, m.head_dim, m.d_model
  shapes = {'query': ((H, E), ('heads', 'kv')), 'key': ((K, E), ('kv_heads', 'kv')),
            'value': ((K, E), ('kv_heads', 'kv')), 'out': ((D,), ('embed',))}
  return {name: module.param(f'{name}_bias', nn.with_logical_partitioning(nn.initializers.zeros, names), shape,
                             dtype) for name, (shape, names) in shapes.items()}


def is_local(m, layer: int) -> bool:
  """Whether layer `layer` (from 0) attends through a sliding window (model.attention_window, _global_every)."""
  a = m.attention
  return a.window > 0 and not (a.global_every and (layer + 1) % a.global_every == 0)


def scores_config(m, local, sinks=None) -> attention_lib.Scores:
  """attention.Scores of a layer: its window (traced when `local` is), soft-cap, sinks and query scale."""
  a = m.attention
  window = (jnp.where(local, a.window, 0) if isinstance(local, jax.Array) else a.window * bool(local)) if a.window else 0
  return attention_lib.Scores(window=window, softcap=a.softcap, sinks=sinks,
                              scale=a.query_scalar ** -0.5 if a.query_scalar else 0.0, width=a.window)


def block_errors(model_cfg, stages: int = 1) -> list[str]:
  """config.validate's checks of the block features (cfg.model's flat keys): the attention paths that cannot
  honour a window, soft-cap or sinks are refused here, by the field that asks for them."""
  g = lambda key, default=0: model_cfg.get(key, default)  # noqa: E731  a saved config may predate a key
  e = [f'model.{key}={g(key)} must be >= 0 (0 = off).' for key in (
      'attention_window', 'attention_global_every', 'rope_local_theta', 'attention_softcap', 'final_softcap',
      'query_pre_attn_scalar') if g(key) < 0]
  if g('norm_placement', 'pre') not in NORM_PLACEMENTS:
    e.append(f'model.norm_placement={g("norm_placement")!r} is unknown; use one of {", ".join(NORM_PLACEMENTS)}.')
  elif g('norm_placement', 'pre') != 'pre' and g('parallel_block', True):
    e.append(f'model.norm_placement={g("norm_placement")} needs the sequential block; set model.parallel_block=False.')
  if g('mlp_activation', 'swiglu') not in MLP_ACTIVATIONS:
    e.append(f'model.mlp_activation={g("mlp_activation")!r} is unknown; use one of {", ".join(MLP_ACTIVATIONS)}.')
  elif g('mlp_activation', 'swiglu') == 'geglu' and g('moe_experts'):
    e.append('model.mlp_activation=geglu: the experts of a mixture of experts are SwiGLU; set model.moe_experts=0.')
  clamp = (g('mlp_swiglu_limit', 7.0), g('mlp_swiglu_alpha', 1.702))
  if g('mlp_activation', 'swiglu') == 'clamped' and not (clamp[0] > 0 and clamp[1] > 0):
    e.append(f'model.mlp_swiglu_limit={g("mlp_swiglu_limit", 7.0)} and model.mlp_swiglu_alpha='
             f'{g("mlp_swiglu_alpha", 1.702)} must be positive under mlp_activation=clamped (gpt-oss: 7 and 1.702).')
  # cuDNN takes a window but no soft-cap or sinks; splash a window and a soft-cap but no sinks (attention.Scores).
  kernel = g('attention', 'xla')
  missing = [f'model.{k}' for k, takes in (('attention_softcap', kernel == 'splash'), ('attention_sinks', False))
             if g(k) > 0 and not takes]
  if missing and kernel in ('cudnn', 'splash'):
    e.append(f'{", ".join(missing)}: model.attention={kernel} cannot compute {"them" if len(missing) > 1 else "it"}; '
             f'set model.attention=xla (or auto, which then runs xla).')
  if g('attention_window') > 0 and stages > 1 and 0 < g('attention_global_every') <= g('num_layers', 1):
    e.append(f'model.attention_global_every={g("attention_global_every")} with mesh.stage={stages}: a pipeline runs '
             f'one layer body, all local or all global; set attention_global_every=0 or mesh.stage=1.')
  return e


def ring_cached_attention(module, q, k, v, segment_ids, window: int, scores):
  """A local layer's decoding step: q (B, T, H, E) over its last `window` keys, kept in a ring buffer.

  The cache holds R = min(S, W) slots (S: the length of the call that creates it), so a local layer's cache does
  not grow with the sequence. Slot s of the sequence lives at ring position s mod R; `slots` (R,) records which
  sequence slot each position holds (unwritten ones are segment 0, never attended). The queries attend over the
  ring as it was plus this call's own T keys, by sequence slot (causal, windowed), then the last min(T, R) of
  those keys overwrite the oldest positions. `module`: the Attention whose `cache` collection this is.
  """
  B, T, K, E = k.shape
  R = min(T, window)  # the creating call's T is the sequence length S
  key = module.variable('cache', 'key', jnp.zeros, (B, R, K, E), k.dtype)
  value = module.variable('cache', 'value', jnp.zeros, (B, R, K, E), v.dtype)
  segments = module.variable('cache', 'segment_ids', jnp.zeros, (B, R), jnp.int32)
  slots = module.variable('cache', 'slots', jnp.zeros, (R,), jnp.int32)
  index = module.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
  i, R = index.value, key.value.shape[1]
  new_slots = i + jnp.arange(T)
  out = attention_lib.attention(
      q, jnp.concatenate([key.value, k.astype(key.value.dtype)], 1),
      jnp.concatenate([value.value, v.astype(value.value.dtype)], 1), segment_ids,
      kv_segment_ids=jnp.concatenate([segments.value, segment_ids.astype(jnp.int32)], 1), order=new_slots,
      kv_order=jnp.concatenate([slots.value, new_slots]), scores_cfg=scores)
  keep = min(T, R)  # static: only the last R of a long prefill can still be seen
  at = new_slots[T - keep:] % R  # distinct ring positions
  key.value = key.value.at[:, at].set(k[:, T - keep:].astype(key.value.dtype))
  value.value = value.value.at[:, at].set(v[:, T - keep:].astype(value.value.dtype))
  segments.value = segments.value.at[:, at].set(segment_ids[:, T - keep:].astype(jnp.int32))
  slots.value = slots.value.at[at].set(new_slots[T - keep:])
  index.value = i + T
  return out


def tokens(x):
  """(B, T, ...) -> (N, ...) with N = B·T, a free reshape: every weight matmul then has one token axis.

  Why: a weight gradient contracts over the tokens; with two token axes (B, T) XLA:CPU canonicalises the dot
  by physically transposing the (B, T, F) activation gradient first (one copy per matmul, per step). With one
  axis the dot takes its operands as they lie. GPUs and TPUs are indifferent; the math is the same.

  Under context parallelism (T split over devices) x stays (B, T, ...): merging a split B with a split T is not
  a sharding XLA can keep once a device holds more than one row, so the reshape would all-gather every
  projection's activations along the whole sequence, which is what context parallelism exists to avoid.
  """
  if attention_lib.context_ways() > 1:
    return x
  return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
