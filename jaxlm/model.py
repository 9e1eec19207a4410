"""A PaLM-style decoder in Flax Linen: parallel attention + SwiGLU block, multi-query attention, RoPE, no biases.

Shape letters used in every einsum and comment:
  B batch, T query sequence, S key sequence, N = B·T tokens, D model width, H query heads, K key/value heads,
  G = H // K query heads per key/value head, E head dim, F MLP hidden, V vocabulary, L layers.

The model knows only logical axis names (`embed`, `heads`, `act_batch`, ...); `sharding.py` maps them to the
device mesh. Parameters are stored in `param_dtype` (float32 master weights) and cast to `dtype` for compute.
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops
from jax.ad_checkpoint import checkpoint_name

from jaxlm import attention as attention_lib
from jaxlm import lora as lora_lib
from jaxlm import mla as mla_lib
from jaxlm import moe as moe_lib
from jaxlm import mtp as mtp_lib
from jaxlm import pipeline as pipeline_lib
from jaxlm.blocks import (MLP_ACTIVATIONS, NORM_PLACEMENTS, AttentionConfig, MlpConfig,  # noqa: F401
                          NormsConfig, activation, biases, block_errors, is_local, ring_cached_attention,
                          scores_config, tokens)
from jaxlm.rope import ROPE_SCALINGS, layer_frequencies, rope, rope_frequencies  # noqa: F401  (callers' names)


DTYPES = ('bfloat16', 'float32', 'float16')  # model.dtype and model.param_dtype
MATMUL_DTYPES = ('dtype', 'fp8')  # model.matmul_dtype: the projections in model.dtype, or in fp8 (`project`)
# Flax's collection for fp8 scales and amax histories: their "gradient" is their next value (step.py).
FP8 = fp8_ops.OVERWRITE_WITH_GRADIENT
QK_NORMS = ('none', 'head', 'full')  # model.qk_norm (QKNorm)


def head_dim(model_cfg) -> int:
  """E: the configured head size, or D // H."""
  return model_cfg.head_dim or model_cfg.d_model // model_cfg.num_heads


def mlp_dim(model_cfg) -> int:
  """F: the configured SwiGLU width, or 4 * D as in PaLM."""
  return model_cfg.mlp_dim or 4 * model_cfg.d_model


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """The model section of the config, resolved and frozen (hashable, so Flax can close over it)."""
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  parallel_block: bool = True
  tie_embeddings: bool = True
  rope_theta: float = 10_000.0
  rope_scaling: str = 'none'  # see rope_frequencies
  rope_factor: float = 1.0
  rope_original_max_positions: int = 0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_beta_fast: float = 32.0
  rope_beta_slow: float = 1.0
  rope_attention_factor: float = 0.0
  rope_truncate: bool = True
  rope_mscale_all_dim: float = 0.0  # see rope.softmax_mscale
  z_loss: float = 1e-4
  dropout_rate: float = 0.0
  dtype: str = 'bfloat16'
  param_dtype: str = 'float32'
  remat: str = 'full'
  scan_layers: bool = True
  explicit_transpose_grads: bool = False
  matmul_dtype: str = 'dtype'
  embed_scale: bool = False  # model.embed_scale: the looked-up embeddings times sqrt(D) (Gemma)
  final_softcap: float = 0.0  # model.final_softcap: logits -> cap·tanh(logits / cap) (Gemma 2); 0 = off
  mtp_depth: int = 0  # model.mtp_depth: multi-token prediction modules in training (jaxlm/mtp.py); 0 = off
  mtp_weight: float = 0.3  # model.mtp_weight: λ on the mean of their losses
  # Each feature's keys in its own small frozen config; cfg.model keeps them flat (`from_config` maps them).
  attention: AttentionConfig = AttentionConfig()  # model.attention, attention_block_q, qk_norm
  norms: NormsConfig = NormsConfig()  # model.norm_eps, norm_placement, norm_offset
  mlp: MlpConfig = MlpConfig()  # model.mlp_activation, mlp_swiglu_limit, mlp_swiglu_alpha
  moe: moe_lib.MoeConfig = moe_lib.MoeConfig()  # model.moe_*: read only when moe.experts > 0 (jaxlm/moe.py)
  lora: lora_lib.LoraConfig = lora_lib.LoraConfig()  # model.lora: read where a projection is made (`project`)
  mla: mla_lib.MlaConfig = mla_lib.MlaConfig()  # model.kv_lora_rank > 0: multi-head latent attention (jaxlm/mla.py)

  @classmethod
  def from_config(cls, model_cfg) -> 'ModelConfig':
    """Builds the frozen config from `cfg.model`, filling the derived sizes (head_dim, mlp_dim, moe.mlp_dim)."""
    # .get: a config saved before a key existed (an old checkpoint's) means that key's default.
    nested = {'attention', 'norms', 'mlp', 'moe', 'lora', 'mla'}
    fields = {f.name: model_cfg.get(f.name, f.default) for f in dataclasses.fields(cls) if f.name not in nested}
    fields.update(head_dim=head_dim(model_cfg), mlp_dim=mlp_dim(model_cfg))
    moe = moe_lib.MoeConfig.from_config(model_cfg)
    fields.update(attention=AttentionConfig.from_config(model_cfg), norms=NormsConfig.from_config(model_cfg),
                  mlp=MlpConfig.from_config(model_cfg),
                  moe=dataclasses.replace(moe, mlp_dim=moe.mlp_dim or fields['mlp_dim']),
                  lora=lora_lib.LoraConfig.from_config(model_cfg.get('lora')),
                  mla=mla_lib.MlaConfig.from_config(model_cfg))
    return cls(**fields)


def is_moe(m: ModelConfig, layer: int) -> bool:
  """Whether layer `layer` (from 0) is a mixture of experts: after the moe_first_dense dense layers (DeepSeek's
  first_k_dense_replace), every moe_every-th layer, the last of each group."""
  first = layer - m.moe.first_dense
  return m.moe.experts > 0 and first >= 0 and (first + 1) % m.moe.every == 0


def dense_prefix(m: ModelConfig) -> int:
  """Layers before the first group of a mixture of experts that are plain dense layers (model.moe_first_dense)."""
  return m.moe.first_dense if m.moe.experts else 0


def qk_norm_params(m: ModelConfig) -> int:
  """QK-norm's scales per layer: one E vector each for q and k per head, or one per feature of all heads."""
  return {'none': 0, 'head': 2 * m.head_dim, 'full': (m.num_heads + m.num_kv_heads) * m.head_dim}[m.attention.qk_norm]


def param_count(m: ModelConfig, active: bool = False) -> int:
  """Parameters of the model, from its shape alone (tests check it against the real pytree).

  active: only those one token's forward pass multiplies by: the router, the shared experts and k of the X
  routed experts (what MFU counts for a mixture of experts).
  """
  D, H, K, E, F, V, L = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim, m.vocab_size, m.num_layers
  attention = D * H * E + 2 * D * K * E + H * E * D + qk_norm_params(m)  # q, k, v, out, q/k norms
  attention = mla_lib.attention_params(m) if m.mla.kv_lora_rank else attention
  mlp = 3 * D * F  # gate, up, down
  routed = m.moe.top_k if active else m.moe.experts
  moe = (D + 1) * m.moe.experts + 3 * D * m.moe.mlp_dim * (routed + m.moe.shared_experts)  # router + bias, experts
  moe += moe_lib.bias_params(m.moe, D, routed)  # gpt-oss: the experts' and the router's biases
  moe_layers = sum(is_moe(m, i) for i in range(L))
  # one shared LayerNorm vs two RMSNorms per layer (pre or post), four when they sandwich the sublayers
  norms = D if m.parallel_block else (4 if m.norms.placement == 'sandwich' else 2) * D
  attention += H if m.attention.sinks else 0
  attention += (H + 2 * K) * E + D if m.attention.bias else 0  # gpt-oss: q, k, v, out biases
  embeddings = V * D * (1 if m.tie_embeddings else 2)
  base = L * (attention + norms) + (L - moe_layers) * mlp + moe_layers * moe + D + embeddings  # + final norm
  # Multi-token prediction (jaxlm/mtp.py), per depth: three norms, the (2D, D) projection and a layer of the
  # last layer's kind (DeepSeek-V3's: a mixture of experts).
  base += m.mtp_depth * (3 * D + 2 * D * D + attention + norms + (moe if is_moe(m, L - 1) else mlp))
  return base + lora_param_count(m)


def lora_param_count(m: ModelConfig) -> int:
  """LoRA's adapter parameters: r·(I + O) per adapted projection; a mixture of experts' MLPs get none."""
  if not m.lora.rank:
    return 0
  D, H, K, E, F = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim
  sizes = {'query': D + H * E, 'key': D + K * E, 'value': D + K * E, 'out': H * E + D, 'gate': D + F, 'up': D + F,
           'down': F + D}
  dense = sum(not is_moe(m, i) for i in range(m.num_layers))
  return m.lora.rank * sum(sizes[t] * (dense if t in ('gate', 'up', 'down') else m.num_layers)
                           for t in m.lora.targets)


def flops_per_token(m: ModelConfig, seq_len: int, causal: bool = False) -> float:
  """Training FLOPs per token by PaLM's appendix B: 6N + 12·L·H·Q·T (Q = head dim, T = sequence length).

  N counts every parameter that takes part in a matmul: with untied embeddings the input table is a lookup and
  is left out, and of a mixture of experts only the active parameters (`param_count(active=True)`) count (PaLM's models were tied, where N is simply all parameters). PaLM counts attention over the
  whole T×T square; `causal=True` halves that term, as only the lower triangle does useful work.
  """
  n = param_count(m, active=True) - (0 if m.tie_embeddings else m.vocab_size * m.d_model)
  c = m.mla  # MLA: queries and keys En + Er wide, values Ev (jaxlm/mla.py); else E each
  widths = c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim if c.kv_lora_rank else 2 * m.head_dim
  attention = 6 * (m.num_layers + m.mtp_depth) * m.num_heads * widths * seq_len  # + MTP depths (training)
  return 6 * n + (attention / 2 if causal else attention)


def storage_dtype(m: ModelConfig):
  """How the model's own (non-adapter) parameters are stored: param_dtype, or under LoRA model.lora.base_dtype."""
  return jnp.dtype(m.lora.base_dtype if m.lora.rank else m.param_dtype)


def _param(module, name, names, shape, std, m: ModelConfig):
  """A parameter with logical axis names, normal(std) init, stored in param_dtype (`storage_dtype`)."""
  init = nn.with_logical_partitioning(nn.initializers.normal(std), names)
  return module.param(name, init, shape, storage_dtype(m))


class Norm(nn.Module):
  """LayerNorm without bias (PaLM) or RMSNorm (Llama); statistics in float32 whatever the compute dtype."""
  config: ModelConfig
  rms: bool

  @nn.compact
  def __call__(self, x):  # (B, T, D)
    scale = self.param('scale', nn.with_logical_partitioning(_scale_init(self.config), ('embed',)),
                       (self.config.d_model,), storage_dtype(self.config))
    x32 = x.astype(jnp.float32)
    if not self.rms:
      x32 = x32 - x32.mean(-1, keepdims=True)
    x32 = x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + self.config.norms.eps)
    return (x32 * _scale(scale, self.config)).astype(self.config.dtype)


def _scale_init(m: ModelConfig):
  """A norm scale's init: ones, or zeros under model.norm_offset, whose scale is 1 + w (so 1 either way)."""
  return nn.initializers.zeros if m.norms.offset else nn.initializers.ones


def _scale(w, m: ModelConfig):
  """A norm's multiplier in float32: w, or 1 + w under model.norm_offset (Gemma, which adds in float32)."""
  w = w.astype(jnp.float32)
  return 1.0 + w if m.norms.offset else w


class QKNorm(nn.Module):
  """QK-norm: RMSNorm of queries or keys (B, T, N, E) before RoPE, which keeps attention logits from growing.

  head  over each head's E features, one (E,) scale shared by the heads (Qwen3: `q_norm` of size head_dim).
  full  over all N·E features of a token, an (N, E) scale (OLMoE, OLMo 2: `q_norm` of size num_heads·head_dim).
  """
  config: ModelConfig
  heads: str  # the logical name of the head axis: `heads` for queries, `kv_heads` for keys

  @nn.compact
  def __call__(self, x):  # (B, T, N, E)
    m = self.config
    whole = m.attention.qk_norm == 'full'
    shape, names = ((x.shape[2], x.shape[3]), (self.heads, 'kv')) if whole else ((x.shape[3],), ('kv',))
    scale = self.param('scale', nn.with_logical_partitioning(_scale_init(m), names), shape, storage_dtype(m))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt((x32 * x32).mean((-2, -1) if whole else -1, keepdims=True) + m.norms.eps)
    return (x32 * _scale(scale, m)).astype(x.dtype)


@jax.custom_vjp
def swiglu(g, u):
  """silu(g) * u, element-wise, with a backward pass that keeps only g and u.

  Autodiff of the plain formula keeps sigmoid(g) and silu(g) as well, each its own pass over (N, F) in the
  forward; this forward is one pass, and the backward recomputes the sigmoid (as torch.compile does). Same
  values; two fewer (N, F) residuals per layer (its effect on the step: bench/RESULTS.md, "Reaching 1.0×").
  """
  return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
  return swiglu(g, u), (g, u)


def _swiglu_bwd(residuals, dh):
  # The barrier hides from XLA that this sigmoid is the forward's: otherwise common-subexpression elimination
  # merges the two, and the forward must then write sigmoid(g) and silu(g) out for the backward after all.
  g, u = jax.lax.optimization_barrier(residuals)
  s = jax.nn.sigmoid(g)
  silu = g * s
  return dh * u * (s + silu * (1 - s)), dh * silu  # d silu/dg = s + g·s·(1 - s)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


@jax.custom_vjp
def _dense_nn(x, w):
  return jnp.dot(x, w)


def _dense_nn_fwd(x, w):
  return jnp.dot(x, w), (x, w)


def _dense_nn_bwd(residuals, dy):
  x, w = residuals
  barrier = jax.lax.optimization_barrier  # keeps XLA from folding a transpose back into the product
  if x.shape[1] <= dy.shape[1]:  # copy the smaller of x (N, I) and dy (N, O) transposed
    dw = jnp.dot(barrier(x.T), dy)  # (I, N)·(N, O)
  else:
    dw = barrier(jnp.dot(barrier(dy.T), x)).T  # ((O, N)·(N, I))ᵀ: the (O, I) result is smaller than x
  return jnp.dot(dy, w.T), dw


_dense_nn.defvjp(_dense_nn_fwd, _dense_nn_bwd)


def dense(x, w, plain_weight_grad: bool):
  """x (N, I) · w (I, O) -> (N, O); with `plain_weight_grad` the weight gradient runs as a plain (NN) product.

  model.explicit_transpose_grads turns this on.

  The weight gradient xᵀ·dy contracts both operands over their leading token axis. XLA:CPU hands such a
  transposed-operand product to a slower Eigen path (bench/cpu_matmul.py), so on a CPU it pays to copy the
  smaller of x and dy transposed and multiply plainly (bench/RESULTS.md, "Reaching 1.0×").
  GPUs and TPUs take transposed operands at full speed: there the copy would only cost memory traffic.
  A (B, T, I) x (context parallelism keeps its tokens unmerged: blocks.tokens) takes the plain product.
  """
  return _dense_nn(x, w) if plain_weight_grad and x.ndim == 2 else jnp.dot(x, w)


def project(x, w, name: str, m: ModelConfig, lora=None):
  """A layer's projection x (N, I) · w (I, O) -> (N, O): `dense`, or with model.matmul_dtype=fp8 Flax's fp8 dot;
  plus LoRA's branch (alpha/r)·(x·A)·B when `lora` holds the projection's adapters (A, B) (lora.adapter).

  fp8 is delayed scaling as in Transformer Engine: x and w quantised to e4m3, the output gradient to e5m2, each
  with a scale from the amax of the last 1024 steps (Flax's default history). The scales and histories are
  variables of a child module `<name>_fp8` in the FP8 collection; call this inside a compact module. The LoRA
  branch runs in the compute dtype (not fp8): its matmuls are r wide.
  """
  if m.matmul_dtype == 'fp8':
    y = fp8_ops.Fp8DirectDotGeneralOp(name=f'{name}_fp8')(x, w, (((x.ndim - 1,), (0,)), ((), ())))
  else:
    y = dense(x, w, m.explicit_transpose_grads)
  if lora is not None:
    a, b = lora
    low = dense(x, a.astype(x.dtype), m.explicit_transpose_grads)  # (N, r)
    y = y + dense(low, b.astype(x.dtype), m.explicit_transpose_grads) * jnp.asarray(m.lora.scale, x.dtype)
  return y


def inference_config(m: ModelConfig) -> ModelConfig:
  """The model as evaluated, sampled and exported: fp8 matmuls back in model.dtype, the same parameters."""
  return dataclasses.replace(m, matmul_dtype='dtype')


class Attention(nn.Module):
  """Multi-query / grouped-query self-attention with rotary positions, biases only with model.attention_bias;
  `local`: a sliding-window layer (model.attention_window), a bool or, for scanned layers, a traced one.
  `static_local`: known to be local when the model is built (unrolled layers, all of them local, or a mixed
  scanned stack decoded layer by layer: Decoder.decode_one_by_one): its decoding cache is then a ring buffer."""
  config: ModelConfig
  static_local: bool | None = None

  @nn.compact
  def __call__(self, x, segment_ids, positions, local=False):  # x: (B, T, D)
    m = self.config
    D, H, K, E = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
    wq = _param(self, 'query', ('embed', 'heads', 'kv'), (D, H, E), D ** -0.5, m)
    wk = _param(self, 'key', ('embed', 'kv_heads', 'kv'), (D, K, E), D ** -0.5, m)
    wv = _param(self, 'value', ('embed', 'kv_heads', 'kv'), (D, K, E), D ** -0.5, m)
    wo = _param(self, 'out', ('heads', 'kv', 'embed'), (H, E, D), (H * E) ** -0.5, m)
    embed, heads, kv_heads, kv = (D, 'embed'), (H, 'heads'), (K, 'kv_heads'), (E, 'kv')
    adapter = functools.partial(lora_lib.adapter, self, lo=m.lora, dtype=m.param_dtype)
    lora = {name: adapter(name, inputs, outputs) for name, inputs, outputs in (
        ('query', (embed,), (heads, kv)), ('key', (embed,), (kv_heads, kv)), ('value', (embed,), (kv_heads, kv)),
        ('out', (heads, kv), (embed,)))}
    dt = jnp.dtype(m.dtype)
    B, T, _ = x.shape
    x = tokens(x)  # (N, D)
    # Heads folded into the weights' columns, (D, H·E): a plain matrix product, for the reason in `tokens`.
    q = project(x, wq.astype(dt).reshape(D, H * E), 'query', m, lora['query']).reshape(B, T, H, E)
    k = project(x, wk.astype(dt).reshape(D, K * E), 'key', m, lora['key']).reshape(B, T, K, E)
    v = project(x, wv.astype(dt).reshape(D, K * E), 'value', m, lora['value']).reshape(B, T, K, E)
    bias = biases(self, m, storage_dtype(m))  # gpt-oss: q, k, v and output biases (model.attention_bias)
    if bias is not None:
      q, k, v = (y + bias[n].astype(dt) for y, n in ((q, 'query'), (k, 'key'), (v, 'value')))
    q = nn.with_logical_constraint(q, ('act_batch', 'act_seq', 'act_heads', 'act_kv'))
    if m.attention.qk_norm != 'none':
      q, k = QKNorm(m, 'heads', name='query_norm')(q), QKNorm(m, 'kv_heads', name='key_norm')(k)
    # Plain RoPE keeps its float32 formula; a scaled one (or a local layer's own base) its precomputed frequencies.
    frequencies = layer_frequencies(m, local)
    q, k = rope(q, positions, m.rope_theta, frequencies), rope(k, positions, m.rope_theta, frequencies)
    sinks = None
    if m.attention.sinks:  # zeros: at init each sink weighs like one key whose score is 0
      sinks = self.param('sinks', nn.with_logical_partitioning(nn.initializers.zeros, ('heads',)), (H,),
                         storage_dtype(m))
    scores = scores_config(m, local, sinks)
    if self.is_mutable_collection('cache') and self.static_local and m.attention.window:  # W slots, not S
      out = ring_cached_attention(self, q, k, v, segment_ids, m.attention.window, scores)
    elif self.is_mutable_collection('cache'):  # decoding (jaxlm/generate.py): attend over the KV cache
      out = self.cached_attention(q, k, v, segment_ids, scores)
    else:
      out = attention_lib.attention(q, k, v, segment_ids, m.attention.kernel, m.attention.block_q,
                                    scores_cfg=scores)  # (B, T, H, E)
    out = nn.with_logical_constraint(out, ('act_batch', 'act_seq', 'act_heads', 'act_kv'))
    # Named so the `attn_out` remat policy can keep it instead of recomputing the whole attention.
    out = checkpoint_name(out, 'attn_out')
    out = project(tokens(out.reshape(B, T, H * E)), wo.astype(dt).reshape(H * E, D), 'out', m, lora['out'])
    return (out if bias is None else out + bias['out'].astype(dt)).reshape(B, T, D)

  def cached_attention(self, q, k, v, segment_ids, scores=attention_lib.PLAIN):
    """q (B, T, H, E) over this layer's KV cache after writing k, v (B, T, K, E) at its next T slots.

    The cache holds only the K key/value heads (one under multi-query attention), sized (B, S, K, E) by the call
    that creates it (its T becomes S), as Flax's decode caches are. `index` is the next slot to write, the same
    for every row (generate.py left-pads ragged prompts); `segment_ids` (B, S) marks written, non-padding slots.
    """
    B, T, K, E = k.shape
    key = self.variable('cache', 'key', jnp.zeros, (B, T, K, E), k.dtype)
    value = self.variable('cache', 'value', jnp.zeros, (B, T, K, E), v.dtype)
    segments = self.variable('cache', 'segment_ids', jnp.zeros, (B, T), jnp.int32)
    index = self.variable('cache', 'index', lambda: jnp.zeros((), jnp.int32))
    i = index.value
    key.value = jax.lax.dynamic_update_slice(key.value, k.astype(key.value.dtype), (0, i, 0, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v.astype(value.value.dtype), (0, i, 0, 0))
    segments.value = jax.lax.dynamic_update_slice(segments.value, segment_ids.astype(jnp.int32), (0, i))
    index.value = i + T
    S = key.value.shape[1]
    return attention_lib.attention(q, key.value, value.value, segment_ids, kv_segment_ids=segments.value,
                                   order=i + jnp.arange(T), kv_order=jnp.arange(S), scores_cfg=scores)


class SwiGLU(nn.Module):
  """MLP: down(silu(gate(x)) * up(x)) (Shazeer 2020, used by PaLM), no biases; with model.mlp_activation=geglu
  down(gelu(gate(x)) * up(x)), gelu tanh-approximated as Gemma's (transformers' gelu_pytorch_tanh); clamped:
  gpt-oss's gate (blocks.clamped_swiglu)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x):  # (B, T, D)
    m = self.config
    D, F = m.d_model, m.mlp_dim
    dt = jnp.dtype(m.dtype)
    w_gate = _param(self, 'gate', ('embed', 'mlp'), (D, F), D ** -0.5, m)
    w_up = _param(self, 'up', ('embed', 'mlp'), (D, F), D ** -0.5, m)
    w_down = _param(self, 'down', ('mlp', 'embed'), (F, D), F ** -0.5, m)
    adapter = functools.partial(lora_lib.adapter, self, lo=m.lora, dtype=m.param_dtype)
    lora = {name: adapter(name, inputs, outputs) for name, inputs, outputs in (
        ('gate', ((D, 'embed'),), ((F, 'mlp'),)), ('up', ((D, 'embed'),), ((F, 'mlp'),)),
        ('down', ((F, 'mlp'),), ((D, 'embed'),)))}
    B, T, _ = x.shape
    x = tokens(x)  # (N, D)
    gate = activation(m.mlp, swiglu)
    h = gate(project(x, w_gate.astype(dt), 'gate', m, lora['gate']),
             project(x, w_up.astype(dt), 'up', m, lora['up']))  # (N, F)
    h = nn.with_logical_constraint(h.reshape(B, T, F), ('act_batch', 'act_seq', 'act_mlp'))
    return project(tokens(h), w_down.astype(dt), 'down', m, lora['down']).reshape(B, T, D)


def moe_mlp(m: ModelConfig, **kwargs) -> moe_lib.MoE:
  """The mixture-of-experts MLP of model `m` (moe.MoE), given what it takes from the model: the widths and dtypes,
  the gate (model.mlp_activation: SwiGLU, or gpt-oss's clamped one), and the dense MLP of its shared experts."""
  moe = dataclasses.replace(m.moe, mlp_dim=m.moe.mlp_dim or mlp_dim(m))
  shared = None
  if moe.shared_experts:  # one dense SwiGLU as wide as all of them, on every token
    # No LoRA adapters inside a mixture of experts (model.lora): its MLPs stay frozen.
    shared = functools.partial(SwiGLU, dataclasses.replace(m, mlp_dim=moe.shared_experts * moe.mlp_dim,
                                                           lora=lora_lib.LoraConfig()))
  return moe_lib.MoE(moe, d_model=m.d_model, dtype=m.dtype, param_dtype=storage_dtype(m),
                     activation=activation(m.mlp, swiglu), shared=shared, **kwargs)


# The residual stream between layers, (B, T, D): its sequence split over context and tensor (sharding.RULES);
# GATHERED: the same activation whole along the sequence but for context, as the layer's matmuls take it.
RESIDUAL = ('act_batch', 'act_res_seq', 'act_embed')
GATHERED = ('act_batch', 'act_seq', 'act_embed')


def gathered(h):
  """A norm's output (B, T, D) made whole along the sequence (but for context) for the input matmuls."""
  return nn.with_logical_constraint(h, GATHERED)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_cotangent(y, spec):
  return y


def _gather_cotangent_fwd(y, spec):
  return y, None


def _gather_cotangent_bwd(spec, _, dy):
  return (jax.lax.with_sharding_constraint(dy, spec),)


_gather_cotangent.defvjp(_gather_cotangent_fwd, _gather_cotangent_bwd)


def to_residual(y):
  """An output projection's (B, T, D) on its way into the residual stream: itself, with its gradient gathered.

  Forward, the partial sums over tensor go straight to the residual's sequence split (Megatron's reduce-scatter;
  XLA may all-reduce and keep its slice instead, where the flattened (N, D) product hides the sequence axis).
  Backward, the residual's gradient arrives sequence-split; left alone, XLA:SPMD feeds it to the output
  projections' weight gradients by replicating it whole (an "involuntary full rematerialization" of the global
  (N, D)), so it is made whole along the sequence here first, one all-gather: Megatron's backward of its
  reduce-scatter. The spec is resolved now, under the rules the forward runs with (a pipeline stage's).
  """
  rules = nn.get_logical_axis_rules()
  if not rules or jax.sharding.get_abstract_mesh().empty:
    return y
  return nn.with_logical_constraint(_gather_cotangent(y, nn.logical_to_mesh_axes(GATHERED, rules)), RESIDUAL)


class Block(nn.Module):
  """One decoder layer: PaLM's parallel block, or the sequential pre-norm block when parallel_block=False."""
  config: ModelConfig
  deterministic: bool = True
  moe: bool = False  # the MLP is a mixture of experts (jaxlm/moe.py)
  local: bool | None = None  # a local layer, known when the model is built (Attention.static_local)

  @nn.compact
  def __call__(self, x, segment_ids, positions, local=False):  # x: (B, T, D); local: see Attention
    m = self.config
    local = local if self.local is None else self.local
    drop = nn.Dropout(m.dropout_rate, deterministic=self.deterministic)
    if self.moe:  # routed per token; padding (segment id 0) goes to no expert
      mlp = lambda h: moe_mlp(m, name='moe')(h, segment_ids)  # noqa: E731
    else:
      mlp = SwiGLU(m, name='mlp')
    # x arrives sequence-split over tensor (RESIDUAL, Megatron's sequence parallelism): the norms and residual
    # adds run on T/tensor tokens per device; `gathered` makes each norm's output whole along the sequence for
    # the input matmuls (one all-gather), and `to_residual` returns the output projections' partial sums to
    # the split.
    if m.parallel_block:
      # PaLM: y = x + Attn(LN(x)) + MLP(LN(x)); the two input matmuls can fuse (PaLM reports it faster at scale).
      h = gathered(Norm(m, rms=False, name='norm')(x))
      attn, out = self.attention()(h, segment_ids, positions, local), mlp(h)
      x = x + drop(to_residual(attn)) + drop(to_residual(out))
    else:
      attention = lambda h: self.attention()(h, segment_ids, positions, local)  # noqa: E731
      x = x + drop(self.sublayer('attn', attention, x))
      x = nn.with_logical_constraint(x, RESIDUAL)
      x = x + drop(self.sublayer('mlp', mlp, x))
    x = nn.with_logical_constraint(x, RESIDUAL)
    return x, None  # (carry, output) as nn.scan wants

  def attention(self):
    """The layer's attention module: model.Attention, or multi-head latent attention (model.kv_lora_rank > 0)."""
    if self.config.mla.kv_lora_rank:
      return mla_lib.MLA(self.config, project, name='attention')
    return Attention(self.config, self.local, name='attention')

  def sublayer(self, name: str, fn, x):
    """The sequential block's sublayer `fn` on the residual x, normed as model.norm_placement says (NormsConfig):
    its input by `<name>_norm` (pre, sandwich), its output by `<name>_post_norm` (sandwich, post)."""
    m = self.config
    placement = m.norms.placement
    h = x if placement == 'post' else Norm(m, rms=True, name=f'{name}_norm')(x)
    y = to_residual(fn(gathered(h)))
    return y if placement == 'pre' else Norm(m, rms=True, name=f'{name}_post_norm')(y)


class Group(nn.Module):
  """moe_every consecutive layers, the last a mixture of experts: the unit scanned when dense and MoE alternate."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, segment_ids, positions, local):  # local: (moe_every,) bools, one per block
    m = self.config
    static = not isinstance(local, jax.Array)  # numpy (layers decoded one by one): each block knows its kind
    for j in range(m.moe.every):
      x, _ = Block(m, self.deterministic, moe=j == m.moe.every - 1, local=bool(local[j]) if static else None,
                   name=f'block_{j}')(x, segment_ids, positions, local[j])
    return x, None


REMAT_POLICIES = {
    'full': jax.checkpoint_policies.nothing_saveable,  # recompute the whole layer in the backward pass
    'dots': jax.checkpoint_policies.checkpoint_dots,  # keep every matmul output
    'dots_no_batch': jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,  # keep weight matmuls only
    'attn_out': jax.checkpoint_policies.save_only_these_names('attn_out'),  # keep attention outputs only
}
REMAT_CHOICES = ('none', *REMAT_POLICIES)  # model.remat: 'none' keeps every activation


class Decoder(nn.Module):
  """The language model: embeddings, L blocks (scanned or unrolled), final norm, (tied) output projection.

  With a `pipeline` layout the blocks run as a pipeline over the mesh's stages (jaxlm/pipeline.py); the
  parameters are the same tree either way (the scanned `layers` stack), so checkpoints do not depend on it.
  """
  config: ModelConfig
  pipeline: pipeline_lib.Layout | None = None

  @nn.compact
  def __call__(self, inputs, segment_ids, positions, deterministic: bool = True):
    """inputs, segment_ids, positions: (B, T) int32 -> logits (B, T, V) in the compute dtype."""
    m = self.config
    embedding, table, x = self.embed(inputs)

    # The scanned unit: one layer, or with MoE every n-th layer a group of n (jaxlm/moe.py); the stack's
    # variables (parameters, fp8 scales, routing statistics) get a leading axis, one entry per unit.
    # With moe_first_dense = k (DeepSeek's first-k-dense), the first k layers are plain Blocks: their own
    # scanned stack, `dense_layers`, before the units of `layers`.
    first = dense_prefix(m)
    if m.moe.experts and m.moe.every > 1:
      unit, units = Group, (m.num_layers - first) // m.moe.every
    else:
      unit, units = Block, m.num_layers - first
    fields = {'moe': True} if unit is Block and m.moe.experts else {}
    # Which layers are local (sliding window), scanned alongside the parameters: one stack holds both kinds.
    local = np.array([is_local(m, i) for i in range(m.num_layers)])
    if unit is Block and local.all():  # every layer local: each knows it when built (its decode cache a ring)
      fields['local'] = True
    block = Block
    if m.remat != 'none':
      block = nn.remat(Block, policy=REMAT_POLICIES[m.remat], prevent_cse=not m.scan_layers)
      unit = nn.remat(unit, policy=REMAT_POLICIES[m.remat], prevent_cse=not m.scan_layers)
    if self.pipeline is not None and not self.is_initializing():
      def layer(p, h, seg, pos, rng):  # one Block on one microbatch, with one layer's parameters
        rngs = {} if rng is None else {'dropout': rng}
        # config.validate lets a pipeline run only layers that are all local or all global.
        return Block(m, deterministic).apply({'params': p}, h, seg, pos, bool(local[0]), rngs=rngs)[0]
      rng = None if deterministic else self.make_rng('dropout')
      policy = REMAT_POLICIES.get(m.remat)
      x = pipeline_lib.run(layer, self.variables['params']['layers'], x, segment_ids, positions, rng,
                           self.pipeline, policy)
      x = nn.with_logical_constraint(x, RESIDUAL)
    elif (m.scan_layers and self.is_mutable_collection('cache') and not self.is_initializing() and local.any()
          and 'local' not in fields):
      x = self.decode_one_by_one(x, segment_ids, positions, local, first, units, fields)
    elif m.scan_layers:
      # One compiled layer body applied L times; parameters get a leading `layers` axis.
      scan = functools.partial(nn.scan, variable_axes={'params': 0, FP8: 0, moe_lib.STATS: 0, 'cache': 0},
                               split_rngs={'params': True, 'dropout': True},
                               in_axes=(nn.broadcast, nn.broadcast, 0),
                               metadata_params={nn.PARTITION_NAME: 'layers'})
      if first:
        x, _ = scan(block, length=first)(m, deterministic, name='dense_layers')(x, segment_ids, positions,
                                                                             local[:first])
      rest = local[first:].reshape(units, -1) if unit is not Block else local[first:]  # (units, moe_every)
      x, _ = scan(unit, length=units)(m, deterministic, name='layers', **fields)(x, segment_ids, positions, rest)
    else:
      for i in range(m.num_layers):
        x, _ = block(m, deterministic, moe=is_moe(m, i), local=bool(local[i]), name=f'layers_{i}')(
            x, segment_ids, positions, bool(local[i]))

    depths = []
    if m.mtp_depth and self.is_mutable_collection(mtp_lib.COLLECTION):  # training's extra predictions only
      depths = mtp_lib.MTP(m, Block, Norm, moe=is_moe(m, m.num_layers - 1), name='mtp')(
          x, table, inputs, segment_ids, positions, deterministic)
    logits = self.head(x, embedding, depths)
    if depths:
      self.sow(mtp_lib.COLLECTION, 'logits', jnp.stack(logits[1:]))  # (mtp_depth, B, T, V)
    return logits[0]

  def embed(self, inputs):
    """(the (V, D) embedding parameter, its gather view, the looked-up (B, T, D) residual stream)."""
    m = self.config
    D, V = m.d_model, m.vocab_size
    # PaLM: N(0, 1) embeddings, since no norm follows the lookup; logits are then scaled by 1/sqrt(D) when tied.
    embedding = _param(self, 'embedding', ('vocab', 'embed'), (V, D), 1.0, m)
    # Gather from a view of the table whole along V and split along D over tensor: a gather from a vocab-split
    # table makes XLA rematerialise the whole result, and a replicated view would hold the whole (V, D) table,
    # and backward its whole float32 gradient, on every device. The looked-up rows then move to the residual
    # stream's sequence split (an all-to-all over tensor).
    table = nn.with_logical_constraint(embedding, (None, 'act_table_embed'))
    x = jnp.take(table, inputs, axis=0).astype(m.dtype)  # (B, T, D)
    if m.embed_scale:  # Gemma: its N(0, 1/D)-scale table brought to unit scale, in the compute dtype as Gemma does
      x = x * jnp.asarray(math.sqrt(D), m.dtype)
    return embedding, table, nn.with_logical_constraint(x, RESIDUAL)

  def decode_one_by_one(self, x, segment_ids, positions, local, first, units, fields):
    """Decoding (jaxlm/generate.py: the `cache` collection mutable) through a scanned stack that mixes local and
    global layers: its units applied one by one, each with its parameters sliced from the stack and told its
    kind, so that a local layer's cache is a ring of W slots (Attention.static_local) and a global layer's the
    whole sequence; a scan would give every layer the same cache. Each unit's cache is `<stack>_<u>`."""
    m = self.config
    unit = Group if m.moe.experts and m.moe.every > 1 else Block  # as __call__ chose, without remat (no backward)
    units_local = local[first:].reshape(units, -1) if unit is Group else local[first:]
    stacks = [('dense_layers', Block, {}, local[:first]), ('layers', unit, fields, units_local)]
    for name, module, kwargs, kinds in stacks:
      for u, kind in enumerate(kinds):
        params = jax.tree.map(lambda a, u=u: a[u], self.variables['params'][name])
        cache = self.variable('cache', f'{name}_{u}', dict)
        static = {'local': bool(kind)} if module is Block else {}
        # parent=None: an unbound module, applied to its slice of the stack (not a new child of the decoder)
        (x, _), variables = module(m, True, **kwargs, **static, parent=None).apply(
            {'params': params, 'cache': cache.value}, x, segment_ids, positions, kind, mutable=['cache'])
        cache.value = variables['cache']
    return x

  def head(self, x, embedding, depths=()):
    """The final norm and the output projection: [(B, T, V) logits of x, then of each of MTP's normed `depths`],
    soft-capped if configured; the projection is shared (DeepSeek-V3's MTP output head)."""
    m = self.config
    x = Norm(m, rms=not m.parallel_block, name='final_norm')(x)
    unembed = None if m.tie_embeddings else _param(self, 'unembed', ('embed', 'vocab'), (m.d_model, m.vocab_size),
                                                    m.d_model ** -0.5, m)
    return [self.project_out(gathered(h), embedding, unembed) for h in (x, *depths)]

  def project_out(self, x, embedding, unembed):
    """Normed (B, T, D) -> logits (B, T, V) by the (tied) output projection."""
    m = self.config
    D, V = m.d_model, m.vocab_size
    B, T, _ = x.shape
    if m.tie_embeddings:
      # The 1/sqrt(D) goes on the (N, D) input, not the (N, V) logits: the same product, one pass fewer over
      # the largest activation (forward and backward).
      logits = dense(tokens(x) * (1 / math.sqrt(D)), embedding.astype(m.dtype).T, m.explicit_transpose_grads)  # (N, V)
    else:
      logits = dense(tokens(x), unembed.astype(m.dtype), m.explicit_transpose_grads)
    if m.final_softcap:  # Gemma 2: logits bounded to (-cap, cap), in float32
      logits = (m.final_softcap * jnp.tanh(logits.astype(jnp.float32) / m.final_softcap)).astype(logits.dtype)
    return nn.with_logical_constraint(logits.reshape(B, T, V), ('act_batch', 'act_seq', 'act_vocab'))


def loss_fn(logits, targets, weights, z_loss: float, denominator=None):
  """Mean next-token cross-entropy over weighted tokens plus PaLM's z-loss, in float32.

  `denominator` (default: the sum of `weights`) lets microbatches divide by the whole batch's token count.
  z-loss = z_loss * log(Z)^2 pulls the softmax normaliser towards 1, which keeps bf16 logits from drifting
  (PaLM section 5). Returns (total loss, {'loss': cross-entropy, 'z_loss': ..., 'max_logit': ...}).
  """
  logits = logits.astype(jnp.float32)  # (B, T, V)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # (B, T)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, T)
  denom = jnp.maximum(weights.sum(), 1.0) if denominator is None else denominator
  ce = ((log_z - target_logit) * weights).sum() / denom
  zl = z_loss * (jnp.square(log_z) * weights).sum() / denom
  return ce + zl, {'loss': ce, 'z_loss': zl, 'max_logit': logits.max()}
