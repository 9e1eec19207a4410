"""Mixture of experts: the router presets, dropless dispatch through grouped GEMMs, capacity, routing statistics.

model.py calls `MoE` in place of the dense MLP in every MoE layer, handing it what it takes from the model
(model.moe_mlp): this module never imports model.py, and nothing else in the model knows experts.

Shape letters (model.py's, plus): X routed experts (model.moe_experts), k experts per token (model.moe_top_k),
F here is one expert's hidden width (model.moe_mlp_dim), A = N·k token-expert assignments.

Dropless (the default, as MaxText's megablox path and torchtitan): every assignment is kept. The A assignments
are sorted by expert, each expert's rows run through its weights as one grouped GEMM (`jax.lax.ragged_dot`), and
the rows are put back by the inverse permutation and summed over k with the router's weights: a gather and a
reshape-sum, no scatter-add, so the result does not depend on the order atomics land in. Padding tokens
(segment id 0) are assigned to no expert: they sort past the last group, which ragged_dot leaves at zero, and
they count in no statistic.

Expert parallelism (mesh.expert > 1, `expert_parallel`): each device of the expert axis holds X/E experts (E ways)
and the routed assignments travel to them inside `jax.shard_map`, by `model.moe_transport`: `all_to_all` (GPU,
TPU: ragged all-to-all there and back, receive buffers the worst case unless model.moe_buffer_factor says less,
any overflow counted) or `gather` (any platform, the CPU tests': all-gather the expert group's tokens, run the
local experts, reduce-scatter the outputs). Routing runs before, on the whole sharded batch, so the statistics
are the same sums as without the axis.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxlm import sharding

ROUTERS = ('mixtral', 'qwen3_moe', 'olmoe', 'deepseek_v3', 'deepseek_v2', 'gpt_oss')  # model.moe_router
IMPLS = ('ragged', 'dense')  # model.moe_impl: sorted grouped GEMMs, or every expert on every token (reference)
TRANSPORTS = ('auto', 'gather', 'all_to_all')  # model.moe_transport: how tokens reach their experts' devices
# model.moe_aux_loss_form: the load-balancing loss as a mean over MoE layers of each one's Switch loss (1 at uniform
# routing), or as transformers' load_balancing_loss_func computes it for Mixtral-style and gpt-oss models (`loss`).
AUX_LOSS_FORMS = ('switch', 'pooled')
STATS = 'moe_stats'  # the Flax collection each MoE layer writes its routing statistics into, when mutable


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """cfg.model's moe_* keys without the prefix, resolved and frozen: what the mixture of experts reads."""
  experts: int = 0  # X; 0: dense MLPs, and the fields below are read only when > 0
  top_k: int = 2  # k experts per token
  mlp_dim: int = 0  # F: one routed expert's SwiGLU width (the caller resolves 0 to model.mlp_dim's)
  shared_experts: int = 0  # DeepSeek's shared experts, as one dense SwiGLU this many experts wide
  every: int = 1  # every n-th layer is a mixture of experts, the last of each group of n
  first_dense: int = 0  # plain dense layers before the first group (DeepSeek's first_k_dense_replace)
  router: str = 'mixtral'  # ROUTERS
  groups: int = 1  # DeepSeek-V3's group-limited routing (`route`)
  top_groups: int = 1
  norm_topk_prob: bool = True
  routed_scale: float = 1.0
  capacity_factor: float = 0.0  # 0: dropless
  aux_loss: float = 0.0  # the load-balancing loss's weight (`loss`)
  aux_loss_form: str = 'switch'  # AUX_LOSS_FORMS
  router_z_loss: float = 0.0
  bias_rate: float = 0.0  # auxiliary-loss-free balancing (`update_bias`)
  impl: str = 'ragged'  # IMPLS
  transport: str = 'auto'  # TRANSPORTS
  buffer_factor: float = 0.0  # all_to_all receive buffers (`buffer_rows`); 0: the worst case
  expert_bias: bool = False  # gpt-oss: each expert's gate, up and down projections have biases
  router_bias: bool = False  # gpt-oss: a learned bias on the router's logits (choice and weights alike)

  @classmethod
  def from_config(cls, model_cfg) -> 'MoeConfig':
    """From `cfg.model`'s moe_* keys (a key a saved config lacks: its default); mlp_dim as given (0 unresolved)."""
    return cls(**{f.name: model_cfg.get(f'moe_{f.name}', f.default) for f in dataclasses.fields(cls)})


def route(logits, preset: str, top_k: int, norm_topk_prob: bool, routed_scale: float, bias=None, groups: int = 1,
          top_groups: int = 1):
  """The router's choice for each token: (weights (N, k), experts (N, k) int32, scores (N, X)), in float32.

  mixtral      softmax over all X, top-k, renormalised over the k (= a softmax over the top-k logits).
  qwen3_moe    softmax over all X, top-k, renormalised only with norm_topk_prob (Qwen3-MoE checkpoints set it).
  olmoe        the same formula as qwen3_moe (OLMoE checkpoints leave norm_topk_prob off).
  deepseek_v3  sigmoid scores; the top-k chosen on scores + bias (the checkpoint's e_score_correction_bias),
               weighted by the unbiased scores, renormalised with norm_topk_prob, times routed_scale.
  deepseek_v2  softmax over all X, top-k (greedy, or group-limited), renormalised only with norm_topk_prob (the
               released V2 checkpoints leave it off), times routed_scale.
  gpt_oss      top-k over the logits (+ bias), weighted by a softmax over the k chosen logits alone: mixtral's
               weights in exact arithmetic, computed as gpt-oss does (scores stay the softmax over all X).
  `bias` (X,) shifts the choice only, never the weights (auxiliary-loss-free balancing, DeepSeek-V3 §2.1.2).
  groups > 1: DeepSeek-V3's group-limited routing (n_group, topk_group): the X experts in `groups` equal groups,
  each group scored by the sum of its two best (biased) scores (deepseek_v2's group_limited_greedy: by its best
  one), and the top-k chosen only inside the `top_groups` best groups, which bounds the devices a token is sent
  to when groups map to devices.
  The same operations in the same order as transformers' routers (tests/test_moe.py compares them).
  """
  logits = logits.astype(jnp.float32)
  scores = jax.nn.sigmoid(logits) if preset == 'deepseek_v3' else jax.nn.softmax(logits, axis=-1)
  choice = logits if preset == 'gpt_oss' else scores
  choice = choice if bias is None else choice + bias
  if top_groups < groups:
    choice = limit_groups(choice, groups, top_groups, best=1 if preset == 'deepseek_v2' else 2)
  _, experts = jax.lax.top_k(choice, top_k)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if preset == 'gpt_oss':
    weights = jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1)
  elif preset == 'mixtral' or norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if preset == 'deepseek_v3' else 0.0))
  if routed_scale != 1.0:
    weights = weights * routed_scale
  return weights, experts.astype(jnp.int32), scores


def limit_groups(choice, groups: int, top_groups: int, best: int = 2):
  """choice (N, X) with every expert outside each token's `top_groups` best groups set to -inf, a group scored by
  the sum of its `best` highest choices (DeepSeek-V3: 2, DeepSeek-V2: 1)."""
  N, X = choice.shape
  group_scores = jax.lax.top_k(choice.reshape(N, groups, X // groups), best)[0].sum(-1)  # (N, groups)
  _, chosen = jax.lax.top_k(group_scores, top_groups)  # (N, top_groups)
  mask = jax.nn.one_hot(chosen, groups, dtype=jnp.bool_).any(axis=1)  # (N, groups)
  return jnp.where(jnp.repeat(mask, X // groups, axis=-1), choice, -jnp.inf)


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
  """Assignments each expert takes from `num_tokens` tokens under capacity `factor` (0: all of them, dropless)."""
  if factor <= 0:
    return num_tokens
  return min(num_tokens, math.ceil(factor * num_tokens * top_k / num_experts))


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def assign(experts, valid, num_experts: int, cap: int):
  """Which assignments an expert takes: (keep (N, k) bool, load (X,) assignments asked of each expert).

  valid (N,) marks real tokens; padding asks nothing. Over capacity, earlier tokens win (a stable sort keeps
  the token order inside each expert, as GShard's position-in-expert cumsum does); a token's k choices are
  judged independently.
  """
  N, k = experts.shape
  flat = jnp.where(valid[:, None], experts, num_experts).reshape(-1)  # (A,): padding → past the last expert
  load = jnp.bincount(flat, length=num_experts + 1)[:num_experts]  # (X,)
  if cap >= N:  # every expert can take every token: nothing is dropped
    return (flat < num_experts).reshape(N, k), load
  order = jnp.argsort(flat, stable=True)
  counts = jnp.bincount(flat, length=num_experts + 1)
  starts = _exclusive_cumsum(counts)  # first sorted row of each expert
  rank = jnp.arange(N * k) - starts[flat[order]]  # position of each sorted row inside its expert
  keep_sorted = (rank < cap) & (flat[order] < num_experts)
  keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)  # back to (token, choice) order; unique indices
  return keep.reshape(N, k), load


@jax.custom_vjp
def permute(x, order, inverse):
  """x[order] for a permutation `order` whose inverse is `inverse`; the backward is a gather too (no scatter)."""
  return jnp.take(x, order, axis=0, unique_indices=True, mode='clip')


def _permute_fwd(x, order, inverse):
  return permute(x, order, inverse), (order, inverse)


def _permute_bwd(residuals, dy):
  order, inverse = residuals
  return permute(dy, inverse, order), None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def _sort_by_expert(x, experts, keep, num_experts: int):
  """Each token's k assignments as rows grouped by expert: (rows (A, D), order, inverse, counts (X,) int32).

  Assignments not kept (padding, over capacity, another device's experts) sort past the last expert's rows.
  """
  n, k = experts.shape
  flat = jnp.where(keep, experts, num_experts).reshape(-1)  # (A,): assignment a = n·k + j
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # sorted row → assignment
  inverse = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=jnp.int32))  # assignment → sorted row
  rows = permute(jnp.broadcast_to(x[:, None], (n, k, x.shape[-1])).reshape(n * k, -1), order, inverse)
  counts = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return rows, order, inverse, counts


def _combine(rows, order, inverse, weights, keep):
  """Sorted output rows back in assignment order, summed over each token's k choices with the router's weights
  (assignments not kept add nothing)."""
  n, k = keep.shape
  y = permute(rows, inverse, order).reshape(n, k, -1)
  return (y * jnp.where(keep, weights, 0.0).astype(y.dtype)[..., None]).sum(axis=1)


def ragged_experts(x, weights, experts, keep, w_gate, w_up, w_down, swiglu, biases=None):
  """Σ_k weight · expert(x) for each token, dropless: sort by expert, grouped GEMMs, unsort, reshape-sum.

  x (N, D); weights, experts, keep (N, k); w_gate, w_up (X, D, F); w_down (X, F, D). Assignments not kept
  (padding, over capacity) sort past the last expert's rows, where ragged_dot writes zeros. `biases`: gpt-oss's
  (gate (X, F), up (X, F), down (X, D)), each row getting its expert's (rows not kept: the last expert's, weighed 0).
  """
  xs, order, inverse, group_sizes = _sort_by_expert(x, experts, keep, w_gate.shape[0])  # (A, D) by expert
  g, u = jax.lax.ragged_dot(xs, w_gate, group_sizes), jax.lax.ragged_dot(xs, w_up, group_sizes)  # (A, F)
  if biases is not None:
    row = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(xs.shape[0]), side='right')  # (A,) each row's expert
    row = jnp.minimum(row, w_gate.shape[0] - 1)
    g, u = g + biases[0][row], u + biases[1][row]
  ys = jax.lax.ragged_dot(swiglu(g, u), w_down, group_sizes)  # (A, D)
  if biases is not None:
    ys = ys + biases[2][row]
  return _combine(ys, order, inverse, weights, keep)


def dense_experts(x, weights, experts, keep, w_gate, w_up, w_down, swiglu, biases=None):
  """The same sum computed as every expert on every token, weighted by a one-hot combine: the test reference."""
  X = w_gate.shape[0]
  combine = (jax.nn.one_hot(experts, X, dtype=jnp.float32) * jnp.where(keep, weights, 0.0)[..., None]).sum(1)
  g, u = jnp.einsum('nd,xdf->nxf', x, w_gate), jnp.einsum('nd,xdf->nxf', x, w_up)  # (N, X, F)
  if biases is not None:
    g, u = g + biases[0], u + biases[1]
  y = jnp.einsum('nxf,xfd->nxd', swiglu(g, u), w_down)  # (N, X, D)
  y = y if biases is None else y + biases[2]
  return jnp.einsum('nx,nxd->nd', combine.astype(y.dtype), y)


def bias_params(m: MoeConfig, d_model: int, experts: int) -> int:
  """gpt-oss's biases in one MoE layer with `experts` experts counted: (2F + D) each, and the router's X."""
  return experts * (2 * m.mlp_dim + d_model) * m.expert_bias + m.experts * m.router_bias


# Expert parallelism: the stacked experts split over the mesh's `expert` axis (sharding.EXPERT_RULES), each device
# holding X/E of them, while the tokens stay split over the batch axes (expert among them). Routing runs before,
# on the whole (sharded) batch, so its statistics stay whole-batch sums; only the experts' rows travel.


def expert_ways() -> int:
  """Ways the experts are split on the mesh being traced under (1: no expert axis)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get(sharding.EXPERT, 1)


def _token_axes() -> tuple:
  """The mesh axes the flattened tokens (N = B·T) are split over: the batch's, then the sequence's."""
  as_tuple = lambda a: () if a is None else ((a,) if isinstance(a, str) else tuple(a))  # noqa: E731
  batch_axes, seq_axes = nn.logical_to_mesh_axes(('act_batch', 'act_seq'))
  return as_tuple(batch_axes) + as_tuple(seq_axes)


def token_ways() -> int:
  """Ways the flattened tokens are split on the mesh being traced under."""
  return sharding.ways(jax.sharding.get_abstract_mesh(), _token_axes())


def transport(name: str) -> str:
  """model.moe_transport resolved for the mesh being traced under: 'auto' is all_to_all on GPU and TPU, gather
  elsewhere (XLA:CPU has no ragged-all-to-all)."""
  from jaxlm import attention  # the mesh's platform, as the attention kernel is chosen
  platform = attention.mesh_platform() or jax.default_backend()
  if name == 'auto':
    return 'all_to_all' if platform in ('gpu', 'tpu', 'cuda', 'rocm') else 'gather'
  if name == 'all_to_all' and platform == 'cpu':
    from jaxlm import errors
    raise errors.ConfigError('model.moe_transport=all_to_all on a CPU mesh: XLA:CPU has no ragged-all-to-all; '
                             'use model.moe_transport=gather (or auto)')
  return name


def describe(m: MoeConfig, mesh) -> str | None:
  """The start-up report's line on expert parallelism for MoE config `m` on `mesh` (None without an expert
  axis): the experts per device and the transport that will run. Refuses all_to_all on a CPU mesh here, before
  anything compiles."""
  ways = dict(mesh.shape).get(sharding.EXPERT, 1)
  if not m.experts or ways == 1:
    return None
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    chosen = transport(m.transport)
  how = {'all_to_all': 'ragged all-to-all there and back, receive buffers ' + (
      f'{m.buffer_factor:g}× the balanced share (overflow counted)' if m.buffer_factor else
      'the worst case (nothing can overflow)'), 'gather': 'all-gather of the expert group\'s tokens, '
         'reduce-scatter of the outputs'}[chosen]
  return (f'experts: {m.experts} over expert={ways}, {m.experts // ways} per device; tokens travel by '
          f'{chosen} ({how}), model.moe_transport={m.transport}')


def buffer_rows(tokens: int, top_k: int, local_experts: int, ways: int, factor: float) -> int:
  """Rows of one device's all_to_all receive buffer for `tokens` local tokens.

  The worst case (factor 0, the default): every token of all `ways` devices sends min(k, X/E) assignments here,
  so nothing can overflow. factor > 0: that many times the balanced share (tokens·k rows), capped at the worst case.
  """
  worst = ways * tokens * min(top_k, local_experts)
  return worst if factor <= 0 else min(worst, max(1, math.ceil(factor * tokens * top_k)))


def fit_buffer(counts, buffer: int):
  """What the all_to_all transport sends when receive buffers hold `buffer` rows: (sent (E, X), overflow).

  counts (E, X): assignments each of the E devices of the expert axis has for each of the X experts (device d
  owns experts d·X/E … (d+1)·X/E − 1). Each receiver fills its buffer from the senders in order; a sender's rows
  for one receiver are sorted by expert, so when they do not all fit the last ones are cut. sent (E, X) are the
  rows that arrive, overflow the number that do not (counted, never silently lost: they add nothing to the
  layer's output and are reported as moe/<layer>/overflow). Plain arithmetic, identical on every device.
  """
  E, X = counts.shape
  per = counts.reshape(E, E, X // E)  # [sender, receiver, local expert]
  chunk = per.sum(-1)  # (E, E) rows each sender has for each receiver
  before = _exclusive_cumsum(chunk, axis=0)  # rows earlier senders put in each receiver's buffer
  room = jnp.clip(buffer - before, 0, chunk)  # how many of its rows each sender gets in
  earlier = _exclusive_cumsum(per)  # inside one chunk: rows of the receiver's lower experts
  sent = jnp.clip(room[..., None] - earlier, 0, per).reshape(E, X)
  return sent, (counts - sent).sum()


# The exchange primitive, a module attribute so that tests on the CPU mesh (where XLA has no ragged-all-to-all)
# can put an emulation built from all_gather in its place and run the all_to_all transport's own arithmetic.
ragged_all_to_all = jax.lax.ragged_all_to_all


def _local_choices(experts, keep, local_experts: int):
  """experts (.., k) as indices into this device's X/E experts, and which assignments this device runs."""
  local = experts - jax.lax.axis_index(sharding.EXPERT) * local_experts
  return local, keep & (local >= 0) & (local < local_experts)


def _local_biases(biases, mlp_axis):
  """gpt-oss's biases of this device's experts, (gate, up) split over the hidden width as the weights are; the
  down projection's (X/E, D) kept on the first device of the tensor axis alone, so that the sum of the partial
  outputs over it adds it once. None stays None."""
  if biases is None or not mlp_axis:
    return biases
  gate, up, down = biases
  return gate, up, down * (jax.lax.axis_index(mlp_axis) == 0).astype(down.dtype)


def _gather_body(x, weights, experts, keep, w_gate, w_up, w_down, biases, *, run, swiglu, mlp_axis):
  """All-gather the tokens (and their routing) over the expert axis, run this device's experts on the
  assignments that chose them (the rest sort past its groups), reduce-scatter the partial outputs back."""
  gather = lambda a: jax.lax.all_gather(a, sharding.EXPERT, axis=0, tiled=True)  # noqa: E731
  x, weights, experts, keep = gather(x), gather(weights), gather(experts), gather(keep)  # (E·n, ...)
  local, mine = _local_choices(experts, keep, w_gate.shape[0])
  # (E·n, D): this device's experts' share
  y = run(x, weights, local, mine, w_gate, w_up, w_down, swiglu, _local_biases(biases, mlp_axis))
  if mlp_axis:  # the experts' hidden width split over tensor: the down projection's partial sums
    y = jax.lax.psum(y, mlp_axis)
  return jax.lax.psum_scatter(y, sharding.EXPERT, scatter_dimension=0, tiled=True), jnp.zeros((), jnp.float32)


def _all_to_all_body(x, weights, experts, keep, w_gate, w_up, w_down, biases, *, run, swiglu, mlp_axis,
                     buffer_factor, other_axes):
  """MaxText-style dropless dispatch: sort this device's assignments by expert, exchange the counts, send each
  row to the device owning its expert (ragged all-to-all), group the received rows by local expert, grouped
  GEMMs, send them back the same way, unsort, and sum over k with the router's weights."""
  n, k = experts.shape
  Xl = w_gate.shape[0]
  E = jax.lax.axis_size(sharding.EXPERT)
  r = jax.lax.axis_index(sharding.EXPERT)
  rows, order, inverse, counts = _sort_by_expert(x, experts, keep, Xl * E)  # counts (X,) for every expert
  all_counts = jax.lax.all_gather(counts, sharding.EXPERT)  # (E, X): every sender's counts, on every device
  buffer = buffer_rows(n, k, Xl, E, buffer_factor)
  sent, overflow = fit_buffer(all_counts, buffer)
  chunk = all_counts.reshape(E, E, Xl).sum(-1)  # [sender, receiver] rows asked
  sent_chunk = sent.reshape(E, E, Xl).sum(-1)  # [sender, receiver] rows that fit
  in_offsets = _exclusive_cumsum(chunk, axis=1)  # where each receiver's rows start in each sender's sorted rows
  out_offsets = _exclusive_cumsum(sent_chunk, axis=0)  # where each sender's rows start in each receiver's buffer
  received = ragged_all_to_all(rows, jnp.zeros((buffer, rows.shape[-1]), rows.dtype), in_offsets[r],
                               sent_chunk[r], out_offsets[r], sent_chunk[:, r], axis_name=sharding.EXPERT)
  # The buffer holds sender 0's rows for this device's experts in expert order, then sender 1's, ...: the local
  # expert of each row follows from the counts; rows past the last are empty.
  segments = sent.reshape(E, E, Xl)[:, r].reshape(-1)  # (E·Xl,) [sender, local expert] in buffer order
  segment = jnp.searchsorted(jnp.cumsum(segments), jnp.arange(buffer, dtype=jnp.int32), side='right')
  local = jnp.where(segment < E * Xl, segment % Xl, Xl)  # (buffer,)
  y = run(received, jnp.ones((buffer, 1), jnp.float32), local[:, None], (local < Xl)[:, None], w_gate, w_up,
          w_down, swiglu, _local_biases(biases, mlp_axis))  # (buffer, D): each row through its expert, unweighted
  if mlp_axis:
    y = jax.lax.psum(y, mlp_axis)
  back = ragged_all_to_all(y, jnp.zeros_like(rows), out_offsets[:, r], sent_chunk[:, r], in_offsets[:, r],
                           sent_chunk[r], axis_name=sharding.EXPERT)  # (A, D) in this device's sorted order
  y = _combine(back, order, inverse, weights, keep)  # rows that did not fit came back as zeros
  overflow = overflow.astype(jnp.float32) / E  # every device of the expert axis counted the same overflow
  overflow = jax.lax.psum(overflow, (sharding.EXPERT, *other_axes))
  return y, overflow


def expert_parallel(x, weights, experts, keep, w_gate, w_up, w_down, *, run, swiglu, transport: str,
                    buffer_factor: float, biases=None):
  """`run` (ragged_experts / dense_experts) with the experts split over the mesh's expert axis, in shard_map:
  (y (N, D), overflow) for tokens x (N, D) split over the batch and context axes. `biases`: gpt-oss's (gate
  (X, F), up (X, F), down (X, D)), split over the expert axis with their weights.

  Weights enter as (X/E, D, F) blocks on each device: their `embed` is all-gathered over fsdp as any fsdp
  layer's is, never over the expert axis. The experts' hidden width F stays split over tensor inside, and the
  down projection's partial sums are added over it.
  """
  (mlp_axis,) = nn.logical_to_mesh_axes(('mlp',))
  token_axes = _token_axes()
  other_axes = tuple(a for a in token_axes if a != sharding.EXPERT)
  tok = P(token_axes)
  w_in, w_out = P(sharding.EXPERT, None, mlp_axis), P(sharding.EXPERT, mlp_axis, None)
  b_specs = None if biases is None else (P(sharding.EXPERT, mlp_axis), P(sharding.EXPERT, mlp_axis),
                                         P(sharding.EXPERT, None))
  if transport == 'gather':
    body = functools.partial(_gather_body, run=run, swiglu=swiglu, mlp_axis=mlp_axis)
  else:
    body = functools.partial(_all_to_all_body, run=run, swiglu=swiglu, mlp_axis=mlp_axis,
                             buffer_factor=buffer_factor, other_axes=other_axes)
  return jax.shard_map(body, in_specs=(tok, tok, tok, tok, w_in, w_in, w_out, b_specs), out_specs=(tok, P()))(
      x, weights, experts, keep, w_gate, w_up, w_down, biases)


class MoE(nn.Module):
  """A routed SwiGLU MLP: a float32 router picks k of X experts per token, plus optional shared experts.

  What it takes from the model comes from its caller (model.moe_mlp): the widths and dtypes, the gate
  `activation` (silu(g)·u, or gpt-oss's clamped one), and `shared`, which makes the dense MLP of the shared
  experts (None without them).
  When the STATS collection is mutable, the layer writes its routing statistics there as sums over its tokens
  (`statistics`), so microbatches and data shards add up to the whole batch's.
  """
  config: MoeConfig
  d_model: int
  dtype: str  # the compute dtype (model.dtype)
  param_dtype: object  # how the experts are stored (model.storage_dtype)
  activation: Callable  # (g, u) -> silu(g)·u
  shared: Callable | None = None  # (name=) -> a Flax module (B, T, D) -> (B, T, D)

  @nn.compact
  def __call__(self, x, segment_ids):  # x: (B, T, D), segment_ids: (B, T)
    m = self.config
    D, X, F, k = self.d_model, m.experts, m.mlp_dim, m.top_k
    dt = jnp.dtype(self.dtype)

    def param(name, names, shape, std):  # normal(std) init, logical axis names, stored in param_dtype
      return self.param(name, nn.with_logical_partitioning(nn.initializers.normal(std), names), shape,
                        self.param_dtype)
    w_router = param('router', ('embed', None), (D, X), D ** -0.5)
    # Per-expert selection bias (auxiliary-loss-free balancing, `update_bias`; DeepSeek-V3's
    # e_score_correction_bias). A parameter so that checkpoints, eval and export carry it; only top-k's choice
    # reads it, so its gradient is zero and the optimizer never moves it (1-D: no weight decay either).
    bias = self.param('bias', nn.with_logical_partitioning(nn.initializers.zeros, ('experts',)), (X,),
                      jnp.float32)
    w_gate = param('gate', ('experts', 'embed', 'mlp'), (X, D, F), D ** -0.5)
    w_up = param('up', ('experts', 'embed', 'mlp'), (X, D, F), D ** -0.5)
    w_down = param('down', ('experts', 'mlp', 'embed'), (X, F, D), F ** -0.5)
    zeros = lambda name, names, shape: self.param(  # noqa: E731  gpt-oss's biases, zeros at init
        name, nn.with_logical_partitioning(nn.initializers.zeros, names), shape, self.param_dtype)
    b = None
    if m.expert_bias:
      b = (zeros('gate_bias', ('experts', 'mlp'), (X, F)), zeros('up_bias', ('experts', 'mlp'), (X, F)),
           zeros('down_bias', ('experts', 'embed'), (X, D)))
    B, T, _ = x.shape
    xt = x.reshape(B * T, D)  # (N, D): one token axis, as model.tokens
    valid = segment_ids.reshape(B * T) > 0  # (N,)
    # The router in float32 whatever the compute dtype: near-ties between experts decide the choice.
    logits = jnp.dot(xt.astype(jnp.float32), w_router.astype(jnp.float32))  # (N, X)
    if m.router_bias:
      logits = logits + zeros('router_bias', ('experts',), (X,)).astype(jnp.float32)
    weights, experts, scores = route(logits, m.router, k, m.norm_topk_prob, m.routed_scale,
                                     bias=jax.lax.stop_gradient(bias.astype(jnp.float32)), groups=m.groups,
                                     top_groups=m.top_groups)
    keep, load = assign(experts, valid, X, capacity(B * T, k, X, m.capacity_factor))
    # Expert GEMMs stay in model.dtype: fp8's per-tensor scales do not cover X experts' grouped rows.
    run = ragged_experts if m.impl == 'ragged' else dense_experts
    w = (w_gate.astype(dt), w_up.astype(dt), w_down.astype(dt))
    b = None if b is None else tuple(a.astype(dt) for a in b)
    # Experts split over the expert axis: tokens travel to them and back, gpt-oss's biases split with their
    # experts. A token count the mesh does not divide (init's dummy trace, a small sampling batch) runs in the
    # global view below instead: the same result, XLA gathering what it needs.
    if expert_ways() > 1 and xt.shape[0] % token_ways() == 0:
      y, overflow = expert_parallel(xt, weights, experts, keep, *w, run=run, swiglu=self.activation,
                                    transport=transport(m.transport), buffer_factor=m.buffer_factor, biases=b)
    else:
      y, overflow = run(xt, weights, experts, keep, *w, self.activation, b), jnp.zeros((), jnp.float32)
    if self.shared is not None:  # DeepSeek's shared experts: one dense SwiGLU as wide as all of them, on every token
      y = y + self.shared(name='shared')(x).reshape(B * T, D)
    if self.is_mutable_collection(STATS):
      for name, value in statistics(logits, scores, keep, load, valid, overflow).items():
        self.variable(STATS, name, lambda v=value: jnp.zeros_like(v)).value = value
    return y.reshape(B, T, D)


def statistics(logits, scores, keep, load, valid, overflow=0.0) -> dict:
  """One layer's routing statistics over its tokens, as sums (so they add up over microbatches and shards).

  tokens: real tokens; load (X,): assignments asked of each expert; kept: assignments taken; prob (X,): router
  probabilities summed over tokens (the P of the Switch auxiliary loss); z: Σ log(Σ exp(logits))² (router
  z-loss, ST-MoE); entropy: Σ of each token's router entropy; overflow: kept assignments the all_to_all
  transport lost to a full receive buffer (model.moe_buffer_factor; 0 with the default worst-case buffer).
  """
  w = valid.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # (N,)
  p = jax.nn.softmax(logits, axis=-1)
  entropy = -(p * jax.nn.log_softmax(logits, axis=-1)).sum(-1)
  return {'tokens': w.sum(), 'load': load.astype(jnp.float32), 'kept': (keep & valid[:, None]).sum().astype(
      jnp.float32), 'prob': (scores * w[:, None]).sum(0), 'z': (jnp.square(log_z) * w).sum(),
          'entropy': (entropy * w).sum(), 'overflow': jnp.asarray(overflow, jnp.float32)}


def _nodes(tree, marker: str, path=()):
  """(path, node) for every dict in `tree` holding key `marker`: one per MoE module (scanned or not)."""
  if marker in tree:
    yield path, tree
    return
  for key in sorted(tree):
    if isinstance(tree[key], dict) or hasattr(tree[key], 'items'):
      yield from _nodes(tree[key], marker, (*path, key))


def per_layer(stats, every: int, marker: str = 'load', first: int = 0) -> list[tuple[int, dict]]:
  """[(layer number, that layer's statistics)], in layer order, from the STATS collection of a model's apply.

  Scanned stacks hold one entry per unit on a leading axis (`layers/moe` or `layers/block_j/moe`, units of
  `every` layers, after the `first` dense layers of model.moe_first_dense); unrolled ones are `layers_i/moe`.
  """
  out, mtp = [], []
  for path, node in _nodes(stats, marker):
    if path[0] == 'mtp':  # a multi-token prediction depth's block (jaxlm/mtp.py): numbered after the layers below
      mtp.append((int(path[1].split('_')[1]), dict(node)))
    elif path[0] == 'layers':  # scanned: split the leading unit axis
      j = int(path[1].split('_')[1]) if path[1].startswith('block_') else every - 1
      units = node[marker].shape[0]
      # tree.map: a parameter node holds subtrees too (the shared experts' `shared` SwiGLU)
      out += [(first + u * every + j, {k: jax.tree.map(lambda x, u=u: x[u], v) for k, v in node.items()})
              for u in range(units)]
    else:
      out.append((int(path[0].split('_')[1]), dict(node)))
  last = max((i for i, _ in out), default=first - 1)  # MTP's block is MoE when the last layer is: L - 1
  return sorted(out, key=lambda item: item[0]) + [(last + k, s) for k, s in sorted(mtp, key=lambda item: item[0])]


def aux_loss(layer: dict, tokens, top_k: int, load=None):
  """Switch/GShard load-balancing loss X·Σ_e f_e·P_e of one layer: 1.0 when routing is uniform.

  f_e = load_e / (tokens·k), the fraction of assignments expert e was asked to take (no gradient); P_e = prob_e
  / tokens, its mean router probability. `tokens` is the whole batch's count of real tokens and `load` its
  loads, so that a microbatch's share (its prob_e) adds up over microbatches to the whole batch's loss.
  """
  load = layer['load'] if load is None else load
  f = jax.lax.stop_gradient(load) / (tokens * top_k)
  return load.shape[-1] * (f * layer['prob'] / tokens).sum()


def loss(stats, m: MoeConfig, tokens, loads=None):
  """The routing losses added to the training loss: moe_aux_loss · the load-balancing loss, plus
  moe_router_z_loss · mean over layers of the router z-loss (Σ log Z² / tokens). Linear in each microbatch's
  sums given the whole batch's `tokens` (and `loads`, per layer, when the batch is split), so the same update
  whatever the split.

  The load-balancing loss by model.moe_aux_loss_form: `switch`, the mean over MoE layers of `aux_loss` (1 at
  uniform routing); `pooled`, transformers' load_balancing_loss_func (Mixtral, gpt-oss): every layer's
  assignments and router probabilities summed first, X·Σ_e (assignments_e / (L·tokens))·(prob_e / (L·tokens)),
  k at uniform routing. A checkpoint's router_aux_loss_coef means the latter (hf/gpt_oss.py imports it so)."""
  layers = per_layer(stats, m.every)
  loads = [s['load'] for _, s in layers] if loads is None else loads
  total = 0.0
  if m.aux_loss and m.aux_loss_form == 'pooled':
    rows = tokens * len(layers)
    f = jax.lax.stop_gradient(sum(loads)) / rows  # (X,): each expert's share of the assignments, k in all
    total += m.aux_loss * m.experts * (f * sum(s['prob'] for _, s in layers) / rows).sum()
  elif m.aux_loss:
    total += m.aux_loss * sum(aux_loss(s, tokens, m.top_k, l) for (_, s), l in zip(layers, loads)) / len(layers)
  if m.router_z_loss:
    total += m.router_z_loss * sum(s['z'] for _, s in layers) / tokens / len(layers)
  return total


def metrics(stats, m: MoeConfig, bias_params=None) -> dict:
  """Per MoE layer: max/mean load, dropped fraction, aux and z losses (unscaled), router entropy, bias norm;
  and `moe/max_load`, the largest over layers (the progress line's summary)."""
  out = {}
  first = m.first_dense
  biases = dict(per_layer(bias_params, m.every, 'router', first)) if bias_params is not None else {}
  for i, s in per_layer(stats, m.every, first=first):
    tokens = jnp.maximum(s['tokens'], 1.0)
    load = s['load']
    out[f'moe/{i}/max_load'] = load.max() / jnp.maximum(load.mean(), 1e-9)
    out[f'moe/{i}/dropped'] = 1.0 - s['kept'] / (tokens * m.top_k)
    out[f'moe/{i}/aux_loss'] = aux_loss(s, tokens, m.top_k)
    out[f'moe/{i}/z_loss'] = s['z'] / tokens
    out[f'moe/{i}/entropy'] = s['entropy'] / tokens
    if 'overflow' in s:  # assignments lost to a full all_to_all receive buffer: a count, 0 unless undersized
      out[f'moe/{i}/overflow'] = s['overflow']
    if i in biases:
      out[f'moe/{i}/bias_norm'] = jnp.linalg.norm(biases[i]['bias'])
  out['moe/max_load'] = jnp.max(jnp.stack([v for k, v in out.items() if k.endswith('/max_load')]))
  return out


def loads(stats, every: int) -> list:
  """Each MoE layer's load (X,), in layer order."""
  return [s['load'] for _, s in per_layer(stats, every)]


def update_bias(params, stats, rate: float):
  """Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2; torchtitan's default): after each optimizer step, each
  expert's selection bias moves by `rate` towards its share, bias_e += rate·sign(mean load − load_e), centred so
  the biases keep summing to zero. `stats` are the whole batch's sums (all microbatches, all data shards)."""
  stat_nodes = dict(_nodes(stats, 'load'))

  def walk(tree, path=()):
    if 'bias' in tree and 'router' in tree:
      load = stat_nodes[path]['load']  # (..., X): a leading unit axis under scan
      delta = rate * jnp.sign(load.mean(-1, keepdims=True) - load)
      return {**tree, 'bias': tree['bias'] + delta - delta.mean(-1, keepdims=True)}
    return {k: walk(v, (*path, k)) if isinstance(v, dict) else v for k, v in tree.items()}
  return walk(params)
