"""gpt-oss (GptOssForCausalLM) both directions side by side: config.json <-> cfg.model keys, and the tensors jaxlm's
other families lack (attention biases and sinks, the router's bias, the experts' fused gate/up projection and their
biases). convert.py keeps the tensors' mapping common to every family and calls these.

The block: pre-norm RMSNorm, attention with biases and a sink per head, alternating sliding-window and full
layers, YaRN RoPE, and a mixture of experts in every layer whose router takes the top-k logits (plus a bias) and
softmaxes over those k, and whose experts run gpt-oss's clamped SwiGLU (blocks.clamped_swiglu) with biases.
Its checkpoints store each expert's gate and up columns interleaved in one `gate_up_proj` (X, D, 2F): gate in the
even columns, up in the odd ones; jaxlm keeps them apart (X, D, F) each. The released checkpoints quantize the
experts' projections to MXFP4 (quantization_config quant_method mxfp4: `<proj>_blocks` and `<proj>_scales`);
the import dequantizes them exactly (`dequantize_mxfp4`) and trains and exports the result unquantized.
"""

import numpy as np

from jaxlm import model as model_lib
from jaxlm.hf.families import ExportError, HFImportError, pattern

ARCHITECTURE, MODEL_TYPE = 'GptOssForCausalLM', 'gpt_oss'
DEFAULT_THETA = 150_000.0  # transformers' GptOssConfig.default_theta, when config.json gives no rope_theta
# config.json keys with the one value jaxlm computes; anything else there is refused by name.
_FIXED = {'attention_dropout': (0.0, 0, None), 'partial_rotary_factor': (1.0, None)}
# Keys read below or without effect on the forward pass (training, bookkeeping; hidden_act: the experts ignore it).
_KNOWN = {'architectures', 'model_type', 'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
          'num_attention_heads', 'num_key_value_heads', 'head_dim', 'num_local_experts', 'num_experts_per_tok',
          'experts_per_token', 'sliding_window', 'layer_types', 'rope_parameters', 'rope_scaling', 'rope_theta',
          'max_position_embeddings', 'initial_context_length', 'rms_norm_eps', 'swiglu_alpha', 'swiglu_limit',
          'attention_bias', 'tie_word_embeddings', 'router_aux_loss_coef', 'output_router_logits',
          'initializer_range', 'use_cache', 'bos_token_id', 'eos_token_id', 'pad_token_id', 'dtype', 'torch_dtype',
          'transformers_version', 'hidden_act', '_name_or_path', 'quantization_config', *_FIXED}
# MXFP4's element type, E2M1, by its 4-bit code (the OCP Microscaling spec): sign bit, then the magnitudes.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
_MXFP4_PROJECTIONS = ('experts.gate_up_proj', 'experts.down_proj')  # what the released checkpoints quantize


def overrides(hf: dict, rope: dict) -> dict:
  """cfg.model values for a gpt-oss config.json; `rope`: convert._rope's reading of its RoPE."""
  for key, allowed in _FIXED.items():
    if key in hf and hf[key] not in allowed:
      raise HFImportError(f'{key}={hf[key]!r} is not supported for {MODEL_TYPE}: jaxlm computes {allowed[0]!r}.')
  quant = hf.get('quantization_config')
  if quant is not None and (quant or {}).get('quant_method') != 'mxfp4':
    raise HFImportError(f'quantization_config={quant!r} is not supported for {MODEL_TYPE}: jaxlm dequantizes '
                        f'quant_method mxfp4 only; import a bfloat16 copy.')
  unknown = sorted(set(hf) - _KNOWN)
  if unknown:
    raise HFImportError(f'config.json field {unknown[0]!r} (={hf[unknown[0]]!r}) is not handled by jaxlm\'s '
                        f'{MODEL_TYPE} import; remove it if it does not change the model.')
  k = hf['num_experts_per_tok']
  if hf.get('experts_per_token', k) != k:
    raise HFImportError(f'experts_per_token={hf["experts_per_token"]} differs from num_experts_per_tok={k}: say '
                        f'which one the model uses.')
  L = hf['num_hidden_layers']
  # transformers' default when layer_types is absent: sliding, full, sliding, ... (full every second layer).
  types = hf.get('layer_types') or ['sliding_attention' if (i + 1) % 2 else 'full_attention' for i in range(L)]
  H = hf['num_attention_heads']
  return dict(vocab_size=hf['vocab_size'], d_model=hf['hidden_size'], num_layers=L, num_heads=H,
              num_kv_heads=hf.get('num_key_value_heads') or H, head_dim=hf.get('head_dim') or hf['hidden_size'] // H,
              mlp_dim=hf['intermediate_size'], parallel_block=False, tie_embeddings=False, qk_norm='none',
              norm_eps=float(hf.get('rms_norm_eps', 1e-5)), **rope, **pattern({**hf, 'layer_types': types}),
              attention_sinks=True, attention_bias=bool(hf.get('attention_bias', True)), mlp_activation='clamped',
              mlp_swiglu_limit=float(hf.get('swiglu_limit', 7.0)),
              mlp_swiglu_alpha=float(hf.get('swiglu_alpha', 1.702)),
              moe_experts=hf['num_local_experts'], moe_top_k=k, moe_mlp_dim=hf['intermediate_size'], moe_every=1,
              moe_first_dense=0, moe_router='gpt_oss', moe_expert_bias=True, moe_router_bias=True,
              moe_bias_rate=0.0,  # its router has a learned bias; a selection bias would not export
              # router_aux_loss_coef weighs transformers' pooled load-balancing loss (moe.loss)
              moe_aux_loss=float(hf.get('router_aux_loss_coef', 0.0)), moe_aux_loss_form='pooled')


def dequantize_mxfp4(blocks, scales) -> np.ndarray:
  """An MXFP4 tensor as float32 (exact: every value is a power of two times an E2M1 value), in the layout of the
  unquantized one: blocks (X, R, G, 16) uint8, two E2M1 codes a byte (the low nibble first), and scales (X, R, G)
  uint8, one E8M0 exponent (bias 127) per 32 values -> (X, G·32, R), as transformers dequantizes them."""
  blocks, exponents = np.asarray(blocks, np.uint8), np.asarray(scales, np.int32) - 127
  if blocks.shape[:-1] != exponents.shape:
    raise HFImportError(f'MXFP4 blocks of shape {blocks.shape} do not match their scales {exponents.shape}; the '
                        f'checkpoint is damaged or not gpt-oss\'s layout: download it again.')
  values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)  # (X, R, G, 16, 2)
  values = np.ldexp(values.reshape(*exponents.shape, -1), exponents[..., None])  # (X, R, G, 32)
  return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2)


def dequantized(tensors: dict) -> dict:
  """`tensors` with each MXFP4 expert projection (`<proj>_blocks`, `<proj>_scales`) replaced by `<proj>` in
  float32; a checkpoint without them comes back as it was."""
  names = [k.removesuffix('_blocks') for k in tensors
           if k.endswith('_blocks') and k.removesuffix('_blocks').endswith(_MXFP4_PROJECTIONS)]
  out = dict(tensors)
  for name in names:
    scales = out.pop(name + '_scales', None)
    if scales is None:
      raise HFImportError(f'tensor {name + "_scales"!r} is missing from the checkpoint ({name}_blocks needs it); '
                          f'the download is incomplete: fetch every *.safetensors file again.')
    out[name] = dequantize_mxfp4(out.pop(name + '_blocks'), scales)
  return out


def attention_from_hf(get, pre: str, m) -> dict:
  """One layer's attention biases (per head) and sinks, as model.attention_bias / attention_sinks ask."""
  H, K, E = m.num_heads, m.num_kv_heads, m.head_dim
  a, out = pre + 'self_attn.', {}
  if m.attention.bias:
    out.update(query_bias=get(a + 'q_proj.bias', (H * E,)).reshape(H, E),
               key_bias=get(a + 'k_proj.bias', (K * E,)).reshape(K, E),
               value_bias=get(a + 'v_proj.bias', (K * E,)).reshape(K, E), out_bias=get(a + 'o_proj.bias', (m.d_model,)))
  if m.attention.sinks:
    out['sinks'] = get(a + 'sinks', (H,))
  return out


def attention_to_hf(p: dict, pre: str, m) -> dict:
  """The inverse of attention_from_hf: one layer's self_attn biases and sinks (float32)."""
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  a = pre + 'self_attn.'
  out = {a + 'sinks': f32(p['sinks'])}
  if m.attention.bias:
    for name, proj in (('query', 'q'), ('key', 'k'), ('value', 'v'), ('out', 'o')):
      out[f'{a}{proj}_proj.bias'] = f32(p[f'{name}_bias']).reshape(-1)
  return out


def moe_from_hf(get, pre: str, m) -> dict:
  """One MoE layer's parameters (jaxlm/moe.py) from mlp.router.* and mlp.experts.* (transformers' layout:
  gate_up_proj (X, D, 2F) gate/up interleaved, down_proj (X, F, D), each x·W, not torch's (out, in))."""
  X, D, F = m.moe.experts, m.d_model, m.moe.mlp_dim
  b = pre + 'mlp.'
  gate_up = get(b + 'experts.gate_up_proj', (X, D, 2 * F))
  gate_up_bias = get(b + 'experts.gate_up_proj_bias', (X, 2 * F))
  return {'router': get(b + 'router.weight', (X, D)).T, 'router_bias': get(b + 'router.bias', (X,)),
          'bias': np.zeros((X,), np.float32),  # jaxlm's selection bias (moe_bias_rate): gpt-oss has none
          'gate': gate_up[..., 0::2], 'up': gate_up[..., 1::2], 'gate_bias': gate_up_bias[:, 0::2],
          'up_bias': gate_up_bias[:, 1::2], 'down': get(b + 'experts.down_proj', (X, F, D)),
          'down_bias': get(b + 'experts.down_proj_bias', (X, D))}


def moe_to_hf(p: dict, pre: str, m) -> dict:
  """The inverse of moe_from_hf; absent biases (moe_expert_bias, moe_router_bias off) are written as zeros."""
  if np.any(np.asarray(p['bias']) != 0):
    raise ExportError('the model\'s expert-selection biases are not zero (model.moe_bias_rate): GptOssForCausalLM '
                      'has no place for them; train with model.moe_bias_rate=0 to export.')
  X, D, F = m.moe.experts, m.d_model, m.moe.mlp_dim
  f32 = lambda name, shape: np.asarray(p[name], np.float32) if name in p else np.zeros(shape, np.float32)  # noqa: E731
  gate_up, gate_up_bias = np.empty((X, D, 2 * F), np.float32), np.empty((X, 2 * F), np.float32)
  gate_up[..., 0::2], gate_up[..., 1::2] = f32('gate', None), f32('up', None)
  gate_up_bias[:, 0::2], gate_up_bias[:, 1::2] = f32('gate_bias', (X, F)), f32('up_bias', (X, F))
  b = pre + 'mlp.'
  return {b + 'router.weight': f32('router', None).T, b + 'router.bias': f32('router_bias', (X,)),
          b + 'experts.gate_up_proj': gate_up, b + 'experts.gate_up_proj_bias': gate_up_bias,
          b + 'experts.down_proj': f32('down', None), b + 'experts.down_proj_bias': f32('down_bias', (X, D))}


def check_exportable(m, features: list[str]) -> None:
  """An ExportError unless GptOssForCausalLM computes `m` (a model with moe_router=gpt_oss). `features`: the
  block options on (families.features); gpt-oss's own are expected there, any other is refused."""
  own = ('model.attention_window', 'model.attention_sinks', 'model.attention_bias', 'model.mlp_activation')
  problems = [f for f in features if not f.startswith(own)]
  moe = m.moe
  if m.mlp.activation != 'clamped' or not m.attention.sinks:
    problems.append(f'mlp_activation={m.mlp.activation}, attention_sinks={m.attention.sinks}')
  if m.parallel_block or m.attention.qk_norm != 'none' or m.norms.placement != 'pre':
    problems.append(f'parallel_block={m.parallel_block}, qk_norm={m.attention.qk_norm}, '
                    f'norm_placement={m.norms.placement}')
  if moe.every != 1 or moe.first_dense or moe.shared_experts or moe.routed_scale != 1.0:
    problems.append(f'moe_every={moe.every}, moe_first_dense={moe.first_dense}, moe_shared_experts='
                    f'{moe.shared_experts}, moe_routed_scale={moe.routed_scale}')
  if problems:
    raise ExportError(f'{"; ".join(problems)}: {ARCHITECTURE} computes the sequential pre-norm block with '
                      f'attention sinks, the clamped SwiGLU (mlp_activation=clamped) and gpt_oss routing in every '
                      f'layer, no QK-norm; change those keys to export.')


def hf_config(m, max_positions: int) -> dict:
  """config.json's gpt-oss keys for `m` (beside convert.hf_config's common ones)."""
  types = ['sliding_attention' if model_lib.is_local(m, i) else 'full_attention' for i in range(m.num_layers)]
  return {'model_type': MODEL_TYPE, 'num_local_experts': m.moe.experts, 'num_experts_per_tok': m.moe.top_k,
          'intermediate_size': m.moe.mlp_dim, 'layer_types': types,
          'sliding_window': m.attention.window or max_positions, 'attention_bias': m.attention.bias,
          'swiglu_limit': m.mlp.limit, 'swiglu_alpha': m.mlp.alpha, 'router_aux_loss_coef': m.moe.aux_loss,
          'output_router_logits': False, 'tie_word_embeddings': False}
