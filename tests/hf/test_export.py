"""Hugging Face export and import: transformers reproduces jaxlm's logits and greedy tokens; import -> export is exact.

Each variant gets random parameters, norm scales included (so a swapped or dropped norm shows), is saved in the
trainer's checkpoint layout (with optimizer state), exported, and loaded by transformers from the local
directory with the network off.
"""

import dataclasses
import json
import os
import shutil

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

from jaxlm import checkpoint as checkpoint_lib
from jaxlm.hf import export
from jaxlm.hf import import_llama as import_hf
from jaxlm import model as model_lib
from jaxlm import sharding
from jaxlm.data import tokenizer as tokenizer_lib
from tests.helpers import load_config, plain_program

# Small, distinct sizes so a wrong transpose or head split fails loudly: V 397, D 48, H 4, F 100, L 2.
VARIANTS = {
    'llama-gqa-untied': dict(parallel_block=False, num_kv_heads=2, tie_embeddings=False),
    'llama-mqa-tied-unrolled-e10': dict(parallel_block=False, num_kv_heads=1, tie_embeddings=True,
                                        scan_layers=False, head_dim=10),
    'cohere-mqa-tied': dict(parallel_block=True, num_kv_heads=1, tie_embeddings=True),
    'cohere-gqa-untied-unrolled': dict(parallel_block=True, num_kv_heads=2, tie_embeddings=False,
                                       scan_layers=False),
}
MAX_ABS = {}  # variant -> max |logit difference|, printed at the end of the module (pytest -s)


def _config(**overrides):
  c = load_config('palm_tiny')
  c.model.update(vocab_size=397, d_model=48, num_layers=2, num_heads=4, head_dim=0, mlp_dim=100,
                 rope_theta=1000.0, norm_eps=1e-5, dtype='float32', remat='none')
  c.model.update(**overrides)
  c.mesh.update(data=1, fsdp=1, tensor=1)
  c.optim.update(warmup_steps=0, lr=1e-2)
  return c


@pytest.fixture(scope='module')
def hf():
  """(torch, transformers), imported once for the module, offline."""
  torch = pytest.importorskip('torch', reason='torch is not installed: pip install -e ".[test]"')
  transformers = pytest.importorskip('transformers', reason='transformers is not installed: pip install -e ".[test]"')
  pytest.importorskip('safetensors', reason='safetensors is not installed: pip install -e ".[test]"')
  os.environ['HF_HUB_OFFLINE'] = '1'
  torch.manual_seed(0)
  yield torch, transformers
  if MAX_ABS:
    print('\nmax |logits(jaxlm) - logits(transformers)|: ' +
          ', '.join(f'{k} {v:.2e}' for k, v in MAX_ABS.items()))


@pytest.fixture(scope='module')
def spm_model(tmp_path_factory) -> str:
  """A small SentencePiece model trained on some standard-library source (a prepared-data directory)."""
  import json as json_module  # any stdlib package with code, docstrings and indentation will do
  lines = []
  for name in sorted(os.listdir(os.path.dirname(json_module.__file__))):
    if name.endswith('.py'):
      with open(os.path.join(os.path.dirname(json_module.__file__), name)) as f:
        lines += f.read().splitlines()
  out = tmp_path_factory.mktemp('prepared')
  return tokenizer_lib.train(lines, str(out / 'tokenizer.model'), vocab_size=390)


def _random_run(cfg, workdir, step: int = 2):
  """Random parameters saved as a full TrainState (optimizer state included, as the trainer saves); returns
  (model, params).

  Drawn in numpy from the abstract shapes (a compiled init costs seconds per variant here). Norm scales are drawn
  around 1 rather than left at 1, where a swapped or dropped norm weight would not show in the logits.
  """
  model = model_lib.Decoder(model_lib.ModelConfig.from_config(cfg.model))
  dummy = np.zeros((1, 8), np.int32)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0), dummy, dummy + 1, dummy)['params']))
  rng = np.random.default_rng(step)

  def draw(path, x):
    name = jax.tree_util.keystr(path)
    if 'scale' in name:
      return rng.uniform(0.5, 1.5, x.shape).astype(np.float32)
    std = 1.0 if 'embedding' in name else cfg.model.d_model ** -0.5
    return (std * rng.standard_normal(x.shape)).astype(np.float32)

  params = jax.tree_util.tree_map_with_path(draw, shapes)
  state = {'step': np.int32(step), 'params': params, 'opt_state': jax.device_get(optax.adamw(1e-3).init(params)),
           'rng': np.asarray(jax.random.key_data(jax.random.PRNGKey(0)))}
  import_hf.write_checkpoint(str(workdir), state, cfg.to_dict(), step=step)
  return model, params


def _jax_logits(model, params, tokens):
  B, T = tokens.shape
  positions = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  return np.asarray(jax.jit(model.apply)({'params': params}, tokens, np.ones_like(tokens), positions))


def _imported(result, hf_dir):
  """(float32 ModelConfig, parameters) of an import: its run's config, the HF directory's tensors converted."""
  cfg = export.read_config(result['checkpoint'])
  cfg.model.dtype = 'float32'
  m = model_lib.ModelConfig.from_config(cfg.model)
  return m, import_hf.from_hf(import_hf.read_safetensors(str(hf_dir)), m, scan_layers=cfg.model.scan_layers)


def _load_hf(hf, path):
  torch, transformers = hf
  model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
  model.generation_config.eos_token_id = None  # random weights: never stop early, always 20 tokens
  model.generation_config.pad_token_id = 0
  return model


@pytest.mark.parametrize('variant', list(VARIANTS))
def test_transformers_matches_jaxlm(hf, variant, tmp_path, spm_model):
  torch, transformers = hf
  cfg = _config(**VARIANTS[variant])
  model, params = _random_run(cfg, tmp_path / 'run')
  summary = export.export(str(tmp_path / 'run'), str(tmp_path / 'hf'), tokenizer=spm_model)
  want_arch = 'CohereForCausalLM' if cfg.model.parallel_block else 'LlamaForCausalLM'
  assert summary['architecture'] == want_arch and summary['step'] == 2
  hf_model = _load_hf(hf, str(tmp_path / 'hf'))
  assert type(hf_model).__name__ == want_arch

  # transformers decodes 20 tokens greedily (with its KV cache) after a random prompt; jaxlm then scores that
  # sequence in one forward. Logits must agree everywhere, and jaxlm's argmax after every prefix must be the
  # token transformers chose: by causality that is jaxlm's own greedy decoding, token for token.
  prompt = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (1, 8))
  with torch.no_grad():
    seq = hf_model.generate(torch.from_numpy(prompt), max_new_tokens=20, do_sample=False)  # (1, 28)
    theirs = hf_model(seq).logits.numpy()
  seq = seq.numpy().astype(np.int32)
  assert seq.shape == (1, 28)
  ours = _jax_logits(model, params, seq)
  MAX_ABS[variant] = float(np.abs(ours - theirs).max())
  assert MAX_ABS[variant] < 1e-4, MAX_ABS[variant]
  assert ours[0, 7:-1].argmax(-1).tolist() == seq[0, 8:].tolist()

  # The SentencePiece model ships too: AutoTokenizer (offline) encodes code exactly as it does, and with special
  # tokens prepends EOS, the document-start token of jaxlm's training data.
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  ours_tok = tokenizer_lib.load(spm_model)
  text = ' leading space\n\n    def f(x):\n\treturn {"n": 12345, "ü": "日本語 🙂"}  # comment  \n'
  assert hf_tok.encode(text, add_special_tokens=False) == ours_tok.encode(text)
  assert hf_tok(text)['input_ids'] == [ours_tok.eos_id] + ours_tok.encode(text)
  assert hf_tok.decode(ours_tok.encode(text)) == text
  assert hf_tok.eos_token_id == hf_tok.bos_token_id == ours_tok.eos_id


def test_tokenizer_json_matches_sentencepiece_on_source_files(hf, spm_model, tmp_path):
  _, transformers = hf
  export.write_tokenizer(spm_model, str(tmp_path), model_max_length=1 << 20)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = tokenizer_lib.load(spm_model)
  import email  # unseen by the tokenizer's training
  folder = os.path.dirname(email.__file__)
  for name in sorted(os.listdir(folder))[:8]:
    if name.endswith('.py'):
      with open(os.path.join(folder, name)) as f:
        text = f.read()
      assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text), name


def _hf_llama(hf, path, *, tied: bool, spm_model: str):
  """A random Llama made and saved by transformers itself, norms scrambled, with a SentencePiece tokenizer."""
  torch, transformers = hf
  rope = dict(rope_parameters={'rope_type': 'default', 'rope_theta': 1000.0})
  if not hasattr(transformers.LlamaConfig(), 'rope_parameters'):  # transformers 4.x
    rope = dict(rope_theta=1000.0)
  config = transformers.LlamaConfig(vocab_size=397, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
                                    tie_word_embeddings=tied, max_position_embeddings=64, **rope)
  model = transformers.LlamaForCausalLM(config).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.mul_(torch.rand_like(p) + 0.5)
  model.save_pretrained(path, safe_serialization=True)
  shutil.copyfile(spm_model, os.path.join(path, 'tokenizer.model'))
  return model


@pytest.mark.parametrize('tied', [False, True])
def test_import_then_export_is_bit_exact(hf, tmp_path, tied, spm_model):
  torch, _ = hf
  from safetensors.numpy import load_file
  original = _hf_llama(hf, str(tmp_path / 'hf'), tied=tied, spm_model=spm_model)
  result = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert '--config.checkpoint.init_from=' in result['flags']
  assert '--config.model.parallel_block=False' in result['flags']
  summary = export.export(str(tmp_path / 'run'), str(tmp_path / 'back'))
  assert 'tokenizer.json' in summary['files']  # the model's own tokenizer travels with it

  before = {k: v for f in os.listdir(tmp_path / 'hf') if f.endswith('.safetensors')
            for k, v in load_file(str(tmp_path / 'hf' / f)).items()}
  after = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  if tied:  # jaxlm holds the imported head untied, so the export writes it out: the same values
    before.setdefault('lm_head.weight', before['model.embed_tokens.weight'])
  assert sorted(before) == sorted(after)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  config = json.loads((tmp_path / 'back' / 'config.json').read_text())
  assert (config['model_type'], config['num_key_value_heads'], config['head_dim']) == ('llama', 2, 12)

  # The printed warm start works: the trainer's init_from loader reads the checkpoint into the model the
  # overrides build, and that model computes what transformers does.
  cfg = export.read_config(result['checkpoint'])
  cfg.model.dtype = 'float32'
  cfg.mesh.update(data=1, fsdp=1, tensor=1)
  mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    program = plain_program(cfg, mesh, steps=cfg.train.steps)
    init_from = result['flags'].split('--config.checkpoint.init_from=')[1]
    params = checkpoint_lib.load_params(init_from, program.abstract_state.params, program.state_shardings.params)
  tokens = np.random.default_rng(2).integers(0, 397, (2, 20)).astype(np.int32)
  with torch.no_grad():
    theirs = original(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  assert np.abs(_jax_logits(program.model, params, tokens) - theirs).max() < 1e-4


def test_import_refuses_pickles_and_unsupported_configs(tmp_path):
  (tmp_path / 'config.json').write_text('{}')
  (tmp_path / 'pytorch_model.bin').write_bytes(b'')
  with pytest.raises(import_hf.HFImportError, match='arbitrary code'):
    import_hf.read_safetensors(str(tmp_path))
  base = dict(model_type='llama', hidden_size=48, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=2, intermediate_size=100, vocab_size=397)
  assert import_hf.model_overrides(base)['head_dim'] == 12
  # Qwen3's files may carry a sliding_window that use_sliding_window=False switches off (transformers nulls it).
  assert import_hf.model_overrides({**base, 'model_type': 'qwen3', 'use_sliding_window': False,
                                    'sliding_window': 4096})['qk_norm'] == 'head'
  for bad, match in [(dict(rope_scaling={'rope_type': 'dynamic', 'factor': 8.0}), 'rope'),
                     (dict(rope_parameters={'rope_type': 'longrope', 'factor': 4.0}), 'rope'),
                     (dict(rope_parameters={'rope_type': 'linear', 'factor': 2.0, 'partial_rotary_factor': 0.5}),
                      'partial_rotary_factor'),
                     (dict(attention_bias=True), 'attention_bias'), (dict(mlp_bias=True), 'mlp_bias'),
                     (dict(hidden_act='gelu'), 'silu'), (dict(sliding_window=4096), 'sliding_window'),
                     (dict(model_type='qwen2'), 'llama'),
                     (dict(model_type='qwen3', layer_types=['full_attention', 'sliding_attention']), 'layer_types'),
                     (dict(model_type='qwen3', use_sliding_window=True, sliding_window=4096), 'sliding_window')]:
    with pytest.raises(import_hf.HFImportError, match=match):
      import_hf.model_overrides({**base, **bad})


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_imported_qwen3_matches_transformers_and_exports_back(hf, tmp_path, spm_model):
  """A dense Qwen3 (Llama's block with a per-head RMSNorm on q and k, head_dim ≠ D/H, tied) imports exactly."""
  torch, transformers = hf
  from safetensors.numpy import load_file
  config = transformers.Qwen3Config(vocab_size=397, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                    tie_word_embeddings=True, max_position_embeddings=64, bos_token_id=1,
                                    eos_token_id=2, rope_parameters={'rope_type': 'default', 'rope_theta': 1000.0})
  original = transformers.Qwen3ForCausalLM(config).float().eval()
  with torch.no_grad():
    for name, p in original.named_parameters():
      if name.endswith('norm.weight'):  # q_norm and k_norm included: a dropped or swapped one shows
        p.mul_(torch.rand_like(p) + 0.5)
  original.save_pretrained(str(tmp_path / 'hf'), safe_serialization=True)
  shutil.copyfile(spm_model, str(tmp_path / 'hf' / 'tokenizer.model'))
  result = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert result['overrides']['qk_norm'] == 'head' and '--config.model.qk_norm=head' in result['flags']
  assert result['tokenizer_files'] == ['tokenizer.model', 'generation_config.json']  # save_pretrained wrote it

  m, params = _imported(result, tmp_path / 'hf')
  tokens = np.random.default_rng(4).integers(0, 397, (2, 20)).astype(np.int32)
  with torch.no_grad():
    theirs = original(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  MAX_ABS['import-qwen3'] = float(np.abs(_jax_logits(model_lib.Decoder(m), params, tokens) - theirs).max())
  assert MAX_ABS['import-qwen3'] <= 1e-4
  no_norm = {**params, 'layers': {**params['layers'], 'attention': {
      k: v for k, v in params['layers']['attention'].items() if not k.endswith('_norm')}}}
  # The QK-norm is what made the logits agree.
  plain = dataclasses.replace(m, attention=dataclasses.replace(m.attention, qk_norm='none'))
  assert np.abs(_jax_logits(model_lib.Decoder(plain), no_norm, tokens) - theirs).max() > 1e-3

  summary = export.export(str(tmp_path / 'run'), str(tmp_path / 'back'))
  assert summary['architecture'] == 'Qwen3ForCausalLM' and 'tokenizer.json' in summary['files']
  written = json.loads((tmp_path / 'back' / 'config.json').read_text())
  assert (written['model_type'], written['head_dim']) == ('qwen3', 16)
  before = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
  before.setdefault('lm_head.weight', before['model.embed_tokens.weight'])  # tied there, held untied here
  after = load_file(str(tmp_path / 'back' / 'model.safetensors'))
  assert sorted(before) == sorted(after)
  for name in before:
    np.testing.assert_array_equal(after[name], before[name], err_msg=name)
  back = _load_hf(hf, str(tmp_path / 'back'))
  assert type(back).__name__ == 'Qwen3ForCausalLM'
  with torch.no_grad():
    again = back(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  MAX_ABS['export-qwen3'] = float(np.abs(again - theirs).max())
  assert MAX_ABS['export-qwen3'] <= 1e-4


def test_export_refuses_models_without_a_faithful_equivalent():
  cfg = _config(num_heads=5, head_dim=10)  # D=48 is not a multiple of H=5: transformers rejects the config
  with pytest.raises(export.ExportError, match='multiple'):
    export.architecture(model_lib.ModelConfig.from_config(cfg.model))
  cfg = _config(parallel_block=True, head_dim=16)  # Cohere always derives head_dim = D / H
  with pytest.raises(export.ExportError, match='Cohere'):
    export.architecture(model_lib.ModelConfig.from_config(cfg.model))
  for qk_norm, block in (('full', False), ('head', True)):  # Qwen3 is the sequential block with per-head norms
    cfg = _config(parallel_block=block, qk_norm=qk_norm)
    with pytest.raises(export.ExportError, match=f'qk_norm={qk_norm}'):
      export.architecture(model_lib.ModelConfig.from_config(cfg.model))


# RoPE scaling (model.rope_scaling): transformers' rope_parameters for each kind jaxlm computes exactly. The original
# context is short (16 positions) so the 40-token test sequences reach well past it, where the kinds differ.
SCALED_ROPE = {
    'linear': {'rope_type': 'linear', 'factor': 4.0},
    'llama3': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
               'original_max_position_embeddings': 16},
    'yarn': {'rope_type': 'yarn', 'factor': 4.0, 'original_max_position_embeddings': 16},
}


@pytest.mark.parametrize('kind', list(SCALED_ROPE))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_imported_scaled_llama_matches_transformers_and_exports_back(hf, tmp_path, kind):
  torch, transformers = hf
  if not hasattr(transformers.LlamaConfig(), 'rope_parameters'):
    pytest.skip('transformers 4.x: rope_parameters is a 5.x config key')
  config = transformers.LlamaConfig(vocab_size=397, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-5,
                                    max_position_embeddings=64,
                                    rope_parameters={**SCALED_ROPE[kind], 'rope_theta': 1000.0})
  original = transformers.LlamaForCausalLM(config).float().eval()
  original.save_pretrained(str(tmp_path / 'hf'), safe_serialization=True)
  result = import_hf.import_hf(str(tmp_path / 'hf'), str(tmp_path / 'run'))
  assert result['overrides']['rope_scaling'] == kind and f'--config.model.rope_scaling={kind}' in result['flags']

  m, params = _imported(result, tmp_path / 'hf')
  tokens = np.random.default_rng(3).integers(0, 397, (2, 40)).astype(np.int32)
  with torch.no_grad():
    theirs = original(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  ours = _jax_logits(model_lib.Decoder(m), params, tokens)
  MAX_ABS[f'import-{kind}'] = float(np.abs(ours - theirs).max())
  assert MAX_ABS[f'import-{kind}'] < 1e-4
  # Plain RoPE would not have matched: the scaling is what made the logits agree.
  plain = dataclasses.replace(m, rope_scaling='none')
  assert np.abs(_jax_logits(model_lib.Decoder(plain), params, tokens) - theirs).max() > 1e-3

  # Export writes the scaling back; transformers reads it and computes the same logits.
  export.export(str(tmp_path / 'run'), str(tmp_path / 'back'))
  written = json.loads((tmp_path / 'back' / 'config.json').read_text())
  assert written['rope_scaling']['rope_type'] == kind and written['rope_parameters']['rope_type'] == kind
  back = _load_hf(hf, str(tmp_path / 'back'))
  with torch.no_grad():
    again = back(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  assert np.abs(again - theirs).max() < 1e-4


def test_exported_scaled_cohere_matches_transformers(hf, tmp_path):
  # The parallel block (Cohere, interleaved rotary) under YaRN: the scaled frequencies follow the pair permutation.
  torch, _ = hf
  cfg = _config(parallel_block=True, num_kv_heads=1, rope_scaling='yarn', rope_factor=4.0,
                rope_original_max_positions=16)
  model, params = _random_run(cfg, tmp_path / 'run')
  export.export(str(tmp_path / 'run'), str(tmp_path / 'hf'))
  hf_model = _load_hf(hf, str(tmp_path / 'hf'))
  tokens = np.random.default_rng(4).integers(0, 397, (2, 40)).astype(np.int32)
  with torch.no_grad():
    theirs = hf_model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
  MAX_ABS['export-cohere-yarn'] = float(np.abs(_jax_logits(model, params, tokens) - theirs).max())
  assert MAX_ABS['export-cohere-yarn'] < 1e-4
