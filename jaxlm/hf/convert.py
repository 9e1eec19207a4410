"""jaxlm <-> Hugging Face layouts, both directions side by side so they cannot drift.

Torch's Linear stores (out, in), so every jaxlm (in, out) matrix is transposed. The sequential block maps to
LlamaForCausalLM; PaLM's parallel block to CohereForCausalLM (q/k permuted to its interleaved rotary). A model
with no exact Hugging Face equivalent, or a checkpoint jaxlm cannot compute exactly, is refused by name.
"""

import math

import jax
import numpy as np

from jaxlm import lora as lora_lib, model as model_lib
from jaxlm.hf import deepseek, gpt_oss
from jaxlm.hf.families import (FAMILY_BLOCKS, FAMILY_MODEL_TYPES, ExportError, HFImportError,  # noqa: F401
                               family_architecture, family_config, family_overrides, features, norm_names,
                               refuse_quantized)

# A Hugging Face model directory's tokenizer files (import copies them beside a run's checkpoints; export looks there).
TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja',
                   'tokenizer.model', 'generation_config.json')  # the last: the end-of-sequence ids sampling stops at


def layer_params(params: dict, m) -> list[dict]:
  """Per-layer parameter dicts, whether the layers were scanned (stacked on axis 0, in groups of moe_every
  when MoE and dense layers alternate, after the `dense_layers` stack of model.moe_first_dense) or unrolled.
  `m`: a ModelConfig, or (older callers) the layer count."""
  num_layers, every = (m, 1) if isinstance(m, int) else (m.num_layers, m.moe.every if m.moe.experts else 1)
  first = 0 if isinstance(m, int) else model_lib.dense_prefix(m)
  if 'layers' not in params:
    return [params[f'layers_{i}'] for i in range(num_layers)]
  prefix = [jax.tree.map(lambda x, i=i: x[i], params['dense_layers']) for i in range(first)]
  if every > 1:
    return prefix + [jax.tree.map(lambda x, i=i: x[i // every], params['layers'][f'block_{i % every}'])
                     for i in range(num_layers - first)]
  return prefix + [jax.tree.map(lambda x, i=i: x[i], params['layers']) for i in range(num_layers - first)]


def interleave_permutation(head_dim: int) -> np.ndarray:
  """Column order that turns half-split RoPE pairs (i, i+E/2) into interleaved pairs (2i, 2i+1)."""
  half = head_dim // 2
  return np.stack([np.arange(half), np.arange(half) + half], axis=-1).reshape(-1)


# Dense export: architecture -> model_type.
DENSE_MODEL_TYPES = {'CohereForCausalLM': 'cohere', 'LlamaForCausalLM': 'llama', 'Qwen3ForCausalLM': 'qwen3'}

# Mixture-of-experts export: router preset -> (architecture, model_type, the QK-norm it computes).
MOE_ARCHITECTURES = {'mixtral': ('MixtralForCausalLM', 'mixtral', 'none'),
                     'qwen3_moe': ('Qwen3MoeForCausalLM', 'qwen3_moe', 'head'),
                     'olmoe': ('OlmoeForCausalLM', 'olmoe', 'full')}


def _moe_architecture(m: model_lib.ModelConfig) -> str:
  """The Hugging Face MoE class for `m`, or an ExportError naming what it cannot hold."""
  if m.parallel_block:
    raise ExportError('a parallel-block (PaLM) mixture of experts has no Hugging Face equivalent; train it with '
                      'model.parallel_block=False to export it.')
  moe = m.moe
  if moe.router not in MOE_ARCHITECTURES:
    raise ExportError(f'model.moe_router={moe.router} has no export; use mixtral, qwen3_moe or olmoe.')
  arch, _, qk_norm = MOE_ARCHITECTURES[moe.router]
  if moe.expert_bias or moe.router_bias:
    raise ExportError(f'model.moe_expert_bias={moe.expert_bias}, moe_router_bias={moe.router_bias}: {arch} has no '
                      f'biases in its experts or router; use model.moe_router=gpt_oss (GptOssForCausalLM) or turn '
                      f'them off.')
  if moe.first_dense and (moe.router != 'qwen3_moe' or moe.first_dense % moe.every):
    raise ExportError(f'model.moe_first_dense={moe.first_dense}: {arch} has no dense first layers'
                      f'{" but mlp_only_layers, whose pattern matches only when moe_every divides it" if moe.router == "qwen3_moe" else ""}'
                      f', so this model has no faithful Hugging Face equivalent.')
  if m.attention.qk_norm != qk_norm or moe.shared_experts or moe.routed_scale != 1.0 or (
      moe.every != 1 and moe.router != 'qwen3_moe'):
    raise ExportError(f'{arch} computes qk_norm={qk_norm}, no shared experts, routed scale 1'
                      f'{"" if moe.router == "qwen3_moe" else ", MoE in every layer"}; this model differs '
                      f'(qk_norm={m.attention.qk_norm}, moe_shared_experts={moe.shared_experts}, moe_every={moe.every}), so '
                      f'it has no faithful Hugging Face equivalent.')
  return arch


def architecture(m: model_lib.ModelConfig) -> str:
  """The Hugging Face class that computes exactly this model, or an ExportError saying why there is none."""
  if m.mtp_depth and not m.mla.kv_lora_rank:  # refused rather than written without them
    raise ExportError(f'model.mtp_depth={m.mtp_depth}: the multi-token prediction modules have a Hugging Face '
                      f'layout only in DeepSeek-V3 (MLA, model.kv_lora_rank > 0); export a copy of the run with '
                      f'model.mtp_depth=0 to write the main model alone.')
  if m.mla.kv_lora_rank:  # multi-head latent attention: DeepSeek-V3's or -V2's class only (hf/deepseek.py)
    deepseek.check_exportable(m, features(m))
    return deepseek.architecture(m)
  if m.moe.experts and m.moe.router == 'gpt_oss':  # attention sinks and biases, clamped experts (hf/gpt_oss.py)
    gpt_oss.check_exportable(m, features(m))
    return gpt_oss.ARCHITECTURE
  if m.moe.experts:
    if features(m):
      raise ExportError(f'{", ".join(features(m))} on a mixture of experts has no Hugging Face export yet.')
    return _moe_architecture(m)
  if features(m):
    return family_architecture(m)
  qk_norm = m.attention.qk_norm
  if qk_norm == 'full' or (qk_norm == 'head' and m.parallel_block):
    raise ExportError(f'model.qk_norm={qk_norm} on a dense{" parallel-block" if m.parallel_block else ""} model '
                      f'has no Hugging Face equivalent (Qwen3 is the sequential block with qk_norm=head); export it '
                      f'with qk_norm=none or head.')
  if m.d_model % m.num_heads:
    # transformers validates hidden_size % num_attention_heads == 0 even when head_dim is given explicitly.
    raise ExportError(f'd_model={m.d_model} is not a multiple of num_heads={m.num_heads}: transformers refuses '
                      f'such a config, so there is no faithful Hugging Face equivalent.')
  if m.parallel_block and m.head_dim != m.d_model // m.num_heads:
    raise ExportError(f'head_dim={m.head_dim} differs from d_model/num_heads={m.d_model // m.num_heads}: '
                      f'Cohere (the parallel block) derives head_dim from the widths, so this model has no '
                      f'faithful Hugging Face equivalent.')
  if m.attention.qk_norm == 'head':
    return 'Qwen3ForCausalLM'  # Llama's block with a per-head RMSNorm on queries and keys
  return 'CohereForCausalLM' if m.parallel_block else 'LlamaForCausalLM'


def to_hf(params: dict, m: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """Hugging Face state dict (name -> float32 numpy) of jaxlm `params`."""
  cohere = architecture(m) == 'CohereForCausalLM'
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  out = {'model.embed_tokens.weight': f32(params['embedding'])}  # (V, D)
  for i, p in enumerate(layer_params(params, m)):
    out.update(layer_to_hf(p, f'model.layers.{i}.', m, cohere))
  out['model.norm.weight'] = f32(params['final_norm']['scale'])
  if not m.tie_embeddings:
    out['lm_head.weight'] = f32(params['unembed']).T  # (V, D)
  elif not cohere:
    out['lm_head.weight'] = out['model.embed_tokens.weight'] / np.float32(math.sqrt(m.d_model))
  if m.mtp_depth:  # DeepSeek-V3's layout: depth k as layer L + k - 1 (architecture() allows MTP there only)
    out.update(deepseek.mtp_to_hf(params['mtp'], m, layer_to_hf, out))
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def layer_to_hf(p: dict, pre: str, m: model_lib.ModelConfig, cohere: bool = False) -> dict[str, np.ndarray]:
  """One decoder layer's tensors under `pre` (model.layers.{i}.), float32 torch (out, in)."""
  D, H, K, E = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  rope_order = interleave_permutation(E) if cohere else np.arange(E)
  out = {}
  a = p['attention']
  if m.mla.kv_lora_rank:
    out.update(deepseek.attention_to_hf(a, pre, m))
  else:
    out[pre + 'self_attn.q_proj.weight'] = f32(a['query'])[:, :, rope_order].reshape(D, H * E).T
    out[pre + 'self_attn.k_proj.weight'] = f32(a['key'])[:, :, rope_order].reshape(D, K * E).T
    out[pre + 'self_attn.v_proj.weight'] = f32(a['value']).reshape(D, K * E).T
    out[pre + 'self_attn.o_proj.weight'] = f32(a['out']).reshape(H * E, D).T
  if m.attention.sinks or m.attention.bias:  # only gpt-oss's class has them (architecture() checked)
    out.update(gpt_oss.attention_to_hf(a, pre, m))
  if m.attention.qk_norm != 'none':
    out[pre + 'self_attn.q_norm.weight'] = f32(a['query_norm']['scale']).reshape(-1)
    out[pre + 'self_attn.k_norm.weight'] = f32(a['key_norm']['scale']).reshape(-1)
  if 'moe' in p:
    to = (deepseek.moe_to_hf if m.mla.kv_lora_rank else gpt_oss.moe_to_hf if m.moe.router == 'gpt_oss'
          else _experts_to_hf)
    out.update(to(p['moe'], pre, m))
  else:
    mlp = p['mlp']
    out[pre + 'mlp.gate_proj.weight'] = f32(mlp['gate']).T  # (F, D)
    out[pre + 'mlp.up_proj.weight'] = f32(mlp['up']).T
    out[pre + 'mlp.down_proj.weight'] = f32(mlp['down']).T  # (D, F)
  if cohere:
    out[pre + 'input_layernorm.weight'] = f32(p['norm']['scale'])
  else:
    for ours, theirs in norm_names(m).items():
      out[pre + theirs + '.weight'] = f32(p[ours]['scale'])
  return out


# LoRA (model.lora): jaxlm's projection names -> the Hugging Face module each adapts (Llama's and Cohere's alike).
PEFT_MODULES = {'query': 'self_attn.q_proj', 'key': 'self_attn.k_proj', 'value': 'self_attn.v_proj',
                'out': 'self_attn.o_proj', 'gate': 'mlp.gate_proj', 'up': 'mlp.up_proj', 'down': 'mlp.down_proj'}


def _peft_modules(m: model_lib.ModelConfig) -> dict:
  """The adaptable weights of a layer -> (peft's module name under it, B's output columns in HF's order or None)."""
  mlp = {name: (module, None) for name, module in PEFT_MODULES.items() if module.startswith('mlp.')}
  if m.mla.kv_lora_rank:  # DeepSeek's MLA projections (jaxlm/hf/deepseek.py)
    return {**deepseek.peft_modules(m), **mlp}
  cohere = architecture(m) == 'CohereForCausalLM'
  rope_order = interleave_permutation(m.head_dim) if cohere else None  # (r, heads, E): the converter's order
  return {name: (module, rope_order if name in ('query', 'key') else None) for name, module in PEFT_MODULES.items()}


def lora_to_peft(params: dict, m: model_lib.ModelConfig) -> dict[str, np.ndarray]:
  """peft's adapter state dict (adapter_model.safetensors) of a LoRA model's adapters: per layer and adapted
  weight `base_model.model.model.layers.{i}.<module>.lora_A.weight` (r, in) and `.lora_B.weight` (out, r),
  torch's (out, in) layout, with B's output columns in the order `to_hf` gives the weight's (Cohere's q/k
  permutation, DeepSeek's interleaved rotary dims). MoE layers carry no MLP adapters (the experts are never
  adapted)."""
  r = m.lora.rank
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  out = {}
  for i, p in enumerate(layer_params(params, m)):
    for name, (module, order) in _peft_modules(m).items():
      owner = p['attention'] if module.startswith('self_attn') else p.get('mlp')
      if owner is None or f'{name}_lora_a' not in owner:
        continue
      a, b = f32(owner[f'{name}_lora_a']), f32(owner[f'{name}_lora_b'])
      if order is not None:
        b = b[..., order]
      pre = f'base_model.model.model.layers.{i}.{module}.'
      out[pre + 'lora_A.weight'] = a.reshape(-1, r).T  # (r, in)
      out[pre + 'lora_B.weight'] = b.reshape(r, -1).T  # (out, r)
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def peft_config(m: model_lib.ModelConfig, base_model: str = '') -> dict:
  """adapter_config.json for `lora_to_peft`'s tensors: plain LoRA with scale lora_alpha / r (no rsLoRA)."""
  adapted = {'query_b' if name == 'query' and m.mla.q_lora_rank else name for name in m.lora.targets}
  if not any(not model_lib.is_moe(m, i) for i in range(m.num_layers)):  # no dense MLP: no MLP adapters (gpt-oss)
    adapted -= set(lora_lib.MLP_TARGETS)
  modules = sorted(module.split('.')[-1] for name, (module, _) in _peft_modules(m).items() if name in adapted)
  return {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM', 'r': m.lora.rank, 'lora_alpha': m.lora.alpha,
          'target_modules': modules, 'lora_dropout': 0.0,
          'bias': 'none', 'fan_in_fan_out': False, 'use_rslora': False, 'use_dora': False,
          'init_lora_weights': True, 'modules_to_save': None, 'base_model_name_or_path': base_model,
          'inference_mode': True}


def hf_config(m: model_lib.ModelConfig, *, max_positions: int, dtype: str, bos_id: int, eos_id: int) -> dict:
  """config.json for `m`, readable by transformers 4.4x (rope_theta) and 5.x (rope_parameters) alike."""
  arch = architecture(m)
  cohere = arch == 'CohereForCausalLM'
  c = {
      'architectures': [arch], 'model_type': DENSE_MODEL_TYPES.get(arch, 'llama'),
      'vocab_size': m.vocab_size, 'hidden_size': m.d_model, 'intermediate_size': m.mlp_dim,
      'num_hidden_layers': m.num_layers, 'num_attention_heads': m.num_heads, 'num_key_value_heads': m.num_kv_heads,
      'hidden_act': 'silu', 'max_position_embeddings': max_positions,  # lm-eval truncates contexts to this
      'rope_theta': m.rope_theta, 'rope_parameters': {**(rope_scaling_to_hf(m) or {'rope_type': 'default'}),
                                                       'rope_theta': m.rope_theta},
      'rope_scaling': rope_scaling_to_hf(m), 'attention_bias': False, 'attention_dropout': 0.0, 'initializer_range': 0.02,
      'bos_token_id': bos_id, 'eos_token_id': eos_id, 'pad_token_id': None, 'use_cache': True,
      'torch_dtype': dtype, 'dtype': dtype,
  }
  if m.moe.experts and arch not in (*deepseek.ARCHITECTURES, gpt_oss.ARCHITECTURE):
    _, model_type, _ = MOE_ARCHITECTURES[m.moe.router]
    c.update(model_type=model_type, num_local_experts=m.moe.experts, num_experts=m.moe.experts,
             num_experts_per_tok=m.moe.top_k, norm_topk_prob=m.moe.norm_topk_prob, output_router_logits=False,
             intermediate_size=m.moe.mlp_dim if model_type != 'qwen3_moe' else m.mlp_dim,
             moe_intermediate_size=m.moe.mlp_dim, decoder_sparse_step=m.moe.every,
             mlp_only_layers=list(range(m.moe.first_dense)),
             sliding_window=None, use_sliding_window=False, clip_qkv=None)
  if cohere:
    c.update(layer_norm_eps=m.norms.eps, use_qk_norm=False, tie_word_embeddings=m.tie_embeddings,
             logit_scale=1.0 / math.sqrt(m.d_model) if m.tie_embeddings else 1.0)
  else:
    c.update(rms_norm_eps=m.norms.eps, mlp_bias=False, head_dim=m.head_dim, pretraining_tp=1,
             tie_word_embeddings=False)
  if arch in FAMILY_MODEL_TYPES:
    c.update(family_config(m, arch, max_positions, rope_scaling_to_hf(m)))
  if arch in deepseek.ARCHITECTURES:
    c.update(deepseek.hf_config(m))
  if arch == gpt_oss.ARCHITECTURE:
    c.update(gpt_oss.hf_config(m, max_positions))
  return c


_UNSUPPORTED = {
    'attention_bias': (False, None), 'mlp_bias': (False, None), 'sliding_window': (None,),
    'use_sliding_window': (False, None), 'partial_rotary_factor': (1.0, None), 'quantization_config': (None,),
    'attn_logit_softcapping': (None,), 'final_logit_softcapping': (None,), 'logit_scale': (1.0, None),
    'use_bidirectional_attention': (False, None),
}


def rope_scaling_to_hf(m: model_lib.ModelConfig) -> dict | None:
  """transformers' rope_scaling dict (rope_type and its parameters) for m.rope_scaling; None for plain RoPE."""
  if m.rope_scaling == 'none':
    return None
  out = {'rope_type': m.rope_scaling, 'factor': m.rope_factor}
  if m.rope_scaling == 'llama3':
    out.update(low_freq_factor=m.rope_low_freq_factor, high_freq_factor=m.rope_high_freq_factor,
               original_max_position_embeddings=m.rope_original_max_positions)
  elif m.rope_scaling == 'yarn':
    out.update(beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, truncate=m.rope_truncate,
               original_max_position_embeddings=m.rope_original_max_positions,
               attention_factor=model_lib.rope_frequencies(m)[1])  # explicit: readers need not re-derive it
    if m.rope_mscale_all_dim:  # DeepSeek's softmax correction (rope.softmax_mscale)
      out['mscale_all_dim'] = m.rope_mscale_all_dim
  return out


def _rope(hf: dict) -> dict:
  """cfg.model RoPE values from either config style (4.x rope_theta + rope_scaling, 5.x rope_parameters).

  Plain, linear, llama3 and yarn RoPE are computed exactly; dynamic NTK and longrope (whose frequencies change
  with the sequence length) are refused.
  """
  params = hf.get('rope_parameters') or {}
  scaling = hf.get('rope_scaling') or {}
  kind = scaling.get('rope_type') or scaling.get('type') or params.get('rope_type', 'default')
  p = {**params, **scaling}
  out = dict(rope_theta=float(params.get('rope_theta') or hf.get('rope_theta') or 10_000.0),
             rope_scaling='none' if kind == 'default' else kind)
  if kind == 'default':
    return out
  if kind not in model_lib.ROPE_SCALINGS:
    raise HFImportError(f'rope scaling {scaling or params} is not supported: jaxlm computes plain, linear, llama3 '
                        f'and yarn RoPE exactly, not {kind!r}.')
  if float(p.get('partial_rotary_factor', 1.0)) != 1.0:
    raise HFImportError(f'partial_rotary_factor={p["partial_rotary_factor"]} is not supported: jaxlm rotates '
                        f'the whole head.')
  original = p.get('original_max_position_embeddings') or hf.get('max_position_embeddings') or 0
  factor = p.get('factor')
  if factor is None and kind == 'yarn' and p.get('original_max_position_embeddings'):
    factor = hf['max_position_embeddings'] / p['original_max_position_embeddings']  # as transformers does
  out.update(rope_factor=float(factor if factor is not None else 1.0))
  if kind == 'llama3':
    out.update(rope_low_freq_factor=float(p['low_freq_factor']), rope_high_freq_factor=float(p['high_freq_factor']),
               rope_original_max_positions=int(original))
  elif kind == 'yarn':
    f = out['rope_factor']
    mscale = lambda scale, k=1.0: 1.0 if scale <= 1 else 0.1 * k * math.log(scale) + 1.0
    attention = p.get('attention_factor')
    if attention is None:  # transformers' rule, folded into one number here
      attention = (mscale(f, p['mscale']) / mscale(f, p['mscale_all_dim'])
                   if p.get('mscale') and p.get('mscale_all_dim') else mscale(f))
    out.update(rope_beta_fast=float(p.get('beta_fast') or 32.0), rope_beta_slow=float(p.get('beta_slow') or 1.0),
               rope_attention_factor=float(attention), rope_truncate=bool(p.get('truncate', True)),
               rope_original_max_positions=int(original))
  return out


# Mixture-of-experts families (jaxlm/moe.py): model_type -> (router preset, QK-norm).
MOE_FAMILIES = {'mixtral': ('mixtral', 'none'), 'qwen3_moe': ('qwen3_moe', 'head'), 'olmoe': ('olmoe', 'full')}
# Dense families: model_type -> QK-norm (Qwen3: Llama's block with a per-head RMSNorm on queries and keys).
DENSE_FAMILIES = {'llama': 'none', 'qwen3': 'head'}
IMPORTABLE = (*DENSE_FAMILIES, *MOE_FAMILIES, *FAMILY_BLOCKS, *deepseek.MODEL_TYPES, gpt_oss.MODEL_TYPE)


def _moe_overrides(hf: dict) -> dict:
  """cfg.model's moe_* and qk_norm values for a Mixtral, Qwen3-MoE or OLMoE config.json."""
  kind = hf['model_type']
  if kind not in MOE_FAMILIES:
    return {}
  router, qk_norm = MOE_FAMILIES[kind]
  every = int(hf.get('decoder_sparse_step') or 1)
  dense = sorted(hf.get('mlp_only_layers') or [])
  # Qwen3-MoE: layer i is MoE when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers. jaxlm's
  # first-k-dense (model.moe_first_dense) computes that exactly when the list is the first k layers, k a
  # multiple of the step.
  if dense and (dense != list(range(len(dense))) or len(dense) % every):
    raise HFImportError(f'mlp_only_layers={dense} is not supported: jaxlm makes only the first k layers dense '
                        f'(model.moe_first_dense), k a multiple of decoder_sparse_step={every}.')
  if hf.get('clip_qkv') is not None:
    raise HFImportError(f'clip_qkv={hf["clip_qkv"]} is not supported: jaxlm does not clip q, k and v.')
  # Mixtral always renormalises; transformers' OLMoE and Qwen3-MoE configs default norm_topk_prob to False.
  # The expert count is num_local_experts in Mixtral's and transformers 5's files, num_experts in older ones.
  return dict(moe_experts=int(hf.get('num_local_experts') or hf['num_experts']), moe_top_k=int(hf['num_experts_per_tok']),
              moe_mlp_dim=int(hf.get('moe_intermediate_size') or hf['intermediate_size']),
              moe_every=every, moe_first_dense=len(dense), moe_router=router,
              moe_norm_topk_prob=bool(hf.get('norm_topk_prob', kind == 'mixtral')), qk_norm=qk_norm)


def model_overrides(hf: dict) -> dict:
  """cfg.model values that compute what the Hugging Face `config.json` dict `hf` describes."""
  if hf.get('model_type') != gpt_oss.MODEL_TYPE:  # gpt-oss dequantizes its MXFP4 experts itself (hf/gpt_oss.py)
    refuse_quantized(hf)  # every other family: before its own key checks, with the fix
  if hf.get('vision_config') is not None or hf.get('model_type') == 'gemma3':
    raise HFImportError(f'{hf.get("architectures") or hf.get("model_type")} has a vision tower (vision_config): '
                        f'jaxlm imports text models only; import the text model (Gemma3ForCausalLM, model_type '
                        f'gemma3_text).')
  if hf.get('model_type') in deepseek.MODEL_TYPES:  # multi-head latent attention: its own keys (hf/deepseek.py)
    return deepseek.overrides(hf, _rope(hf))
  if hf.get('model_type') == gpt_oss.MODEL_TYPE:  # sinks, biases, clamped experts: its own keys (hf/gpt_oss.py)
    return gpt_oss.overrides(hf, _rope({**hf, 'rope_theta': hf.get('rope_theta') or gpt_oss.DEFAULT_THETA}))
  if hf.get('model_type') in FAMILY_BLOCKS:
    hf, family = family_overrides(hf)
  else:
    family = {}
  if hf.get('model_type') not in IMPORTABLE:
    raise HFImportError(f'model_type={hf.get("model_type")!r}: only {", ".join(IMPORTABLE)} checkpoints '
                        f'can be imported.')
  if hf.get('use_sliding_window') is False:  # Qwen families: transformers then ignores sliding_window (sets None)
    hf = {**hf, 'sliding_window': None}
  if hf.get('hidden_act', 'silu') != 'silu':
    raise HFImportError(f'hidden_act={hf["hidden_act"]!r}: jaxlm\'s MLP is SwiGLU (silu) only.')
  for key, allowed in _UNSUPPORTED.items():
    if key in hf and hf[key] not in allowed:
      raise HFImportError(f'{key}={hf[key]!r} is not supported by jaxlm (it needs {allowed[0]!r}).')
  if any(kind != 'full_attention' for kind in hf.get('layer_types') or []):
    raise HFImportError(f'layer_types={hf["layer_types"]} is not supported: jaxlm attends over the full context '
                        f'in every layer (no sliding-window layers).')
  D, H = hf['hidden_size'], hf['num_attention_heads']
  K = hf.get('num_key_value_heads') or H
  E = hf.get('head_dim') or D // H
  if H % K or E % 2:
    raise HFImportError(f'num_key_value_heads={K} must divide num_attention_heads={H}, and head_dim={E} be even.')
  return dict(vocab_size=hf['vocab_size'], d_model=D, num_layers=hf['num_hidden_layers'], num_heads=H,
              num_kv_heads=K, head_dim=E, mlp_dim=hf['intermediate_size'], parallel_block=False,
              tie_embeddings=False, norm_eps=float(hf.get('rms_norm_eps', 1e-6)), **_rope(hf),
              **({'qk_norm': DENSE_FAMILIES[hf['model_type']]} if hf['model_type'] in DENSE_FAMILIES else {}),
              **_moe_overrides(hf), **family)


def checkpoint_overrides(hf: dict, tensors: dict) -> dict:
  """cfg.model values read from the tensors rather than config.json: DeepSeek-V3's stored MTP depth."""
  if hf.get('model_type') != deepseek.MODEL_TYPE:
    return {}
  depth = deepseek.stored_mtp_depth(tensors, hf['num_hidden_layers'])
  return {'mtp_depth': depth} if depth else {}


def from_hf(tensors: dict[str, np.ndarray], m: model_lib.ModelConfig, *, scan_layers: bool) -> dict:
  """jaxlm params (float32 numpy) of a Hugging Face Llama state dict: the inverse of export.to_hf."""
  D, L = m.d_model, m.num_layers
  tensors = {k.removeprefix('model.'): v for k, v in gpt_oss.dequantized(tensors).items()}
  if m.mla.kv_lora_rank:  # DeepSeek-V3's multi-token prediction layers follow the last block
    deepseek.refuse_mtp_layers(tensors, L + m.mtp_depth)

  def get(name, shape=None):
    if name not in tensors:
      raise HFImportError(f'tensor {name!r} is missing from the checkpoint.')
    x = np.asarray(tensors[name], np.float32)
    if shape is not None and x.shape != shape:
      raise HFImportError(f'tensor {name!r} has shape {x.shape}, config.json implies {shape}.')
    return x

  layers = [layer_from_hf(tensors, get, f'layers.{i}.', m, model_lib.is_moe(m, i)) for i in range(L)]
  embedding = get('embed_tokens.weight', (m.vocab_size, D))
  lm_head = tensors.get('lm_head.weight', embedding)  # absent when tied: the head is the embedding
  params = {'embedding': embedding, 'final_norm': {'scale': get('norm.weight', (D,))},
            'unembed': np.ascontiguousarray(np.asarray(lm_head, np.float32).T)}
  first = model_lib.dense_prefix(m)
  stack = lambda units: jax.tree.map(lambda *xs: np.stack(xs), *units)  # noqa: E731
  if scan_layers and first:  # the dense first layers: their own stack (model.Decoder)
    params['dense_layers'] = stack(layers[:first])
  if scan_layers and m.moe.experts and m.moe.every > 1:  # scanned in groups of moe_every layers (model.Group)
    n = m.moe.every
    params['layers'] = stack([{f'block_{j}': layers[first + g * n + j] for j in range(n)}
                              for g in range((L - first) // n)])
  elif scan_layers:
    params['layers'] = stack(layers[first:])
  else:
    params.update({f'layers_{i}': p for i, p in enumerate(layers)})
  if m.mla.kv_lora_rank and m.mtp_depth:
    params['mtp'] = deepseek.mtp_from_hf(tensors, get, m, layer_from_hf, model_lib.is_moe(m, L - 1))
  return jax.tree.map(np.ascontiguousarray, params)


def layer_from_hf(tensors: dict, get, pre: str, m: model_lib.ModelConfig, moe: bool) -> dict:
  """One decoder layer's jaxlm parameters from the tensors under `pre` (layers.{i}.); `moe`: its MLP kind."""
  D, H, K, E = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim
  layer = {
      'attention': deepseek.attention_from_hf(get, pre, m) if m.mla.kv_lora_rank else {
          'query': get(pre + 'self_attn.q_proj.weight', (H * E, D)).T.reshape(D, H, E),
          'key': get(pre + 'self_attn.k_proj.weight', (K * E, D)).T.reshape(D, K, E),
          'value': get(pre + 'self_attn.v_proj.weight', (K * E, D)).T.reshape(D, K, E),
          'out': get(pre + 'self_attn.o_proj.weight', (D, H * E)).T.reshape(H, E, D)},
      **{ours: {'scale': get(pre + theirs + '.weight', (D,))} for ours, theirs in norm_names(m).items()}}
  if m.attention.sinks or m.attention.bias:
    layer['attention'].update(gpt_oss.attention_from_hf(get, pre, m))
  if m.attention.qk_norm != 'none':  # Qwen3: one (E,) scale per q/k; OLMoE: over all heads, (H·E,) and (K·E,)
    shapes = ((E,), (E,)) if m.attention.qk_norm == 'head' else ((H, E), (K, E))
    layer['attention']['query_norm'] = {'scale': get(pre + 'self_attn.q_norm.weight').reshape(shapes[0])}
    layer['attention']['key_norm'] = {'scale': get(pre + 'self_attn.k_norm.weight').reshape(shapes[1])}
  if moe and m.moe.router == 'gpt_oss':
    layer['moe'] = gpt_oss.moe_from_hf(get, pre, m)
  elif moe:
    layer['moe'] = _experts_from_hf(tensors, get, pre, m)
    if m.mla.kv_lora_rank:
      layer['moe'] = deepseek.moe_from_hf(get, pre, m, layer['moe'])
  else:
    layer['mlp'] = {'gate': get(pre + 'mlp.gate_proj.weight').T, 'up': get(pre + 'mlp.up_proj.weight').T,
                    'down': get(pre + 'mlp.down_proj.weight').T}
  return layer


def _experts_from_hf(tensors: dict, get, pre: str, m: model_lib.ModelConfig) -> dict:
  """One MoE layer's jaxlm parameters from either Hugging Face layout, told apart by key names, never by shape.

  per-expert  Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2 (gate/up/down), or Qwen3-MoE's and OLMoE's
              mlp.experts.{e}.gate_proj/up_proj/down_proj: each torch (out, in).
  fused       transformers 5's in-memory layout: mlp.experts.gate_up_proj (X, 2F, D), gate rows first, and
              mlp.experts.down_proj (X, D, F).
  """
  X, D, F = m.moe.experts, m.d_model, m.moe.mlp_dim
  block = pre + ('block_sparse_moe.' if pre + 'block_sparse_moe.gate.weight' in tensors else 'mlp.')
  out = {'router': get(block + 'gate.weight', (X, D)).T, 'bias': np.zeros((X,), np.float32)}
  if block + 'experts.gate_up_proj' in tensors:
    gate_up = get(block + 'experts.gate_up_proj', (X, 2 * F, D))
    out.update(gate=gate_up[:, :F].transpose(0, 2, 1), up=gate_up[:, F:].transpose(0, 2, 1),
               down=get(block + 'experts.down_proj', (X, D, F)).transpose(0, 2, 1))
    return out
  names = ('w1', 'w3', 'w2') if block.endswith('block_sparse_moe.') else ('gate_proj', 'up_proj', 'down_proj')
  for key, name, shape in zip(('gate', 'up', 'down'), names, ((F, D), (F, D), (D, F))):
    out[key] = np.stack([get(f'{block}experts.{e}.{name}.weight', shape).T for e in range(X)])
  return out


def _experts_to_hf(p: dict, pre: str, m: model_lib.ModelConfig) -> dict:
  """One MoE layer in its family's per-expert layout (what transformers' save_pretrained writes)."""
  if np.any(np.asarray(p['bias']) != 0):
    raise ExportError(f'the model\'s expert-selection biases are not zero (auxiliary-loss-free balancing, '
                      f'model.moe_bias_rate): {MOE_ARCHITECTURES[m.moe.router][0]} has no place for them; train with '
                      f'model.moe_bias_rate=0 (and model.moe_aux_loss instead) to export.')
  mixtral = m.moe.router == 'mixtral'
  block = pre + ('block_sparse_moe.' if mixtral else 'mlp.')
  names = ('w1', 'w3', 'w2') if mixtral else ('gate_proj', 'up_proj', 'down_proj')
  out = {block + 'gate.weight': np.asarray(p['router'], np.float32).T}  # (X, D)
  for key, name in zip(('gate', 'up', 'down'), names):
    w = np.asarray(p[key], np.float32)
    for e in range(m.moe.experts):
      out[f'{block}experts.{e}.{name}.weight'] = w[e].T
  return out
