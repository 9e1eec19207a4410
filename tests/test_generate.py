"""The KV-cache sampler: cache == full recompute (tokens and every step's logits), sampling's distribution and
seeding, end-of-text stops, and sharded == one device with the cache where the rules table puts it."""

import functools

import flax.linen as nn
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxlm import generate as generate_lib
from jaxlm import model as model_lib
from jaxlm import sharding
from tests.helpers import grid, load_config

PROMPTS = [[3, 17, 5, 9, 2], [11], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2], [4, 40, 1]]  # ragged: 5, 1, 11, 3


@functools.cache
def tiny(num_kv_heads: int = 1, parallel_block: bool = True, scan_layers: bool = True, rope_scaling: str = 'none',
         std: float = 0.5):
  """A tiny float32 model (vocab 62, D 16, 4 heads of 4, 2 layers) and random parameters as numpy arrays."""
  cfg = load_config('palm_tiny')
  cfg.model.update(vocab_size=62, d_model=16, num_layers=2, num_heads=4, num_kv_heads=num_kv_heads, mlp_dim=24,
                   parallel_block=parallel_block, tie_embeddings=parallel_block, scan_layers=scan_layers,
                   rope_scaling=rope_scaling, rope_factor=4.0, rope_original_max_positions=32)
  m = model_lib.ModelConfig.from_config(cfg.model)
  seq = np.zeros((1, 8), np.int32)
  boxed = jax.eval_shape(lambda: generate_lib.inference_model(m).init(jax.random.PRNGKey(0), seq, seq + 1, seq))
  rng = np.random.default_rng(0)  # numpy draws: a compiled init costs seconds here
  params = jax.tree.map(lambda x: (rng.standard_normal(x.shape) * std).astype(np.float32),
                        nn.unbox(boxed['params']))
  return m, params, nn.get_partition_spec(boxed['params'])


def full_forward_logits(m, params, rows: list[list[int]]) -> list[np.ndarray]:
  """Float32 logits (len(row), V) of each row by one plain forward over the rows right-padded (no cache)."""
  T = max(map(len, rows))
  tokens, segment_ids = np.zeros((len(rows), T), np.int32), np.zeros((len(rows), T), np.int32)
  for r, row in enumerate(rows):
    tokens[r, :len(row)], segment_ids[r, :len(row)] = row, 1
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
  logits = jax.jit(model_lib.Decoder(m).apply)({'params': params}, tokens, segment_ids, positions)
  return [np.asarray(logits[r, :len(row)], np.float32) for r, row in enumerate(rows)]


CASES = {  # (num_kv_heads, parallel_block, scan_layers, rope_scaling)
    'mqa-parallel-scan': (1, True, True, 'none'),  # PaLM: multi-query, parallel block
    'gqa-parallel-unrolled': (2, True, False, 'none'),
    'mha-parallel-scan-linear': (4, True, True, 'linear'),
    'mqa-sequential-unrolled': (1, False, False, 'none'),
    'gqa-sequential-scan-llama3': (2, False, True, 'llama3'),  # Llama 3: grouped-query, sequential, scaled RoPE
    'mha-sequential-unrolled-yarn': (4, False, False, 'yarn'),
}


# Two cases in the fast loop, all six in the full suite.
@pytest.mark.parametrize('num_kv_heads, parallel_block, scan_layers, rope_scaling', grid(
    list(CASES.values()), fast=[CASES['mqa-parallel-scan'], CASES['gqa-sequential-scan-llama3']],
    ids=lambda v: next(k for k, c in CASES.items() if c == v), unpack=True))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_cached_greedy_equals_full_recompute_and_every_step_logits_equal_the_full_forward(
    num_kv_heads, parallel_block, scan_layers, rope_scaling):
  m, params, _ = tiny(num_kv_heads, parallel_block, scan_layers, rope_scaling)
  new = 64
  out = generate_lib.generate(m, params, PROMPTS, new, return_logits=True)
  assert out.finish_reasons == ['length'] * len(PROMPTS)
  assert np.array(out.tokens).tolist() == generate_lib.generate_without_cache(m, params, PROMPTS, new).tolist()
  # The cache holds the K key/value heads only: (layers, B, S, K, E) scanned, (B, S, K, E) per layer unrolled.
  shapes = generate_lib.cache_shapes(generate_lib.inference_model(m), params, 4, 16 + new)
  leaves = {'/'.join(str(k.key) for k in path): x.shape
            for path, x in jax.tree_util.tree_flatten_with_path(shapes)[0]}
  key = 'layers/attention/key' if scan_layers else 'layers_0/attention/key'
  assert leaves[key] == ((2,) if scan_layers else ()) + (4, 16 + new, num_kv_heads, 4)
  # Each decode step's logits are the logits of an unpadded full forward at that position (right-padded here,
  # where the sampler left-pads: the positions and masks of both layouts are checked against each other).
  full = full_forward_logits(m, params, [p + t for p, t in zip(PROMPTS, out.tokens)])
  for r, prompt in enumerate(PROMPTS):
    expected = full[r][len(prompt) - 1:-1]
    # rtol 1e-5, and for logits near 0 the same 1e-5 of the row's scale (float32 sums in another order).
    np.testing.assert_allclose(out.logits[r], expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert out.logits[r].argmax(-1).tolist() == out.tokens[r]


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_generation_stops_each_row_at_its_end_of_text_token():
  m, params, _ = tiny()
  free = generate_lib.generate(m, params, PROMPTS, 12)
  eos = free.tokens[0][3]  # row 0 writes it at step 3; other rows may never
  out = generate_lib.generate(m, params, PROMPTS, 12, eos_id=eos)
  for row, stopped, reason in zip(free.tokens, out.tokens, out.finish_reasons):
    if eos in row:
      assert (stopped, reason) == (row[:row.index(eos)], 'eos')
    else:
      assert (stopped, reason) == (row, 'length')
  assert out.finish_reasons[0] == 'eos'
  # Three copies of row 0 fill a batch of 4 with one padding row; the loop stops once the three have ended.
  out = generate_lib.generate(m, params, [PROMPTS[0]] * 3, 12, eos_id=eos)
  stop = free.tokens[0].index(eos)  # 3, or earlier if row 0 wrote it before
  assert out.tokens == [free.tokens[0][:stop]] * 3 and out.steps == stop + 1 < 12
  assert out.generated_tokens == sum(len(t) + (r == 'eos') for t, r in zip(out.tokens, out.finish_reasons))
  # Several stop ids (as generation_config.json lists Qwen3's <|im_end|> and <|endoftext|>), each the first one a
  # different prompt reaches: row 0 stops at the first, row 1 at the second.
  first = lambda row, ids: next((i for i, t in enumerate(row) if t in ids), None)
  a, b = next((a, b) for a in free.tokens[0][1:] for b in free.tokens[1][1:] if a != b and
              free.tokens[0][first(free.tokens[0], {a, b})] == a and free.tokens[1][first(free.tokens[1], {a, b})] == b)
  out = generate_lib.generate(m, params, PROMPTS, 12, eos_id=[a, b])
  assert out.tokens == [row[:first(row, {a, b})] if first(row, {a, b}) is not None else row for row in free.tokens]
  assert out.finish_reasons[:2] == ['eos', 'eos'] and out.compile_seconds == 0.0  # the stop ids are an input
  assert [out.tokens[0] + [a], out.tokens[1] + [b]] == [row[:len(t) + 1] for row, t in zip(free.tokens[:2], out.tokens)]


def test_refusals():
  m, params, _ = tiny()
  with pytest.raises(generate_lib.GenerateError, match='empty prompt'):
    generate_lib.generate(m, params, [[1, 2], []], 4)
  with pytest.raises(generate_lib.GenerateError, match='beyond the 16 the cache is sized for'):
    generate_lib.generate(m, params, [[1] * 10], 7, max_len=16)


def _restricted(logits: np.ndarray, s: generate_lib.Sampling) -> np.ndarray:
  """softmax(logits / T) restricted to the top-k, then to the top-p nucleus, renormalised (numpy, float64)."""
  p = np.exp((logits - logits.max()) / s.temperature)
  p /= p.sum()
  order = np.argsort(-p, kind='stable')
  keep = np.zeros_like(p, bool)
  keep[order[:s.top_k or len(p)]] = True
  p = np.where(keep, p, 0) / p[keep].sum()
  if s.top_p < 1:
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(keep)
    keep[order[before < s.top_p]] = True
    p = np.where(keep, p, 0) / p[keep].sum()
  return p


def test_filter_logits_keeps_the_top_k_then_the_top_p_nucleus():
  logits = np.random.default_rng(1).standard_normal((5, 62)).astype(np.float32) * 2
  for s in (generate_lib.Sampling(0.7, top_k=5), generate_lib.Sampling(1.3, top_p=0.6),
            generate_lib.Sampling(1.0, top_k=20, top_p=0.5)):
    kept = np.isfinite(np.asarray(generate_lib.filter_logits(logits, s)))
    expected = np.stack([_restricted(row, s) > 0 for row in logits])
    assert (kept == expected).all() and 1 <= kept.sum(-1).min() and kept.sum(-1).max() < 62


SAMPLINGS = {'top_k': generate_lib.Sampling(0.8, top_k=6), 'top_p': generate_lib.Sampling(0.5, top_p=0.8),
             'top_k_and_p': generate_lib.Sampling(1.0, top_k=12, top_p=0.9)}


@pytest.mark.parametrize('sampling', grid(list(SAMPLINGS.values()), fast=[SAMPLINGS['top_k_and_p']],
                                          ids=lambda v: next(k for k, s in SAMPLINGS.items() if s == v)))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_first_sampled_token_follows_the_restricted_softmax(sampling):
  """2,048 rows of one prompt in one call: the first tokens' frequencies against softmax(logits / T), restricted."""
  m, params, _ = tiny(std=1.0)
  prompt = PROMPTS[0]
  n = 2048
  out = generate_lib.generate(m, params, [prompt] * n, 1, sampling=sampling, seed=7)
  counts = np.bincount([t[0] for t in out.tokens], minlength=m.vocab_size) / n
  logits = full_forward_logits(m, params, [prompt])[0][-1].astype(np.float64)
  expected = _restricted(logits, sampling)
  unrestricted = _restricted(logits, generate_lib.Sampling(sampling.temperature))
  assert 0.5 * np.abs(expected - unrestricted).sum() > 0.1  # the restriction matters, so the test can fail
  assert counts[expected == 0].sum() == 0  # nothing outside the top-k / nucleus is ever drawn
  assert 0.5 * np.abs(counts - expected).sum() < 0.05


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_sampling_is_reproducible_with_a_seed():
  m, params, _ = tiny()
  s = generate_lib.Sampling(1.0, top_k=20, top_p=0.95)
  a = generate_lib.generate(m, params, PROMPTS, 16, sampling=s, seed=3)
  assert a.tokens == generate_lib.generate(m, params, PROMPTS, 16, sampling=s, seed=3).tokens
  assert a.tokens != generate_lib.generate(m, params, PROMPTS, 16, sampling=s, seed=4).tokens


MESHES = {'fsdp4-tensor2-gqa': ((1, 4, 2), 2), 'data2-fsdp4-mqa': ((2, 4, 1), 1), 'fsdp4-tensor2-mqa': ((1, 4, 2), 1)}


@pytest.mark.parametrize('mesh_shape, num_kv_heads', grid(
    list(MESHES.values()), fast=[MESHES['fsdp4-tensor2-gqa']], ids=lambda v: next(k for k, c in MESHES.items() if c == v),
    unpack=True))
@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_sharded_greedy_equals_one_device_with_the_cache_on_the_rules_tables_axes(mesh_shape, num_kv_heads):
  m, params, logical = tiny(num_kv_heads)
  new = 24
  expected = generate_lib.generate(m, params, PROMPTS, new).tokens
  cfg = load_config('palm_tiny')
  cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = mesh_shape
  mesh = sharding.make_mesh(cfg.mesh)
  placed = jax.device_put(params, sharding.logical_to_mesh(logical, mesh))
  out = generate_lib.generate(m, placed, PROMPTS, new, mesh=mesh)
  assert out.tokens == expected
  # The cache: rows over data × fsdp, kv heads over tensor where K divides it (multi-query's one head replicated).
  model = generate_lib.inference_model(m)
  ways = mesh_shape[0] * mesh_shape[1]
  batch = max(ways, 4)  # 4 prompts, rounded up to a multiple of the data × fsdp ways
  with sharding.activate(mesh):
    (prefill, _), _ = generate_lib._programs(model, generate_lib.Sampling(), 8, new, False, placed, batch, 16, mesh)
    rows = jax.sharding.NamedSharding(mesh, P(('data', 'fsdp')))
    _, cache = prefill(placed, *jax.device_put(generate_lib.left_pad(PROMPTS, 16, batch), rows))
  heads = 'tensor' if num_kv_heads % mesh_shape[2] == 0 else None
  for name in ('key', 'value'):
    x = cache['layers']['attention'][name]
    assert x.shape == (2, batch, 16 + new, num_kv_heads, 4)
    assert x.sharding.spec == P(None, ('data', 'fsdp'), None, heads, None), (name, x.sharding)
    assert x.sharding.shard_shape(x.shape)[1] == batch // ways
  assert cache['layers']['attention']['segment_ids'].sharding.spec == P(None, ('data', 'fsdp'), None)


HF_VARIANTS = {'llama-gqa-untied': dict(parallel_block=False, num_kv_heads=2, tie_embeddings=False),
               'cohere-mqa-tied': dict(parallel_block=True, num_kv_heads=1, tie_embeddings=True)}


@pytest.mark.parametrize('variant', grid(list(HF_VARIANTS), fast=['llama-gqa-untied']))
def test_greedy_tokens_equal_transformers_generate_on_the_export(variant, tmp_path):
  """8 prompts of different lengths in one batch × 32 new tokens: jaxlm's cached greedy == transformers'."""
  from jaxlm.hf import export
  from tests.hf.test_export import _config, _load_hf, _random_run  # the export tests' random runs
  torch = pytest.importorskip('torch', reason='torch is not installed: pip install -e ".[test]"')
  transformers = pytest.importorskip('transformers', reason='transformers is not installed: pip install -e ".[test]"')
  cfg = _config(**HF_VARIANTS[variant])
  model, params = _random_run(cfg, tmp_path / 'run')
  export.export(str(tmp_path / 'run'), str(tmp_path / 'hf'))
  hf_model = _load_hf((torch, transformers), str(tmp_path / 'hf'))  # never stops early; pads with 0
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, cfg.model.vocab_size, n).tolist() for n in (3, 17, 8, 1, 12, 5, 20, 9)]
  new = 32
  ours = generate_lib.generate(model.config, params, prompts, new).tokens
  # transformers' batched generate: left-padded, with an attention mask it derives the positions from.
  T = max(map(len, prompts))
  ids, mask = np.zeros((len(prompts), T), np.int64), np.zeros((len(prompts), T), np.int64)
  for r, p in enumerate(prompts):
    ids[r, T - len(p):], mask[r, T - len(p):] = p, 1
  with torch.no_grad():
    theirs = hf_model.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                               do_sample=False)[:, T:].numpy()
  assert theirs.shape == (len(prompts), new)
  assert ours == theirs.tolist()
  assert len({t for row in ours for t in row}) > len(prompts)  # varied text, not one token repeated


@pytest.mark.e2e  # seconds of compiles: the full suite runs it, the fast loop keeps unit-sized tests
def test_fp8_trained_weights_sample_with_ordinary_matmuls():
  """An fp8 run's parameters are ordinary weights; the sampler runs them in model.dtype, as eval does."""
  import dataclasses
  m, params, _ = tiny()
  fp8 = dataclasses.replace(m, matmul_dtype='fp8')
  assert generate_lib.inference_model(fp8) == generate_lib.inference_model(m)
  assert generate_lib.generate(fp8, params, PROMPTS, 8).tokens == generate_lib.generate(m, params, PROMPTS, 8).tokens
