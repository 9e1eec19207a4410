"""The families whose blocks go beyond Llama's (model.py's block options): Gemma 2, Gemma 3 (text), Mistral,
OLMo 2 and OLMo 3, both directions side by side: config.json <-> cfg.model keys, and the layer norms' names.

convert.py calls these for the families listed here and keeps the tensors' mapping common to all.
"""

from jaxlm import errors
from jaxlm import model as model_lib


class ExportError(errors.ConfigError):
  """A checkpoint or model that cannot be exported faithfully; the message says why and what to do."""


class HFImportError(errors.ConfigError):
  """A Hugging Face directory jaxlm cannot import exactly; the message says why."""


def refuse_quantized(hf: dict) -> None:
  """An HFImportError naming config.json's quantization_config (the released DeepSeek-V3's FP8 blocks): jaxlm reads
  plain weights and would take the quantised ones without their scales (gpt-oss's MXFP4 is dequantized instead)."""
  q = hf.get('quantization_config')
  if q is None:
    return
  method = q.get('quant_method', '?') if isinstance(q, dict) else q
  scales = ' (its weight_scale_inv block scales)' if method == 'fp8' else ''
  raise HFImportError(f'config.json field \'quantization_config\' (quant_method={method!r}): a quantised checkpoint '
                      f'jaxlm would read without its scales{scales}; import a bfloat16 copy (DeepSeek-V3: its '
                      f'inference/fp8_cast_bf16.py) and drop the field.')


_GEMMA = dict(norm_placement='sandwich', norm_offset=True, mlp_activation='geglu', embed_scale=True)
# model_type -> the cfg.model block keys every checkpoint of the family has (its window, caps and RoPE: its config).
FAMILY_BLOCKS = {'gemma2': dict(_GEMMA, qk_norm='none'), 'gemma3_text': dict(_GEMMA, qk_norm='head'),
                 'mistral': dict(qk_norm='none'), 'olmo2': dict(norm_placement='post', qk_norm='full'),
                 'olmo3': dict(norm_placement='post', qk_norm='full')}
FAMILY_MODEL_TYPES = {'Gemma2ForCausalLM': 'gemma2', 'Gemma3ForCausalLM': 'gemma3_text',
                      'MistralForCausalLM': 'mistral', 'Olmo2ForCausalLM': 'olmo2', 'Olmo3ForCausalLM': 'olmo3'}
# Families whose config.json gives RoPE per layer type (transformers 5): rope_parameters.{full,sliding}_attention.
_PER_LAYER_ROPE = ('gemma3_text', 'olmo3')
_LAYER_TYPES = ('full_attention', 'sliding_attention')
GELU_TANH = ('gelu_pytorch_tanh', 'gelu_tanh')  # transformers' names of the tanh-approximated gelu


def norm_names(m) -> dict[str, str]:
  """The sequential block's norms: jaxlm's name -> the Hugging Face layer's, by model.norm_placement."""
  return {'pre': {'attn_norm': 'input_layernorm', 'mlp_norm': 'post_attention_layernorm'},
          'sandwich': {'attn_norm': 'input_layernorm', 'attn_post_norm': 'post_attention_layernorm',
                       'mlp_norm': 'pre_feedforward_layernorm', 'mlp_post_norm': 'post_feedforward_layernorm'},
          'post': {'attn_post_norm': 'post_attention_layernorm',
                   'mlp_post_norm': 'post_feedforward_layernorm'}}[m.norms.placement]


def pattern(hf: dict) -> dict:
  """attention_window and attention_global_every for config.json's layer_types and sliding_window."""
  L, window = hf['num_hidden_layers'], hf.get('sliding_window')
  types = hf.get('layer_types')
  if not types:  # Mistral: every layer local when sliding_window is set
    types = ['sliding_attention' if window else 'full_attention'] * L
  unknown = sorted(set(types) - set(_LAYER_TYPES))
  if unknown or len(types) != L:
    raise HFImportError(f'layer_types entry {unknown[0] if unknown else len(types)!r} is not supported: jaxlm\'s '
                        f'layers are {" or ".join(_LAYER_TYPES)}, one per layer ({L}).')
  if 'sliding_attention' not in types:
    return dict(attention_window=0, attention_global_every=0)
  if not window:
    raise HFImportError(f'sliding_window={window!r} with sliding_attention layers: give the window size.')
  fulls = [i for i, kind in enumerate(types) if kind == 'full_attention']
  every = fulls[0] + 1 if fulls else 0
  if types != [_LAYER_TYPES[not (every and (i + 1) % every == 0)] for i in range(L)]:
    raise HFImportError(f'layer_types={types} is not supported: jaxlm makes every n-th layer global '
                        f'(model.attention_global_every), the rest local.')
  return dict(attention_window=int(window), attention_global_every=every)


def _per_layer_rope(hf: dict) -> tuple[dict, dict]:
  """(hf with its global RoPE where convert._rope reads it, rope_local_theta) of a Gemma 3 or OLMo 3 config: per
  layer type (transformers 5) or rope_theta + rope_local_base_freq + rope_scaling (4.x)."""
  params = hf.get('rope_parameters') or {}
  if 'full_attention' not in params:
    return hf, dict(rope_local_theta=float(hf.get('rope_local_base_freq') or hf.get('rope_theta') or 10_000.0))
  local = params.get('sliding_attention') or {}
  if local.get('rope_type', 'default') != 'default':
    raise HFImportError(f'rope_parameters.sliding_attention={local} is not supported: jaxlm\'s local layers '
                        f'rotate with plain RoPE (model.rope_local_theta).')
  return ({**hf, 'rope_parameters': params['full_attention'], 'rope_scaling': None},
          dict(rope_local_theta=float(local.get('rope_theta') or 10_000.0)))


def family_overrides(hf: dict) -> tuple[dict, dict]:
  """(config.json with the keys handled here cleared for convert's common checks, cfg.model block keys)."""
  kind = hf['model_type']
  out = dict(FAMILY_BLOCKS[kind], **pattern(hf))
  if kind.startswith('gemma'):
    act = hf.get('hidden_activation') or hf.get('hidden_act')
    if act not in GELU_TANH:
      raise HFImportError(f'hidden_activation={act!r} is not supported: jaxlm\'s Gemma MLP is GeGLU with '
                          f'tanh-approximated gelu ({GELU_TANH[0]}).')
    out.update(attention_softcap=float(hf.get('attn_logit_softcapping') or 0.0),
               final_softcap=float(hf.get('final_logit_softcapping') or 0.0),
               query_pre_attn_scalar=float(hf.get('query_pre_attn_scalar') or 0.0))
  if kind in _PER_LAYER_ROPE:
    hf, local = _per_layer_rope(hf)
    out.update(local)
  cleared = dict(hf, sliding_window=None, layer_types=None, attn_logit_softcapping=None,
                 final_logit_softcapping=None, hidden_act='silu')
  return cleared, out


# The block options (cfg.model key -> ModelConfig value) and their off values: a model with any of them on is
# exported only as a family that computes it.
def _options(m) -> dict:
  a = m.attention
  return {'attention_window': a.window, 'attention_softcap': a.softcap, 'final_softcap': m.final_softcap,
          'attention_sinks': a.sinks, 'attention_bias': a.bias, 'query_pre_attn_scalar': a.query_scalar,
          'rope_local_theta': a.local_rope_theta,
          'norm_placement': m.norms.placement, 'norm_offset': m.norms.offset, 'mlp_activation': m.mlp.activation,
          'embed_scale': m.embed_scale}


_OFF = {'attention_window': 0, 'attention_softcap': 0.0, 'final_softcap': 0.0, 'attention_sinks': False,
        'attention_bias': False,
        'query_pre_attn_scalar': 0.0, 'rope_local_theta': 0.0, 'norm_placement': 'pre', 'norm_offset': False,
        'mlp_activation': 'swiglu', 'embed_scale': False}


def features(m) -> list[str]:
  """`model.key=value` of each block option of `m` that is on."""
  return [f'model.{k}={v}' for k, v in _options(m).items() if v != _OFF[k]]


def _all_local(m) -> bool:
  return all(model_lib.is_local(m, i) for i in range(m.num_layers))


def family_architecture(m) -> str:
  """The Hugging Face class whose block is `m`'s (its options on), or an ExportError naming what none computes."""
  o = _options(m)
  block = {k: o[k] for k in ('norm_placement', 'norm_offset', 'mlp_activation', 'embed_scale')}
  extra = lambda keys: [f'model.{k}={o[k]}' for k in keys if o[k] != _OFF[k]]  # noqa: E731
  arch, problems = None, extra(['attention_sinks', 'attention_bias'])
  if block == _GEMMA and m.attention.qk_norm in ('none', 'head'):
    arch = 'Gemma3ForCausalLM' if m.attention.qk_norm == 'head' else 'Gemma2ForCausalLM'
    if arch == 'Gemma2ForCausalLM' and o['rope_local_theta'] not in (0.0, m.rope_theta):
      problems.append(f'model.rope_local_theta={o["rope_local_theta"]} (Gemma 2 has one RoPE base)')
  elif block == {k: _OFF[k] for k in block} and m.attention.qk_norm == 'none' and _all_local(m):
    arch = 'MistralForCausalLM'
    problems += extra(['attention_softcap', 'final_softcap', 'query_pre_attn_scalar', 'rope_local_theta'])
  elif block == dict({k: _OFF[k] for k in block}, norm_placement='post') and m.attention.qk_norm == 'full':
    # OLMo 3 is OLMo 2 with local layers (and RoPE per layer type).
    two = not m.attention.window and o['rope_local_theta'] in (0.0, m.rope_theta)
    arch = 'Olmo2ForCausalLM' if two else 'Olmo3ForCausalLM'
    problems += extra(['attention_softcap', 'final_softcap', 'query_pre_attn_scalar'])
  if arch is None or problems:
    raise ExportError(f'{", ".join(problems or features(m))} (qk_norm={m.attention.qk_norm}): no Hugging Face '
                      f'class jaxlm exports computes this block (Gemma2/Gemma3ForCausalLM: sandwich norms with '
                      f'(1+w), GeGLU, scaled embeddings; Mistral: all layers local; Olmo2/Olmo3: post norms with '
                      f'qk_norm=full); change those keys to match one.')
  return arch


def family_config(m, arch: str, max_positions: int, rope_scaling: dict | None) -> dict:
  """config.json's family keys for `m` exported as `arch` (beside convert.hf_config's common ones);
  `rope_scaling`: the global layers' (convert.rope_scaling_to_hf)."""
  c = {'model_type': FAMILY_MODEL_TYPES[arch]}
  a = m.attention
  if arch == 'MistralForCausalLM':
    return dict(c, sliding_window=a.window)
  if arch == 'Olmo2ForCausalLM':
    return c
  types = [_LAYER_TYPES[model_lib.is_local(m, i)] for i in range(m.num_layers)]
  c.update(layer_types=types, sliding_window=a.window or max_positions)
  if arch != 'Olmo3ForCausalLM':
    c.update(hidden_activation=GELU_TANH[0], hidden_act=GELU_TANH[0],
             query_pre_attn_scalar=_whole(a.query_scalar or m.head_dim), attn_logit_softcapping=a.softcap or None,
             final_logit_softcapping=m.final_softcap or None)
  if arch in ('Gemma3ForCausalLM', 'Olmo3ForCausalLM'):
    full = {'rope_type': 'default', **(rope_scaling or {}), 'rope_theta': m.rope_theta}
    local = {'rope_type': 'default', 'rope_theta': a.local_rope_theta or m.rope_theta}
    c.update(rope_parameters={'full_attention': full, 'sliding_attention': local}, rope_scaling=None,
             use_bidirectional_attention=False)
  return c


def _whole(x):
  """x as an int when it is one (transformers' Gemma configs type query_pre_attn_scalar as an int)."""
  return int(x) if float(x).is_integer() else float(x)
