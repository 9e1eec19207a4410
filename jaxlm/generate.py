"""The sampling engine: prefill every prompt in one pass, then decode from a KV cache in one compiled loop.

  out = generate.generate(model_cfg, params, [[eos, 17, 4], [eos, 9]], max_new_tokens=64,
                          sampling=generate.Sampling(temperature=0.8, top_p=0.95), eos_id=eos, mesh=mesh)

Ragged prompts share one batch **left-padded** to a common length P: every row's last prompt token sits in the
same slot, so the whole batch writes one cache slot per step (a scalar index, as in Flax's decode caches) and
reads its next-token logits from the same column. Padding slots have segment id 0, which attention never reads
as a key, and each row's positions start at 0 at its first real token (RoPE sees the same positions as an
unpadded forward). This is the layout transformers' batched `generate` uses too.

The cache lives in the model's `cache` collection (model.Attention.cached_attention): per layer the K key/value
heads only (one under multi-query attention), (B, S, K, E) with S = P + max_new_tokens. It is sharded with the
rules table: rows over `act_batch` (data, fsdp), kv heads over `act_kv_heads` (tensor) where they divide it
(multi-query's one head is replicated, as its weights are).

Decoding runs inside one `lax.while_loop` that stops when every row has produced one of the stop ids (`eos_id`:
one id or the model's list, as generation_config.json's eos_token_id); a finished row keeps
stepping (its outputs are dropped), as the batch shares one slot index. Programs are compiled once per bucket:
the batch rounded up to a power of two (and to a multiple of the batch's mesh ways), P to a power of two (capped
by `max_len`), and the sampling settings.
"""

import dataclasses
import functools
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlm import errors
from jaxlm import model as model_lib
from jaxlm import sharding


class GenerateError(errors.JaxlmError, ValueError):
  """Prompts or settings the sampler cannot take; the message says what to change."""
  exit_code = 2


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is chosen: temperature 0 is greedy; top_k 0 and top_p 1 restrict nothing."""
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0


@dataclasses.dataclass
class Output:
  """What `generate` returns, one entry per prompt (in order)."""
  tokens: list[list[int]]  # generated ids, without the end-of-text token
  finish_reasons: list[str]  # 'eos' (stopped at a stop id) or 'length' (max_new_tokens reached)
  prompt_tokens: int  # real (unpadded) prompt tokens prefilled
  prefill_seconds: float
  decode_seconds: float  # the compiled loop, after the first token (which prefill's logits give)
  compile_seconds: float  # 0 when both programs came from the cache
  logits: np.ndarray | None = None  # (prompts, max_new_tokens, V) float32 with return_logits: each step's
  steps: int = 0  # tokens the loop wrote per row before every row had ended (<= max_new_tokens)
  # Per row, the float32 log-probability of each token written, the stop id included (one more entry than
  # `tokens` when the row ended with 'eos'): `token_logprobs` of the step's logits, as the RL trainer scores them.
  logprobs: list[list[float]] = dataclasses.field(default_factory=list)
  ends: list[int | None] = dataclasses.field(default_factory=list)  # the stop id each row ended with (None: length)

  @property
  def generated_tokens(self) -> int:
    """Tokens written in all, each row's end-of-text token included."""
    return sum(len(t) + (r == 'eos') for t, r in zip(self.tokens, self.finish_reasons))


def inference_model(model_cfg: model_lib.ModelConfig) -> model_lib.Decoder:
  """The decoder as sampled: ordinary matmuls (fp8 runs too), nothing kept for a backward pass, no dropout."""
  m = dataclasses.replace(model_lib.inference_config(model_cfg), remat='none', dropout_rate=0.0)
  return model_lib.Decoder(m)


def filter_logits(logits, sampling: Sampling):
  """Float32 logits (B, V) divided by the temperature, -inf outside top-k, then outside the top-p nucleus.

  top-p keeps the smallest set of most likely tokens whose probability reaches top_p (the first always), after
  top-k, as transformers' TopKLogitsWarper then TopPLogitsWarper do.
  """
  logits = logits.astype(jnp.float32) / sampling.temperature
  if 0 < sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]  # (B, 1)
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1.0:
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]  # (B, V), most likely first
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above each
    kept = jnp.sum(before < sampling.top_p, axis=-1, keepdims=True)  # (B, 1), >= 1
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    logits = jnp.where(logits < threshold, -jnp.inf, logits)
  return logits


def token_logprobs(logits, tokens, temperature: float):
  """log softmax(logits / temperature) at `tokens`, float32: (..., V), (...) -> (...); temperature 0 counts as 1.

  The distribution before top-k / top-p, as TRL's GRPO trainer scores completions: the RL train step computes
  the same function of the same logits (jaxlm.policy.policy_loss), so the sampler's numbers are its old log-probs.
  """
  logits = logits.astype(jnp.float32) / (temperature or 1.0)
  picked = jnp.take_along_axis(logits, tokens[..., None], axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def sample(logits, key, sampling: Sampling):
  """The next token (B,) int32 from logits (B, V): argmax at temperature 0, else a draw per row."""
  if sampling.temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, filter_logits(logits, sampling), axis=-1).astype(jnp.int32)


def left_pad(prompts: list[list[int]], length: int, rows: int, pad_id: int = 0):
  """(tokens, segment_ids, positions), each (rows, length) int32: prompts right-aligned, padding rows after."""
  tokens = np.full((rows, length), pad_id, np.int32)
  segment_ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  for r, ids in enumerate(prompts):
    n = len(ids)
    tokens[r, length - n:] = ids
    segment_ids[r, length - n:] = 1
    positions[r, length - n:] = np.arange(n)
  return tokens, segment_ids, positions


def _bucket(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _batch_axes(mesh):
  return None if mesh is None else nn.logical_to_mesh_axes(('act_batch',), sharding.rules(mesh))[0]


def cache_shardings(cache_shapes, mesh):
  """NamedShardings of the cache's leaves through the rules table; an axis that does not divide is replicated."""
  def one(path, x):
    name = path[-1].key
    logical = {'key': ('act_batch', None, 'act_kv_heads', 'act_kv'), 'value': ('act_batch', None, 'act_kv_heads',
               'act_kv'), 'segment_ids': ('act_batch', None), 'index': (), 'slots': (None,)}[name]
    logical = (None,) * (x.ndim - len(logical)) + logical  # the scanned stack's leading layer axis
    axes = nn.logical_to_mesh_axes(logical, sharding.rules(mesh))
    axes = [a if size % sharding.ways(mesh, a) == 0 else None for a, size in zip(axes, x.shape)]
    return NamedSharding(mesh, P(*axes))
  return jax.tree_util.tree_map_with_path(one, cache_shapes)


def cache_shapes(model, params, batch: int, length: int):
  """The cache collection's ShapeDtypeStructs for `batch` rows of `length` slots (no FLOPs spent)."""
  x = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  _, variables = jax.eval_shape(lambda p, t: model.apply({'params': p}, t, t, t, mutable=['cache']), params, x)
  return variables['cache']


def cache_bytes_per_token(model_cfg: model_lib.ModelConfig, params) -> int:
  """Bytes the decode cache holds per token of a row, all layers: keys and values per kv head, or MLA's latent and
  rotary key (jaxlm/mla.py), plus each slot's segment id. From two cache shapes, no FLOPs spent; a local layer's
  ring counts while the sequence is shorter than its window."""
  model = inference_model(model_cfg)
  size = lambda n: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache_shapes(model, params, 1, n)))  # noqa: E731
  return (size(16) - size(8)) // 8


def _constrain(cache, shardings):
  return cache if shardings is None else jax.lax.with_sharding_constraint(cache, shardings)


def _prefill(model, params, tokens, segment_ids, positions, shapes, shardings):
  """Last-column float32 logits (B, V) of the prompts and the cache holding their keys and values."""
  cache = _constrain(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), shardings)
  logits, variables = model.apply({'params': params, 'cache': cache}, tokens, segment_ids, positions,
                                  mutable=['cache'])
  return logits[:, -1].astype(jnp.float32), _constrain(variables['cache'], shardings)


def _decode(model, sampling, stops, max_new, return_logits, params, cache, logits, next_positions, key,
            shardings):
  """The compiled loop: (tokens, log-probs (B, max_new), steps run, [logits (B, max_new, V)]) after prefill's.
  `stops`: (slots,) int32, the ids a row stops at, padded with -1 (never drawn)."""
  B, V = logits.shape
  first = sample(logits, jax.random.fold_in(key, 0), sampling)
  tokens = jnp.zeros((B, max_new), jnp.int32).at[:, 0].set(first)
  logprobs = jnp.zeros((B, max_new), jnp.float32).at[:, 0].set(token_logprobs(logits, first, sampling.temperature))
  done = jnp.isin(first, stops) | (next_positions == 0)  # the batch's padding rows (no prompt) are done at once
  all_logits = jnp.zeros((B, max_new, V) if return_logits else (B, 0, V), jnp.float32)
  if return_logits:
    all_logits = all_logits.at[:, 0].set(logits)

  def cond(carry):
    t, _, _, _, _, done, _ = carry
    return (t < max_new) & ~jnp.all(done)

  def body(carry):
    t, cache, last, tokens, logprobs, done, all_logits = carry
    positions = (next_positions + t - 1)[:, None]  # (B, 1): `last` is the row's (t-1)-th new token
    out, variables = model.apply({'params': params, 'cache': cache}, last[:, None], jnp.ones_like(positions),
                                 positions, mutable=['cache'])
    step_logits = out[:, 0].astype(jnp.float32)  # (B, V)
    token = sample(step_logits, jax.random.fold_in(key, t), sampling)
    token = jnp.where(done, stops[0], token)  # a finished row keeps an end of text
    tokens = jax.lax.dynamic_update_slice(tokens, token[:, None], (0, t))
    logprob = token_logprobs(step_logits, token, sampling.temperature)[:, None]
    logprobs = jax.lax.dynamic_update_slice(logprobs, logprob, (0, t))
    if return_logits:
      all_logits = jax.lax.dynamic_update_slice(all_logits, step_logits[:, None], (0, t, 0))
    return (t + 1, _constrain(variables['cache'], shardings), token, tokens, logprobs,
            done | jnp.isin(token, stops), all_logits)

  t, _, _, tokens, logprobs, _, all_logits = jax.lax.while_loop(
      cond, body, (jnp.int32(1), cache, first, tokens, logprobs, done, all_logits))
  return tokens, logprobs, t, all_logits


_COMPILED = {}  # (what decides the program) -> (prefill, decode) executables: one compile per bucket


def _programs(model, sampling, stop_slots, max_new, return_logits, params, batch, length, mesh):
  """The compiled prefill and decode for one bucket, and the seconds compiling them took (0 if cached)."""
  param_shardings = tuple(getattr(x, 'sharding', None) for x in jax.tree.leaves(params))
  key = (model, sampling, stop_slots, max_new, return_logits, batch, length, mesh, param_shardings)
  if key in _COMPILED:
    return _COMPILED[key], 0.0
  start = time.perf_counter()
  shapes = cache_shapes(model, params, batch, length + max_new)
  shardings = None if mesh is None else cache_shardings(shapes, mesh)
  rows = None if mesh is None else NamedSharding(mesh, P(_batch_axes(mesh)))
  abstract = lambda shape, dtype=jnp.int32, where=rows: jax.ShapeDtypeStruct(shape, dtype, sharding=where)
  prefill = jax.jit(lambda p, t, s, pos: _prefill(model, p, t, s, pos, shapes, shardings),
                    out_shardings=None if mesh is None else (rows, shardings))
  prompt = abstract((batch, length))
  prefill = prefill.lower(params, prompt, prompt, prompt).compile()
  decode = jax.jit(lambda p, c, lg, pos, k, stops: _decode(model, sampling, stops, max_new, return_logits, p, c, lg,
                                                           pos, k, shardings))
  cache = shapes if shardings is None else jax.tree.map(lambda s, sh: abstract(s.shape, s.dtype, sh), shapes,
                                                        shardings)
  logits = abstract((batch, model.config.vocab_size), jnp.float32)
  decode = decode.lower(params, cache, logits, abstract((batch,)), jax.random.PRNGKey(0),
                        jnp.full((stop_slots,), -1, jnp.int32)).compile()
  _COMPILED[key] = (prefill, decode)
  return (prefill, decode), time.perf_counter() - start


def check_lengths(prompts: list[list[int]], max_new_tokens: int, max_len: int | None) -> None:
  """Refuses prompts the sampler cannot take: none, an empty one, or one too long for the cache with its reply."""
  if not prompts:
    raise GenerateError('no prompts given; pass at least one')
  if any(len(p) == 0 for p in prompts):
    raise GenerateError('an empty prompt has nothing to continue; give each prompt at least one token')
  if max_new_tokens < 1:
    raise GenerateError(f'max_new_tokens={max_new_tokens} generates nothing; give a positive number')
  longest = max(len(p) for p in prompts)
  if max_len is not None and longest + max_new_tokens > max_len:
    raise GenerateError(f'the longest prompt ({longest} tokens) plus max_new_tokens={max_new_tokens} is '
                        f'{longest + max_new_tokens} tokens, beyond the {max_len} the cache is sized for (the '
                        f'model\'s sequence length); shorten the prompt or lower --max_new_tokens')


def generate(model_cfg: model_lib.ModelConfig, params, prompts: list[list[int]], max_new_tokens: int, *,
             sampling: Sampling = Sampling(), seed: int = 0, eos_id: int | list[int] | None = None, pad_id: int = 0,
             mesh=None, max_len: int | None = None, return_logits: bool = False) -> Output:
  """Continues each prompt (token ids) by up to `max_new_tokens` tokens on `mesh` (None: the default device).

  `params` as the model stores them (placed on `mesh` as the program's shardings say, or anywhere without one).
  `max_len`: the longest sequence the model takes (the run's data.seq_len); prompt + max_new_tokens beyond it
  is refused. `eos_id`: the id, or ids, a row stops at (a tokenizer's `stop_ids`); None: every row runs
  `max_new_tokens`.
  """
  check_lengths(prompts, max_new_tokens, max_len)
  longest = max(len(p) for p in prompts)
  model = inference_model(model_cfg)
  length = _bucket(longest)
  if max_len is not None:
    length = min(length, max_len - max_new_tokens)
  ways = 1 if mesh is None else sharding.ways(mesh, _batch_axes(mesh))
  batch = math.ceil(_bucket(len(prompts)) / ways) * ways
  stops = () if eos_id is None else tuple(int(i) for i in np.atleast_1d(eos_id))
  # The stop ids are an input of the program, not part of it: any list of up to 8 ids shares one compile.
  slots = np.full(max(8, _bucket(len(stops))), -1, np.int32)
  slots[:len(stops)] = stops
  context = sharding.activate(mesh) if mesh is not None else nn.logical_axis_rules(())
  with context:
    (prefill, decode), compile_seconds = _programs(model, sampling, len(slots), max_new_tokens, return_logits,
                                                   params, batch, length, mesh)
    tokens, segment_ids, positions = left_pad(prompts, length, batch, pad_id)
    if mesh is not None:  # rows over the batch's mesh axes, as the programs were compiled for
      rows = NamedSharding(mesh, P(_batch_axes(mesh)))
      tokens, segment_ids, positions = jax.device_put((tokens, segment_ids, positions), rows)
    lengths = np.zeros(batch, np.int32)
    lengths[:len(prompts)] = [len(p) for p in prompts]
    if mesh is not None:
      lengths = jax.device_put(lengths, NamedSharding(mesh, P(_batch_axes(mesh))))
    start = time.perf_counter()
    logits, cache = prefill(params, tokens, segment_ids, positions)
    jax.block_until_ready(logits)
    prefilled = time.perf_counter()
    out, logprobs, steps, all_logits = decode(params, cache, logits, lengths, jax.random.PRNGKey(seed),
                                              jnp.asarray(slots))
    out, logprobs = _to_host(out), _to_host(logprobs)
    decoded = time.perf_counter()
  steps = int(steps)
  result, reasons, scores, ends = [], [], [], []
  for row, row_logprobs in zip(out[:len(prompts), :steps].tolist(), logprobs[:len(prompts), :steps].tolist()):
    end = next((i for i, token in enumerate(row) if token in stops), None)
    if end is not None:
      result.append(row[:end])
      reasons.append('eos')
    else:
      result.append(row)
      reasons.append('length')
    scores.append(row_logprobs[:len(row) if end is None else end + 1])
    ends.append(None if end is None else row[end])
  return Output(result, reasons, int(lengths.sum()), prefilled - start, decoded - prefilled, compile_seconds,
                _to_host(all_logits)[:len(prompts)] if return_logits else None, steps, scores, ends)


def _to_host(x) -> np.ndarray:
  """A global array as numpy, on every process: its rows are spread over processes when the mesh spans them
  (every process gave the same prompts, so every process gets every row back)."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def generate_without_cache(model_cfg: model_lib.ModelConfig, params, prompts: list[list[int]],
                           max_new_tokens: int) -> np.ndarray:
  """Greedy tokens (prompts, max_new_tokens) re-running the full forward over the whole sequence for each token.

  The reference the cache is tested against and the baseline bench/generate.py measures it by: the same left
  padding, in a (B, P + max_new_tokens) buffer whose unwritten tail is segment 0 (never attended to).
  """
  model = inference_model(model_cfg)
  length = _bucket(max(len(p) for p in prompts))
  tokens, segment_ids, _ = left_pad(prompts, length, len(prompts))
  pad = length - segment_ids.sum(1)  # (B,) padding slots before each prompt
  tail = ((0, 0), (0, max_new_tokens))
  positions = np.maximum(np.arange(length + max_new_tokens)[None] - pad[:, None], 0).astype(np.int32)
  return np.asarray(_no_cache(model, length, max_new_tokens, params, np.pad(tokens, tail),
                              np.pad(segment_ids, tail), positions))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _no_cache(model, length, max_new, params, tokens, segment_ids, positions):
  """The no-cache loop: each step the full forward over all (B, S) slots, its argmax at the last written one."""
  def body(t, carry):
    tokens, segment_ids, out = carry
    logits = model.apply({'params': params}, tokens, segment_ids, positions)  # (B, S, V): every token again
    token = jnp.argmax(jax.lax.dynamic_index_in_dim(logits, length + t - 1, axis=1, keepdims=False), axis=-1)
    token = token.astype(jnp.int32)[:, None]  # (B, 1)
    tokens = jax.lax.dynamic_update_slice(tokens, token, (0, length + t))
    segment_ids = jax.lax.dynamic_update_slice(segment_ids, jnp.ones_like(token), (0, length + t))
    return tokens, segment_ids, jax.lax.dynamic_update_slice(out, token, (0, t))

  out = jnp.zeros((tokens.shape[0], max_new), jnp.int32)
  return jax.lax.fori_loop(0, max_new, body, (tokens, segment_ids, out))[2]


def sample_texts(model_cfg: model_lib.ModelConfig, params, prompts, tokenizer, *, max_new_tokens: int,
                 max_len: int, mesh=None) -> list[str]:
  """Greedy continuations of text `prompts` (each after the separator training documents follow, and stopping
  at the next one or any other of the model's stop ids), as the training loop logs them at each evaluation;
  `max_new_tokens` shrinks to what the cache holds."""
  eos = tokenizer.separator_id if tokenizer.separator_id >= 0 else None
  ids = [([eos] if eos is not None else []) + tokenizer.encode(p) for p in prompts]
  new = min(max_new_tokens, max_len - max(map(len, ids)))
  if new < 1:
    raise GenerateError(f'the longest sample prompt is {max(map(len, ids))} tokens, which leaves no room in the '
                        f'{max_len}-token sequence; shorten train.sample_prompts')
  out = generate(model_cfg, params, ids, new, eos_id=tokenizer.stop_ids or eos, mesh=mesh, max_len=max_len)
  return [tokenizer.decode(t) for t in out.tokens]
