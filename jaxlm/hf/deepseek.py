"""DeepSeek-V3 (DeepseekV3ForCausalLM) and DeepSeek-V2 (DeepseekV2ForCausalLM) both directions side by side:
config.json <-> cfg.model keys, and the tensors of multi-head latent attention (jaxlm/mla.py) and of the DeepSeek
mixture of experts (shared experts, the expert-selection bias). convert.py keeps the tensors' mapping common to
every family and calls these.

V2 is V3's model but for the router (model.moe_router=deepseek_v2): softmax scores, top-k greedy or limited to
the groups with the best single score (topk_method group_limited_greedy), no renormalisation, no selection bias
(e_score_correction_bias), and no MTP layers. V2's checkpoints always store the rotary dims interleaved.

RoPE: DeepSeek's checkpoints store the rotary dims of q_b_proj's and kv_a_proj_with_mqa's rows as interleaved
pairs (2i, 2i+1) (config rope_interleave, on in the released ones); jaxlm rotates half-split pairs (i, i + Er/2),
so those rows are permuted on the way in and back on the way out.

Multi-token prediction: a released checkpoint stores its num_nextn_predict_layers MTP layers after the last block
(model.layers.61.* in V3), which transformers ignores; jaxlm imports them as its MTP depths (jaxlm/mtp.py, the
block of the last layer's kind) and exports them back to the same names.
"""

import numpy as np

from jaxlm.hf.families import ExportError, HFImportError

ARCHITECTURE, MODEL_TYPE = 'DeepseekV3ForCausalLM', 'deepseek_v3'
V2_ARCHITECTURE, V2_MODEL_TYPE = 'DeepseekV2ForCausalLM', 'deepseek_v2'
ARCHITECTURES, MODEL_TYPES = (ARCHITECTURE, V2_ARCHITECTURE), (MODEL_TYPE, V2_MODEL_TYPE)
# config.json keys with the one value jaxlm computes; anything else there is refused by name.
_FIXED = {'attention_bias': (False, None), 'hidden_act': ('silu',), 'scoring_func': ('sigmoid', None),
          'topk_method': ('noaux_tc', None), 'moe_layer_freq': (1, None), 'quantization_config': (None,),
          'pretraining_tp': (1, None), 'attention_dropout': (0.0, 0, None),
          'rope_interleave': (True, None)}  # the released layout, which attention_from_hf de-interleaves
# DeepSeek-V2's: softmax routing, greedy or group-limited; transformers' V2 never renormalises the top-k weights.
_FIXED_V2 = {**{k: v for k, v in _FIXED.items() if k not in ('scoring_func', 'topk_method', 'rope_interleave')},
             'scoring_func': ('softmax', None), 'topk_method': ('greedy', 'group_limited_greedy', None),
             'norm_topk_prob': (False, None), 'mlp_bias': (False, None)}
# Keys read below or without effect on the forward pass (training or bookkeeping).
_KNOWN = {'architectures', 'model_type', 'vocab_size', 'hidden_size', 'intermediate_size', 'moe_intermediate_size',
          'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads', 'n_shared_experts', 'n_routed_experts',
          'routed_scaling_factor', 'kv_lora_rank', 'q_lora_rank', 'qk_rope_head_dim', 'v_head_dim',
          'qk_nope_head_dim', 'n_group', 'topk_group', 'num_experts_per_tok', 'first_k_dense_replace',
          'norm_topk_prob', 'max_position_embeddings', 'rms_norm_eps', 'rope_parameters', 'rope_scaling',
          'rope_theta', 'tie_word_embeddings', 'num_nextn_predict_layers', 'qk_head_dim',
          'head_dim', 'initializer_range', 'use_cache', 'bos_token_id', 'eos_token_id', 'pad_token_id', 'dtype',
          'torch_dtype', 'transformers_version', 'output_router_logits', 'aux_loss_alpha', 'seq_aux', 'ep_size',
          'router_aux_loss_coef', '_name_or_path', 'auto_map'}  # auto_map: the remote code, not used


def overrides(hf: dict, rope: dict) -> dict:
  """cfg.model values for a DeepSeek-V3 or -V2 config.json; `rope`: convert._rope's reading of its RoPE."""
  kind = hf['model_type']
  fixed = _FIXED_V2 if kind == V2_MODEL_TYPE else _FIXED
  for key, allowed in fixed.items():
    if key in hf and hf[key] not in allowed:
      raise HFImportError(f'{key}={hf[key]!r} is not supported for {kind}: jaxlm computes '
                          f'{" or ".join(repr(a) for a in allowed if a is not None)}.')
  unknown = sorted(set(hf) - _KNOWN - set(fixed))
  if unknown:
    raise HFImportError(f'config.json field {unknown[0]!r} (={hf[unknown[0]]!r}) is not handled by jaxlm\'s '
                        f'{kind} import; remove it if it does not change the model.')
  params = {**(hf.get('rope_parameters') or {}), **(hf.get('rope_scaling') or {})}
  mscale_all_dim = float(params.get('mscale_all_dim') or 0.0) if rope['rope_scaling'] != 'none' else 0.0
  if mscale_all_dim and rope['rope_scaling'] != 'yarn':  # transformers would scale the softmax; jaxlm: yarn only
    raise HFImportError(f'rope mscale_all_dim={mscale_all_dim} under rope_type={rope["rope_scaling"]} is not '
                        f'supported: jaxlm applies DeepSeek\'s softmax mscale² with yarn only.')
  if mscale_all_dim:  # YaRN's softmax correction (rope.softmax_mscale); the cos/sin ratio is in `rope` already
    rope = dict(rope, rope_mscale_all_dim=mscale_all_dim)
  H, En, Er = hf['num_attention_heads'], hf['qk_nope_head_dim'], hf['qk_rope_head_dim']
  return dict(**_mla_and_moe(hf, H, En, Er), **rope, **_router(hf))


def _router(hf: dict) -> dict:
  """cfg.model's router keys: V3's sigmoid routing with its selection bias, or V2's softmax routing (greedy, or
  group-limited) with none (model.moe_bias_rate=0: none grows in training either, so the model stays V2's)."""
  if hf['model_type'] == MODEL_TYPE:
    return dict(moe_router='deepseek_v3', moe_groups=hf.get('n_group') or 1, moe_top_groups=hf.get('topk_group') or 1,
                moe_norm_topk_prob=bool(hf.get('norm_topk_prob', True)))
  limited = hf.get('topk_method') == 'group_limited_greedy'
  return dict(moe_router='deepseek_v2', moe_groups=hf['n_group'] if limited else 1,
              moe_top_groups=hf['topk_group'] if limited else 1, moe_norm_topk_prob=False, moe_bias_rate=0.0)


def _mla_and_moe(hf: dict, H: int, En: int, Er: int) -> dict:
  """cfg.model's sizes, MLA and mixture-of-experts keys common to V2 and V3."""
  return dict(vocab_size=hf['vocab_size'], d_model=hf['hidden_size'], num_layers=hf['num_hidden_layers'],
              num_heads=H, num_kv_heads=H, head_dim=En + Er, mlp_dim=hf['intermediate_size'], parallel_block=False,
              tie_embeddings=False, norm_eps=float(hf.get('rms_norm_eps', 1e-6)), qk_norm='none',
              kv_lora_rank=hf['kv_lora_rank'], q_lora_rank=hf.get('q_lora_rank') or 0, qk_nope_head_dim=En,
              qk_rope_head_dim=Er, v_head_dim=hf['v_head_dim'], moe_experts=hf['n_routed_experts'],
              moe_top_k=hf['num_experts_per_tok'], moe_mlp_dim=hf['moe_intermediate_size'],
              moe_shared_experts=hf.get('n_shared_experts') or 0, moe_every=1,
              moe_first_dense=hf.get('first_k_dense_replace') or 0,
              moe_routed_scale=float(hf.get('routed_scaling_factor', 1.0)))


def rope_order(m, interleave: bool = True) -> np.ndarray:
  """Per head, the HF rows that become jaxlm's En + Er query/key columns: the rope part de-interleaved."""
  c = m.mla
  Er = c.qk_rope_head_dim
  rot = np.concatenate([np.arange(0, Er, 2), np.arange(1, Er, 2)]) if interleave else np.arange(Er)
  return np.concatenate([np.arange(c.qk_nope_head_dim), c.qk_nope_head_dim + rot])


def peft_modules(m) -> dict:
  """MLA's adaptable weights -> (peft's module name under the layer, the HF row order of B's output columns or
  None): the rotary columns of q_(b_)proj and kv_a_proj_with_mqa re-interleaved, as attention_to_hf does."""
  c = m.mla
  back = np.argsort(rope_order(m))
  R, En = c.kv_lora_rank, c.qk_nope_head_dim
  query = ('query_b', 'self_attn.q_b_proj') if c.q_lora_rank else ('query', 'self_attn.q_proj')
  return {query[0]: (query[1], back), 'query_a': ('self_attn.q_a_proj', None),
          'kv_a': ('self_attn.kv_a_proj_with_mqa', np.concatenate([np.arange(R), R + back[En:] - En])),
          'kv_b': ('self_attn.kv_b_proj', None), 'out': ('self_attn.o_proj', None)}


def stored_mtp_depth(tensors: dict, num_layers: int) -> int:
  """How many multi-token prediction layers the checkpoint stores after its last block (a released DeepSeek-V3's
  num_nextn_predict_layers, model.layers.{L + k - 1}.eh_proj, which transformers ignores): the model.mtp_depth
  an import takes. A config's num_nextn_predict_layers without those tensors imports the main model alone."""
  names, depth = {k.removeprefix('model.') for k in tensors}, 0
  while f'layers.{num_layers + depth}.eh_proj.weight' in names:
    depth += 1
  return depth


def refuse_mtp_layers(tensors: dict, first: int) -> None:
  """An HFImportError if the checkpoint stores layers from `first` on (L + model.mtp_depth), which jaxlm would
  drop: more multi-token prediction layers than the model keeps."""
  extra = sorted(k for k in tensors if k.startswith('layers.') and int(k.split('.')[1]) >= first)
  if extra:
    raise HFImportError(f'tensor {"model." + extra[0]!r} and {len(extra) - 1} more belong to a multi-token '
                        f'prediction layer or a layer past the model\'s {first} layers and MTP depths '
                        f'(model.mtp_depth), which would be dropped; import the directory with '
                        f'jaxlm.hf.import_llama (it keeps each stored layer with an eh_proj) or remove them.')


def _mtp_shared(tensors: dict, pre: str) -> None:
  """DeepSeek stores copies of the embedding and output head in each MTP layer; jaxlm shares the model's."""
  for name, main in (('embed_tokens.weight', 'embed_tokens.weight'), ('shared_head.head.weight', 'lm_head.weight')):
    if pre + name in tensors and not np.array_equal(tensors[pre + name], tensors.get(main)):
      raise HFImportError(f'tensor {"model." + pre + name!r} differs from the model\'s {main!r}: jaxlm\'s '
                          f'multi-token prediction shares the model\'s embedding and output head; make them equal.')


def mtp_from_hf(tensors: dict, get, m, layer_from_hf, moe: bool) -> dict:
  """jaxlm's MTP parameters (jaxlm/mtp.py) from the layers DeepSeek-V3 stores after its last block: depth k at
  layers.{L + k - 1}: enorm, hnorm, eh_proj, a decoder layer (`moe`: the last layer's kind), shared_head.norm."""
  D, out = m.d_model, {}
  for k in range(1, m.mtp_depth + 1):
    pre = f'layers.{m.num_layers + k - 1}.'
    _mtp_shared(tensors, pre)
    eh = get(pre + 'eh_proj.weight', (D, 2 * D))  # torch (out, in), in = [enorm(embedding), hnorm(hidden)]
    out[f'proj_{k}'] = np.concatenate([eh[:, D:], eh[:, :D]], 1).T  # jaxlm's (2D, D) takes [hidden; embedding]
    out[f'hidden_norm_{k}'] = {'scale': get(pre + 'hnorm.weight', (D,))}
    out[f'embed_norm_{k}'] = {'scale': get(pre + 'enorm.weight', (D,))}
    out[f'norm_{k}'] = {'scale': get(pre + 'shared_head.norm.weight', (D,))}
    out[f'block_{k}'] = layer_from_hf(tensors, get, pre, m, moe)
  return out


def mtp_to_hf(p: dict, m, layer_to_hf, main: dict) -> dict:
  """The inverse of mtp_from_hf, with the copies of the embedding and head (`main`: the model's tensors) that
  the released checkpoints store in each MTP layer."""
  D, out = m.d_model, {}
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  for k in range(1, m.mtp_depth + 1):
    pre = f'model.layers.{m.num_layers + k - 1}.'
    proj = f32(p[f'proj_{k}']).T  # (D, 2D): [hidden | embedding] columns
    out[pre + 'eh_proj.weight'] = np.concatenate([proj[:, D:], proj[:, :D]], 1)
    out[pre + 'hnorm.weight'] = f32(p[f'hidden_norm_{k}']['scale'])
    out[pre + 'enorm.weight'] = f32(p[f'embed_norm_{k}']['scale'])
    out[pre + 'shared_head.norm.weight'] = f32(p[f'norm_{k}']['scale'])
    out[pre + 'embed_tokens.weight'] = main['model.embed_tokens.weight']
    out[pre + 'shared_head.head.weight'] = main['lm_head.weight']
    out.update(layer_to_hf(p[f'block_{k}'], pre, m))
  return out


def attention_from_hf(get, pre: str, m) -> dict:
  """One layer's MLA parameters (jaxlm/mla.py) from `pre`self_attn.* tensors (torch (out, in))."""
  c, D, H = m.mla, m.d_model, m.num_heads
  R, En, Er, Ev = c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
  order = rope_order(m)
  a = pre + 'self_attn.'
  out = {}
  if c.q_lora_rank:
    out['query_a'] = get(a + 'q_a_proj.weight', (c.q_lora_rank, D)).T
    out['query_norm'] = get(a + 'q_a_layernorm.weight', (c.q_lora_rank,))
    out['query_b'] = get(a + 'q_b_proj.weight', (H * (En + Er), c.q_lora_rank)).T.reshape(-1, H, En + Er)[..., order]
  else:
    out['query'] = get(a + 'q_proj.weight', (H * (En + Er), D)).T.reshape(D, H, En + Er)[..., order]
  kv_a = get(a + 'kv_a_proj_with_mqa.weight', (R + Er, D)).T  # (D, R + Er)
  out['kv_a'] = np.concatenate([kv_a[:, :R], kv_a[:, R:][:, order[En:] - En]], 1)
  out['kv_norm'] = get(a + 'kv_a_layernorm.weight', (R,))
  out['kv_b'] = get(a + 'kv_b_proj.weight', (H * (En + Ev), R)).T.reshape(R, H, En + Ev)
  out['out'] = get(a + 'o_proj.weight', (D, H * Ev)).T.reshape(H, Ev, D)
  return out


def attention_to_hf(p: dict, pre: str, m) -> dict:
  """The inverse of attention_from_hf: one layer's self_attn.* tensors (float32, torch (out, in))."""
  c, D, H = m.mla, m.d_model, m.num_heads
  back = np.argsort(rope_order(m))
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  a, out = pre + 'self_attn.', {}
  if c.q_lora_rank:
    out[a + 'q_a_proj.weight'] = f32(p['query_a']).T
    out[a + 'q_a_layernorm.weight'] = f32(p['query_norm'])
    out[a + 'q_b_proj.weight'] = f32(p['query_b'])[..., back].reshape(c.q_lora_rank, -1).T
  else:
    out[a + 'q_proj.weight'] = f32(p['query'])[..., back].reshape(D, -1).T
  R, En = c.kv_lora_rank, c.qk_nope_head_dim
  kv_a = f32(p['kv_a'])
  out[a + 'kv_a_proj_with_mqa.weight'] = np.concatenate([kv_a[:, :R], kv_a[:, R:][:, back[En:] - En]], 1).T
  out[a + 'kv_a_layernorm.weight'] = f32(p['kv_norm'])
  out[a + 'kv_b_proj.weight'] = f32(p['kv_b']).reshape(R, -1).T
  out[a + 'o_proj.weight'] = f32(p['out']).reshape(H * c.v_head_dim, D).T
  return out


def moe_from_hf(get, pre: str, m, experts: dict) -> dict:
  """A MoE layer's parameters: the routed `experts` (convert's reading) plus the selection bias and the shared
  experts (one SwiGLU, jaxlm's `shared`)."""
  X, D, F = m.moe.experts, m.d_model, m.moe.mlp_dim * m.moe.shared_experts
  v2 = m.moe.router == 'deepseek_v2'  # no selection bias: zeros, which route as none
  out = dict(experts, bias=np.zeros((X,), np.float32) if v2 else get(pre + 'mlp.gate.e_score_correction_bias', (X,)))
  if m.moe.shared_experts:
    s = pre + 'mlp.shared_experts.'
    out['shared'] = {'gate': get(s + 'gate_proj.weight', (F, D)).T, 'up': get(s + 'up_proj.weight', (F, D)).T,
                     'down': get(s + 'down_proj.weight', (D, F)).T}
  return out


def moe_to_hf(p: dict, pre: str, m) -> dict:
  """A MoE layer's tensors in the per-expert layout transformers' save_pretrained writes."""
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  out = {pre + 'mlp.gate.weight': f32(p['router']).T}
  if m.moe.router != 'deepseek_v2':
    out[pre + 'mlp.gate.e_score_correction_bias'] = f32(p['bias'])
  elif np.any(f32(p['bias']) != 0):
    raise ExportError(f'the expert-selection biases of layer {pre} are not zero (model.moe_bias_rate > 0): '
                      f'{V2_ARCHITECTURE} has none; train with model.moe_bias_rate=0 to export.')
  for key in ('gate', 'up', 'down'):
    for e in range(m.moe.experts):
      out[f'{pre}mlp.experts.{e}.{key}_proj.weight'] = f32(p[key][e]).T
    if 'shared' in p:
      out[f'{pre}mlp.shared_experts.{key}_proj.weight'] = f32(p['shared'][key]).T
  return out


def architecture(m) -> str:
  """The class of an MLA model: DeepSeek-V2's for its router, else V3's (check_exportable says what fits)."""
  return V2_ARCHITECTURE if m.moe.experts and m.moe.router == 'deepseek_v2' else ARCHITECTURE


def check_exportable(m, features: list[str]) -> None:
  """An ExportError unless DeepseekV3ForCausalLM or DeepseekV2ForCausalLM computes `m` (an MLA model)."""
  moe = m.moe
  problems = list(features)
  if m.parallel_block or m.attention.qk_norm != 'none':
    problems.append(f'parallel_block={m.parallel_block}, qk_norm={m.attention.qk_norm}')
  if moe.experts and (moe.router not in ('deepseek_v3', 'deepseek_v2') or moe.every != 1):
    problems.append(f'model.moe_router={moe.router}, moe_every={moe.every}')
  if moe.router == 'deepseek_v2' and (m.mtp_depth or moe.norm_topk_prob):
    problems.append(f'model.mtp_depth={m.mtp_depth}, moe_norm_topk_prob={moe.norm_topk_prob} with the deepseek_v2 '
                    f'router ({V2_ARCHITECTURE} has no MTP layers and never renormalises)')
  if not moe.experts or m.tie_embeddings:
    problems.append(f'moe_experts={moe.experts}, tie_embeddings={m.tie_embeddings}')
  if problems:
    raise ExportError(f'{"; ".join(problems)}: {ARCHITECTURE} and {V2_ARCHITECTURE} (the classes with MLA) '
                      f'compute the sequential pre-norm block with deepseek_v3 (or deepseek_v2) routing in every '
                      f'layer after moe_first_dense and an untied head; change those keys to export.')


def hf_config(m) -> dict:
  """config.json's DeepSeek-V3 (or -V2) keys for `m` (beside convert.hf_config's common ones)."""
  moe = m.moe
  if architecture(m) == V2_ARCHITECTURE:  # no rope_interleave (always interleaved) nor MTP layers
    return {**{k: v for k, v in _v3_config(m).items() if k not in ('rope_interleave', 'num_nextn_predict_layers')},
            'model_type': V2_MODEL_TYPE, 'norm_topk_prob': False,
            'topk_method': 'group_limited_greedy' if moe.groups > 1 else 'greedy'}
  return _v3_config(m)


def _v3_config(m) -> dict:
  """DeepSeek-V3's keys (V2's are these less two)."""
  c, moe = m.mla, m.moe
  return {'model_type': MODEL_TYPE, 'kv_lora_rank': c.kv_lora_rank, 'q_lora_rank': c.q_lora_rank or None,
          'qk_nope_head_dim': c.qk_nope_head_dim, 'qk_rope_head_dim': c.qk_rope_head_dim,
          'v_head_dim': c.v_head_dim, 'head_dim': c.qk_rope_head_dim, 'rope_interleave': True,
          'n_routed_experts': moe.experts, 'num_experts_per_tok': moe.top_k, 'moe_intermediate_size': moe.mlp_dim,
          'n_shared_experts': moe.shared_experts, 'first_k_dense_replace': moe.first_dense, 'n_group': moe.groups,
          'topk_group': moe.top_groups, 'norm_topk_prob': moe.norm_topk_prob,
          'routed_scaling_factor': moe.routed_scale, 'num_nextn_predict_layers': m.mtp_depth}
