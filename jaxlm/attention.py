"""Attention kernels behind one function, chosen by `cfg.model.attention`.

  xla     the reference: einsum scores, float32 softmax, an explicit (B, 1, 1, T, S) mask. Runs everywhere.
          `model.attention_block_q` > 0 takes the queries in blocks (recomputed in the backward pass), so long
          sequences need (block, S) scores at a time instead of (T, S).
  cudnn   cuDNN flash attention through jax.nn.dot_product_attention(implementation='cudnn'): NVIDIA GPUs,
          bfloat16/float16, head dim a multiple of 8 (<= 128; <= 256 on Hopper and later). Causal masking is
          the kernel's own (it skips the upper triangle); documents are a boolean mask, which JAX turns into
          an additive (B, 1, T, S) bias.
  splash  Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention): TPU only; causal mask
          plus segment ids, so documents cost no mask tensor at all. Sequence length a multiple of 128.
  auto    gpu -> cudnn, tpu -> splash, anything else -> xla.

Deterministic mode (train.deterministic, i.e. XLA_FLAGS holding --xla_gpu_deterministic_ops=true): on a GPU,
auto chooses xla, whose einsums and softmax XLA runs deterministically. cuDNN flash attention's backward is the
part without a deterministic form we can count on: under that flag palm_1b (cuDNN attention) crashed at its first
step while palm_small (xla attention) was bit-exact (issue #31). So `config.validate` refuses
model.attention=cudnn with train.deterministic, and cudnn asked for under the flag by hand falls back to xla.

Context parallelism (mesh.context = C > 1, `act_seq` split): the step hands the model every sequence in
`sharding.zigzag_order` (shard i holds chunks i and 2C-1-i of 2C, c = T/2C tokens each), so array order is not
token order. Queries stay local. A global layer all-gathers keys and values along the sequence (one (S, E) head
per device under multi-query attention: cheap), and the causal mask comes from the zig-zag order, not from array
indices. A local layer whose window fits in a chunk (W <= c) gathers nothing: each chunk needs only the W keys,
values and segment ids before it, the tail of the chunk before it, which two collective-permutes bring from the
neighbouring shards (`_halo_attention`); its queries then take the blocks of [halo + chunk] their window
reaches, as on one device. So its communication and key/value memory per device do not grow with T. A window
longer than a chunk reaches into shards beyond the neighbours: that layer gathers the whole sequence and takes
only the blocks its window reaches (`_window_blocks`, by position in the zig-zag order). Only `xla` takes these
masks: cudnn's and splash's causal masks assume array order, so they fall back to xla with that reason.

A kernel that cannot run here (cudnn on a CPU, float32 for cudnn, splash off a TPU, an unsupported head size)
falls back to `xla` and says so in the log, once per distinct reason: never silently.

Shapes: q (B, T, H, E); k, v (B, S, K, E) with H a multiple of K; segment_ids (B, T), 0 = padding. Every kernel
attends causally within one nonzero segment. Outputs at padding positions are unspecified (but finite): they
carry zero loss weight, so no kernel has to agree there.
"""

import dataclasses
import functools
import logging
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import sharding

log = logging.getLogger(__name__)

IMPLS = ('xla', 'cudnn', 'splash', 'auto')
# What train.deterministic adds to XLA_FLAGS (before JAX starts its backend); GPU only: CPU and TPU kernels are
# deterministic already.
DETERMINISTIC_XLA_FLAGS = '--xla_gpu_deterministic_ops=true'
_AUTO = {'gpu': 'cudnn', 'tpu': 'splash'}
_logged = set()


@dataclasses.dataclass(frozen=True)
class Scores:
  """What a layer does to its attention scores beyond softmax(q·k / sqrt(E)) (all off by default).

  window  W > 0: a local layer, each query attending to its W most recent keys, itself included (key position
          > query position - W, transformers' sliding-window convention); 0 = the whole causal past. May be a
          traced int32 scalar (scanned layers carry local and global layers in one stack); <= 0 then means global.
  softcap cap > 0: scores become cap·tanh(scores / cap) before masking (Gemma 2).
  sinks   (H,) learned logits, one per query head, that join each softmax's denominator and attend to nothing
          (gpt-oss); None = no sinks.
  scale   the scores' multiplier; 0 = 1/sqrt(E) (Gemma's query_pre_attn_scalar gives another).
  width   a traced window's W when it is local (the fused kernels build their masks from a static width).
  """
  window: object = 0
  softcap: float = 0.0
  sinks: object = None
  scale: float = 0.0
  width: int = 0

  def unsupported(self, kernel: str) -> str | None:
    """What of these scores the fused `kernel` cannot compute (only xla computes them all), or None.

    cuDNN (jax.nn.dot_product_attention) takes a window (its local_window_size) but no soft-cap or sinks; splash
    takes a window (a LocalMask) and a soft-cap (attn_logits_soft_cap) but no sinks."""
    missing = [name for name, asked, takes in (('soft-cap', bool(self.softcap), kernel == 'splash'),
                                                ('sinks', self.sinks is not None, False)) if asked and not takes]
    return ' and '.join(missing) or None


def windowed(kernel, scores: Scores, *args):
  """kernel(*args, window=W) with W static: the layer's own window, or for a traced one (scanned layers mixing
  local and global) a cond between the local kernel (scores.width) and the global one (0)."""
  if isinstance(scores.window, int):
    return kernel(*args, window=scores.window)
  return jax.lax.cond(jnp.reshape(scores.window, ()) > 0, functools.partial(kernel, window=scores.width),
                      functools.partial(kernel, window=0), *args)


PLAIN = Scores()


def attention_mask(segment_ids, order=None, kv_segment_ids=None, kv_order=None, window=0):
  """(B, 1, 1, T, S) boolean: causal, within one document, never from padding (segment 0), and with `window`
  W > 0 only the W most recent positions (the query's own included; see `Scores`).

  `order` (T,): the original position in the row of each array slot (context parallelism's zig-zag order);
  None means array order. Causality compares those, so it holds whatever order the tokens arrive in.
  `kv_segment_ids` (B, S) and `kv_order` (S,) describe the keys when they are not the queries (a block of
  queries against the whole row); by default they are the queries'.
  """
  kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
  order = np.arange(segment_ids.shape[1]) if order is None else order
  kv_order = order if kv_order is None else kv_order
  distance = jnp.asarray(order)[:, None] - jnp.asarray(kv_order)[None, :]  # (T, S): query - key position
  causal = distance >= 0
  if not (isinstance(window, int) and window == 0):  # within a document positions are array order, so this
    causal = causal & ((window <= 0) | (distance < window))  # is the distance in tokens
  same_doc = segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # (B, T, S)
  real = (segment_ids != 0)[:, :, None]  # (B, T, 1)
  return (causal & same_doc & real)[:, None, None]


def _scores_attention(q, k, v, segment_ids, order, kv_segment_ids, kv_order, scores_cfg: Scores = PLAIN):
  """Queries q (B,T,H,E) over keys and values (B,S,K,E), the whole (T, S) scores at once -> (B,T,H,E)."""
  B, T, H, E = q.shape
  S, K = k.shape[1], k.shape[2]
  G = H // K  # query heads per kv head
  # The G query heads that share a kv head become more query rows, M = T·G: both products are then plain
  # batched matmuls over (B, K), and the (M, S) scores and their gradients are never transposed (XLA:CPU
  # would copy them for a layout like (B, K, G, T, S)). For multi-query attention (K = 1) q moves for free.
  q = q.reshape(B, T, K, G, E).transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, E)  # (B, K, M, E)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, S, E)
  c = scores_cfg
  scores = jnp.einsum('BKME,BKSE->BKMS', q, k).astype(jnp.float32) * (c.scale or 1 / math.sqrt(E))
  if c.softcap:  # Gemma 2: bounded scores, cap·tanh(s / cap), before the mask
    scores = c.softcap * jnp.tanh(scores / c.softcap)
  # Finite fill, not -inf: a fully masked (padding) row then gives a uniform softmax rather than NaN.
  mask = attention_mask(segment_ids, order, kv_segment_ids, kv_order, c.window).reshape(B, 1, T, 1, S)
  scores = jnp.where(mask, scores.reshape(B, K, T, G, S), jnp.finfo(jnp.float32).min)
  if c.sinks is None:
    probs = jax.nn.softmax(scores, axis=-1)
  else:  # gpt-oss: exp(sink) joins every row's denominator; the sink column itself is dropped
    sink = jnp.broadcast_to(c.sinks.astype(jnp.float32).reshape(1, K, 1, G, 1), (B, K, T, G, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :S]
  probs = probs.astype(v.dtype).reshape(B, K, T * G, S)
  out = jnp.einsum('BKMS,BKSE->BKME', probs, v)  # (B, K, M, Ev): values may be narrower than keys (MLA)
  Ev = v.shape[-1]
  return out.reshape(B, K, T, G, Ev).transpose(0, 2, 1, 3, 4).reshape(B, T, H, Ev)


def xla_attention(q, k, v, segment_ids, order=None, block_q: int = 0, shards: int = 1, scores_cfg: Scores = PLAIN):
  """Reference attention: einsum scores, softmax in float32. q: (B,T,H,E); k, v: (B,S,K,E) -> (B,T,H,E).

  `order`: the tokens' original positions in the row when they arrive permuted (see `attention_mask`).
  `block_q` > 0: the queries go through in blocks of that many rows of each of the `shards` contiguous parts
  of T (the context shards: block i of every part together), each block recomputed in the backward pass, so
  the live scores are (shards·block_q, S) rather than (T, S); the result is the same. 0: all rows at once.
  A local layer (a window W) whose row is long enough goes by `_window_blocks` instead: only the keys its
  window reaches, on one device or split over context shards alike.
  """
  B, T = q.shape[:2]
  width = scores_cfg.window if isinstance(scores_cfg.window, int) else scores_cfg.width
  block = _window_block(T, width, block_q, order, shards) if width > 0 else 0
  if block:
    local = functools.partial(_window_blocks, width=width, block=block, scores_cfg=scores_cfg, order=order,
                              shards=shards)
    full = functools.partial(xla_attention, order=order, block_q=block_q, shards=shards,
                             scores_cfg=dataclasses.replace(scores_cfg, width=0))
    return _local_or_full(scores_cfg, local, full, q, k, v, segment_ids)
  order = np.arange(T) if order is None else np.asarray(order)
  blocks = T // (shards * block_q) if block_q else 1
  if blocks <= 1:
    return _scores_attention(q, k, v, segment_ids, order, segment_ids, order, scores_cfg)

  def split(x):  # (B, T, ...) -> (blocks, B, shards·block_q, ...)
    x = x.reshape(B, shards, blocks, block_q, *x.shape[2:])
    return jnp.moveaxis(x, 2, 0).reshape(blocks, B, shards * block_q, *x.shape[4:])

  q_order = order.reshape(shards, blocks, block_q).transpose(1, 0, 2).reshape(blocks, shards * block_q)
  # Checkpointed: otherwise the backward pass keeps every block's probabilities, all of (T, S) again.
  one = jax.checkpoint(lambda qb, sb, ob: _scores_attention(qb, k, v, sb, ob, segment_ids, order, scores_cfg))
  out = jax.lax.map(lambda xs: one(*xs), (split(q), split(segment_ids), q_order))  # (blocks, B, shards·block_q, ..)
  out = out.reshape(blocks, B, shards, block_q, *out.shape[3:])
  return jnp.moveaxis(out, 0, 2).reshape(*q.shape[:-1], v.shape[-1])


# The most scores (elements, all heads: 8 MiB in float32) one pass of a local layer's blocks forms at once; more go
# through a loop of equal groups. Small enough that a group's scores and probabilities stay in a CPU's caches (one
# pass over all of palm_tiny's 8k-token blocks, 64 MiB, ran its step ~1.7× slower than groups of 4 blocks).
LOCAL_MAX_SCORES = 1 << 21


def _local_or_full(scores_cfg: Scores, local, full, *args):
  """`local(*args)` for a local layer, `full(*args)` for a global one: by the window itself when it is a number,
  by a `cond` on it when traced (a scanned stack of both kinds: one layer body, the kind a per-layer value)."""
  if isinstance(scores_cfg.window, int):
    return local(*args) if scores_cfg.window > 0 else full(*args)
  return jax.lax.cond(jnp.reshape(scores_cfg.window, ()) > 0, local, full, *args)


def _largest_divisor(n: int, cap: int) -> int:
  """The largest divisor of n no greater than cap (>= 1): a block size that splits n evenly."""
  return next(d for d in range(min(cap, n), 0, -1) if n % d == 0)


def _window_block(T: int, width: int, block_q: int, order, shards: int) -> int:
  """The query block of a local layer's `_window_blocks` (0: the row is too short for blocks to skip anything).

  A block must be a run of consecutive positions (the zig-zag order of context parallelism keeps runs of
  T / 2C) and the blocks must split evenly over the `shards`: the largest such size up to block_q (or W)."""
  order = np.arange(T) if order is None else np.asarray(order)
  breaks = np.flatnonzero(np.diff(order) != 1) + 1  # where a run of consecutive positions ends
  runs = int(np.gcd.reduce(np.concatenate([breaks, [T // shards]]).astype(np.int64)))
  block = _largest_divisor(runs, block_q or width)
  return block if T % shards == 0 and T > block + width else 0


def _window_blocks(q, k, v, segment_ids, *, width: int, block: int, scores_cfg: Scores, order=None,
                   shards: int = 1):
  """A local layer's attention by blocks of `block` queries over only the keys its window reaches, so its cost
  grows with T, not T²: queries at positions [p, p + b) see keys [p − W, p + b) ((b, b + W) scores per block, not
  (b, T)); blocks of keys wholly outside the window are never gathered, let alone computed and masked. The W
  slots before the row's start are padding (segment 0), which no real query attends to; the mask is the same
  as the whole row's, so the result is the same.

  `order` (context parallelism's zig-zag order; None = array order) says where each array slot sits in the row:
  each block is a run of consecutive positions, and its keys are gathered from wherever the window's positions
  lie in the (all-gathered) keys. Under `shards` > 1 the blocks are taken in the shards' contiguous parts of T,
  the part a batch axis (each context device computes its own queries' blocks), the blocks within it a loop. In
  array order on one shard (no context parallelism) they go by `_window_groups`, folded into the batch."""
  B, T = q.shape[:2]
  order = np.arange(T) if order is None else np.asarray(order)
  if shards == 1 and np.array_equal(order, np.arange(T)):
    return _window_groups(q, k, v, segment_ids, width=width, block=block, scores_cfg=scores_cfg)
  blocks = T // block
  per = blocks // shards  # blocks in each shard's part of T
  starts = order[::block]  # (blocks,): each block's first position; the block holds [start, start + b)
  positions = starts[:, None] - width + np.arange(block + width)[None, :]  # (blocks, b + W) key positions
  # Each block's keys gathered up front (a static index into the keys padded by W slots in front: position p
  # at slot W + (its array slot), the W positions before the row at slots 0..W-1), not sliced inside the loop:
  # the loop's backward would add a whole-row gradient per block.
  take = np.where(positions >= 0, width + np.argsort(order)[np.maximum(positions, 0)], positions + width)
  pad = lambda x: jnp.pad(x, [(0, 0), (width, 0)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731

  def parts(x, n):  # (B, blocks·n, ...) -> (per, B, shards, n, ...): the loop axis first
    return jnp.moveaxis(x.reshape(B, shards, per, n, *x.shape[2:]), 2, 0)

  keys = lambda x: parts(pad(x)[:, take.reshape(-1)], block + width)  # noqa: E731
  rows = lambda x: parts(x, block)  # noqa: E731
  by_part = lambda a: jnp.asarray(a.reshape(shards, per, -1).transpose(1, 0, 2))  # noqa: E731  (per, shards, n)

  def one(xs):  # the shards' blocks side by side: a batch axis
    qb, kb, vb, sb, kvb, qo, ko = xs
    attend = lambda *a: _scores_attention(*a, scores_cfg)  # noqa: E731
    return jax.vmap(attend, in_axes=(1, 1, 1, 1, 0, 1, 0), out_axes=1)(qb, kb, vb, sb, qo, kvb, ko)

  # Checkpointed: the backward pass recomputes a block's probabilities rather than keeping every block's.
  out = jax.lax.map(jax.checkpoint(one), (rows(q), keys(k), keys(v), rows(segment_ids), keys(segment_ids),
                                          by_part(order), by_part(positions)))  # (per, B, shards, b, H, Ev)
  return jnp.moveaxis(out, 0, 2).reshape(*q.shape[:-1], v.shape[-1])


def _window_groups(q, k, v, segment_ids, *, width: int, block: int, scores_cfg: Scores,
                   max_scores: int = LOCAL_MAX_SCORES, before=None):
  """A local layer's attention by blocks of `block` queries over only the keys its window reaches, so its cost
  grows with T, not T²: queries [i·b, (i+1)·b) see keys [i·b − W, (i+1)·b) ((b, b + W) scores per block, not
  (b, T)). The W slots before the row's start are padding (segment 0), which no real query attends to; the mask
  is the same as the whole row's, so the result is the same.

  The blocks are folded into the batch: groups of n blocks of every row of B, B·n rows of b queries over their
  b + W keys, n the most blocks whose scores stay within `max_scores` (at least one; every row of B in each group,
  so B's sharding holds). For the same B·T above that bound, the groups have the same shapes at every T (a loop
  over single blocks of B rows ran more and smaller steps as T rose and B fell). A query's distance to a key slot
  is the same in every block (W + j − j'), so one (b, b + W) causal mask serves all. With more than one group,
  each is recomputed in the backward pass rather than kept.

  `before`: (keys, values, segment ids), (B, W, ...) each, the W positions that precede each row (a context
  shard's halo, `_halo_attention`) in place of the padding."""
  B, T = q.shape[:2]
  blocks = T // block
  # Each block's keys gathered by a static index: (blocks, b + W) slots of the padded row, 1 + W/b times the keys.
  take = np.arange(blocks)[:, None] * block + np.arange(block + width)[None, :]
  heads = q.shape[2]
  per_block = B * block * (block + width) * heads
  groups = next(g for g in range(1, blocks + 1) if blocks % g == 0 and (blocks // g) * per_block <= max_scores
                or g == blocks)
  n = blocks // groups  # blocks per group

  def keys(x, front):  # (groups, B·n, b + W, ...): the row after its W `front` slots (None: padding)
    tail = x.shape[2:]
    x = jnp.pad(x, [(0, 0), (width, 0)] + [(0, 0)] * len(tail)) if front is None else jnp.concatenate([front, x], 1)
    x = x[:, take].reshape(B, groups, n, block + width, *tail)
    return jnp.moveaxis(x, 1, 0).reshape(groups, B * n, block + width, *tail)

  def rows(x):  # (groups, B·n, b, ...)
    tail = x.shape[2:]
    return jnp.moveaxis(x.reshape(B, groups, n, block, *tail), 1, 0).reshape(groups, B * n, block, *tail)

  q_order, kv_order = np.arange(width, width + block), np.arange(block + width)  # relative to the block's keys

  def one(qb, kb, vb, sb, kvb):
    return _scores_attention(qb, kb, vb, sb, q_order, kvb, kv_order, scores_cfg)

  front_k, front_v, front_s = (None,) * 3 if before is None else before
  args = (rows(q), keys(k, front_k), keys(v, front_v), rows(segment_ids), keys(segment_ids, front_s))
  if groups == 1:
    out = one(*(x[0] for x in args))[None]
  else:  # checkpointed: the backward pass recomputes a group's probabilities rather than keeping every group's
    out = jax.lax.map(lambda xs: jax.checkpoint(one)(*xs), args)  # (groups, B·n, b, H, Ev)
  out = out.reshape(groups, B, n, block, *out.shape[3:])
  return jnp.moveaxis(out, 0, 1).reshape(*q.shape[:-1], v.shape[-1])


def document_mask(segment_ids):
  """(B, 1, T, S) boolean, True where query and key are in the same segment; causality is the kernel's.

  Padding (segment 0) attends to earlier padding, so no row is ever fully masked: a fully masked row is NaN in
  a flash kernel, and NaN times a zero loss weight is still NaN.
  """
  return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def cudnn_attention(q, k, v, segment_ids, implementation: str = 'cudnn', scale: float = 0.0, window: int = 0):
  """jax.nn.dot_product_attention with is_causal and a document mask; `implementation='xla'` runs it on a CPU.

  jax.nn's layout is ours, (B, T, N, E), and it takes K < H key/value heads natively (GQA/MQA), so nothing
  is transposed or repeated. `scale` 0 is 1/sqrt(E). `window` W > 0: the W most recent keys, the query's own
  included (jax.nn's local_window_size counts the keys before the query: W - 1).
  """
  return jax.nn.dot_product_attention(q, k, v, mask=document_mask(segment_ids), is_causal=True,
                                      scale=scale or None, implementation=implementation,
                                      local_window_size=(window - 1, 0) if window > 0 else None)


def _splash_block(seq_len: int) -> int | None:
  """The largest kernel block (512, 256 or 128) that tiles `seq_len`, or None."""
  return next((b for b in (512, 256, 128) if seq_len % b == 0), None)


@functools.lru_cache(maxsize=None)
def _splash_spec(heads: int, seq_len: int, window: int = 0):
  """The causal mask over (T, T) for `heads` query heads (with `window` > 0: its W most recent keys, the query's
  own included) and the kernel's block sizes; pure Python, cached. A local mask's blocks wholly outside the
  window are skipped by the kernel, not computed and masked."""
  # Imported here: Pallas TPU is a heavy import and a GPU/CPU run never needs it.
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
  one = (mask_lib.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0) if window > 0 else
         mask_lib.CausalMask((seq_len, seq_len)))
  mask = mask_lib.MultiHeadMask([one for _ in range(heads)])
  b = _splash_block(seq_len)
  blocks = kernel_lib.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                 block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  return mask, blocks


def _splash_kernel(heads: int, seq_len: int, mqa: bool, interpret: bool, window: int = 0, softcap: float = 0.0):
  """A splash kernel for one example: causal (or local, `window`) over (T, T) for `heads` query heads; `softcap`
  > 0 bounds its logits as cap·tanh(s / cap).

  Built inside the trace that uses it, never eagerly: its mask tables (numpy, cached by the library per mask
  and block shape) become constants of that trace. An eager build would put them on a device, which fails on a
  compile-only TPU mesh (pre-flight) and would tie a cached kernel to whichever backend built it first.
  """
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
  mask, blocks = _splash_spec(heads, seq_len, window)
  make = kernel_lib.make_splash_mqa if mqa else kernel_lib.make_splash_mha
  kernel = make(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret,
                attn_logits_soft_cap=softcap or None)
  return kernel, kernel_lib.SegmentIds


def _splash_local(q, k, v, segment_ids, interpret: bool, scale: float = 0.0, window: int = 0, softcap: float = 0.0):
  """Splash attention on one device's shard: q (B, T, H, E), k/v (B, S, K, E) with K = 1, H, or dividing H."""
  B, T, H, E = q.shape
  K = k.shape[2]
  # The kernel takes unscaled logits: scale q (exact for E a power of 4, one bf16 rounding otherwise).
  q = (q * (scale or 1.0 / math.sqrt(E))).astype(q.dtype).transpose(0, 2, 1, 3)  # (B, H, T, E)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, S, E)
  if K == H:
    kernel, SegmentIds = _splash_kernel(H, T, False, interpret, window, softcap)
    run = lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(q=s, kv=s))
  else:
    # MQA kernel per kv head: its G = H // K query heads share one (S, E) key and value.
    G = H // K
    kernel, SegmentIds = _splash_kernel(G, T, True, interpret, window, softcap)
    one = lambda q, k, v, s: kernel(q, k, v, segment_ids=SegmentIds(q=s, kv=s))  # q (G,T,E), k/v (S,E)

    def run(q, k, v, s):  # q (H, T, E), k/v (K, S, E)
      out = jax.vmap(one, in_axes=(0, 0, 0, None))(q.reshape(K, G, T, E), k, v, s)  # (K, G, T, E)
      return out.reshape(H, T, E)
  out = jax.vmap(run)(q, k, v, segment_ids)  # (B, H, T, E)
  return out.transpose(0, 2, 1, 3).astype(q.dtype)  # (B, T, H, E)


def splash_attention(q, k, v, segment_ids, interpret: bool = False, scale: float = 0.0, window: int = 0,
                     softcap: float = 0.0):
  """Pallas splash attention with segment ids; under a mesh it runs per shard (batch and heads split).

  A Pallas kernel cannot be split by the SPMD partitioner, so it goes inside shard_map with the batch and head
  axes the sharding rules give `act_batch` and `act_heads`. `interpret=True` runs the kernel's Python
  semantics on any backend (slow; for tests on a CPU).
  """
  mesh = jax.sharding.get_abstract_mesh()
  local = functools.partial(_splash_local, interpret=interpret, scale=scale, window=window, softcap=softcap)
  if mesh.empty or mesh.size == 1:
    return local(q, k, v, segment_ids)
  batch_axes, heads_axis = nn.logical_to_mesh_axes(('act_batch', 'act_heads'))
  H, K = q.shape[2], k.shape[2]
  heads_ways = mesh.shape[heads_axis] if isinstance(heads_axis, str) else 1
  if K % heads_ways == 0:
    kv_heads_axis = heads_axis  # each shard of query heads gets exactly its own key/value heads
  elif K == 1:
    kv_heads_axis = None  # multi-query: every shard needs the one key/value head
  else:
    # The kv heads do not split evenly over the head shards: give every query head its own copy.
    _log_once('splash: %d kv heads do not split over %d head shards; repeating them to %d heads', K,
              heads_ways, H)
    k, v = jnp.repeat(k, H // K, axis=2), jnp.repeat(v, H // K, axis=2)
    kv_heads_axis = heads_axis
  P = jax.sharding.PartitionSpec
  qo = P(batch_axes, None, heads_axis, None)
  kv = P(batch_axes, None, kv_heads_axis, None)
  return jax.shard_map(local, in_specs=(qo, kv, kv, P(batch_axes, None)), out_specs=qo,
                       check_vma=False)(q, k, v, segment_ids)


def _log_once(message: str, *args, level: int = logging.INFO) -> None:
  """Logs a message the first time these exact words come up (traces repeat; the log should not)."""
  text = message % args if args else message
  if text not in _logged:
    _logged.add(text)
    log.log(level, text)


def _cudnn_problem(platform: str, dtype, head_dim: int, seq_len: int, device, context: int = 1) -> str | None:
  if context > 1:
    return (f'context parallelism (mesh context={context}) puts tokens in zig-zag order, and the cuDNN kernel\'s '
            f'causal mask assumes array order')
  if platform != 'gpu':
    return f'cuDNN runs only on NVIDIA GPUs and this backend is {platform}'
  version = getattr(getattr(device, 'client', None), 'platform_version', '') or ''
  if 'rocm' in version.lower():
    return f'this GPU runs ROCm ({version}), which has no cuDNN'
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f'cuDNN flash attention needs bfloat16 or float16 compute, and model.dtype is {jnp.dtype(dtype)}'
  capability = getattr(device, 'compute_capability', None)
  hopper = capability is not None and float(capability) >= 9.0
  limit = 256 if hopper else 128
  if head_dim % 8 or head_dim > limit:
    return f'cuDNN needs a head dim that is a multiple of 8 and <= {limit} on this GPU, and it is {head_dim}'
  if seq_len % 2:
    return f'cuDNN needs an even sequence length when it trains with a mask, and it is {seq_len}'
  return None


def _splash_problem(platform: str, seq_len: int, context: int = 1) -> str | None:
  if context > 1:
    return (f'context parallelism (mesh context={context}) puts tokens in zig-zag order, and splash\'s causal '
            f'mask assumes array order (and needs the whole sequence on one device)')
  if platform != 'tpu':
    return f'Pallas splash attention runs only on TPU and this backend is {platform}'
  if _splash_block(seq_len) is None:
    return f'splash attention needs a sequence length that is a multiple of 128, and it is {seq_len}'
  return None


def mesh_platform() -> str | None:
  """The platform of the mesh in context ('tpu', 'gpu', 'cpu'), or None outside any mesh."""
  abstract = jax.sharding.get_abstract_mesh()
  abstract_device = None if abstract.empty else getattr(abstract, 'abstract_device', None)
  return None if abstract_device is None else abstract_device.platform  # None: a mesh of axis sizes alone


def deterministic_ops() -> bool:
  """Whether this process asked XLA for deterministic GPU kernels (train.deterministic, or XLA_FLAGS by hand)."""
  return DETERMINISTIC_XLA_FLAGS in os.environ.get('XLA_FLAGS', '').split()


def select(impl: str, *, dtype, head_dim: int, seq_len: int, platform: str | None = None,
           device=None, context: int | None = None, deterministic: bool | None = None) -> tuple[str, str]:
  """(kernel that will run, why) for the configured `impl` on `platform`.

  `context` (ways the sequence is split) defaults to that of the mesh being traced under.
  `deterministic` (default: `deterministic_ops()`): on a GPU, cudnn is not chosen; xla runs instead.
  `platform` defaults to that of the mesh being traced under (a compile-only TPU mesh built on a CPU host
  compiles for the TPU), else JAX's default backend.
  """
  if impl not in IMPLS:
    raise ValueError(f'unknown attention implementation {impl!r}; use one of {", ".join(IMPLS)}')
  platform = platform or mesh_platform() or jax.default_backend()
  context = context_ways() if context is None else context
  if device is None and platform == jax.default_backend():
    device = jax.devices()[0]
  if impl == 'xla':
    return 'xla', 'xla attention, as configured'
  if impl == 'auto':
    if platform not in _AUTO:
      return 'xla', f'attention=auto on {platform}: no fused kernel for this platform, using xla'
    kernel, why = select(_AUTO[platform], dtype=dtype, head_dim=head_dim, seq_len=seq_len, platform=platform,
                         device=device, context=context, deterministic=deterministic)
    return kernel, f'attention=auto on {platform}: {why}'
  deterministic = deterministic_ops() if deterministic is None else deterministic
  if impl == 'cudnn' and deterministic and platform == 'gpu':
    problem = (f'deterministic mode ({DETERMINISTIC_XLA_FLAGS}) has no reliable deterministic form of cuDNN '
               f'attention\'s backward')
  else:
    problem = (_cudnn_problem(platform, dtype, head_dim, seq_len, device, context) if impl == 'cudnn'
               else _splash_problem(platform, seq_len, context))
  if problem:
    return 'xla', f'attention={impl} cannot run here: {problem}; falling back to xla'
  return impl, f'{impl} attention'


def context_ways() -> int:
  """Ways the mesh being traced under splits the sequence (`act_seq`); 1 outside a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return 1
  (axes,) = nn.logical_to_mesh_axes(('act_seq',))
  return sharding.ways(mesh, axes)


def gather_sequence(x):
  """x (B, S, ...) with its sequence axis all-gathered (replicated), the batch split as ever, the rest free."""
  (batch_axes,) = nn.logical_to_mesh_axes(('act_batch',))
  P = jax.sharding.PartitionSpec
  return jax.lax.with_sharding_constraint(x, P(batch_axes, None, *[P.UNCONSTRAINED] * (x.ndim - 2)))


def attention(q, k, v, segment_ids, impl: str = 'xla', block_q: int = 0, *, kv_segment_ids=None, order=None,
              kv_order=None, scores_cfg: Scores = PLAIN):
  """Causal, document-masked attention with the kernel `impl` selects here (see `select`).

  `block_q`: xla attention's query rows per block on each context shard (0 = all at once; see xla_attention).
  Decoding (jaxlm/generate.py) passes a KV cache as k, v (B, S, K, E) with its `kv_segment_ids` (B, S), and the
  cache slots of the queries, `order` (T,), and of the keys, `kv_order` (S,): the reference kernel then masks
  by slot (causal) and segment (unwritten slots and padding are 0), whatever the kernel configured.
  `scores_cfg`: a window, soft-cap, sinks or scale (`Scores`); what a fused kernel cannot compute of them
  (`Scores.unsupported`: config.validate refuses it by name) runs on xla instead.
  """
  if kv_segment_ids is not None:
    _log_once('attention over a KV cache: xla attention (the fused kernels take no cache)')
    return _scores_attention(q, k, v, segment_ids, order, kv_segment_ids, kv_order, scores_cfg)
  context = context_ways()
  kernel, why = select(impl, dtype=q.dtype, head_dim=q.shape[-1], seq_len=q.shape[1], context=context)
  if kernel != 'xla' and (missing := scores_cfg.unsupported(kernel)):
    kernel, why = 'xla', f'attention={impl}: {kernel} has no {missing}; xla attention computes them'
  # A requested kernel that cannot run is worth a warning; auto's choice and plain xla are information.
  _log_once(why, level=logging.WARNING if impl not in ('auto', 'xla') and kernel != impl else logging.INFO)
  if kernel != 'xla':
    try:
      if kernel == 'cudnn':
        return windowed(functools.partial(cudnn_attention, scale=scores_cfg.scale), scores_cfg, q, k, v, segment_ids)
      return windowed(functools.partial(splash_attention, scale=scores_cfg.scale, softcap=scores_cfg.softcap),
                      scores_cfg, q, k, v, segment_ids)
    except (NotImplementedError, ValueError, RuntimeError) as e:  # raised while tracing: shape/version limits
      _log_once('%s attention refused these inputs (%s: %s); falling back to xla', kernel, type(e).__name__, e,
                level=logging.WARNING)
  if context > 1:
    return _context_attention(q, k, v, segment_ids, block_q, context, scores_cfg)
  return xla_attention(q, k, v, segment_ids, block_q=block_q, scores_cfg=scores_cfg)


def _context_attention(q, k, v, segment_ids, block_q: int, context: int, scores_cfg: Scores):
  """xla attention with the sequence split `context` ways in the zig-zag order: a local layer whose window fits
  in one chunk (W <= T / 2C) by halos (`_halo_attention`), any other by the whole keys and values gathered."""
  T = q.shape[1]
  width = scores_cfg.window if isinstance(scores_cfg.window, int) else scores_cfg.width
  if 0 < width <= T // (2 * context):
    local = functools.partial(_halo_attention, width=width, block_q=block_q, context=context,
                              scores_cfg=dataclasses.replace(scores_cfg, window=width))
    # A traced window (scanned local and global layers): only the global branch gathers the whole sequence.
    full = functools.partial(_context_attention, block_q=block_q, context=context,
                             scores_cfg=dataclasses.replace(scores_cfg, window=0, width=0))
    return _local_or_full(scores_cfg, local, full, q, k, v, segment_ids)
  # Queries (and so scores, probabilities and outputs) stay split along T; each device gathers the whole
  # key and value sequence: K heads of (S, E) each, one under multi-query attention. The backward pass
  # reduce-scatters their gradients. The mask's order is a constant: the step's zig-zag permutation. A local
  # layer whose window is longer than a chunk comes here too: its queries reach back past the chunk before their
  # own, into chunks that lie on shards other than the neighbours (chunk i-2 on shard i-2, ...), so one halo
  # from each neighbour would not hold its keys; a multi-hop halo is not built (the short-window families,
  # Mistral's 4k at 32k and gpt-oss's 128, fit a chunk).
  order = sharding.zigzag_order(T, context)
  return xla_attention(q, gather_sequence(k), gather_sequence(v), segment_ids, order, block_q, context, scores_cfg)


def _halo_attention(q, k, v, segment_ids, *, width: int, block_q: int, context: int, scores_cfg: Scores):
  """A local layer (window W <= c = T / 2C) under context parallelism, exchanging only halos, not the sequence.

  Shard i holds chunks i and 2C-1-i (`sharding.zigzag_order`). A chunk's queries reach back at most W positions,
  all inside the chunk before it: chunk i-1 (the first chunk of shard i-1) and chunk 2C-2-i (the second chunk
  of shard i+1; for i = C-1 that is chunk C-1, its own first). So each shard sends the last W keys, values and
  segment ids of its first chunk to shard i+1 and of its second chunk to shard i-1 (two collective-permutes;
  chunk 0's halo arrives as zeros: segment 0, padding, never attended) and each chunk, after its halo, is a row
  in array order: `_window_groups` over [halo + chunk], the same blocks and mask as one device's. Only the
  context axis is manual (the shard_map's axis_names); batch and heads stay split as the rules say."""
  (axes,) = nn.logical_to_mesh_axes(('act_seq',))
  c = q.shape[1] // (2 * context)
  block = _largest_divisor(c, block_q or width)
  # The sinks (a traced parameter) enter as an argument, replicated, rather than closed over by the shard_map.
  cfg = dataclasses.replace(scores_cfg, sinks=None)
  ahead = [(j, j + 1) for j in range(context - 1)]  # shard j -> shard j+1; none into shard 0 (zeros)

  def local(q, k, v, segment_ids, sinks):  # one shard's (B, 2c, ...): its two chunks
    B = q.shape[0]
    chunks = lambda x: x.reshape(B * 2, c, *x.shape[2:])  # noqa: E731  rows: (b, first), (b, second), ...
    tails = [x.reshape(B, 2, c, *x.shape[2:])[:, :, c - width:] for x in (k, v, segment_ids)]  # (B, 2, W, ..)
    first = jax.lax.ppermute([t[:, 0] for t in tails], axes, ahead)  # from shard i-1: chunk i-1's tail
    second = jax.lax.ppermute([t[:, 1] for t in tails], axes, [(b, a) for a, b in ahead])  # from shard i+1
    last = jax.lax.axis_index(axes) == context - 1
    second = [jnp.where(last, t[:, 0], s) for t, s in zip(tails, second)]
    before = [jnp.stack([f, s], 1).reshape(B * 2, width, *f.shape[2:]) for f, s in zip(first, second)]
    out = _window_groups(chunks(q), chunks(k), chunks(v), chunks(segment_ids), width=width, block=block,
                         scores_cfg=dataclasses.replace(cfg, sinks=sinks), before=before)
    return out.reshape(B, 2 * c, *out.shape[2:])

  P = jax.sharding.PartitionSpec
  row = P(None, axes)
  # Partial-manual: only the context axes are manual (jax.shard_map's axis_names, JAX 0.10 and 0.11 alike); the
  # data, fsdp and tensor axes stay automatic, so the batch and heads keep the rules' sharding inside.
  names = {axes} if isinstance(axes, str) else set(axes)
  return jax.shard_map(local, in_specs=(row, row, row, row, P()), out_specs=row, axis_names=names)(
      q, k, v, segment_ids, scores_cfg.sinks)
