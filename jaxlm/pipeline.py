"""Pipeline parallelism: the layer stack split into stages on the mesh's `stage` axis, microbatches flowing through.

S stages, M microbatches, R repeats; each stage holds R chunks of Lc = L / (S·R) consecutive layers. Chunk
c = r·S + s (r < R) lives on stage s, so layer l sits on stage (l // Lc) % S:
  gpipe     R = 1: stage s holds layers [s·L/S, (s+1)·L/S), a contiguous block of the stored `layers` axis.
  circular  R > 1 (interleaved, as Megatron's virtual stages and MaxText's circular pipeline): stage s holds R
            non-adjacent chunks, and each microbatch goes round the ring R times.

The loop, as in MaxText (a shifting state buffer, no per-device program): a buffer of shape (S, mb, T, D), split
over `stage`, holds what each stage works on. Every iteration all stages apply their current chunk at once
(a vmap over the stage axis, so each stage's devices run only their slice), then the buffer shifts by one stage
(a roll on the stage-split axis, which XLA turns into a collective-permute: the only traffic between stages).
Stage 0 takes the next microbatch from the input; the last stage writes its result back, where stage 0 picks it up
again for the next repeat. With T = R·M + S − 1 iterations every microbatch passes every layer once, in order.
The backward pass is JAX's autodiff of that loop (so the schedule is GPipe's: all forwards, then all backwards).

Bubble: each stage is busy R·M of the T iterations, idle (its result discarded) S − 1 of them:
  bubble = (S − 1) / (R·M + S − 1).
R shrinks it at the price of R× more stage-to-stage transfers per step. Memory: autodiff keeps each
iteration's stage inputs for the backward, (R·M + S − 1) × (S, mb, T, D) activations under remat (mb = B / M).
"""

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jaxlm import sharding

SCHEDULES = ('gpipe', 'circular')  # pipeline.schedule


@dataclasses.dataclass(frozen=True)
class Layout:
  """How the layer stack runs as a pipeline: S stages, M microbatches per step, R repeats (chunks per stage)."""
  stages: int
  microbatches: int
  repeats: int = 1
  schedule: str = 'gpipe'

  @property
  def iterations(self) -> int:
    """T = R·M + S − 1: loop iterations per forward pass."""
    return self.repeats * self.microbatches + self.stages - 1

  @property
  def bubble(self) -> float:
    """The idle share of each stage: (S − 1) / (R·M + S − 1)."""
    return bubble_fraction(self.stages, self.microbatches, self.repeats)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
  """(S − 1) / (R·M + S − 1): the share of iterations a stage spends without a microbatch to work on."""
  return (stages - 1) / (repeats * microbatches + stages - 1)


def microbatches(pipeline_cfg, stages: int) -> int:
  """pipeline.microbatches, with 0 meaning one per stage (the fewest that keep every stage busy)."""
  return pipeline_cfg.microbatches or stages


def layout(pipeline_cfg, stages: int) -> Layout | None:
  """The Layout `pipeline_cfg` asks for on `stages` stages; None without a pipeline (stages = 1)."""
  if stages <= 1:
    return None
  repeats = pipeline_cfg.repeats if pipeline_cfg.schedule == 'circular' else 1
  return Layout(stages, microbatches(pipeline_cfg, stages), repeats, pipeline_cfg.schedule)


def stage_layers(lay: Layout, num_layers: int) -> list[list[range]]:
  """For each stage, its chunks of consecutive layers (one range per repeat)."""
  per_chunk = num_layers // (lay.stages * lay.repeats)
  return [[range((r * lay.stages + s) * per_chunk, (r * lay.stages + s + 1) * per_chunk) for r in range(lay.repeats)]
          for s in range(lay.stages)]


def describe(lay: Layout, num_layers: int) -> str:
  """The start-up report's lines: schedule, bubble, and which layers each stage holds."""
  lines = [f'pipeline: {lay.schedule}, {lay.stages} stages × {lay.repeats} repeat(s), {lay.microbatches} '
           f'microbatches, {lay.iterations} iterations; bubble (S−1)/(R·M+S−1) = {lay.bubble:.3f}']
  for s, chunks in enumerate(stage_layers(lay, num_layers)):
    lines.append(f'  stage {s}: layers ' + ', '.join(str(c.start) if len(c) == 1 else f'{c.start}-{c.stop - 1}'
                                                   for c in chunks))
  return '\n'.join(lines)


def split(x, m: int):
  """(B, ...) -> (M, B/M, ...), taking every M-th row (as step.accumulate_gradients does)."""
  return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def merge(x):
  """The inverse of `split`: (M, B/M, ...) -> (B, ...)."""
  return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def run(layer: Callable, params, x, segment_ids, positions, rng, lay: Layout, policy=None):
  """The stacked layers applied to x (B, T, D) as a pipeline; the same result as applying them in order.

  layer(p, x, segment_ids, positions, rng) -> x is one layer on one microbatch, p one layer's parameters.
  params: every layer's parameters stacked on a leading (L, ...) axis, in layer order (the stored layout).
  rng: dropout key or None; layer l on microbatch m uses fold_in(fold_in(rng, m), l), whatever the stage count.
  policy: remat policy (jax.checkpoint_policies) applied per layer; None keeps every activation.
  """
  S, M, R = lay.stages, lay.microbatches, lay.repeats
  L = jax.tree.leaves(params)[0].shape[0]
  Lc = L // (S * R)
  # (L, ...) -> (R, S, Lc, ...): layer (r·S + s)·Lc + j. For gpipe (R = 1) the stored split of `layers` over
  # stages is exactly this reshape; circular regroups the stored blocks (an all-to-all; see README).
  free = jax.sharding.PartitionSpec.UNCONSTRAINED  # the storage's fsdp / tensor split stays as it is
  w = jax.tree.map(lambda p: jax.lax.with_sharding_constraint(
      p.reshape(R, S, Lc, *p.shape[1:]),
      jax.sharding.PartitionSpec(None, sharding.STAGE, None, *[free] * (p.ndim - 1))),
      params)
  act = ('act_batch', 'act_res_seq', 'act_embed')  # the stage buffer holds the residual stream (model.RESIDUAL)
  tok = ('act_batch', 'act_seq')  # segment ids and positions, whole along the sequence but for context
  xs = split(x, M)  # (M, mb, T, D)
  seg, pos = split(segment_ids, M), split(positions, M)  # (M, mb, T)

  body = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)

  def stage_fn(w_stage, h, seg_s, pos_s, mb_index, first_layer):
    """One stage's chunk (Lc layers) on one microbatch: h (mb, T, D)."""
    def one(h, wj_j):
      wj, j = wj_j
      key = None if rng is None else jax.random.fold_in(jax.random.fold_in(rng, mb_index), first_layer + j)
      return body(wj, h, seg_s, pos_s, key), None
    h, _ = jax.lax.scan(one, h, (w_stage, jnp.arange(Lc)))
    return h

  stage_ids = jnp.arange(S)

  def iteration(carry, t):
    # prev: what each stage produced last iteration, with its microbatch's segment ids and positions (which
    # travel with it); buf: (M, mb, T, D), the microbatches between repeats (first the input, last the output).
    (prev, prev_seg, prev_pos), buf = carry
    i = t - stage_ids  # flat microbatch index r·M + m at each stage (outside [0, R·M): a bubble)
    repeat = jnp.clip(i // M, 0, R - 1)
    # Stage 0 takes microbatch t mod M from buf; the others take their upstream neighbour's output: the roll on
    # the stage-split axis is the stage-to-stage transfer.
    first = stage_ids == 0
    take = lambda new, old: jnp.where(first.reshape(-1, *[1] * (old.ndim - 1)), new[None], jnp.roll(old, 1, axis=0))
    h = sharding.constrain_stages(take(buf[jnp.mod(t, M)], prev), act)
    seg_now = sharding.constrain_stages(take(seg[jnp.mod(t, M)], prev_seg), tok)
    pos_now = sharding.constrain_stages(take(pos[jnp.mod(t, M)], prev_pos), tok)
    w_now = jax.tree.map(lambda p: p[0] if R == 1 else jax.vmap(lambda ps, r: ps[r], in_axes=(1, 0))(p, repeat), w)
    with sharding.in_stage():
      out = jax.vmap(stage_fn, spmd_axis_name=sharding.STAGE)(
          w_now, h, seg_now, pos_now, jnp.mod(i, M), (repeat * S + stage_ids) * Lc)
    out = sharding.constrain_stages(out, act)
    # The last stage finishes microbatch t − (S − 1); keep it for the next repeat (or as the output).
    done = t - (S - 1)
    slot = jnp.mod(done, M)
    valid = (done >= 0) & (done < R * M)
    buf = buf.at[slot].set(jnp.where(valid, out[S - 1], buf[slot]))
    return ((out, seg_now, pos_now), buf), None

  zeros = lambda a, names: sharding.constrain_stages(jnp.zeros((S, *a.shape[1:]), a.dtype), names)
  init = ((zeros(xs, act), zeros(seg, tok), zeros(pos, tok)), xs)
  (_, buf), _ = jax.lax.scan(iteration, init, jnp.arange(lay.iterations))
  return merge(buf)
