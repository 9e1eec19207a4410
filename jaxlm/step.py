"""The program: the abstract train state and its shardings first, then the jitted init / train / eval steps.

`build_program(cfg, mesh)` is everything `python -m jaxlm.train` compiles, and what `jaxlm.tools.size` and the
benchmarks measure. Building it creates no array on any device (shapes only), so it works on compile-only
devices too; the functions it returns set up their own mesh and logical-axis rules when traced.
"""

import collections
import dataclasses
from typing import Any, Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlm import distill as distill_lib
from jaxlm import lora as lora_lib
from jaxlm import model as model_lib
from jaxlm import moe as moe_lib
from jaxlm import mtp as mtp_lib
from jaxlm import optimizer as optimizer_lib
from jaxlm import pipeline as pipeline_lib
from jaxlm import preference as preference_lib
from jaxlm import sharding

# train.objective: next-token cross-entropy, a preference loss (preference.py), or a teacher's distribution (distill.py)
OBJECTIVES = ('lm', 'preference', 'distill')


@flax.struct.dataclass
class TrainState:
  """Everything a step changes; checkpointed as one unit."""
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any  # optax state; float16 runs keep their dynamic loss scale here
  rng: jax.Array  # base PRNG key; step s uses fold_in(rng, s), so resume needs no RNG bookkeeping
  lr_scale: jax.Array  # float32 multiplier on updates, set by the host (post-rollback LR, fault drills)
  batches: jax.Array  # int32 batches drawn from the data, skipped ones included (fault drills key on it)
  fp8: Any  # model.matmul_dtype=fp8: the scales and amax histories (model.FP8 collection); else {}
  # optim.ema > 0: float32 average of the trained params (with LoRA the adapters alone: the base never moves); else {}
  ema: Any = dataclasses.field(default_factory=dict)
  # preference.reference=copy: the frozen initial parameters the loss compares with (checkpointed, so a resume is
  # exact); else {}.
  reference: Any = dataclasses.field(default_factory=dict)


class _InContext:
  """A jitted function that enters its mesh and the logical-axis rules whenever it is traced or called."""

  def __init__(self, fn, mesh):
    self.fn, self.mesh = fn, mesh

  def __call__(self, *args):
    with sharding.activate(self.mesh):
      return self.fn(*args)

  def lower(self, *args):
    with sharding.activate(self.mesh):
      return self.fn.lower(*args)


@dataclasses.dataclass
class Program:
  """Everything built for one model on one mesh: shapes and shardings first, then the jitted functions."""
  model: model_lib.Decoder
  mesh: jax.sharding.Mesh
  schedule: optax.Schedule
  abstract_state: TrainState  # ShapeDtypeStructs, no memory
  state_shardings: TrainState  # NamedShardings, same tree
  batch_sharding: jax.sharding.NamedSharding
  init: Callable[[], TrainState]
  train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]
  eval_step: Callable[[Any, dict], dict]
  score: Callable[[Any, dict], jax.Array] | None = None  # an objective's token log-probs (RL's reference)
  # train.objective=preference: (params, reference, batch) -> sums of the preference metrics over its pairs.
  preference_eval_step: Callable[[Any, Any, dict], dict] | None = None
  batch_extra: tuple = ()  # batch keys beyond the LM's: ((name, dtype[, trailing shape]), ...), e.g. preference pairs
  copy_reference: Callable[[Any], Any] | None = None  # reference=copy: params -> the frozen reference


def build_program(cfg, mesh, objective=None) -> Program:
  """The abstract state, its shardings, and the jitted init / train / eval functions `cfg` implies on `mesh`.

  Under stability.policy=off (and no fault drill) the step is exactly the plain AdamW step: no finiteness
  check, no update multiplier. `objective`: None is the language-model loss; else a loss over the batch's
  logits (e.g. `policy.PolicyObjective`, RL), whose batch carries the keys it names.
  """
  # Built under the abstract mesh: optax's tree_map_params runs tx.init, whose small counters would be eager
  # arrays on the real mesh, which compile-only devices (libtpu topologies) cannot hold. The jitted functions
  # enter the real mesh when they are traced.
  with sharding.activate(mesh.abstract_mesh if isinstance(mesh, jax.sharding.Mesh) else mesh):
    stages = dict(mesh.shape).get(sharding.STAGE, 1)
    pipeline = pipeline_lib.layout(cfg.pipeline, stages) if 'pipeline' in cfg else None
    kind = cfg.train.get('objective', 'lm')  # train.objective; `objective` is a loss object (RL)
    if kind == 'distill':  # a loss over the batch's teacher keys (distill.py); the teacher stays outside the state
      objective = distill_lib.DistillObjective.from_config(cfg.distill, cfg.model.z_loss)
    return _build(cfg.model, cfg.optim, steps=cfg.train.steps, seed=cfg.train.seed, mesh=mesh, pipeline=pipeline,
                  microbatches=cfg.train.microbatches, skip_nonfinite=cfg.stability.policy != 'off',
                  scale_updates=cfg.stability.policy == 'rollback' or bool(cfg.faults.lr_spike_steps),
                  objective=objective, pref_cfg=cfg.preference if kind == 'preference' else None)


_PROGRAMS = collections.OrderedDict()  # what decides a program -> (Program, its seed, {batch shape: compiled step})
_KEEP = 4  # programs kept per process, each with its compiled executables


def cached_program(cfg, mesh, objective=None, keep: int = _KEEP) -> tuple[Program, dict]:
  """build_program's Program, reused by every later run of the same program in this process (a resumed run, a
  sweep's trials, tests), with the train steps already compiled for it: a dict {(batch size, seq len): compiled
  step} that the caller fills. Only init is rebuilt for another train.seed (it alone draws from it). `keep`: the
  newest programs kept, with their executables (the tests' grids keep more)."""
  t, kind = cfg.train, cfg.train.get('objective', 'lm')
  section = lambda name: cfg[name].to_json() if name in cfg else None  # noqa: E731
  # The teacher's and its cache's locations do not shape the student's program (the teacher stays outside it).
  distill = (tuple(sorted((k, v) for k, v in cfg.distill.items() if k not in ('teacher', 'cached')))
             if kind == 'distill' else None)
  key = (cfg.model.to_json(), cfg.optim.to_json(), section('pipeline'), t.steps, t.microbatches, kind,
         cfg.stability.policy, bool(cfg.faults.lr_spike_steps), distill,
         section('preference') if kind == 'preference' else None, objective, mesh)
  if key in _PROGRAMS:
    _PROGRAMS.move_to_end(key)
    program, seed, compiled = _PROGRAMS[key]
    if t.seed != seed:
      program = dataclasses.replace(program, init=build_program(cfg, mesh, objective).init)
    return program, compiled
  program, compiled = build_program(cfg, mesh, objective), {}
  _PROGRAMS[key] = (program, t.seed, compiled)
  while len(_PROGRAMS) > keep:
    _PROGRAMS.popitem(last=False)
  return program, compiled


def compiled_step(program: Program, compiled: dict, batch_size: int, seq_len: int):
  """The program's train step compiled ahead of time for (batch_size, seq_len), kept in `compiled`
  (cached_program's dict): one compile per batch shape and program in a process."""
  shape = (batch_size, seq_len)
  if shape not in compiled:
    compiled[shape] = program.train_step.lower(
        program.abstract_state, abstract_batch(*shape, program.batch_sharding, program.batch_extra)).compile()
  return compiled[shape]


@dataclasses.dataclass(frozen=True)
class _Loss:
  """What the train step's loss needs besides the batch: the objective and its reference (preference tuning)."""
  m: model_lib.ModelConfig
  model: Any
  deterministic: bool
  objective: Any = None  # a loss object over the batch's logits (RL); None: LM or preference
  pref_cfg: Any = None  # the preference section, under train.objective=preference
  ref_kind: str | None = None  # the preference reference: copy | base | cached | None (SimPO)


def _build(model_cfg, optim_cfg, *, steps: int, seed: int, mesh, pipeline, microbatches: int,
           skip_nonfinite: bool, scale_updates: bool, objective=None, pref_cfg=None) -> Program:
  m = model_lib.ModelConfig.from_config(model_cfg)
  model = model_lib.Decoder(m, pipeline=pipeline)
  # Shapes only: building creates no array. Long enough to split over context (2·context zig-zag chunks).
  tokens = jax.ShapeDtypeStruct((1, 8 * sharding.context_size(mesh)), jnp.int32)

  def init_variables(rng):
    dummy = jnp.zeros(tokens.shape, tokens.dtype)
    return model.init({'params': rng}, dummy, dummy + 1, dummy)

  # Shapes before values: logical axis names come with the abstract (boxed) variables. The model is traced for
  # its shapes once here (and once in init's): tracing a model costs more than compiling palm_tiny's step.
  boxed_variables = jax.eval_shape(lambda: init_variables(jax.random.PRNGKey(0)))
  param_logical = nn.get_partition_spec(boxed_variables['params'])
  # LoRA: only the adapters are differentiated and have optimizer state; the base is frozen (`trainable`).
  trainable, with_trainable = trainable_split(m)
  tx = _optimizer(optim_cfg, steps, trainable(param_logical), skip_nonfinite, m.dtype == 'float16')
  # Preference tuning: which reference the loss compares with (none for SimPO), and what the batch carries.
  preference = pref_cfg is not None
  ref_kind = pref_cfg.reference if preference and preference_lib.needs_reference(pref_cfg) else None
  copy = ref_kind == 'copy'
  batch_extra = ((('pairs', jnp.int32),) + ((('ref_logps', jnp.float32),) if ref_kind == 'cached' else ())
                 if preference else tuple((k, jnp.float32) for k in getattr(objective, 'batch_keys', ())))
  if isinstance(objective, distill_lib.DistillObjective):
    batch_extra = distill_lib.batch_keys(objective.top_k, m.vocab_size)
  abstract_params = jax.eval_shape(nn.unbox, boxed_variables['params'])
  state_shardings = _state_shardings(tx, optim_cfg, abstract_params, param_logical, boxed_variables, trainable,
                                     copy, mesh)

  def state_from(variables, rng):
    params = variables['params']
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(trainable(params)), rng=rng,
                      lr_scale=jnp.ones((), jnp.float32), batches=jnp.zeros((), jnp.int32),
                      fp8=variables.get(model_lib.FP8, {}), ema=optimizer_lib.init_ema(optim_cfg, trainable(params)),
                      reference=preference_lib.copy_reference(params, pref_cfg.reference_dtype) if copy else {})

  def init():
    rng = jax.random.PRNGKey(seed)
    return state_from(nn.unbox(init_variables(jax.random.fold_in(rng, 0))), rng)

  # The state's shapes from the variables' shapes above: tracing init itself would trace the model once more.
  abstract_state = jax.eval_shape(state_from, jax.eval_shape(nn.unbox, boxed_variables),
                                  jax.eval_shape(jax.random.PRNGKey, seed))

  loss = _Loss(m=m, model=model, deterministic=m.dropout_rate == 0.0, objective=objective,
               pref_cfg=pref_cfg if preference else None, ref_kind=ref_kind)
  lr = optimizer_lib.schedule(optim_cfg, steps)
  train_step = _train_step(loss, tx, lr, optim_cfg, trainable, with_trainable,
                           microbatches=microbatches, skip_nonfinite=skip_nonfinite, scale_updates=scale_updates)
  batch_sharding = sharding.batch_sharding(mesh)
  return Program(
      **_eval_functions(loss, state_shardings, batch_sharding, mesh), batch_extra=batch_extra,
      model=model, mesh=mesh, schedule=lr, abstract_state=abstract_state,
      state_shardings=state_shardings, batch_sharding=batch_sharding,
      init=_InContext(jax.jit(init, out_shardings=state_shardings), mesh),
      train_step=_InContext(jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                                    out_shardings=(state_shardings, None), donate_argnums=0), mesh))


def _optimizer(optim_cfg, steps: int, train_logical, skip_nonfinite: bool, fp16: bool):
  """The optax transformation: optim.name's, never giving up on non-finite steps, float16's loss scale outermost."""
  tx = optimizer_lib.make_optimizer(optim_cfg, steps, optimizer_lib.decay_mask(train_logical), train_logical)
  if skip_nonfinite:
    # The host decides what persistent NaNs mean (stability.Guard), so never let apply_if_finite give up.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=2**30)
  if fp16:  # outermost: it sees the scaled gradients, and an overflow is not counted as a skipped step
    tx = optimizer_lib.dynamic_loss_scale(tx, optim_cfg.loss_scale_init, optim_cfg.loss_scale_period)
  return tx


def _state_shardings(tx, optim_cfg, abstract_params, param_logical, boxed_variables, trainable, copy: bool, mesh):
  """The TrainState's NamedShardings: parameters and what mirrors them by the rules table, scalars replicated."""
  train_logical = trainable(param_logical)
  abstract_opt = jax.eval_shape(tx.init, trainable(abstract_params))
  replicated = jax.sharding.PartitionSpec()
  opt_logical = optimizer_lib.state_logical(tx, abstract_opt, train_logical, trainable(abstract_params))
  logical = TrainState(step=replicated, params=param_logical, opt_state=opt_logical, rng=replicated,
                       lr_scale=replicated, batches=replicated,
                       # a few floats per layer
                       fp8=jax.tree.map(lambda _: replicated, boxed_variables.get(model_lib.FP8, {})),
                       ema=train_logical if optim_cfg.get('ema', 0.0) else {},  # sharded like what trains
                       reference=param_logical if copy else {})
  return sharding.logical_to_mesh(logical, mesh)


def _loss_fn(loss: _Loss, state, batch: dict, microbatches: int, scale, with_trainable, rng):
  """(variables, microbatch, rng) -> (loss · scale, metrics): the objective's loss, plus MoE's routing losses."""
  m, model = loss.m, loss.model
  moe = m.moe.experts > 0
  # Every microbatch divides by the whole batch's token count, so summed gradients equal the full batch's.
  denominator = jnp.maximum(batch['weights'].sum(), 1.0)
  # Mixture of experts: routing losses over the whole batch's real tokens (and, split into microbatches, its
  # loads from a routing pass first), so they too add up over microbatches to the whole batch's.
  moe_tokens = jnp.maximum((batch['segment_ids'] > 0).sum(), 1).astype(jnp.float32) if moe else None
  moe_loads = None
  mtp = bool(m.mtp_depth) and loss.pref_cfg is None and loss.objective is None
  if moe and m.moe.aux_loss and microbatches > 1:
    moe_loads = routing_loads(model, variables_of(state), batch, rng, microbatches, loss.deterministic, mtp)
  if loss.pref_cfg is not None:  # every microbatch divides by the whole batch's pair count
    num_pairs = jnp.maximum(preference_lib.count_pairs(batch), 1.0)
    ref_params = preference_lib.reference_params(loss.ref_kind, state.params, state.reference)

  # Multi-token prediction (jaxlm/mtp.py) joins the language-model loss, each depth over its own target count.
  if mtp:
    mtp_denominators = jnp.maximum(mtp_lib.target_weights(batch, m.mtp_depth).sum((1, 2)), 1.0)
  collections = [moe_lib.STATS] * moe + [mtp_lib.COLLECTION] * mtp

  def loss_of(variables, mb, mb_rng):
    variables = dict(variables, params=with_trainable(state.params, variables['params']))
    logits = model.apply(variables, mb['inputs'], mb['segment_ids'], mb['positions'],
                         deterministic=loss.deterministic, rngs={'dropout': mb_rng}, mutable=collections or False)
    logits, stats = logits if collections else (logits, None)
    if loss.pref_cfg is not None:
      ref = reference_logps(model, loss.ref_kind, ref_params, mb)
      total, aux = preference_lib.loss(logits, mb, ref, loss.pref_cfg, num_pairs)
    elif isinstance(loss.objective, distill_lib.DistillObjective):  # divided by the batch's weights, as the LM's
      total, aux = loss.objective.loss(logits, mb, denominator)
    elif loss.objective is not None:  # its per-token weights are normalised over the whole batch on the host
      total, aux = loss.objective.loss(logits, mb)
    else:
      total, aux = model_lib.loss_fn(logits, mb['targets'], mb['weights'], m.z_loss, denominator)
    if mtp:
      extra, depths = mtp_lib.loss(stats[mtp_lib.COLLECTION]['logits'][0], mb, m.mtp_weight, mtp_denominators)
      total, aux = total + extra, dict(aux, **depths)
    if moe:
      total = total + moe_lib.loss(stats[moe_lib.STATS], m.moe, moe_tokens, moe_loads)
      aux = dict(aux, moe=stats[moe_lib.STATS])
    return total * scale, aux

  return loss_of


def _train_step(loss: _Loss, tx, lr, optim_cfg, trainable, with_trainable, *, microbatches: int,
                skip_nonfinite: bool, scale_updates: bool):
  """train_step(state, batch) -> (state, metrics): gradients over microbatches, the update, its metrics."""
  m = loss.m
  fp16, moe = m.dtype == 'float16', m.moe.experts > 0

  def train_step(state: TrainState, batch: dict):
    rng = jax.random.fold_in(state.rng, state.step)
    scale = optimizer_lib.loss_scale(state.opt_state) if fp16 else 1.0  # float16: small gradients not flushed
    loss_of = _loss_fn(loss, state, batch, microbatches, scale, with_trainable, rng)
    differentiated = dict(variables_of(state), params=trainable(state.params))
    grads, aux = accumulate_gradients(jax.value_and_grad(loss_of, has_aux=True), differentiated, batch, rng,
                                      microbatches)
    moe_stats = aux.pop('moe', None)  # the whole batch's routing sums
    grads, fp8 = split_overwrite(grads, state.fp8)
    trained = trainable(state.params)
    updates, opt_state = tx.update(grads, state.opt_state, trained)
    step_lr = lr(state.step)
    if scale_updates:  # AdamW's update is linear in the learning rate, so this is an LR multiplier
      updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype), updates)
      step_lr = step_lr * state.lr_scale
    params = with_trainable(state.params, optax.apply_updates(trained, updates))
    metrics = dict(aux, grad_norm=optax.tree.norm(grads) / scale, lr=step_lr,
                   update_ratio=optax.tree.norm(updates) / optax.tree.norm(trained),
                   **group_norms(grads, scale))
    if moe:
      if m.moe.bias_rate:  # a skipped (non-finite) step leaves the biases as it leaves every parameter
        balanced = moe_lib.update_bias(params, moe_stats, m.moe.bias_rate)
        finite = jnp.isfinite(optax.tree.norm(grads)) if skip_nonfinite else True
        params = jax.tree.map(lambda new, old: jnp.where(finite, new, old), balanced, params)
      metrics.update(moe_lib.metrics(moe_stats, m.moe, params))
    if skip_nonfinite:
      finite_state = optimizer_lib.find_state(opt_state, optax.ApplyIfFiniteState)
      metrics.update(skipped_steps=finite_state.total_notfinite, nonfinite_run=finite_state.notfinite_count)
    if fp16:
      metrics['loss_scale'] = optimizer_lib.loss_scale(opt_state)
    # Gradients of the loss (scaled, under float16): not finite exactly when the update was not applied.
    ema = optimizer_lib.update_ema(optim_cfg, state.ema, trainable(params), state.step,
                                   jnp.isfinite(metrics['grad_norm']))
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state, fp8=fp8,
                         batches=state.batches + 1, ema=ema), metrics

  return train_step


def _eval_functions(loss: _Loss, state_shardings, batch_sharding, mesh) -> dict:
  """Program's eval_step (held-out cross-entropy sums), score (an objective's log-probs), preference_eval_step
  and copy_reference, jitted: those this objective has."""
  # Evaluation runs the ordinary matmuls on the same weights (no fp8 state needed): the held-out loss is that
  # of the model tools/eval scores and hf/export writes.
  eval_model = model_lib.Decoder(model_lib.inference_config(loss.m))
  objective, pref_cfg, ref_kind = loss.objective, loss.pref_cfg, loss.ref_kind
  copy = ref_kind == 'copy'

  def eval_step(params, batch: dict):
    logits = eval_model.apply({'params': params}, batch['inputs'], batch['segment_ids'], batch['positions'])
    _, aux = model_lib.loss_fn(logits, batch['targets'], batch['weights'], 0.0)
    n = batch['weights'].sum()
    return {'loss_sum': aux['loss'] * n, 'tokens': n}

  def score(params, batch: dict):
    logits = eval_model.apply({'params': params}, batch['inputs'], batch['segment_ids'], batch['positions'])
    return objective.logprobs(logits, batch['targets'])

  def preference_eval_step(params, reference, batch: dict):
    logits = eval_model.apply({'params': params}, batch['inputs'], batch['segment_ids'], batch['positions'])
    ref = reference_logps(eval_model, ref_kind, preference_lib.reference_params(ref_kind, params, reference), batch)
    _, sums = preference_lib.loss(logits, batch, ref, pref_cfg, 1.0)  # sums over the pairs
    return dict(sums, pairs=preference_lib.count_pairs(batch))

  params_s = state_shardings.params
  ref_shardings = state_shardings.reference if copy else None
  out = {'eval_step': _InContext(jax.jit(eval_step, in_shardings=(params_s, batch_sharding)), mesh),
         'score': None if not hasattr(objective, 'logprobs') else _InContext(
             jax.jit(score, in_shardings=(params_s, batch_sharding)), mesh)}
  if pref_cfg is not None:
    out['preference_eval_step'] = _InContext(jax.jit(preference_eval_step, in_shardings=(
        params_s, ref_shardings, batch_sharding)), mesh)
  if copy:
    out['copy_reference'] = _InContext(jax.jit(
        lambda p: preference_lib.copy_reference(p, pref_cfg.reference_dtype), out_shardings=ref_shardings), mesh)
  return out


def reference_logps(model, kind: str | None, ref_params, batch: dict):
  """The reference's per-token log-probabilities (B, T) of `batch`'s targets, no gradient: a forward with
  `ref_params` (`preference.reference_params`), or the batch's cached `ref_logps`; None without a reference.

  This and `preference.reference_params` are the whole reference mechanism (RL's KL term uses them as well).
  """
  if kind is None:
    return None
  if kind == 'cached':
    return batch['ref_logps']
  logits = model.apply({'params': ref_params}, batch['inputs'], batch['segment_ids'], batch['positions'])
  return jax.lax.stop_gradient(preference_lib.token_logps(logits, batch['targets']))


def trainable_split(m: model_lib.ModelConfig) -> tuple[Callable, Callable]:
  """(trainable, with_trainable): what the optimizer sees of a parameter tree, and the tree with it put back.

  Without LoRA every parameter trains (both are identities). With model.lora the adapters alone train: the base
  gets no gradient and no optimizer state, and stays bit for bit what it was initialised or loaded as.
  """
  if not m.lora.rank:
    return (lambda params: params), (lambda params, trained: trained)
  return (lambda params: lora_lib.split_adapters(params)[1]), lora_lib.join_adapters


def eval_params(state: TrainState, m: model_lib.ModelConfig):
  """The parameters to evaluate and sample: schedule-free's averaged point under sf_adamw (of the trained part),
  else the parameters themselves."""
  trainable, with_trainable = trainable_split(m)
  return with_trainable(state.params, optimizer_lib.eval_params(state.opt_state, trainable(state.params)))


def ema_params(state: TrainState, m: model_lib.ModelConfig):
  """The averaged model (optim.ema): the moving average of what trains, with LoRA put on the frozen base."""
  return trainable_split(m)[1](state.params, state.ema)


def variables_of(state: TrainState) -> dict:
  """The model's variables in `state`: the parameters, and with fp8 matmuls their scales (model.FP8)."""
  return {'params': state.params, **({model_lib.FP8: state.fp8} if state.fp8 else {})}


def split_overwrite(grads: dict, old_fp8):
  """(parameter gradients, next fp8 state) from the gradients of `variables_of(state)`.

  Flax's fp8 dot returns each scale's and amax history's next value as its "gradient" (the FP8 collection is
  Flax's OVERWRITE_WITH_GRADIENT): the optimizer sees only the parameters' gradients and the fp8 state is
  replaced, as flax.training.train_state.TrainState.apply_gradients does. A step with non-finite gradients
  keeps the old fp8 state, as it keeps the parameters: an inf in the amax history would freeze the scale.
  """
  if model_lib.FP8 not in grads:
    return grads['params'], old_fp8
  finite = jnp.isfinite(optax.tree.norm(grads['params']))
  new = jax.tree.map(lambda n, o: jnp.where(finite, n, o), grads[model_lib.FP8], old_fp8)
  return grads['params'], new


# Aux metrics that are a max or a min over the batch's rows, not a sum: microbatches combine them so.
MAX_METRICS = frozenset({'max_logit', 'clip_ratio/high_max'})
MIN_METRICS = frozenset({'clip_ratio/low_min'})


def accumulate_gradients(grad_fn, params, batch: dict, rng, microbatches: int):
  """Gradients and aux metrics of `batch`, computed in `microbatches` sequential pieces and summed.

  grad_fn(params, batch, rng) -> ((loss, aux), grads), with the loss already divided by the whole batch's
  token count, so the sum over microbatches equals the whole batch's gradient.
  """
  if microbatches == 1:
    (_, aux), grads = grad_fn(params, batch, rng)
    return grads, aux
  split = split_microbatches(batch, microbatches)

  def add(carry, mb_and_index):
    mb, i = mb_and_index
    mb = {k: nn.with_logical_constraint(v, ('act_batch', 'act_seq')) for k, v in mb.items()}
    (_, aux_i), g = grad_fn(params, mb, jax.random.fold_in(rng, i))
    acc_g, acc_aux = carry
    acc_aux = {k: jnp.maximum(acc_aux[k], v) if k in MAX_METRICS else jnp.minimum(acc_aux[k], v)
               if k in MIN_METRICS else jax.tree.map(jnp.add, acc_aux[k], v) for k, v in aux_i.items()}
    return (jax.tree.map(jnp.add, acc_g, g), acc_aux), None

  # Sums start at zero (a MoE layer's routing statistics too, whatever their shapes), the max at float32's min.
  aux_shapes = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(lambda x: x[0], split), rng)[0][1])
  zero_aux = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), aux_shapes)
  for k in zero_aux.keys() & MAX_METRICS:  # the LM loss's max_logit; a preference loss has none
    zero_aux[k] = jnp.finfo(jnp.float32).min
  for k in zero_aux.keys() & MIN_METRICS:
    zero_aux[k] = jnp.finfo(jnp.float32).max
  zeros = (jax.tree.map(jnp.zeros_like, params), zero_aux)
  (grads, aux), _ = jax.lax.scan(add, zeros, (split, jnp.arange(microbatches)))
  return grads, aux


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """(B, T) -> (M, B/M, T), taking every M-th row so each microbatch stays spread over all devices."""
  return jax.tree.map(lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
                      .swapaxes(0, 1), batch)


def routing_loads(model, variables, batch: dict, rng, microbatches: int, deterministic: bool,
                  mtp: bool = False) -> list:
  """Each MoE layer's load over the whole batch, from a forward pass over its microbatches (no gradients).

  The auxiliary loss weighs each expert's router probability by the whole batch's load; with the batch split,
  that load is known only after every microbatch, so it is counted first (one extra forward pass, only when
  model.moe_aux_loss is on with train.microbatches > 1). `mtp`: the prediction depths run too (their blocks
  route when the last layer does, jaxlm/mtp.py).
  """
  m = model.config

  def add(acc, mb_and_index):
    mb, i = mb_and_index
    mb = {k: nn.with_logical_constraint(v, ('act_batch', 'act_seq')) for k, v in mb.items()}
    _, stats = model.apply(variables, mb['inputs'], mb['segment_ids'], mb['positions'],
                           deterministic=deterministic, rngs={'dropout': jax.random.fold_in(rng, i)},
                           mutable=[moe_lib.STATS] + [mtp_lib.COLLECTION] * mtp)
    return [a + b for a, b in zip(acc, moe_lib.loads(stats[moe_lib.STATS], m.moe.every))], None

  layers = sum(model_lib.is_moe(m, i) for i in range(m.num_layers))
  layers += m.mtp_depth * model_lib.is_moe(m, m.num_layers - 1) if mtp else 0
  zeros = [jnp.zeros((m.moe.experts,), jnp.float32)] * layers
  loads, _ = jax.lax.scan(add, zeros, (split_microbatches(batch, microbatches), jnp.arange(microbatches)))
  return [jax.lax.stop_gradient(x) for x in loads]


def group_norms(grads, scale=1.0) -> dict:
  """Gradient norm per layer group (embedding, attention, mlp, moe, norms, unembed): where a spike starts."""
  groups = {}
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    names = [str(getattr(k, 'key', k)) for k in path]
    group = next((n for n in ('attention', 'mlp', 'moe', 'unembed', 'embedding') if n in names), 'norms')
    groups.setdefault(group, []).append(g)
  return {f'grad_norm/{k}': optax.tree.norm(v) / scale for k, v in sorted(groups.items())}


def abstract_batch(batch_size: int, seq_len: int, batch_sharding, extra: tuple = ()) -> dict:
  """Shapes of one global batch, for compiling the step ahead of time; `extra`: Program.batch_extra."""
  spec = lambda dtype, trailing=(): jax.ShapeDtypeStruct((batch_size, seq_len, *trailing), dtype,  # noqa: E731
                                                         sharding=batch_sharding)
  return dict(inputs=spec(jnp.int32), targets=spec(jnp.int32), segment_ids=spec(jnp.int32),
              positions=spec(jnp.int32), weights=spec(jnp.float32), **{k: spec(*rest) for k, *rest in extra})


def global_batch(local: dict, batch_sharding) -> dict:
  """Assembles each process's rows into one global array per key, laid out as `batch_sharding` says.

  Under context parallelism every row is first put in `sharding.zigzag_order`, on the host: inputs, targets,
  weights, positions and segment ids alike, so each token keeps its own position, document and loss weight and
  the loss (a sum over tokens) is unchanged. Done here, the permutation is a numpy gather before the transfer;
  inside the step it would move tokens between the devices that already hold them.
  """
  context = sharding.context_size(batch_sharding.mesh)
  rows, seq_len = np.shape(next(iter(local.values())))
  order = sharding.zigzag_order(seq_len, context) if context > 1 else None
  # Whole rows from each process (its share of them, sharding.row_share): with the sequence or the model split
  # across hosts, each device takes its own part of the rows its process read.
  shape = (rows * sharding.row_share(batch_sharding)[1], seq_len)  # and a key's own trailing axes (teacher top-K)
  return {k: jax.make_array_from_process_local_data(
      batch_sharding, np.asarray(v) if order is None else np.asarray(v)[:, order], shape + np.shape(v)[2:])
      for k, v in local.items()}


def evaluate_preference(program: Program, params, reference, batches: list[dict]) -> dict:
  """Preference metrics (eval_loss and TRL's rewards/* and logps/*) over the held-out pairs of `batches`."""
  totals = [program.preference_eval_step(params, reference, global_batch(b, program.batch_sharding))
            for b in batches]
  pairs = max(sum(float(t['pairs']) for t in totals), 1.0)
  out = {k: sum(float(t[k]) for t in totals) / pairs for k in ('loss', *preference_lib.METRICS)}
  return {'eval_loss': out.pop('loss'), **{f'eval_{k}': v for k, v in out.items()}, 'eval_pairs': pairs}


def evaluate(program: Program, params, batches: list[dict]) -> float:
  """Mean held-out cross-entropy per token over `batches` (the same batches every time)."""
  totals = [program.eval_step(params, global_batch(b, program.batch_sharding)) for b in batches]
  loss_sum = sum(float(t['loss_sum']) for t in totals)
  return loss_sum / max(sum(float(t['tokens']) for t in totals), 1.0)
