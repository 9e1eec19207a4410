"""DeepSeek-V3 through import and export: multi-head latent attention (jaxlm/mla.py) and the DeepSeek mixture of
experts; jaxlm's logits equal transformers' on a tiny random DeepseekV3ForCausalLM (float32, eager attention).

The model has a query latent, decoupled RoPE (interleaved in the checkpoint), one dense layer then one MoE layer
(first_k_dense_replace = 1) with a shared expert and group-limited routing. Norm scales are drawn away from 1 and
the router's weights and selection bias are drawn large, so the k-th and (k+1)-th experts of a token are far apart
(a tie broken differently would show as a logit difference, not hide in one).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxlm import config as config_lib
from jaxlm import errors
from jaxlm import mla as mla_lib
from jaxlm import model as model_lib
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.hf import export
from jaxlm.hf import import_llama as import_hf
from tests.data import chat_fixtures
from tests.helpers import export_round_trip, load_config, odd_config, random_batch
from tests.hf.test_families import _logits, _torch_logits

SEQ = 24
CONFIG = dict(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
              qk_nope_head_dim=10, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=640, initializer_range=0.1, rms_norm_eps=1e-6,
              rope_parameters={'rope_type': 'yarn', 'rope_theta': 1000.0, 'factor': 40.0, 'mscale': 0.7,
                               'mscale_all_dim': 1.0, 'original_max_position_embeddings': 16, 'beta_fast': 32,
                               'beta_slow': 1})  # DeepSeek's YaRN, mscale != mscale_all_dim: both factors differ
# The released DeepSeek-V3 config.json's own RoPE and MTP fields (4.x style rope_scaling), for the second case.
RELEASED = dict(num_nextn_predict_layers=1, rope_theta=10000.0, max_position_embeddings=163840, rope_scaling={
    'type': 'yarn', 'factor': 40, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'original_max_position_embeddings': 4096,
    'beta_fast': 32, 'beta_slow': 1})
MAX_ABS = {}
ORIGINAL = {}  # 'model': the fixture's transformers model


def _spread(original):
  """A transformers DeepSeek model with random norm scales (so a dropped norm shows) and large router logits (the
  chosen experts win by a wide margin, far from float32 ties); the model, changed in place."""
  import torch
  with torch.no_grad():
    for name, p in original.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(torch.rand_like(p) + 0.5)
      elif name.endswith('mlp.gate.weight'):
        p.copy_(torch.randn_like(p))
  return original


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """(transformers model, its directory, jaxlm run directory, ModelConfig, params, tokens, transformers' logits)."""
  torch = pytest.importorskip('torch', reason='torch is not installed: pip install -e ".[test]"')
  transformers = pytest.importorskip('transformers', reason='transformers is not installed: pip install -e ".[test]"')
  torch.manual_seed(0)
  config = transformers.DeepseekV3Config(**CONFIG)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  original = _spread(transformers.DeepseekV3ForCausalLM(config).float().eval())
  with torch.no_grad():
    for layer in original.model.layers[CONFIG['first_k_dense_replace']:]:
      layer.mlp.gate.e_score_correction_bias.copy_(torch.rand(CONFIG['n_routed_experts']) * 0.2 - 0.1)
  root = tmp_path_factory.mktemp('deepseek')
  original.save_pretrained(str(root / 'hf'), safe_serialization=True)
  # The model's tokenizer (vocab_size ids), chat template and generation_config.json with two end-of-sequence
  # ids, as a DeepSeek directory ships them: the import carries them beside the run.
  tok = tokenizer_lib.load(chat_fixtures.make_tokenizer(str(root / 'hf'), vocab_size=CONFIG['vocab_size']))
  assert tok.vocab_size == CONFIG['vocab_size']
  (root / 'hf' / 'generation_config.json').write_text(json.dumps(
      {'bos_token_id': tok.bos_id, 'eos_token_id': [tok.eos_id, tok.token_to_id('<|im_end|>')]}))
  result = import_hf.import_hf(str(root / 'hf'), str(root / 'run'))
  ORIGINAL['import'] = result
  cfg = export.read_config(result['checkpoint'])
  cfg.model.dtype = 'float32'
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = import_hf.from_hf(import_hf.read_safetensors(str(root / 'hf')), m, scan_layers=True)
  tokens = np.random.default_rng(1).integers(3, 97, (2, SEQ)).astype(np.int32)
  ORIGINAL['model'] = original  # for the generate test: the same model in transformers
  yield (transformers, root, m, params, tokens, _torch_logits((torch, transformers), original, tokens))
  print('\nmax |logits difference|: ' + ', '.join(f'{k} {v:.2e}' for k, v in MAX_ABS.items()))


def test_import_equals_transformers_and_rope_and_latent_norms_matter(imported, monkeypatch):
  """An imported DeepSeek-V3's logits == transformers' (1e-4) under DeepSeek's YaRN (mscale != mscale_all_dim),
  its layers scanned or unrolled;
  the same weights without the decoupled RoPE (positions all 0), with its rotary dims left interleaved, without
  the latent norms or without YaRN's softmax correction (mscale_all_dim) move them by >= 1e-2."""
  _, root, m, params, tokens, theirs = imported
  assert m.mla.kv_lora_rank == 16 and m.moe.first_dense == 1 and m.moe.router == 'deepseek_v3'
  assert m.rope_scaling == 'yarn' and m.rope_mscale_all_dim == 1.0 and m.rope_attention_factor != 1.0
  no_mscale = dataclasses.replace(m, rope_mscale_all_dim=0.0)
  MAX_ABS['without mscale_all_dim'] = float(np.abs(_logits(model_lib.Decoder(no_mscale), params, tokens)
                                                   - theirs).max())
  assert 'dense_layers' in params and 'shared' in params['layers']['moe']
  # One compiled forward of m for the import, no RoPE and the interleaved weights (same shapes): 3 calls, 1 compile.
  apply = jax.jit(model_lib.Decoder(m).apply)
  positions = np.tile(np.arange(tokens.shape[1], dtype=np.int32), (tokens.shape[0], 1))
  logits = lambda p, pos=positions: np.asarray(apply({'params': p}, tokens, np.ones_like(tokens), pos))  # noqa: E731
  MAX_ABS['import'] = float(np.abs(logits(params) - theirs).max())
  assert MAX_ABS['import'] <= 1e-4
  unrolled = dataclasses.replace(m, scan_layers=False)  # layers_0 (dense), layers_1 (MoE): no stacks
  per_layer = import_hf.from_hf(import_hf.read_safetensors(str(root / 'hf')), unrolled, scan_layers=False)
  assert {'layers_0', 'layers_1'} <= set(per_layer) and 'layers' not in per_layer
  MAX_ABS['import unrolled'] = float(np.abs(_logits(model_lib.Decoder(unrolled), per_layer, tokens) - theirs).max())
  assert MAX_ABS['import unrolled'] <= 1e-4
  assert model_lib.param_count(m) == sum(np.size(x) for x in jax.tree.leaves(params))

  no_rope = logits(params, np.zeros_like(tokens))
  MAX_ABS['without RoPE'] = float(np.abs(no_rope - theirs).max())
  interleaved = jax.tree_util.tree_map_with_path(  # the checkpoint's rotary order, not de-interleaved
      lambda path, x: _reinterleave(x, m) if str(path[-1].key) in ('query_b', 'kv_a') else x, params)
  MAX_ABS['rope interleaved'] = float(np.abs(logits(interleaved) - theirs).max())
  # A fresh trace (_logits' own jit) sees the patched norms.
  monkeypatch.setattr(mla_lib, '_rms', lambda scale, x, m: x)
  MAX_ABS['without latent norms'] = float(np.abs(_logits(model_lib.Decoder(m), params, tokens) - theirs).max())
  for key in ('without RoPE', 'rope interleaved', 'without latent norms', 'without mscale_all_dim'):
    assert MAX_ABS[key] >= 1e-2, key


def test_lora_on_mla_loads_in_peft_and_decodes_from_the_latent_cache(imported, tmp_path):
  """LoRA on every MLA projection (query_a, q_b, kv_a, kv_b, out): the adapter jaxlm writes loads in peft onto the
  transformers model with no key warning and gives jaxlm's logits (1e-4), the adapters moving them by >= 1e-2;
  greedy decoding from the absorbed latent cache (kv_b's adapter merged into the up-projection) equals the full
  recompute."""
  import warnings
  import flax.linen as nn
  import peft
  import torch
  from jaxlm import generate as generate_lib
  from jaxlm import lora as lora_lib
  transformers, _, m, params, tokens, theirs = imported
  lm = dataclasses.replace(m, lora=lora_lib.LoraConfig(rank=4, alpha=8.0,
                                                       targets=('query', 'out', 'query_a', 'kv_a', 'kv_b')))
  shapes = nn.unbox(jax.eval_shape(model_lib.Decoder(lm).init, jax.random.PRNGKey(0), tokens, np.ones_like(tokens),
                                   tokens)['params'])
  rng = np.random.default_rng(0)
  adapters = jax.tree.map(lambda s: rng.normal(0, 0.1, s.shape).astype(np.float32), lora_lib.split_adapters(shapes)[1])
  assert sorted(adapters['layers']['attention']) == sorted(
      f'{w}_lora_{x}' for w in ('query_a', 'query_b', 'kv_a', 'kv_b', 'out') for x in 'ab')
  tuned = lora_lib.join_adapters(params, adapters)
  ours = _logits(model_lib.Decoder(lm), tuned, tokens)
  assert np.abs(ours - theirs).max() >= 1e-2  # the adapters matter
  export.write_adapter(tuned, lm, str(tmp_path / 'adapter'))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    model = peft.PeftModel.from_pretrained(ORIGINAL['model'], str(tmp_path / 'adapter')).eval()
  try:
    assert not [str(w.message) for w in caught if 'key' in str(w.message).lower()]
    MAX_ABS['lora (peft)'] = float(np.abs(_torch_logits((torch, transformers), model, tokens) - ours).max())
    assert MAX_ABS['lora (peft)'] <= 1e-4
  finally:
    model.unload()  # the fixture's transformers model without the adapter layers again, for the other tests
  prompts = [list(tokens[0, :6]), list(tokens[1, :4])]
  cached = generate_lib.generate(lm, tuned, prompts, 6).tokens
  assert cached == [list(t) for t in generate_lib.generate_without_cache(lm, tuned, prompts, 6)]


def test_released_rope_config_imports_with_transformers_logits(imported):
  """The released config.json's RoPE (yarn, factor 40, mscale = mscale_all_dim = 1: cos/sin unscaled, the softmax
  by (0.1·ln 40 + 1)²) and num_nextn_predict_layers import; on the same weights jaxlm's logits == transformers'."""
  transformers, _, m, params, tokens, _ = imported
  import torch
  hf = dict(CONFIG, model_type='deepseek_v3', rope_interleave=True, **RELEASED)
  del hf['rope_parameters']
  rope = {k: v for k, v in import_hf.model_overrides(hf).items() if k.startswith('rope_')}
  assert rope['rope_attention_factor'] == 1.0 and rope['rope_mscale_all_dim'] == 1.0
  config = transformers.DeepseekV3Config(**{k: v for k, v in hf.items() if k != 'model_type'})
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  released = transformers.DeepseekV3ForCausalLM(config).float().eval()
  released.load_state_dict(ORIGINAL['model'].state_dict())
  theirs = _torch_logits((torch, transformers), released, tokens)
  MAX_ABS['released rope'] = float(np.abs(_logits(model_lib.Decoder(dataclasses.replace(m, **rope)), params, tokens)
                                          - theirs).max())
  assert MAX_ABS['released rope'] <= 1e-4


def _reinterleave(x, m):
  """A query_b (…, H, En + Er) or kv_a (D, R + Er) weight with its rotary columns back in interleaved order."""
  Er = m.mla.qk_rope_head_dim
  x = np.array(x)
  x[..., -Er:] = x[..., -Er:][..., np.argsort(np.concatenate([np.arange(0, Er, 2), np.arange(1, Er, 2)]))]
  return x


def test_export_round_trips_to_transformers(imported):
  """The export writes the checkpoint's tensors bit for bit under the same names, and transformers reloads it as
  DeepseekV3ForCausalLM with the original's logits (1e-4)."""
  transformers, root, _, _, tokens, theirs = imported
  import torch
  written, back = export_round_trip(root / 'hf', root / 'run', root / 'back', 'DeepseekV3ForCausalLM')
  assert written['model_type'] == 'deepseek_v3'
  MAX_ABS['export'] = float(np.abs(_torch_logits((torch, transformers), back, tokens) - theirs).max())
  assert MAX_ABS['export'] <= 1e-4
  # The tokenizer, its chat template and the end-of-sequence ids went through the import and came back out.
  assert ORIGINAL['import']['tokenizer_files'] == ['tokenizer.json', 'tokenizer_config.json', 'generation_config.json']
  source, exported = (transformers.AutoTokenizer.from_pretrained(str(root / d)) for d in ('hf', 'back'))
  text = 'Zed has 7 quartzs.\n    return y  # ü'
  assert exported(text)['input_ids'] == source(text)['input_ids']
  messages = chat_fixtures.conversations(3)[2]['messages']
  assert exported.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
      source.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  end_ids = json.loads((root / 'hf' / 'generation_config.json').read_text())['eos_token_id']
  assert json.loads((root / 'back' / 'generation_config.json').read_text())['eos_token_id'][:2] == end_ids


def test_export_refuses_what_deepseek_v3_does_not_compute(imported):
  """MLA with tied embeddings or with another router, or MTP modules without MLA (their one Hugging Face layout
  is DeepSeek-V3's), is refused by name."""
  m = imported[2]
  for changed, match in [(dataclasses.replace(m, tie_embeddings=True), 'tie_embeddings=True'),
                         (dataclasses.replace(m, moe=dataclasses.replace(m.moe, router='mixtral')),
                          'model.moe_router=mixtral'),
                         (dataclasses.replace(m, mtp_depth=1, mla=mla_lib.MlaConfig()), 'model.mtp_depth=1')]:
    with pytest.raises(export.ExportError, match=match):
      export.architecture(changed)


# The released DeepSeek-V3 config.json's quantization_config: FP8 weights in 128 × 128 blocks with their scales.
FP8 = {'activation_scheme': 'dynamic', 'fmt': 'e4m3', 'quant_method': 'fp8', 'weight_block_size': [128, 128]}


def test_import_refuses_fields_jaxlm_does_not_handle(tmp_path):
  """A config.json field jaxlm does not read, or one with a value it does not compute, is refused in one line that
  names it, the released FP8 quantization_config before any tensor is read; a plain query projection
  (q_lora_rank null, V2-Lite) is accepted as q_lora_rank=0."""
  hf = dict(CONFIG, model_type='deepseek_v3', rope_interleave=True)
  (tmp_path / 'config.json').write_text(json.dumps(dict(hf, quantization_config=FP8)))  # no tensors at all
  with pytest.raises(import_hf.HFImportError, match=r"field 'quantization_config' \(quant_method='fp8'\).*"
                                                    r"weight_scale_inv.*bfloat16 copy") as e:
    import_hf.import_hf(str(tmp_path), str(tmp_path / 'run'))
  assert '\n' not in str(e.value)
  assert import_hf.model_overrides(dict(hf, q_lora_rank=None))['q_lora_rank'] == 0
  for bad, match in [(dict(hf, attention_bias=True), 'attention_bias=True'),
                     (dict(hf, scoring_func='softmax'), "scoring_func='softmax'"),
                     (dict(hf, rope_interleave=False), 'rope_interleave=False'),
                     (dict(hf, use_flux_capacitor=3), "field 'use_flux_capacitor'"),
                     (dict(hf, rope_parameters={'rope_type': 'linear', 'factor': 4.0, 'mscale_all_dim': 1.0}),
                      'mscale_all_dim=1.0 under rope_type=linear')]:
    with pytest.raises(import_hf.HFImportError, match=match) as e:
      import_hf.model_overrides(bad)
    assert '\n' not in str(e.value)


@pytest.mark.parametrize('overrides, says', [
    (dict(attention='splash'), 'model.attention=splash with MLA'),
    (dict(attention='cudnn'), 'model.attention=cudnn with MLA: queries and keys are En [+] Er wide and values Ev'),
    (dict(qk_rope_head_dim=7), 'model.qk_rope_head_dim=7 must be even'),
    (dict(v_head_dim=0), 'model.v_head_dim=0 must be > 0'),
    (dict(attention_window=8), 'model.attention_window=8 with MLA'),
    (dict(rope_mscale_all_dim=1.0), 'model.rope_mscale_all_dim=1.0 must be >= 0 and is read only by'),
])
def test_validate_refuses_what_mla_cannot_run(overrides, says):
  c = load_config('palm_tiny')
  c.model.update(parallel_block=False, kv_lora_rank=16, **overrides)
  with pytest.raises(errors.ConfigError, match=says):
    config_lib.validate(c, num_devices=8)


def test_start_up_line_names_the_kernel_mla_runs():
  """model.attention=auto with MLA: the trainer's attention line says xla and why, not the fused kernel auto
  would pick for another model; without MLA the line is attention.select's."""
  c = load_config('palm_tiny')
  c.model.update(attention='auto', kv_lora_rank=16)
  assert mla_lib.kernel_reason(c.model).startswith('xla attention: multi-head latent attention')
  c.model.kv_lora_rank = 0
  assert mla_lib.kernel_reason(c.model) is None


def _mla_config(q_lora_rank: int):
  cfg = odd_config(parallel_block=False)
  cfg.model.update(kv_lora_rank=12, q_lora_rank=q_lora_rank, qk_nope_head_dim=10, qk_rope_head_dim=6,
                   v_head_dim=18)
  return cfg


def _mla_steps(cfg, batch, init=None, **axes):
  """([loss 1, loss 2, grad norm], state) of two train steps on the mesh `axes` (mesh.* sizes, the others 1), from
  the host state `init` (None: the program's own init, which then is returned instead, on the host)."""
  from jaxlm import sharding, train
  from tests.helpers import plain_program
  cfg.mesh.update(**{**dict(data=1, fsdp=1, tensor=1, context=1, stage=1, expert=1), **axes})
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(list(axes.values()) or [1]))])
  program = plain_program(cfg, mesh, steps=10)
  if init is None:
    return jax.device_get(program.init())
  state = jax.device_put(init, program.state_shardings)
  b = train.global_batch(batch, program.batch_sharding)
  state, m1 = program.train_step(state, b)
  state, m2 = program.train_step(state, b)
  return [float(m1['loss']), float(m2['loss']), float(m1['grad_norm'])], state


def _unrolled(tree, num_layers: int):
  """A scanned state's every `layers` stack (params, Adam's moments) as unrolled layers_0 … layers_{L-1}."""
  def unroll(d):
    if not (isinstance(d, dict) and 'layers' in d):
      return d
    out = {k: v for k, v in d.items() if k != 'layers'}
    return {**out, **{f'layers_{i}': jax.tree.map(lambda x, i=i: x[i], d['layers']) for i in range(num_layers)}}
  return jax.tree.map(unroll, tree, is_leaf=lambda d: isinstance(d, dict) and 'layers' in d)


def test_sharded_mla_step_matches_single_device():
  """Two training steps of an MLA model (plain query projection) equal one device's (1e-5) in loss and gradient
  norm on fsdp 4 × tensor 2 (heads split over tensor), on context 2 × fsdp 2 × tensor 2 (the sequence split, in
  zig-zag order), on 2 pipeline stages × fsdp 2, and unrolled (model.scan_layers=False) on fsdp 2 × tensor 2;
  documents packed two to a row. Every mesh starts from the one device's initial state (one init compiled)."""
  q_lora_rank = 0
  cfg = _mla_config(q_lora_rank)
  batch = random_batch(8, 24, cfg.model.vocab_size, docs=2)
  init = _mla_steps(cfg.copy_and_resolve_references(), batch)
  reference, _ = _mla_steps(cfg.copy_and_resolve_references(), batch, init)
  assert reference[1] < reference[0]  # the step did something
  for axes, scan in ((dict(fsdp=4, tensor=2), True), (dict(context=2, fsdp=2, tensor=2), True),
                     (dict(stage=2, fsdp=2), True), (dict(fsdp=2, tensor=2), False)):
    c = cfg.copy_and_resolve_references()
    c.model.scan_layers = scan
    got, state = _mla_steps(c, batch, init if scan else _unrolled(init, c.model.num_layers), **axes)
    np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=f'{axes} scan_layers={scan}')
    if 'tensor' in axes:
      wq = state.params['layers' if scan else 'layers_0']['attention']['query_b' if q_lora_rank else 'query']
      assert 'tensor' in str(wq.sharding.spec)  # heads over tensor, not replicated


def test_latent_cache_greedy_equals_full_recompute():
  """Greedy decoding from the latent cache (R + Er numbers per token per layer) equals greedy by full recompute,
  and the sampler's cache figure is those bytes."""
  from jaxlm import generate as generate_lib
  import flax.linen as nn
  m = dataclasses.replace(model_lib.ModelConfig.from_config(_mla_config(20).model), tie_embeddings=False)
  dummy = np.zeros((1, 8), np.int32)
  params = nn.unbox(jax.jit(model_lib.Decoder(m).init)(jax.random.PRNGKey(3), dummy, dummy + 1, dummy)['params'])
  rng = np.random.default_rng(4)
  params = jax.tree.map(lambda x: x + 0.5 * rng.standard_normal(x.shape).astype(np.float32), params)
  prompts = [list(rng.integers(1, 300, 9)), list(rng.integers(1, 300, 5))]
  cached = generate_lib.generate(m, params, prompts, 10).tokens
  np.testing.assert_array_equal(np.array(cached), generate_lib.generate_without_cache(m, params, prompts, 10))
  assert len(set(cached[0])) > 3
  cache = generate_lib.cache_shapes(generate_lib.inference_model(m), params, 2, 64)['layers']['attention']
  assert cache['latent'].shape[-1] == 12 and cache['rope_key'].shape[-1] == 6 and 'key' not in cache
  # Per token and layer: R + Er float32 numbers and an int32 segment id, whatever the number of heads.
  assert generate_lib.cache_bytes_per_token(m, params) == m.num_layers * ((12 + 6) * 4 + 4)


def test_refuses_a_checkpoint_with_mtp_layers(imported):
  """A DeepSeek-V3 checkpoint with a multi-token prediction layer after the last block (model.layers.L.*) that the
  model does not keep (model.mtp_depth=0) is refused by the tensor's name, not imported without it."""
  _, root, m, _, _, _ = imported
  tensors = import_hf.read_safetensors(str(root / 'hf'))
  tensors['model.layers.2.eh_proj.weight'] = np.zeros((48, 96), np.float32)
  with pytest.raises(import_hf.HFImportError, match="'model.layers.2.eh_proj.weight' and 0 more belong to a "
                                                    "multi-token prediction layer"):
    import_hf.from_hf(tensors, m, scan_layers=True)


def test_greedy_from_the_latent_cache_equals_transformers_generate(imported):
  """jaxlm.generate (latent cache, ragged prompts left-padded in one batch) continues each prompt token for token
  as transformers' generate does; each decode step's logits equal the full forward's on the same tokens (1e-5)."""
  import torch
  from jaxlm import generate as generate_lib
  _, _, m, params, _, _ = imported
  original = ORIGINAL['model']
  original.generation_config.eos_token_id = None  # random weights: never stop early
  prompts = [[10, 11, 12, 13, 14, 15, 16, 17], [40, 7, 90, 3, 50]]
  out = generate_lib.generate(m, params, prompts, 12, return_logits=True)
  for prompt, got in zip(prompts, out.tokens):
    with torch.no_grad():
      want = original.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert got == want.tolist()
  assert len(set(out.tokens[0])) > 3  # not one token repeated
  for row, (prompt, got) in enumerate(zip(prompts, out.tokens)):
    full = _logits(model_lib.Decoder(m), params, np.array([prompt + got], np.int32))[0]  # (T, V)
    steps = full[len(prompt) - 1:len(prompt) - 1 + len(got)]
    np.testing.assert_allclose(out.logits[row, :len(got)], steps, atol=1e-5)


def test_presets_have_deepseek_sizes():
  """configs/deepseek_v3.py without its MTP depth counts DeepSeek-V3's published 671B parameters, 37B active per
  token, and its MTP depth the published 14B; configs/deepseek_small.py is V2-Lite-sized (15.7B, 2.4B active)."""
  v3 = model_lib.ModelConfig.from_config(load_config('deepseek_v3').model)
  main = dataclasses.replace(v3, mtp_depth=0)
  assert 670.5e9 < model_lib.param_count(main) < 671.5e9
  assert 37.0e9 < model_lib.param_count(main, active=True) < 38.0e9
  # The MTP module (a MoE layer as V3's): the published 14B with the embedding and head copies the release
  # stores in it (jaxlm shares them), 685B in all.
  stored_copies = 2 * v3.vocab_size * v3.d_model
  assert 13.0e9 < model_lib.param_count(v3) - model_lib.param_count(main) + stored_copies < 14.5e9
  small = model_lib.ModelConfig.from_config(load_config('deepseek_small').model)
  assert 15.0e9 < model_lib.param_count(small) < 16.5e9
  assert 2.0e9 < model_lib.param_count(small, active=True) < 3.0e9


def _steps_with_experts(cfg, mesh_shape, batch, microbatches: int = 1):
  """[loss 1, loss 2, grad norm, MTP loss, MTP block's aux loss] of two steps on a (data, fsdp, tensor, expert)
  mesh."""
  from jaxlm import sharding, train
  from tests.helpers import plain_program
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:int(np.prod(mesh_shape))])
  program = plain_program(cfg, mesh, steps=10, microbatches=microbatches)
  state = program.init()
  b = train.global_batch(batch, program.batch_sharding)
  state, m1 = program.train_step(state, b)
  state, m2 = program.train_step(state, b)
  assert 'moe/2/bias_norm' in m1  # the MTP depth's block routes too (layer L = 2), its selection bias balanced
  return [float(m1['loss']), float(m2['loss']), float(m1['grad_norm']), float(m1['mtp_loss_1']),
          float(m1['moe/2/aux_loss'])]


def test_sharded_deepseek_step_with_expert_axis_matches_single_device():
  """DeepSeek-V3's whole block: MLA with a query latent, a dense first layer then a MoE layer (sigmoid routing
  over 2 groups, a shared expert, the selection bias updating, an auxiliary loss) and one MTP depth whose block is a
  mixture of experts too: two steps on fsdp 2 × tensor 2 × expert 2 in two microbatches (the routing pass runs the
  MTP block) equal one device, one batch (1e-5) in both losses, gradient norm, the MTP depth's loss and its
  block's auxiliary loss."""
  cfg = _mla_config(20)
  cfg.model.update(moe_experts=4, moe_top_k=2, moe_mlp_dim=24, moe_shared_experts=1, moe_first_dense=1,
                   moe_router='deepseek_v3', moe_groups=2, moe_top_groups=1, moe_routed_scale=2.5, mtp_depth=1,
                   moe_aux_loss=1e-2)
  batch = random_batch(8, 24, cfg.model.vocab_size, docs=2)
  reference = _steps_with_experts(cfg.copy_and_resolve_references(), (1, 1, 1, 1), batch)
  assert reference[1] < reference[0]
  np.testing.assert_allclose(_steps_with_experts(cfg, (1, 2, 2, 2), batch, microbatches=2), reference, rtol=1e-5)


def _mtp_layer(root, rng):
  """The released names of an MTP layer at model.layers.2 (L = 2): random tensors shaped as the MoE layer 1's
  (norm scales near 1, router weights large), enorm, hnorm, eh_proj, shared_head.norm, and the copies of the
  embedding and head a released checkpoint stores there."""
  from safetensors.numpy import load_file
  main = load_file(str(root / 'hf' / 'model.safetensors'))
  layer = {}
  for name, x in main.items():
    if name.startswith('model.layers.1.'):
      std = 1.0 if name.endswith('mlp.gate.weight') else 0.1
      x = rng.random(x.shape) + 0.5 if name.endswith('norm.weight') else rng.standard_normal(x.shape) * std
      layer[name.replace('layers.1.', 'layers.2.')] = x.astype(np.float32)
  D = CONFIG['hidden_size']
  for name in ('enorm', 'hnorm', 'shared_head.norm'):
    layer[f'model.layers.2.{name}.weight'] = (rng.random(D) + 0.5).astype(np.float32)
  layer['model.layers.2.eh_proj.weight'] = (rng.standard_normal((D, 2 * D)) * (2 * D) ** -0.5).astype(np.float32)
  layer['model.layers.2.embed_tokens.weight'] = main['model.embed_tokens.weight']
  layer['model.layers.2.shared_head.head.weight'] = main['lm_head.weight']
  return main, layer


def _reference_mtp(torch, original, layer, tokens):
  """DeepSeek-V3's MTP depth 1 in torch on the stored tensors: h the main model's last hidden state (before its
  final norm), [enorm(Emb(t_{i+1})), hnorm(h_i)] through eh_proj, a decoder layer of transformers' (the MoE
  layer 1's module with layer 2's weights), shared_head.norm, the head -> (B, T, V) logits."""
  import copy
  t = lambda name: torch.from_numpy(np.ascontiguousarray(layer['model.layers.2.' + name]))  # noqa: E731
  block, X = copy.deepcopy(original.model.layers[1]), CONFIG['n_routed_experts']
  state = {}
  for name in block.state_dict():
    if name == 'mlp.experts.gate_up_proj':  # transformers' fused layout: (X, 2F, D), gate rows first
      state[name] = torch.stack([torch.cat([t(f'mlp.experts.{e}.gate_proj.weight'),
                                            t(f'mlp.experts.{e}.up_proj.weight')]) for e in range(X)])
    elif name == 'mlp.experts.down_proj':
      state[name] = torch.stack([t(f'mlp.experts.{e}.down_proj.weight') for e in range(X)])
    else:
      state[name] = t(name)
  block.load_state_dict(state)
  hidden = []
  hook = original.model.norm.register_forward_pre_hook(lambda module, args: hidden.append(args[0]))
  ids = torch.from_numpy(tokens.astype(np.int64))
  rms = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + CONFIG['rms_norm_eps'])  # noqa: E731
  with torch.no_grad():
    original(ids)
    hook.remove()
    nxt = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)  # t_{i+1}; the last position has no target
    x = torch.cat([rms(original.model.embed_tokens(nxt), t('enorm.weight')), rms(hidden[0], t('hnorm.weight'))], -1)
    x = x @ t('eh_proj.weight').T
    T = tokens.shape[1]
    positions = torch.arange(T)[None].expand(tokens.shape[0], T)
    mask = torch.full((T, T), float('-inf')).triu(1)[None, None]
    x = block(x, attention_mask=mask, position_embeddings=original.model.rotary_emb(x, positions))
    x = x[0] if isinstance(x, tuple) else x
    return (rms(x, t('shared_head.norm.weight')) @ t('shared_head.head.weight').T).numpy()


def test_mtp_layer_imports_exports_and_matches_the_v3_formula(imported, tmp_path):
  """A checkpoint with a released-style MTP layer (model.layers.L.*, its block a mixture of experts as V3's)
  imports as model.mtp_depth=1 with the main logits still transformers' (1e-4); the stored tensors land exactly
  in jaxlm's MTP parameters and export back bit for bit under the same names, which transformers loads with no
  main-model key missing and the original's logits (1e-4); jaxlm's MTP logits and loss equal
  a torch computation of DeepSeek-V3's MTP formula on the same tensors (1e-4)."""
  import shutil
  import torch
  from safetensors.numpy import load_file, save_file
  from jaxlm import moe as moe_lib
  from jaxlm import mtp as mtp_lib
  transformers, root, _, _, tokens, theirs = imported
  main, layer = _mtp_layer(root, np.random.default_rng(5))
  shutil.copytree(root / 'hf', tmp_path / 'hf')
  save_file({**main, **layer}, str(tmp_path / 'hf' / 'model.safetensors'))
  config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
  (tmp_path / 'hf' / 'config.json').write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
  result = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert result['overrides']['mtp_depth'] == 1
  cfg = export.read_config(result['checkpoint'])
  cfg.model.update(dtype='float32', mtp_weight=1.0)
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = import_hf.from_hf(import_hf.read_safetensors(str(tmp_path / 'hf')), m, scan_layers=True)
  mtp = params['mtp']
  D = CONFIG['hidden_size']
  np.testing.assert_array_equal(mtp['proj_1'][:D], layer['model.layers.2.eh_proj.weight'][:, D:].T)  # hidden rows
  np.testing.assert_array_equal(mtp['proj_1'][D:], layer['model.layers.2.eh_proj.weight'][:, :D].T)  # embedding
  np.testing.assert_array_equal(mtp['hidden_norm_1']['scale'], layer['model.layers.2.hnorm.weight'])
  np.testing.assert_array_equal(mtp['block_1']['moe']['router'], layer['model.layers.2.mlp.gate.weight'].T)
  np.testing.assert_array_equal(mtp['block_1']['moe']['up'][3], layer['model.layers.2.mlp.experts.3.up_proj.weight'].T)
  assert model_lib.param_count(m) == sum(np.size(x) for x in jax.tree.leaves(params))

  export.export(str(tmp_path / 'run'), str(tmp_path / 'back'))
  after = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert sorted(after) == sorted({**main, **layer})
  for name, x in {**main, **layer}.items():
    np.testing.assert_array_equal(after[name], x, err_msg=name)
  assert json.loads((tmp_path / 'back' / 'config.json').read_text())['num_nextn_predict_layers'] == 1
  # transformers loads the export as DeepseekV3ForCausalLM: every main-model weight found, only the MTP layer's
  # left over (it ignores that layer, as for a released checkpoint), and the original's logits.
  back, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / 'back'), attn_implementation='eager',
                                                                 output_loading_info=True)
  assert type(back).__name__ == 'DeepseekV3ForCausalLM' and not info['missing_keys'] and not info['mismatched_keys']
  assert all(k.startswith('model.layers.2.') for k in info['unexpected_keys']), info['unexpected_keys']
  MAX_ABS['export with MTP'] = float(np.abs(_torch_logits((torch, transformers), back.float().eval(), tokens)
                                            - theirs).max())
  assert MAX_ABS['export with MTP'] <= 1e-4

  B, T = tokens.shape
  positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  logits, stats = jax.jit(lambda p: model_lib.Decoder(m).apply(
      {'params': p}, tokens, np.ones_like(tokens), positions, mutable=[mtp_lib.COLLECTION, moe_lib.STATS]))(params)
  MAX_ABS['import with MTP'] = float(np.abs(np.asarray(logits) - theirs).max())
  assert MAX_ABS['import with MTP'] <= 1e-4
  assert len(moe_lib.per_layer(stats[moe_lib.STATS], 1)) == 2  # layer 1 and the MTP block route
  ours = stats[mtp_lib.COLLECTION]['logits'][0]  # (1, B, T, V)
  want = _reference_mtp(torch, ORIGINAL['model'], layer, tokens)
  MAX_ABS['MTP logits'] = float(np.abs(np.asarray(ours[0])[:, :-1] - want[:, :-1]).max())
  assert MAX_ABS['MTP logits'] <= 1e-4
  weights = np.ones((B, T), np.float32)
  weights[:, -1] = 0
  batch = dict(inputs=tokens, targets=np.concatenate([tokens[:, 1:], tokens[:, :1] * 0], 1), weights=weights,
               segment_ids=np.ones_like(tokens))
  denominators = mtp_lib.target_weights(batch, 1).sum((1, 2))
  got, _ = mtp_lib.loss(ours, batch, 1.0, denominators)
  logp = want[:, :-2] - np.log(np.exp(want[:, :-2] - want[:, :-2].max(-1, keepdims=True)).sum(-1, keepdims=True)) \
      - want[:, :-2].max(-1, keepdims=True)
  reference = -np.take_along_axis(logp, tokens[:, 2:, None], -1).mean()  # position i predicts t_{i+2}
  np.testing.assert_allclose(float(got), reference, rtol=1e-5)



def _sft_losses(cfg, params, batch):
  """[loss 1, loss 2] of two train steps of step.build_program's (one device) from the imported `params` joined
  to the LoRA adapters init drew (B = 0: the import's function to begin with)."""
  from jaxlm import lora as lora_lib
  from jaxlm import sharding, train
  from tests.helpers import plain_program
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, cfg.mesh.expert = 1, 1, 1, 1
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  program = plain_program(cfg, mesh, steps=10)
  state = program.init()
  params = lora_lib.join_adapters(params, lora_lib.split_adapters(jax.device_get(state.params))[1])
  state = dataclasses.replace(state, params=jax.device_put(params, program.state_shardings.params))
  b = train.global_batch(batch, program.batch_sharding)
  state, m1 = program.train_step(state, b)
  state, m2 = program.train_step(state, b)
  return [float(m1['loss']), float(m2['loss'])]


def test_lora_sft_on_the_import_starts_from_transformers_loss_and_lowers_it(imported):
  """Fine-tuning the imported DeepSeek-V3 through the trainer's step (step.build_program) with SFT loss weights
  (prompts and padding weighted 0) and LoRA on every MLA projection: the first step's loss is transformers'
  cross-entropy on the same tokens and weights (1e-5), the second's lower. (Full-parameter steps of MLA and
  DeepSeek's MoE are the sharded tests'; one program here keeps the test cheap.)"""
  _, _, _, params, tokens, theirs = imported
  B, T = tokens.shape
  weights = np.ones((B, T), np.float32)
  weights[0, :8], weights[1, :5], weights[:, -1] = 0, 0, 0  # the prompts, and the last token (no target)
  segment_ids = np.ones_like(tokens)
  segment_ids[1, -4:] = 0  # row 1 padded at the end
  weights[segment_ids == 0] = 0
  batch = dict(inputs=tokens, targets=np.concatenate([tokens[:, 1:], tokens[:, :1] * 0], 1), weights=weights,
               segment_ids=segment_ids, positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)))
  logp = theirs - theirs.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  reference = -(np.take_along_axis(logp, batch['targets'][..., None], -1)[..., 0] * weights).sum() / weights.sum()
  cfg = export.read_config(ORIGINAL['import']['checkpoint'])
  cfg.model.update(dtype='float32', z_loss=0.0, remat='none')
  cfg.model.lora.update(rank=4, alpha=8.0, targets=('query', 'out', 'query_a', 'kv_a', 'kv_b'))
  cfg.optim.update(warmup_steps=0, lr=1e-2)
  losses = _sft_losses(cfg, params, batch)
  np.testing.assert_allclose(losses[0], reference, rtol=1e-5)
  assert losses[1] < losses[0] - 1e-2


def test_deepseek_v2_imports_and_exports_with_transformers_logits(imported, tmp_path):
  """DeepseekV2ForCausalLM (V2-Lite's plain query projection; V2's softmax routing limited to the groups with the
  best single score, no renormalisation, no selection bias) imports with transformers' logits (1e-4), which
  renormalising or dropping the group limit moves by >= 1e-2, and exports back bit for bit as
  DeepseekV2ForCausalLM, which transformers reloads with the same logits."""
  import shutil
  import torch
  transformers, root = imported[:2]
  torch.manual_seed(1)
  # One group of two experts per token (topk_group 1): its best single score picks it, not its best two's sum.
  v2 = {k: v for k, v in CONFIG.items() if k not in ('q_lora_rank', 'topk_group')}
  config = transformers.DeepseekV2Config(**v2, q_lora_rank=None, topk_method='group_limited_greedy', topk_group=1)
  config._attn_implementation = 'eager'  # pylint: disable=protected-access
  original = _spread(transformers.DeepseekV2ForCausalLM(config).float().eval())
  original.save_pretrained(str(tmp_path / 'hf'), safe_serialization=True)
  for name in ('tokenizer.json', 'tokenizer_config.json'):  # the V3 fixture's tokenizer (its vocabulary size)
    shutil.copy(root / 'hf' / name, tmp_path / 'hf' / name)
  result = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert result['overrides']['moe_router'] == 'deepseek_v2' and result['overrides']['moe_groups'] == 4
  cfg = export.read_config(result['checkpoint'])
  cfg.model.dtype = 'float32'
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = import_hf.from_hf(import_hf.read_safetensors(str(tmp_path / 'hf')), m, scan_layers=True)
  tokens = np.random.default_rng(2).integers(3, 97, (2, SEQ)).astype(np.int32)
  theirs = _torch_logits((torch, transformers), original, tokens)
  MAX_ABS['v2 import'] = float(np.abs(_logits(model_lib.Decoder(m), params, tokens) - theirs).max())
  assert MAX_ABS['v2 import'] <= 1e-4
  # V2's routing matters here: renormalising the top-k weights, or dropping the group limit, moves the logits.
  for what, moe in (('v2 renormalised', dataclasses.replace(m.moe, norm_topk_prob=True)),
                    ('v2 without group limit', dataclasses.replace(m.moe, groups=1, top_groups=1))):
    MAX_ABS[what] = float(np.abs(_logits(model_lib.Decoder(dataclasses.replace(m, moe=moe)), params, tokens)
                                 - theirs).max())
    assert MAX_ABS[what] >= 1e-2, what
  written, back = export_round_trip(tmp_path / 'hf', tmp_path / 'run', tmp_path / 'back', 'DeepseekV2ForCausalLM')
  assert written['model_type'] == 'deepseek_v2' and written['topk_method'] == 'group_limited_greedy'
  MAX_ABS['v2 export'] = float(np.abs(_torch_logits((torch, transformers), back, tokens) - theirs).max())
  assert MAX_ABS['v2 export'] <= 1e-4
