"""Train a model: `python -m jaxlm.train --config=configs/palm_small.py [--workdir=DIR] [--config.a.b=v]`.

Reads top to bottom: validate the config, build the mesh, compute the abstract state and its shardings,
initialise (or restore), then `for step: batch -> train_step -> log / eval / save`.
"""

import dataclasses
import functools
import os
import signal
import sys
from typing import Any, Callable

from absl import app, flags, logging
import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import config_flags

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import config as config_lib
from jaxlm import data as data_lib
from jaxlm import distributed
from jaxlm import errors
from jaxlm import metrics as metrics_lib
from jaxlm import model as model_lib
from jaxlm import optimizer as optimizer_lib
from jaxlm import sharding
from jaxlm import stability as stability_lib

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/palm_small.py.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, metrics). Default: runs/<name>.')


@flax.struct.dataclass
class TrainState:
  """Everything a step changes; checkpointed as one unit."""
  step: jax.Array  # int32 scalar: optimizer steps taken
  params: Any
  opt_state: Any
  rng: jax.Array  # base PRNG key; step s uses fold_in(rng, s), so resume needs no RNG bookkeeping
  lr_scale: jax.Array  # float32 multiplier on updates, set by the host (post-rollback LR, fault drills)
  batches: jax.Array  # int32 batches drawn from the data, skipped ones included (fault injection keys on it)
  loss_scale: jax.Array  # float32 dynamic loss scale (float16 compute only; stays 1 otherwise)
  good_steps: jax.Array  # int32 finite steps since the loss scale last changed


@dataclasses.dataclass
class Program:
  """Everything built for one model on one mesh: shapes and shardings first, then the jitted functions."""
  model: model_lib.Decoder
  schedule: optax.Schedule
  abstract_state: TrainState  # ShapeDtypeStructs, no memory
  state_shardings: TrainState  # NamedShardings, same tree
  batch_sharding: jax.sharding.NamedSharding
  init: Callable[[], TrainState]
  train_step: Callable[[TrainState, dict], tuple[TrainState, dict]]
  eval_step: Callable[[Any, dict], dict]


def build(model_cfg, optim_cfg, *, steps: int, seed: int, mesh, microbatches: int = 1,
          skip_nonfinite: bool = False, scale_updates: bool = False) -> Program:
  """Builds the abstract state, its shardings and the jitted init / train / eval functions for `mesh`.

  skip_nonfinite: drop updates whose gradients are not finite (optax.apply_if_finite), counting them.
  scale_updates: multiply updates by state.lr_scale (rollback LR changes, fault drills). With both off the step
  is exactly the plain AdamW step.
  microbatches: gradient accumulation — the batch is split and scanned, gradients summed, same result.
  """
  m = model_lib.ModelConfig.from_config(model_cfg)
  model = model_lib.Decoder(m)
  fp16 = m.dtype == 'float16'
  dummy = jnp.zeros((1, 8), jnp.int32)

  def init_params(rng):
    return model.init({'params': rng}, dummy, dummy + 1, dummy)['params']

  # Shapes before values: logical axis names come with the abstract (boxed) parameters.
  boxed = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  param_logical = nn.get_partition_spec(boxed)
  tx = optimizer_lib.make_optimizer(optim_cfg, steps, optimizer_lib.decay_mask(param_logical))
  if skip_nonfinite:
    # The host decides what persistent NaNs mean (stability.Guard), so never let apply_if_finite give up.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=2**30)
  abstract_params = jax.eval_shape(lambda r: nn.unbox(init_params(r)), jax.random.PRNGKey(0))
  abstract_opt = jax.eval_shape(tx.init, abstract_params)
  replicated = jax.sharding.PartitionSpec()
  # Adam's moments mirror the parameters, so they take the parameters' specs; counters, and Adafactor's
  # factored moments (other shapes than their parameters, and small), are replicated.
  opt_logical = optax.tree_map_params(
      tx, lambda x, spec, p: spec if x.shape == p.shape else replicated, abstract_opt, param_logical,
      abstract_params, transform_non_params=lambda _: replicated,
      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  logical = TrainState(step=replicated, params=param_logical, opt_state=opt_logical, rng=replicated,
                       lr_scale=replicated, batches=replicated, loss_scale=replicated, good_steps=replicated)
  state_shardings = sharding.logical_to_mesh(logical, mesh)

  def init(rng):
    params = nn.unbox(init_params(jax.random.fold_in(rng, 0)))
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params), rng=rng,
                      lr_scale=jnp.ones((), jnp.float32), batches=jnp.zeros((), jnp.int32),
                      loss_scale=jnp.full((), optim_cfg.loss_scale_init if fp16 else 1.0, jnp.float32),
                      good_steps=jnp.zeros((), jnp.int32))

  seed_key = jax.random.PRNGKey(seed)
  abstract_state = jax.eval_shape(init, seed_key)
  lr = optimizer_lib.schedule(optim_cfg, steps)
  deterministic = m.dropout_rate == 0.0

  def train_step(state: TrainState, batch: dict):
    rng = jax.random.fold_in(state.rng, state.step)
    # Every microbatch divides by the whole batch's token count, so summed gradients equal the full batch's.
    denominator = jnp.maximum(batch['weights'].sum(), 1.0)
    scale = state.loss_scale if fp16 else 1.0  # float16: scale the loss up so small gradients do not flush

    def loss_of(params, mb, mb_rng):
      logits = model.apply({'params': params}, mb['inputs'], mb['segment_ids'], mb['positions'],
                           deterministic=deterministic, rngs={'dropout': mb_rng})
      total, aux = model_lib.loss_fn(logits, mb['targets'], mb['weights'], m.z_loss, denominator)
      return total * scale, aux

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)
    if microbatches == 1:
      (_, aux), grads = grad_fn(state.params, batch, rng)
    else:
      # (B, T) -> (M, B/M, T), taking every M-th row so each microbatch stays spread over all devices.
      split = jax.tree.map(lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:])
                           .swapaxes(0, 1), batch)

      def accumulate(carry, mb_and_index):
        mb, i = mb_and_index
        mb = {k: nn.with_logical_constraint(v, ('act_batch', 'act_seq')) for k, v in mb.items()}
        (_, aux_i), g = grad_fn(state.params, mb, jax.random.fold_in(rng, i))
        acc_g, acc_aux = carry
        acc_aux = {k: jnp.maximum(acc_aux[k], v) if k == 'max_logit' else acc_aux[k] + v for k, v in aux_i.items()}
        return (jax.tree.map(jnp.add, acc_g, g), acc_aux), None

      zeros = (jax.tree.map(jnp.zeros_like, state.params),
               {'loss': 0.0, 'z_loss': 0.0, 'max_logit': jnp.finfo(jnp.float32).min})
      (grads, aux), _ = jax.lax.scan(accumulate, zeros, (split, jnp.arange(microbatches)))
    loss_scale, good_steps = state.loss_scale, state.good_steps
    if fp16:
      grads = jax.tree.map(lambda g: g / scale, grads)
      finite = jnp.all(jnp.array([jnp.isfinite(g).all() for g in jax.tree.leaves(grads)]))
      # Dynamic loss scaling: halve on overflow (and drop the step), double after `period` good steps.
      grown = good_steps + 1 >= optim_cfg.loss_scale_period
      loss_scale = jnp.where(finite, jnp.where(grown, scale * 2, scale), jnp.maximum(scale / 2, 1.0))
      good_steps = jnp.where(finite & ~grown, good_steps + 1, 0)
      grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)  # an overflow is not a NaN: no skip count
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    step_lr = lr(state.step)
    if scale_updates:  # AdamW's update is linear in the learning rate, so this is an LR multiplier
      updates = jax.tree.map(lambda u: u * state.lr_scale.astype(u.dtype), updates)
      step_lr = step_lr * state.lr_scale
    params = optax.apply_updates(state.params, updates)
    if fp16:  # an overflowed step leaves parameters and optimizer state untouched
      params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                       (params, opt_state), (state.params, state.opt_state))
    metrics = dict(aux, grad_norm=optax.global_norm(grads), lr=step_lr,
                   update_ratio=optax.global_norm(updates) / optax.global_norm(state.params),
                   **group_norms(grads))
    if skip_nonfinite:
      metrics.update(skipped_steps=opt_state.total_notfinite, nonfinite_run=opt_state.notfinite_count)
    if fp16:
      metrics['loss_scale'] = loss_scale
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, batches=state.batches + 1,
                              loss_scale=loss_scale, good_steps=good_steps)
    return new_state, metrics

  def eval_step(params, batch: dict):
    logits = model.apply({'params': params}, batch['inputs'], batch['segment_ids'], batch['positions'])
    loss, aux = model_lib.loss_fn(logits, batch['targets'], batch['weights'], 0.0)
    n = batch['weights'].sum()
    return {'loss_sum': aux['loss'] * n, 'tokens': n}

  batch_sharding = sharding.batch_sharding(mesh)
  return Program(
      model=model, schedule=lr, abstract_state=abstract_state, state_shardings=state_shardings,
      batch_sharding=batch_sharding,
      init=functools.partial(jax.jit(init, out_shardings=state_shardings), seed_key),
      train_step=jax.jit(train_step, in_shardings=(state_shardings, batch_sharding),
                         out_shardings=(state_shardings, None), donate_argnums=0),
      eval_step=jax.jit(eval_step, in_shardings=(state_shardings.params, batch_sharding)))


def program_for(cfg, mesh) -> Program:
  """`build` with the options a whole config implies (what `run` trains, `jaxlm.size` measures)."""
  t = cfg.train
  return build(cfg.model, cfg.optim, steps=t.steps, seed=t.seed, mesh=mesh, microbatches=t.microbatches,
               skip_nonfinite=cfg.stability.policy != 'off',
               scale_updates=cfg.stability.policy == 'rollback' or bool(cfg.faults.lr_spike_steps))


def group_norms(grads) -> dict:
  """Gradient norm per layer group (embedding, attention, mlp, norms, unembed): where a spike starts."""
  groups = {}
  for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
    names = [str(getattr(k, 'key', k)) for k in path]
    group = next((n for n in ('attention', 'mlp', 'unembed', 'embedding') if n in names), 'norms')
    groups.setdefault(group, []).append(g)
  return {f'grad_norm/{k}': optax.global_norm(v) for k, v in sorted(groups.items())}


def global_batch(local: dict, batch_sharding) -> dict:
  """Assembles each process's rows into one global array per key, laid out as `batch_sharding` says."""
  return {k: jax.make_array_from_process_local_data(batch_sharding, np.asarray(v)) for k, v in local.items()}


def evaluate(program: Program, params, batches: list[dict]) -> float:
  """Mean held-out cross-entropy per token over `batches` (the same batches every time)."""
  totals = [program.eval_step(params, global_batch(b, program.batch_sharding)) for b in batches]
  loss_sum = sum(float(t['loss_sum']) for t in totals)
  return loss_sum / max(sum(float(t['tokens']) for t in totals), 1.0)


def run(cfg, workdir: str) -> dict:
  """Trains as `cfg` says, writing to `workdir`; returns the last logged metrics."""
  acct = metrics_lib.TimeAccounting()  # wall time from process start: start-up counts against goodput
  t = cfg.train
  metrics_lib.enable_compilation_cache(cfg.log)
  mesh = sharding.make_mesh(cfg.mesh)
  primary = jax.process_index() == 0
  log = metrics_lib.MetricsLogger(workdir, cfg.log, total_steps=t.steps, is_primary=primary, config=cfg)
  say = print if primary else (lambda *a, **k: None)  # the start-up report, from process 0 only
  say(f'config:\n{cfg}')
  say(f'mesh: {dict(mesh.shape)} on {mesh.size} {jax.devices()[0].device_kind} devices')
  say(f'bit-reproducible: {reproducibility(t, jax.devices()[0].platform)}')

  with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(sharding.RULES):
    faults = cfg.faults
    program = program_for(cfg, mesh)
    say(f'parameters ({model_lib.param_count(program.model.m):,}):\n'
        + sharding.param_table(program.abstract_state.params, program.state_shardings.params))
    sharding.check_sharded(program.abstract_state.params, program.state_shardings.params, mesh)
    ramp = BatchRamp(t, cfg.data.seq_len)
    # Data before compiling: a bad dataset fails in seconds, not after a long compile.
    vocab = cfg.model.vocab_size
    # The iterator yields ramp units (the first stage's size); a step draws size // unit of them, so the
    # iterator's position stays exact across stages and across resume.
    train_iter = data_lib.make_train_iterator(cfg.data, batch_size=ramp.unit, seed=t.seed, vocab_size=vocab)
    eval_data = data_lib.eval_batches(cfg.data, batch_size=t.batch_size, num_batches=t.eval_batches,
                                      vocab_size=vocab)

    compiled = {}

    def step_for(size: int):
      """The train step compiled ahead of time for this batch size (one per ramp stage)."""
      if size not in compiled:
        with acct.track('compile'):  # ahead of time, so no step time hides a compile
          compiled[size] = program.train_step.lower(
              program.abstract_state, abstract_batch(size, cfg.data.seq_len, program.batch_sharding)).compile()
      return compiled[size]

    memory = metrics_lib.compiled_memory(step_for(t.batch_size))
    say(f'compiled the train step in {acct.last_s:.1f}s; per device: {metrics_lib.format_memory(memory)}')

    # Restore or initialise: the newest readable checkpoint wins; the data iterator is restored with it.
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, 'checkpoints'), cfg.checkpoint, log.event)
    env = checkpoint_lib.environment(cfg, mesh)
    guard = stability_lib.Guard(cfg.stability, log.event, log_every=t.log_every,
                                ledger=os.path.join(workdir, 'rollbacks.json'), writes_ledger=primary)
    with acct.track('checkpoint'):
      state, guard_state = ckpt.restore(program.abstract_state, program.state_shardings, train_iter)
    if state is not None:
      guard.load(guard_state)
      start = int(state.step)
      metrics_path = os.path.join(workdir, 'metrics.jsonl')
      records = metrics_lib.read_metrics(metrics_path) if os.path.exists(metrics_path) else []
      logged = [r['step'] for r in records if r.get('kind') == 'train']
      redone = max(logged + [start]) - start  # steps the killed process had done past the checkpoint
      acct.redo_steps(redone)
      log.event(start, 'resumed', f'resumed from checkpoint step {start} in {ckpt.directory}; '
                f'{redone} logged steps after it will be redone', redo_steps=redone)
    else:
      guard.reset_ledger()
      state = program.init()
      if cfg.checkpoint.init_from:
        params = checkpoint_lib.load_params(cfg.checkpoint.init_from, program.abstract_state.params,
                                            program.state_shardings.params)
        state = state.replace(params=params)
        say(f'warm start: parameters from {cfg.checkpoint.init_from}, fresh optimizer at step 0')
      start = 0
    log.write(start, {**memory, **metrics_lib.device_memory_stats(), 'compile_s': acct.last_s}, kind='system')

    # Preemption: SIGTERM / SIGINT let the current step finish, then a checkpoint is written before exit.
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda signum, _: stop.append(signal.Signals(signum).name))

    flops = model_lib.flops_per_token(program.model.m, cfg.data.seq_len)
    flops_causal = model_lib.flops_per_token(program.model.m, cfg.data.seq_len, causal=True)
    device_kind = jax.devices()[0].device_kind
    slow = metrics_lib.SlowStepDetector(cfg.log.slow_step_factor, cfg.log.slow_step_count)
    profiler = metrics_lib.Profiler(cfg.log, workdir, is_primary=primary)
    poison_batches = stability_lib.steps_set(faults.poison_batches)
    lr_spike_steps = stability_lib.steps_set(faults.lr_spike_steps)
    try:
      last, window_s, window_steps, window_tokens, step_metrics = {}, 0.0, 0, 0, None
      step = start
      while step < t.steps:
        profiler.step(step, block_on=step_metrics)
        size = ramp.size(step)
        with acct.track('data'):
          local = ramp.draw(train_iter, size)
          number = int(state.batches) + 1
          if number in poison_batches:
            local = stability_lib.poison(local, faults.poison, cfg.model.vocab_size, number)
            log.event(step + 1, 'fault_injected', f'batch {number} poisoned with {faults.poison}')
          batch = global_batch(local, program.batch_sharding)
        window_s += acct.last_s
        # Keyed on the batch counter like poison_batches: a drill does not fire again after a rollback.
        lr_scale = faults.lr_spike_factor if number in lr_spike_steps else guard.lr_scale(step)
        if lr_scale != float(state.lr_scale):
          state = set_scalars(state, program, lr_scale=lr_scale)
          log.event(step + 1, 'lr_scale', f'learning rate multiplied by {lr_scale:g} from step {step + 1}'
                    if lr_scale != 1.0 else f'learning rate back on its schedule from step {step + 1}',
                    lr_scale=lr_scale)
        with acct.track('step'):
          state, step_metrics = step_for(size)(state, batch)
          jax.block_until_ready(step_metrics)  # step time is device time; the next batch is already prefetched
        window_s += acct.last_s
        window_steps += 1
        window_tokens += size * cfg.data.seq_len
        step = done = step + 1
        distributed.beat(done)  # the hung-peer watchdog
        if message := slow.update(done, acct.last_s):
          log.event(done, 'slow_step', message)
        if done % t.log_every == 0 or done == t.steps:
          tokens_per_s = window_tokens / window_s
          values = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
          values.update(tokens_per_s=tokens_per_s, step_time_s=window_s / window_steps, tokens=ramp.tokens(done),
                        batch_size=size,
                        mfu=metrics_lib.mfu(tokens_per_s, flops, mesh.size, device_kind),
                        mfu_causal=metrics_lib.mfu(tokens_per_s, flops_causal, mesh.size, device_kind))
          log.write(done, values)
          last = values
          window_s, window_steps, window_tokens = 0.0, 0, 0
          if rollback := guard.observe(done, values):
            with acct.track('checkpoint'):
              state = roll_back(rollback, guard, ckpt, program, train_iter, cfg.stability, log, ramp)
            step = int(state.step)
            acct.redo_steps(done - step)
            continue
        if (t.eval_every and done % t.eval_every == 0) or done == t.steps:
          with acct.track('eval'):
            last['eval_loss'] = evaluate(program, state.params, eval_data)
          log.write(done, {'eval_loss': last['eval_loss']}, kind='eval')
          log.write(done, {**acct.summary(), **metrics_lib.device_memory_stats()}, kind='system')
        stopping = distributed.any_process(bool(stop))  # a signal to any process stops all after the same step
        with acct.track('checkpoint'):
          ckpt.poll()
          if stopping or ckpt.due(done, t.steps):
            ckpt.save(done, state, train_iter, env, guard=guard.state())
          if stopping:
            ckpt.wait()
        if stopping:
          log.event(done, 'preempted', f'{stop[0] if stop else "a stop signal to another process"} received: '
                    f'stopped after step {done}, checkpoint '
                    f'{"saved" if ckpt.last_good == done else "NOT saved"}; run the same command to resume.')
          break
    except BaseException:
      # Shut down without masking the error: the writers may be what failed (a full disk).
      for close in (distributed.disarm, lambda: profiler.stop(block_on=None), getattr(train_iter, 'close', None),
                    ckpt.close, log.close):
        try:
          if close:
            close()
        except Exception:  # pylint: disable=broad-except
          pass
      raise
    distributed.disarm()
    profiler.stop(block_on=step_metrics)
    if hasattr(train_iter, 'close'):
      train_iter.close()  # stops Grain's worker processes (data.num_workers > 0)
    with acct.track('checkpoint'):
      ckpt.close()
    log.write(int(state.step), acct.summary(), kind='system')
    if primary:
      print(acct.table(), flush=True)
    log.close()
  return last


DETERMINISTIC_XLA_FLAGS = '--xla_gpu_deterministic_ops=true'


def set_deterministic(train_cfg) -> None:
  """train.deterministic: asks XLA for deterministic kernels; must run before JAX starts its backend."""
  if train_cfg.deterministic and DETERMINISTIC_XLA_FLAGS not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} {DETERMINISTIC_XLA_FLAGS}'.strip()


def reproducibility(train_cfg, platform: str) -> str:
  """Whether two runs (or a run and its resume) give the same bits on this platform, and why."""
  if platform != 'gpu':
    return f'yes ({platform}: XLA picks deterministic kernels here)'
  if train_cfg.deterministic or DETERMINISTIC_XLA_FLAGS in os.environ.get('XLA_FLAGS', ''):
    return f'yes (train.deterministic: {DETERMINISTIC_XLA_FLAGS})'
  return ('no: GPU reductions and atomics vary from run to run; set --config.train.deterministic=True '
          '(slower: bench/RESULTS.md) for bit-for-bit reruns and resumes')


def set_scalars(state: TrainState, program: Program, **values) -> TrainState:
  """Host-side change of scalar state fields, placed as the compiled step expects them."""
  placed = {k: jax.device_put(np.asarray(v, getattr(program.abstract_state, k).dtype),
                              getattr(program.state_shardings, k)) for k, v in values.items()}
  return state.replace(**placed)


def roll_back(rollback, guard, ckpt, program: Program, train_iter, stability_cfg, log, ramp) -> TrainState:
  """Restores the newest checkpoint before the first bad step and skips the data that led there."""
  ckpt.wait()
  state, _ = ckpt.restore(program.abstract_state, program.state_shardings, train_iter,
                          before=rollback.restore_before)
  if state is None:
    raise stability_lib.StabilityError(f'{rollback.reason}, but no checkpoint predates update '
                                       f'{rollback.restore_before}, which may have caused it. Fix: raise '
                                       f'checkpoint.keep or lower checkpoint.every.')
  to_step = int(state.step)
  # At least every batch the abandoned trajectory trained on, so no culprit is replayed.
  skip = max(guard.rolled_back(to_step), rollback.decided_at - to_step)
  abandoned = ckpt.delete_after(to_step)  # saved on the bad trajectory: must never be resumed from
  first_skipped = int(state.batches) + 1
  for i in range(skip):
    ramp.draw(train_iter, ramp.size(to_step + i))
  state = set_scalars(state, program, batches=int(state.batches) + skip)
  log.event(to_step, 'rollback',
            f'{rollback.reason}: restored checkpoint step {to_step} (before update {rollback.restore_before}, '
            f'the first that may have caused it), skipped batches {first_skipped}-'
            f'{first_skipped + skip - 1}, deleted checkpoints {abandoned} of the abandoned trajectory '
            f'(rollback {guard.rollbacks}/{stability_cfg.max_rollbacks})',
            to_step=to_step, first_bad_step=rollback.first_bad_step, skipped_batches=skip)
  return state


def abstract_batch(batch_size: int, seq_len: int, batch_sharding) -> dict:
  """Shapes of one global batch, for compiling the step ahead of time."""
  spec = lambda dtype: jax.ShapeDtypeStruct((batch_size, seq_len), dtype, sharding=batch_sharding)
  return dict(inputs=spec(jnp.int32), targets=spec(jnp.int32), segment_ids=spec(jnp.int32),
              positions=spec(jnp.int32), weights=spec(jnp.float32))


class BatchRamp:
  """Batch size per step under `train.batch_ramp` (a single stage when there is no ramp)."""

  def __init__(self, train_cfg, seq_len: int):
    stages = config_lib.batch_stages(train_cfg, seq_len)
    self.unit = stages[0][0]
    self.starts = []  # (first step, batch size, tokens before that step)
    step, tokens = 0, 0
    for size, until in stages:
      self.starts.append((step, size, tokens))
      if until != float('inf'):
        n = max(0, -(-(int(until) - tokens) // (size * seq_len)))  # steps until `until` tokens are reached
        step, tokens = step + n, tokens + n * size * seq_len
    self.seq_len = seq_len

  def _stage(self, step: int):
    return [s for s in self.starts if s[0] <= step][-1]

  def size(self, step: int) -> int:
    """Global batch size of the step after `step` steps are done."""
    return self._stage(step)[1]

  def tokens(self, steps: int) -> int:
    """Tokens trained on after `steps` steps."""
    first, size, tokens = self._stage(steps)
    return tokens + (steps - first) * size * self.seq_len

  def draw(self, it, size: int) -> dict:
    """One local batch of `size` (global) rows: size // unit consecutive draws from the iterator."""
    parts = [next(it) for _ in range(size // self.unit)]
    return parts[0] if len(parts) == 1 else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)  # libraries' INFO chatter drowns the progress lines; -v 0 shows it
  cfg = _CONFIG.value
  set_deterministic(cfg.train)
  try:
    distributed.initialize(cfg.dist)  # first of all JAX calls: joins the job's other processes, if any
    config_lib.validate(cfg, jax.device_count(), sharding.num_processes(), sharding.num_slices())
  except config_lib.ConfigError as e:
    print(f'jaxlm: {e}', file=sys.stderr)
    sys.exit(2)
  workdir = _WORKDIR.value or os.path.join('runs', cfg.name)
  try:
    run(cfg, workdir)
  except errors.JaxlmError as e:
    prefix = {errors.DataError: 'data error: ', errors.CheckpointError: 'checkpoint error: ',
              errors.StabilityError: 'training is unstable: '}.get(type(e), '')
    sys.stdout.flush()
    print(f'jaxlm: {prefix}{e}', file=sys.stderr, flush=True)
    sys.exit(e.exit_code)


if __name__ == '__main__':
  flags.mark_flag_as_required('config')
  app.run(main)
