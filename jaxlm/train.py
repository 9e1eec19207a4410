"""Train a model: `python -m jaxlm.train --config=configs/palm_small.py [--workdir=DIR] [--config.a.b=v]`.

Reads in the order a run goes: `start` (config report, mesh, program, data, compiled step, checkpointer),
`restore_or_init`, `loop` (`for step: batch -> train_step -> log / eval / save`), and a shutdown that always
runs, even when the run raises.
"""

if __name__ == '__main__':  # the command runs in a child its watcher waits for; start it before JAX loads (cli.py)
  from jaxlm import cli as _watch
  _watch.run_watched()

import contextlib
import dataclasses
import os
import signal
import sys
from typing import Any

from absl import flags
import jax
import numpy as np
from ml_collections import config_flags

from jaxlm import attention as attention_lib
from jaxlm import checkpoint as checkpoint_lib
from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.data import pipeline as data_lib
from jaxlm import distill as distill_lib
from jaxlm import distributed
from jaxlm import errors
from jaxlm import faults as faults_lib
from jaxlm import perf
from jaxlm import pipeline as pipeline_lib
from jaxlm import preference as preference_lib
from jaxlm import preflight
from jaxlm import metrics as metrics_lib
from jaxlm import mla as mla_lib
from jaxlm import lora as lora_lib
from jaxlm import model as model_lib
from jaxlm import moe as moe_lib
from jaxlm import rundir
from jaxlm.data import storage
from jaxlm import sharding
from jaxlm import stability as stability_lib
from jaxlm import step as step_lib
from jaxlm.step import abstract_batch, global_batch, evaluate  # noqa: F401  (the loop's vocabulary)

class DataSource:
  """The loop's batches from the training data (language modelling, SFT, preference pairs).

  A batch source is what differs between objectives (jaxlm/rl.py's `Rollouts` is the other): `iterator` is the
  position a checkpoint saves as its `data` item, `next` gives the global batch of a step and the host metrics it
  adds to the step's record, `skip` passes over batches after a rollback, `stability` names how the guard judges the
  run, and `begin` sees the state the loop starts from.
  """
  objective = None  # the step builder's default loss for train.objective (lm, preference)
  evaluates = True  # held-out loss at train.eval_every and at the end, on cfg.data's held-out split

  def __init__(self, iterator, ramp: config_lib.BatchRamp, faults: faults_lib.Faults, batch_sharding):
    self.iterator, self.ramp, self.faults, self.batch_sharding = iterator, ramp, faults, batch_sharding

  def next(self, state, step: int, size: int) -> tuple[dict, dict]:
    """The global batch of the step after `step` (a fault drill may poison it) and no host metrics."""
    number = int(state.batches) + 1  # batches drawn so far, skipped ones included, plus this one
    return global_batch(self.faults.batch(self.ramp.draw(self.iterator, size), number, step + 1),
                        self.batch_sharding), {}

  def skip(self, batches: int, step: int) -> None:
    """Draws and drops `batches` batches, the first for the step after `step`."""
    for i in range(batches):
      self.ramp.draw(self.iterator, self.ramp.size(step + i))

  @staticmethod
  def stability(cfg) -> tuple[Any, tuple[str, ...]]:
    """The guard's settings and the logged values it watches for spikes."""
    return cfg.stability, ('loss', 'grad_norm')

  def begin(self, r, state, resumed: bool) -> None:
    """Nothing to prepare: the data position came back with the checkpoint."""


@dataclasses.dataclass
class Run:
  """What start() sets up for the loop: one object, so the loop reads as a list of calls."""
  cfg: Any
  workdir: str
  mesh: jax.sharding.Mesh
  program: step_lib.Program
  log: metrics_lib.MetricsLogger
  acct: perf.TimeAccounting
  ramp: config_lib.BatchRamp
  source: Any  # DataSource, or rl.Rollouts
  eval_data: list | None  # None: this run does not evaluate (an RL run without train.eval_every)
  ckpt: checkpoint_lib.Checkpointer
  guard: stability_lib.Guard
  faults: faults_lib.Faults
  profiler: perf.Profiler
  slow: perf.SlowStepDetector
  env: dict
  gen: Any = None  # train.gen_eval's prompts and cached human side (jaxlm/textgen.py), when on
  harness: Any = None  # train.harness_tasks: lm-eval tasks checked at start-up, scored at evaluations (harness.py)
  compiled: dict = dataclasses.field(default_factory=dict)
  stop: list = dataclasses.field(default_factory=list)  # names of the stop signals received

  @property
  def train_iter(self):
    """The batch source's checkpointed position (the checkpoint's `data` item)."""
    return self.source.iterator

  def step_for(self, size: int):
    """The train step compiled ahead of time for this batch size (one per ramp stage)."""
    if (size, self.cfg.data.seq_len) in self.compiled:  # asked every step: no time bucket opened for a hit
      return self.compiled[size, self.cfg.data.seq_len]
    with self.acct.track('compile'):  # ahead of time, so no step time hides a compile
      return step_lib.compiled_step(self.program, self.compiled, size, self.cfg.data.seq_len)


def run(cfg, workdir: str, source=None, devices=None) -> dict:
  """Trains as `cfg` says, writing to `workdir`; returns the last logged metrics.

  source: where batches come from (default: cfg.data, as DataSource); devices: the mesh's (default: all).
  """
  with contextlib.ExitStack() as shutdown:
    r = start(cfg, workdir, shutdown, source, devices)
    state = restore_or_init(r)
    return loop(r, state)


def start(cfg, workdir: str, shutdown: contextlib.ExitStack, source=None, devices=None) -> Run:
  """Everything before the first step; each piece registers its own shutdown on `shutdown`."""
  acct = perf.TimeAccounting()  # wall time from process start: start-up counts against goodput
  t = cfg.train
  if t.get('harness_tasks'):  # before any device work: a task that cannot run offline fails now, not at step N
    from jaxlm import harness  # pylint: disable=g-import-not-at-top  # lm_eval: runs with harness tasks only
    harness.check_tasks(t.harness_tasks, t.harness_include_path or None)
  with acct.phase('devices, mesh'):  # the first JAX call starts the backend (CUDA, TPU runtime)
    cache = perf.enable_compilation_cache(cfg.log)  # asks the backend for its devices (CPU mesh: off)
    mesh = sharding.make_mesh(cfg.mesh, devices)
  primary = jax.process_index() == 0
  log = metrics_lib.MetricsLogger(workdir, cfg.log, total_steps=t.steps, is_primary=primary, config=cfg)
  shutdown.callback(_quietly, log.close)
  say = print if primary else (lambda *a, **k: None)  # the start-up report, from process 0 only
  with acct.track('compile'):  # model.remat=auto compiles its candidates ahead of time
    cfg = resolve_remat(cfg, mesh, say)
  report_setup(cfg, mesh, cache, say)
  with acct.phase('program'):
    program, compiled = build_program(cfg, mesh, source)
  report_program(program, cfg, mesh, say)
  ramp = config_lib.BatchRamp(t, cfg.data.seq_len)
  faults = faults_lib.Faults(cfg.faults, cfg.model.vocab_size, log.event)
  source, eval_data = open_data(cfg, program, ramp, faults, source, acct, shutdown)
  if t.get('objective') == 'distill' and not cfg.distill.cached:  # the frozen teacher adds its keys to each batch
    with acct.phase('teacher'):
      source = distill_lib.teacher_source(cfg, source, mesh, program,
                                          lambda rows: global_batch(rows, program.batch_sharding))
    say(source.teacher.describe())
  ckpt = checkpoint_lib.Checkpointer(rundir.path(workdir, rundir.CHECKPOINTS), cfg.checkpoint, log.event)
  shutdown.callback(_quietly, ckpt.close)
  profiler = perf.Profiler(cfg.log, workdir, is_primary=primary)
  shutdown.callback(_quietly, profiler.stop)
  shutdown.callback(distributed.disarm)
  stability, watch = source.stability(cfg)
  r = Run(cfg=cfg, workdir=workdir, mesh=mesh, program=program, log=log, acct=acct, ramp=ramp,
          source=source, eval_data=eval_data, ckpt=ckpt, compiled=compiled,
          guard=stability_lib.Guard(stability, log.event, log_every=t.log_every, watch=watch,
                                    ledger=rundir.path(workdir, rundir.ROLLBACKS), writes_ledger=primary),
          faults=faults, profiler=profiler,
          slow=perf.SlowStepDetector(cfg.log.slow_step_factor, cfg.log.slow_step_count),
          env=checkpoint_lib.environment(cfg, mesh))
  if t.get('gen_eval') and eval_data is not None:  # prompts cut once from the held-out batches; human side cached
    from jaxlm import textgen  # pylint: disable=g-import-not-at-top  # runs with gen_eval only
    r.gen = textgen.GenEval(t, eval_data, data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size),
                            program.model.config, seq_len=cfg.data.seq_len, mesh=mesh)
  if t.get('harness_tasks') and eval_data is not None:  # scored at evaluations (checked above)
    from jaxlm import harness  # pylint: disable=g-import-not-at-top
    r.harness = harness.InLoop(t, data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size), program.model.config,
                               seq_len=cfg.data.seq_len, mesh=mesh)
  # A checkpoint this config cannot resume is refused before the compile: seconds, not minutes on a large model.
  ckpt.refuse_misfit(program.abstract_state, program.state_shardings, r.env.get('optimizer'))
  compile_and_check(r, say)
  # Preemption: SIGTERM / SIGINT let the current step finish, then a checkpoint is written before exit.
  for sig in (signal.SIGTERM, signal.SIGINT):
    previous = signal.signal(sig, lambda signum, _: r.stop.append(signal.Signals(signum).name))
    shutdown.callback(signal.signal, sig, previous)
  return r


def report_setup(cfg, mesh, cache, say) -> None:
  """The resolved config, the mesh, reproducibility, the compilation cache, the attention kernel and experts."""
  say(f'config:\n{cfg}')
  say(f'mesh: {dict(mesh.shape)} on {mesh.size} {jax.devices()[0].device_kind} devices')
  say(f'bit-reproducible: {reproducibility(cfg.train, jax.devices()[0].platform)}')
  if cfg.log.compilation_cache:
    say(f'compilation cache: {cache or perf.CPU_MESH_CACHE_OFF}')
  m = cfg.model  # which attention kernel runs, and why (deterministic mode rules cuDNN's out on a GPU)
  say('attention: ' + (mla_lib.kernel_reason(m) or attention_lib.select(
      m.attention, dtype=m.dtype, head_dim=model_lib.head_dim(m), seq_len=cfg.data.seq_len,
      context=mesh.shape.get('context', 1))[1]))
  if experts := moe_lib.describe(moe_lib.MoeConfig.from_config(m), mesh):  # expert parallelism: transport, buffers
    say(experts)


def build_program(cfg, mesh, source) -> tuple[step_lib.Program, dict]:
  """The program for the source's objective (RL's policy loss, else cfg's), and the train steps already compiled
  for it by an earlier run of the same program in this process ({(batch size, seq len): step}; step.cached_program)."""
  return step_lib.cached_program(cfg, mesh, objective=getattr(source, 'objective', None))


def report_program(program: step_lib.Program, cfg, mesh, say) -> None:
  """The parameter table (LoRA and pipeline layouts too); fails if parameters are not sharded as asked."""
  m = program.model.config
  active = model_lib.param_count(m, active=True)  # a mixture of experts: what MFU counts
  say(f'parameters ({model_lib.param_count(m):,}'
      + (f'; {active:,} active per token, which MFU counts' if m.moe.experts else '') + '):\n'
      + sharding.param_table(program.abstract_state.params, program.state_shardings.params))
  if m.lora.rank:  # LoRA: what trains and what stays frozen, per device
    say(lora_report(program))
  sharding.check_sharded(program.abstract_state.params, program.state_shardings.params, mesh)
  if program.model.pipeline is not None:  # which layers on which stage, the schedule and its bubble
    say(pipeline_lib.describe(program.model.pipeline, cfg.model.num_layers))
    held = sharding.bytes_per_device(program.abstract_state.params, program.state_shardings.params)
    say(f'parameters per device: {perf.format_bytes(held)}')


def open_data(cfg, program, ramp, faults, source, acct, shutdown) -> tuple[Any, list | None]:
  """(the batch source, the held-out batches or None): cfg.data's unless a source is given.

  Data before compiling: a bad dataset fails in seconds, not after a long compile. The iterator yields ramp units
  (the first stage's size); a step draws size // unit of them, so its position stays exact.
  """
  t, vocab = cfg.train, cfg.model.vocab_size
  cached = preference_lib.reads_cached(t, cfg.preference)
  if cached:  # the batches carry the reference's log-probabilities: theirs, or refused
    for path in cfg.data.paths.split(','):
      preference_lib.check_cached(path.strip(), cfg.checkpoint.init_from)
  share, shares = sharding.row_share(program.batch_sharding)  # which rows this process reads
  if source is None:
    with acct.phase('data'):
      train_iter = data_lib.make_train_iterator(cfg.data, batch_size=ramp.unit, seed=t.seed, vocab_size=vocab,
                                                process_index=share, process_count=shares,
                                                reference_logps=cached, teacher_cache=distill_lib.cached(cfg))
    if hasattr(train_iter, 'close'):
      shutdown.callback(_quietly, train_iter.close)  # stops Grain's worker processes (data.num_workers > 0)
    source = DataSource(train_iter, ramp, faults, program.batch_sharding)
  if not (source.evaluates or t.eval_every):  # an RL run evaluates on held-out text only when asked to
    return source, None
  with acct.phase('eval data'):
    return source, data_lib.eval_batches(cfg.data, batch_size=t.batch_size, num_batches=t.eval_batches,
                                         vocab_size=vocab, process_index=share, process_count=shares,
                                         reference_logps=cached)


def compile_and_check(r: Run, say) -> None:
  """Compiles the first stage's train step, reports its memory, and refuses (exit 2, the numbers and the cheapest
  fix) a step that would not fit rather than die out of memory in it."""
  t = r.cfg.train
  with r.acct.phase('compile train step'):
    memory = perf.compiled_memory(r.step_for(t.batch_size))
  say(f'compiled the train step in {r.acct.last_s:.1f}s; per device: {perf.format_memory(memory)}')
  r.log.write(0, {**memory, **perf.device_memory_stats(), 'compile_s': r.acct.last_s}, kind='system')
  with r.acct.phase('pre-flight'):
    preflight.check(r.cfg, r.step_for(t.batch_size), r.mesh.local_devices)


def lora_report(program: step_lib.Program) -> str:
  """Trainable (adapters) and frozen (base) parameters and bytes per device, under model.lora."""
  abstract, shardings = program.abstract_state.params, program.state_shardings.params
  base, adapters = lora_lib.split_adapters(abstract)
  base_s, adapters_s = lora_lib.split_adapters(shardings)
  count = lambda tree: sum(x.size for x in jax.tree.leaves(tree))
  held = lambda tree, s: perf.format_bytes(sharding.bytes_per_device(tree, s))
  lo = program.model.config.lora
  note = '; MoE experts get no adapters' if program.model.config.moe.experts else ''
  return (f'LoRA rank {lo.rank}, alpha {lo.alpha:g} on {", ".join(lo.targets)}{note}:\n'
          f'  trainable {count(adapters):,} parameters, {held(adapters, adapters_s)} per device (+ optimizer state)\n'
          f'  frozen    {count(base):,} parameters, {held(base, base_s)} per device ({lo.base_dtype}, no gradient '
          f'or optimizer state)')


def resolve_remat(cfg, mesh, say):
  """cfg with model.remat=auto replaced by the policy preflight.choose_remat picks (compiles, allocates nothing).

  The chosen policy is in the printed config and in every checkpoint's saved config.
  """
  if cfg.model.remat != preflight.REMAT_AUTO:
    return cfg
  policy, why = preflight.choose_remat(cfg, mesh)
  say(f'INFO model.remat=auto chose {policy}: {why}')
  cfg = cfg.copy_and_resolve_references()
  cfg.model.remat = policy
  return cfg


def restore_or_init(r: Run) -> step_lib.TrainState:
  """The newest intact checkpoint (with its data position and guard state), else a fresh or warm start."""
  program, t = r.program, r.cfg.train
  topology = {'processes': jax.process_count(), 'devices_per_process': jax.local_device_count(),
              'mesh': dict(r.mesh.shape)}
  if hasattr(r.train_iter, 'expect'):  # saved with the data position; a resume checks them (data/pipeline.py)
    r.train_iter.expect(allow_change=r.cfg.checkpoint.allow_data_change, topology=topology,
                        **{'train.batch_size': t.batch_size, 'train.batch_ramp': t.batch_ramp})
  with r.acct.track('checkpoint'), r.acct.phase('restore'):
    state, guard_state = r.ckpt.restore(program.abstract_state, program.state_shardings, r.train_iter,
                                        identity=r.env.get('optimizer'))
  if state is not None:
    r.guard.load(guard_state)
    start = int(state.step)
    report_data_resume(r, start, topology)
    logged = [x['step'] for x in rundir.read_metrics(r.workdir) if x.get('kind') == 'train']
    redone = max(logged + [start]) - start  # steps the killed process had done past the checkpoint
    r.acct.redo_steps(redone)
    r.log.event(start, 'resumed', f'resumed from checkpoint step {start} in {r.ckpt.directory}; '
                f'{redone} logged steps after it will be redone', redo_steps=redone)
    r.source.begin(r, state, resumed=True)
    return state
  r.guard.reset_ledger()
  state = initial_state(r)
  r.source.begin(r, state, resumed=False)
  return state


def initial_state(r: Run, say: bool = True) -> step_lib.TrainState:
  """A fresh state, its parameters from checkpoint.init_from when set (a warm start: fresh optimizer, step 0)."""
  program = r.program
  with r.acct.phase('init'):
    state = jax.block_until_ready(program.init())  # waited for, so its device time is not the first step's
  if init_from := r.cfg.checkpoint.init_from:
    params = checkpoint_lib.load_params(init_from, program.abstract_state.params, program.state_shardings.params,
                                        fill=state.params)
    state = state.replace(params=params)
    if program.copy_reference is not None:  # preference.reference=copy: the weights training starts from
      state = state.replace(reference=program.copy_reference(params))
    if say and jax.process_index() == 0:
      print(f'warm start: parameters from {init_from}, fresh optimizer at step 0')
  return state


def report_data_resume(r: Run, step: int, topology: dict) -> None:
  """Says what changed since the checkpoint (processes, devices, mesh) and where the data stream continues."""
  saved = (getattr(r.train_iter, 'restored', None) or {})
  was = saved.get('topology', {})
  changed = [f'{k} {was[k]} -> {v}' for k, v in topology.items() if k in was and was[k] != v]
  if 'rows' in saved:
    r.log.event(step, 'data_resumed', f'data position carried over: global row {r.train_iter.rows:,} '
                f'(token {r.train_iter.rows * r.cfg.data.seq_len:,})'
                + (f'; topology changed since the checkpoint: {", ".join(changed)}' if changed else ''),
                rows=r.train_iter.rows)
  for note in getattr(r.train_iter, 'notes', []):
    r.log.event(step, 'data_change', f'checkpoint.allow_data_change: {note}')


def loop(r: Run, state: step_lib.TrainState) -> dict:
  """`for step: batch -> train_step -> log / eval / save` until train.steps, a stop signal or an error."""
  t, acct = r.cfg.train, r.acct
  window = Window()
  last, metrics, step = {}, None, int(state.step)
  if jax.process_index() == 0:
    print(acct.startup_report(), flush=True)
  eta = perf.Eta(t.steps, save_every=r.cfg.checkpoint.every, eval_every=t.eval_every, eval_batches=t.eval_batches)
  eta.begin(step, acct.summary())
  while step < t.steps:
    r.profiler.step(step, block_on=metrics)
    size = r.ramp.size(step)
    with acct.track('data'):  # an RL rollout's sampling counts in its own bucket, inside this one
      batch, host = r.source.next(state, step, size)
    window.add(acct.last_s)
    state = set_lr_scale(r, state, int(state.batches) + 1, step)
    with acct.track('step'):
      state, metrics = r.step_for(size)(state, batch)
      jax.block_until_ready(metrics)  # step time is device time; the next batch is already prefetched
    step += 1
    window.add(acct.last_s, tokens=host.pop('step_tokens', size * r.cfg.data.seq_len))
    distributed.beat(step)  # the hung-peer watchdog
    if message := r.slow.update(step, acct.last_s):
      r.log.event(step, 'slow_step', message)
    if step % t.log_every == 0 or step == t.steps:
      last = log_step(r, step, metrics, window, size, eta, host)
      if rollback := r.guard.observe(step, last):
        with acct.track('checkpoint'):
          state = roll_back(r, rollback)
        acct.redo_steps(step - int(state.step))
        step = int(state.step)
        continue
    if r.eval_data is not None and ((t.eval_every and step % t.eval_every == 0) or step == t.steps):
      last['eval_loss'] = evaluate_and_log(r, step, state)
    stopping = distributed.any_process(bool(r.stop))  # a signal to any process stops all after the same step
    with acct.track('checkpoint'):
      r.ckpt.on_step(step, t.steps, state, r.train_iter, r.env, r.guard.state(), stopping=stopping)
    if stopping:
      log_preempted(r, step)
      break
  return shut_down(r, state, metrics, last)


def shut_down(r: Run, state, metrics, last: dict) -> dict:
  """The final save reaching storage, the last system record and the time table; a final save that failed
  ends the run with exit 3 here, never a quiet 0."""
  distributed.disarm()  # the final save may take longer than a step
  r.profiler.stop(block_on=metrics)
  with r.acct.track('final_save'):  # the last save reaching the disk (and its checksums): apart from the saves above
    r.ckpt.close()
  r.log.write(int(state.step), {**r.acct.summary(), **r.ckpt.stats()}, kind='system')
  if jax.process_index() == 0:
    print(r.acct.table(), flush=True)
  if error := r.ckpt.unsaved_error():  # the final (or preemption) save failed: the newest weights are lost
    raise error
  return last


class Window:
  """Wall time and tokens since the last logged record (data loading counts: it is part of a step's cost)."""

  def __init__(self):
    self.seconds, self.steps, self.tokens = 0.0, 0, 0

  def add(self, seconds: float, tokens: int = 0) -> None:
    """Adds data-loading time (no tokens), or a finished step's time and tokens."""
    self.seconds += seconds
    self.steps += 1 if tokens else 0
    self.tokens += tokens

  def take(self) -> tuple[float, int, int]:
    taken = self.seconds, self.steps, self.tokens
    self.seconds, self.steps, self.tokens = 0.0, 0, 0
    return taken


def log_step(r: Run, step: int, metrics: dict, window: Window, size: int, eta: perf.Eta | None = None,
             host: dict | None = None) -> dict:
  """One train record: the step's metrics (and the source's host metrics: an RL step's rewards), throughput and MFU
  over the window since the last record, and the ETA."""
  seconds, steps, tokens = window.take()
  m, seq_len = r.program.model.config, r.cfg.data.seq_len
  tokens_per_s = tokens / seconds
  kind, devices = jax.devices()[0].device_kind, r.mesh.size
  values = {k: float(v) for k, v in jax.device_get(metrics).items()}
  values.update(host or {})
  values.update(tokens_per_s=tokens_per_s, step_time_s=seconds / steps, tokens=r.ramp.tokens(step),
                batch_size=size,
                mfu=perf.mfu(tokens_per_s, model_lib.flops_per_token(m, seq_len), devices, kind),
                mfu_causal=perf.mfu(tokens_per_s, model_lib.flops_per_token(m, seq_len, causal=True),
                                           devices, kind))
  if eta is not None:  # the final save's wait: priced at the last save's write time
    written = [x['write_s'] for x in r.ckpt.timings if 'write_s' in x]
    values['eta_s'] = eta(step, r.acct.summary(), final_save_s=written[-1] if written else None)
  if r.cfg.train.get('epochs') and hasattr(r.train_iter, 'epoch'):  # train.epochs: where in the passes we are
    values['epoch'] = r.train_iter.epoch()
  if r.program.model.pipeline is not None:  # the idle share of each stage; MFU above counts model FLOPs only
    values['bubble'] = r.program.model.pipeline.bubble
  if m.matmul_dtype == 'fp8':  # MFU is against the bf16 peak: fp8 runs compare in tokens/s and model FLOP/s only
    values.update(mfu=None, mfu_causal=None)
  r.log.write(step, values)
  return values


def evaluate_and_log(r: Run, step: int, state) -> float:
  """Held-out loss on the same batches every time, greedy samples of train.sample_prompts, and a system record.

  With optim.ema the averaged weights are scored too (`eval_loss_ema`); under sf_adamw the raw loss (and the
  samples) are those of schedule-free's averaged point, the weights it is meant to be evaluated at.
  """
  with r.acct.track('eval'):  # samples count as evaluation time in goodput
    params = step_lib.eval_params(state, r.program.model.config)
    if r.program.preference_eval_step is not None:  # held-out pairs: TRL's rewards/* and logps/*
      record = step_lib.evaluate_preference(r.program, params, state.reference, r.eval_data)
      loss = record['eval_loss']
    else:
      loss = evaluate(r.program, params, r.eval_data)
      record = {'eval_loss': loss}
    if state.ema:  # the same loss as eval_loss, of the averaged model
      ema = step_lib.ema_params(state, r.program.model.config)
      record['eval_loss_ema'] = (evaluate(r.program, ema, r.eval_data) if r.program.preference_eval_step is None
                                 else step_lib.evaluate_preference(r.program, ema, state.reference,
                                                                   r.eval_data)['eval_loss'])
    if r.harness is not None and r.harness.due(step, r.cfg.train.steps):  # harness/<task>/<metric>[_ema]
      record.update(r.harness(params))
      if state.ema:
        record.update(r.harness(step_lib.ema_params(state, r.program.model.config), '_ema'))
    texts = sample_prompts(r, params)
    gen = r.gen(params) if r.gen is not None and r.gen.due(step, r.cfg.train.eval_every, r.cfg.train.steps) \
        else None
  r.log.write(step, record, kind='eval')
  if gen is not None:  # gen records (metrics.jsonl, TensorBoard as gen/*) and a few samples beside the human text
    r.log.write(step, gen[0], kind='gen')
    for s in gen[1]:
      r.log.event(step, 'gen_sample', f'{s["prompt"]!r} -> {s["completion"]!r} (human: {s["human"]!r})', **s)
  for prompt, text in zip(r.cfg.train.sample_prompts, texts):  # one `sample` event per prompt
    r.log.event(step, 'sample', f'greedy: {prompt!r} -> {text!r}', prompt=prompt, completion=text)
  r.log.write(step, {**r.acct.summary(), **perf.device_memory_stats()}, kind='system')
  return loss


def sample_prompts(r: Run, params) -> list[str]:
  """Greedy continuations of train.sample_prompts (jaxlm/generate.py); [] when there are none."""
  t = r.cfg.train
  if not t.get('sample_prompts'):
    return []
  from jaxlm import generate as generate_lib  # pylint: disable=g-import-not-at-top  # runs that sample only
  tokenizer = data_lib.load_tokenizer(r.cfg.data, r.cfg.model.vocab_size)
  return generate_lib.sample_texts(r.program.model.config, params, list(t.sample_prompts), tokenizer,
                                   max_new_tokens=t.sample_tokens, max_len=r.cfg.data.seq_len, mesh=r.mesh)


def log_preempted(r: Run, step: int) -> None:
  saved = 'saved' if r.ckpt.last_good == step else 'NOT saved'
  r.log.event(step, 'preempted', f'{r.stop[0] if r.stop else "a stop signal to another process"} received: '
              f'stopped after step {step}, checkpoint {saved}; run the same command to resume.')


def set_lr_scale(r: Run, state, number: int, step: int):
  """The update multiplier for this step: a fault drill's, the post-rollback factor, or 1."""
  drill = r.faults.lr_scale(number)  # a factor of 0 is a drill too (updates multiplied by 0)
  lr_scale = drill if drill is not None else r.guard.lr_scale(step)
  if lr_scale == float(state.lr_scale):
    return state
  r.log.event(step + 1, 'lr_scale', f'learning rate multiplied by {lr_scale:g} from step {step + 1}'
              if lr_scale != 1.0 else f'learning rate back on its schedule from step {step + 1}',
              lr_scale=lr_scale)
  return set_scalars(state, r.program, lr_scale=lr_scale)


def set_scalars(state, program: step_lib.Program, **values):
  """Host-side change of scalar state fields, placed as the compiled step expects them."""
  placed = {k: jax.device_put(np.asarray(v, getattr(program.abstract_state, k).dtype),
                              getattr(program.state_shardings, k)) for k, v in values.items()}
  return state.replace(**placed)


def roll_back(r: Run, rollback: stability_lib.Rollback):
  """Restores the newest checkpoint before the update that may have caused the trouble; skips its data."""
  r.ckpt.wait()
  program = r.program
  state, _ = r.ckpt.restore(program.abstract_state, program.state_shardings, r.train_iter,
                            before=rollback.restore_before)
  if state is None:
    raise stability_lib.StabilityError(f'{rollback.reason}, but no checkpoint predates update '
                                       f'{rollback.restore_before}, which may have caused it; raise '
                                       f'checkpoint.keep or lower checkpoint.every.')
  to_step = int(state.step)
  # At least every batch the abandoned trajectory trained on, so no culprit is replayed.
  skip = max(r.guard.rolled_back(to_step), rollback.decided_at - to_step)
  abandoned = r.ckpt.delete_after(to_step)  # saved on the bad trajectory: must never be resumed from
  first_skipped = int(state.batches) + 1
  r.source.skip(skip, to_step)
  state = set_scalars(state, program, batches=int(state.batches) + skip)
  r.log.event(to_step, 'rollback',
              f'{rollback.reason}: restored checkpoint step {to_step} (before update {rollback.restore_before}, '
              f'the first that may have caused it), skipped batches {first_skipped}-{first_skipped + skip - 1}, '
              f'deleted checkpoints {abandoned} of the abandoned trajectory '
              f'(rollback {r.guard.rollbacks}/{r.cfg.stability.max_rollbacks})',
              to_step=to_step, first_bad_step=rollback.first_bad_step, skipped_batches=skip)
  return state


DETERMINISTIC_XLA_FLAGS = attention_lib.DETERMINISTIC_XLA_FLAGS  # attention.py chooses its kernel by it


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


def _quietly(close, *args) -> None:
  """Shutdown must not mask the error that ended the run (the writers may be what failed)."""
  try:
    close(*args)
  except Exception:  # pylint: disable=broad-except
    pass


def define_flags() -> None:
  """The command's flags (only when run as a command: importing the trainer defines none)."""
  config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/palm_small.py.', lock_config=True)
  flags.DEFINE_string('workdir', None, 'Run directory (checkpoints, metrics). Default: runs/<name>.')


def main(argv):
  del argv
  cfg = flags.FLAGS.config
  set_deterministic(cfg.train)
  distributed.initialize(cfg.dist)  # first of all JAX calls: joins the job's other processes, if any
  if cfg.train.get('epochs'):  # train.steps follows from the dataset's size (data/pipeline.py)
    cfg = cfg.copy_and_resolve_references()
    cfg.train.steps, rows = data_lib.steps_for_epochs(cfg.data, cfg.train, cfg.model.vocab_size)
    if jax.process_index() == 0:
      print(f'train.epochs={cfg.train.epochs}: {rows:,} rows of {cfg.data.seq_len} tokens per epoch, batch '
            f'{cfg.train.batch_size} -> train.steps={cfg.train.steps}', flush=True)
  config_lib.validate(cfg, jax.device_count(), sharding.num_processes(), sharding.num_slices())
  run(cfg, make_workdir(flags.FLAGS.workdir, cfg))


def make_workdir(flag: str | None, cfg) -> str:
  """--workdir (default runs/<name>), created; a bucket is checked first (endpoint, credentials, bucket)."""
  workdir = flag or os.path.join('runs', cfg.name)
  if storage.is_url(workdir):
    workdir = storage.normalize(workdir)
    storage.check(workdir)  # a wrong endpoint, missing credentials or bucket: one line, exit 3, in seconds
    if problem := storage.checkpoints_unsupported(workdir):
      raise errors.ConfigError(problem)
  try:
    storage.makedirs(workdir)
  except OSError as e:
    raise metrics_lib.storage_error(workdir, e) from e
  return workdir


def console() -> None:
  """The command line (also the console script in pyproject.toml), in a child that a watcher process waits for."""
  workdir = next((a.split('=', 1)[1] for a in sys.argv[1:] if a.startswith('--workdir=')), None)
  if workdir and not os.environ.get(cli.WATCHED):
    try:  # a bucket's endpoint that cannot be reached: said before the trainer starts (main checks the rest)
      storage.check_endpoint(workdir)
    except errors.JaxlmError as e:
      cli.fail(e)
  cli.run_watched()
  cli.run(main, define=define_flags, required=('config',))


if __name__ == '__main__':
  console()
