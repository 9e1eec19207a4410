"""Knowledge distillation: a frozen teacher's next-token distribution as the student's target.

The loss is GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, "On-Policy Distillation of Language
Models", Eq. 1) as TRL's GKDTrainer.generalized_jsd_loss computes it, per token over the vocabulary, with s the
student's and t the teacher's log-probabilities of logits / temperature and m the mixture:
  beta = 0   KL(t ‖ s)                        forward KL, TRL's F.kl_div(s, t)
  beta = 1   KL(s ‖ t)                        reverse KL
  between    beta·KL(t ‖ m) + (1-beta)·KL(s ‖ m),  m = beta·t + (1-beta)·s
Each token's divergence is weighted by the batch's loss weights (an SFT run's assistant-only masks) and divided by
the whole batch's weight sum, as the LM loss is: with 0/1 weights that is TRL's 'batchmean' over tokens whose label
is not -100. `alpha` mixes in the hard-label cross-entropy: (1 - alpha)·divergence + alpha·CE.

The teacher's side reaches the loss as batch keys (`batch_keys`), so the step never holds the teacher: the
teacher is a second, frozen parameter tree (no gradient, no optimizer state, never checkpointed: a resume reloads
it, and its forward is deterministic, so the batches it feeds are the same bits) run by its own jitted call
(`Teacher`) on each batch before the train step. Why not inside the step: the step's signature and its
checkpointed TrainState stay those of every objective, and a batch whose teacher keys come from a cache would
take the same path into the same loss. The cost: a whole batch's teacher log-probabilities are held at once
(B·T·V floats with the full vocabulary, B·T·(2K+1) with top_k=K), not one microbatch's.

top_k = K > 0 keeps the teacher's K most likely tokens and one more category for the mass left over: the student
is compared on the same K + 1 categories (its log-probabilities of the K ids, and the log of its remaining mass).
With K = V there is nothing left over and the loss is the full-vocabulary one.

The teacher's keys come from one of three places: the teacher's forward on the data's batches (`Teacher`,
`TeacherSource`), a cache jaxlm.tools.teacher wrote beside chat data (distill.cached: the data pipeline reads them
into the rows, the teacher is never loaded), or the teacher's forward on completions the student sampled
(distill.on_policy, GKD's on-policy mix: `OnPolicy`).
"""

import dataclasses
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import model as model_lib
from jaxlm import rundir
from jaxlm import sharding
from jaxlm.data import storage

TEACHER_DTYPES = ('float32', 'bfloat16')  # distill.teacher_dtype
# A log-probability floor for the teacher's leftover mass: a category of mass 0 would make the reverse KL infinite.
_LOG_FLOOR = float(np.log(np.finfo(np.float32).tiny))


def generalized_jsd(student_logps, teacher_logps, beta: float):
  """Per-position generalized JSD (summed over the last axis) of two log-probability arrays (..., N)."""
  s, t = student_logps, teacher_logps
  kl = lambda p, q: jnp.sum(jnp.exp(p) * (p - q), axis=-1)  # noqa: E731  KL(p ‖ q) from log-probabilities
  if beta == 0:
    return kl(t, s)
  if beta == 1:
    return kl(s, t)
  mixture = jnp.logaddexp(s + np.log1p(-beta), t + np.log(beta))  # log(beta·t + (1-beta)·s)
  return beta * kl(t, mixture) + (1 - beta) * kl(s, mixture)


def _rest(logps, ids):
  """log of the mass outside `ids` (..., K) of log-probabilities (..., V): a logsumexp over the other tokens."""
  inside = jnp.put_along_axis(jnp.zeros(logps.shape, bool), ids, True, axis=-1, inplace=False)
  return jax.nn.logsumexp(jnp.where(inside, -jnp.inf, logps), axis=-1)


def teacher_targets(teacher_logits, temperature: float, top_k: int) -> dict:
  """The batch keys a teacher's logits (B, T, V) give the loss: its log-probabilities at `temperature`, all of
  them, or (top_k = K) the K largest with their ids and the log of the mass left over."""
  logps = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)  # (B, T, V)
  if not top_k:
    return {'teacher_logps': logps}
  top, ids = jax.lax.top_k(logps, top_k)  # (B, T, K)
  rest = _rest(logps, ids) if top_k < logps.shape[-1] else jnp.full(logps.shape[:-1], -jnp.inf)
  return {'teacher_ids': ids.astype(jnp.int32), 'teacher_logps': top,
          'teacher_rest': jnp.maximum(rest, _LOG_FLOOR)}


def batch_keys(top_k: int, vocab_size: int) -> tuple:
  """The teacher's batch keys for Program.batch_extra: ((name, dtype, trailing shape), ...)."""
  if not top_k:
    return (('teacher_logps', jnp.float32, (vocab_size,)),)
  return (('teacher_ids', jnp.int32, (top_k,)), ('teacher_logps', jnp.float32, (top_k,)),
          ('teacher_rest', jnp.float32, ()))


def token_divergence(student_logits, batch: dict, beta: float, temperature: float):
  """(B, T) generalized JSD between the student's logits / temperature and the batch's teacher keys."""
  s = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)  # (B, T, V)
  t = jax.lax.stop_gradient(batch['teacher_logps'])  # (B, T, V) or (B, T, K)
  if 'teacher_ids' in batch:
    ids = batch['teacher_ids']
    if ids.shape[-1] < s.shape[-1]:  # K + 1 categories: the K ids and the rest
      t = jnp.concatenate([t, jax.lax.stop_gradient(batch['teacher_rest'])[..., None]], axis=-1)
      s = jnp.concatenate([jnp.take_along_axis(s, ids, axis=-1), _rest(s, ids)[..., None]], axis=-1)
    else:  # K = V: the whole vocabulary in the teacher's order
      s = jnp.take_along_axis(s, ids, axis=-1)
  return generalized_jsd(s, t, beta)


@dataclasses.dataclass(frozen=True)
class DistillObjective:
  """The distillation loss the step builder plugs in (train.objective=distill), from the `distill` section."""
  beta: float = 0.5
  temperature: float = 1.0
  alpha: float = 0.0
  top_k: int = 0
  z_loss: float = 0.0  # model.z_loss: PaLM's normaliser penalty, as in the LM loss

  @classmethod
  def from_config(cls, d, z_loss: float = 0.0) -> 'DistillObjective':
    return cls(beta=float(d.beta), temperature=float(d.temperature), alpha=float(d.alpha), top_k=int(d.top_k),
               z_loss=z_loss)

  def loss(self, logits, batch: dict, denominator):
    """(the weighted loss over `batch` / denominator, metrics that add over microbatches) for logits (B, T, V)."""
    w = batch['weights']
    ce, aux = model_lib.loss_fn(logits, batch['targets'], w, self.z_loss, denominator)
    divergence = (token_divergence(logits, batch, self.beta, self.temperature) * w).sum() / denominator
    total = (1 - self.alpha) * divergence + self.alpha * aux['loss'] + aux['z_loss']
    return total, dict(aux, loss=total, ce=aux['loss'], divergence=divergence)


# ------------------------------------------------------------------------------------------ the frozen teacher


def teacher_step_dir(path: str) -> str:
  """The step directory distill.teacher names: a run directory (its newest checkpoint), a checkpoints directory
  or one step directory."""
  if storage.isdir(rundir.path(path, rundir.CHECKPOINTS)):
    return rundir.step_dir(path)
  return checkpoint_lib.step_dir_of(path)


def tokenizer_identity(cfg, workdir: str | None = None) -> str | None:
  """What names a run's tokenizer: the sha256 of the tokenizer files beside an import, of data.tokenizer (stream)
  or in its prepared data's metadata.json; the stdlib corpus's tokenizer by its size, cap and split (what its
  prepared directory is named by: data/prepare.py, stdlib_dataset); None when it cannot be read."""
  import json  # pylint: disable=import-outside-toplevel
  from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  d = cfg.data
  try:
    for name in ('tokenizer.json', 'tokenizer.model'):
      if workdir and os.path.isfile(os.path.join(os.path.expanduser(workdir), name)):
        return tokenizer_lib.file_sha256(os.path.join(os.path.expanduser(workdir), name))
    if d.source == 'stream':
      return tokenizer_lib.file_sha256(tokenizer_lib.main_file(os.path.expanduser(d.tokenizer)))
    if d.source == 'prepared':
      with open(os.path.join(os.path.expanduser(d.paths.split(',')[0].strip()), 'metadata.json')) as f:
        return json.load(f)['tokenizer_sha256']
    # Trained on the corpus sample the cap and the held-out split leave: two caps, two tokenizers of one size.
    return (f'the stdlib corpus tokenizer of {cfg.model.vocab_size} entries (data.stdlib_max_mb='
            f'{d.stdlib_max_mb:g}, data.eval_fraction={d.eval_fraction:g})')
  except (OSError, ValueError, KeyError, AttributeError):
    return None


class Teacher:
  """The frozen teacher on the run's mesh: its parameters sharded by the rules table (optionally bfloat16) and a
  jitted call from a batch to the loss's teacher keys."""

  def __init__(self, d, mesh, batch_sharding):
    self.step_dir = teacher_step_dir(d.teacher)
    cfg = rundir.read_config(self.step_dir)
    m = model_lib.inference_config(model_lib.ModelConfig.from_config(cfg.model))
    model = model_lib.Decoder(m)
    with sharding.activate(mesh):
      shape = (1, 8 * sharding.context_size(mesh))  # shapes only, as step.py traces the student

      def init():
        tokens = jnp.zeros(shape, jnp.int32)
        return model.init({'params': jax.random.PRNGKey(0)}, tokens, tokens + 1, tokens)

      boxed = jax.eval_shape(init)
      self.shardings = sharding.logical_to_mesh(nn.get_partition_spec(boxed['params']), mesh)
    # Stored as asked (bfloat16 halves it); computed as the teacher's own model.dtype says.
    self.abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, d.teacher_dtype),
                                 jax.eval_shape(nn.unbox, boxed['params']))
    self.params = checkpoint_lib.load_params(self.step_dir, self.abstract, self.shardings)
    self.mesh, self.config, self.dtype = mesh, m, d.teacher_dtype
    temperature, top_k = float(d.temperature), int(d.top_k)

    def targets(params, batch):
      logits = model.apply({'params': params}, batch['inputs'], batch['segment_ids'], batch['positions'])
      return teacher_targets(logits, temperature, top_k)

    self._targets = jax.jit(targets, in_shardings=(self.shardings, batch_sharding), out_shardings=batch_sharding)

  def describe(self) -> str:
    """The start-up report's teacher line: where it is from, its size and what one device holds of it."""
    from jaxlm import perf  # pylint: disable=import-outside-toplevel
    count = sum(x.size for x in jax.tree.leaves(self.abstract))
    held = sharding.bytes_per_device(self.abstract, self.shardings)
    return (f'teacher {self.step_dir}: {count:,} parameters ({self.dtype}, frozen: no gradient or optimizer state, '
            f'not checkpointed), {perf.format_bytes(held)} per device')

  def __call__(self, batch: dict) -> dict:
    """`batch` with the teacher's keys added (no gradient ever reaches them: the step sees constants)."""
    with sharding.activate(self.mesh):
      return dict(batch, **self._targets(self.params, batch))


class TeacherSource:
  """A batch source whose batches carry the teacher's keys: the inner source (train.DataSource) does the rest.

  With `on_policy` (distill.on_policy = λ > 0, GKD's on-policy mix), a step drawn with probability λ replaces its
  rows' completions by the student's own samples before the teacher scores them.
  """

  def __init__(self, inner, teacher: Teacher, on_policy: 'OnPolicy | None' = None):
    self.inner, self.teacher, self.on_policy = inner, teacher, on_policy

  def __getattr__(self, name):  # iterator, skip, stability, begin, evaluates, objective: the inner source's
    return getattr(self.inner, name)

  def next(self, state, step: int, size: int) -> tuple[dict, dict]:
    """The inner source's global batch of the step after `step`, with the teacher's keys."""
    batch, host = self.inner.next(state, step, size)
    if self.on_policy is not None and self.on_policy.due(step):
      batch = self.on_policy(state.params, batch, step)
      host = dict(host, on_policy=1.0)
    return self.teacher(batch), host


def teacher_source(cfg, inner, mesh, program, to_global) -> TeacherSource:
  """The run's batch source under train.objective=distill (an online teacher): `inner`'s batches with the teacher's
  keys, on the student's samples on a distill.on_policy share of steps (stop ids from the data's tokenizer)."""
  d = cfg.distill
  on_policy = None
  if d.get('on_policy'):
    from jaxlm.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
    stops = getattr(data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size), 'stop_ids', None) or []
    on_policy = OnPolicy(d, cfg.train, program.model.config, mesh, cfg.data.seq_len, stops, to_global,
                         sharding.row_share(program.batch_sharding))
  return TeacherSource(inner, Teacher(d, mesh, program.batch_sharding), on_policy)


class OnPolicy:
  """GKD's on-policy batches: each row's prompt (its first conversation up to the first weighted target) continued
  by the student's sampler at distill.temperature; only the sampled tokens are weighted.

  Whether step s samples is a function of (train.seed, s), and so is its sampling seed: a resumed run draws the
  same batches. Multi-process as RL is (rl.Rollouts): every process gathers the whole global batch, samples
  every row alike (the same prompts, seed and parameters) and gives the step its own share of the rows.
  """

  def __init__(self, d, train_cfg, model_cfg, mesh, seq_len: int, stop_ids, to_global, row_share=(0, 1)):
    self.fraction, self.max_new = float(d.on_policy), int(d.max_new_tokens)
    self.temperature, self.seed = float(d.temperature), int(train_cfg.seed)
    self.model_cfg, self.mesh, self.seq_len = model_cfg, mesh, seq_len
    self.stop_ids, self.to_global = list(stop_ids), to_global  # to_global: step.global_batch on the run's sharding
    self.row_share = row_share  # (index, count): sharding.row_share of the run's batch sharding

  def due(self, step: int) -> bool:
    """Whether the step after `step` trains on the student's samples."""
    return bool(np.random.default_rng([self.seed, step, 1]).random() < self.fraction)

  def __call__(self, params, batch: dict, step: int) -> dict:
    """`batch` (a global batch) with every row replaced by its prompt and the student's completion of it."""
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    from jaxlm import generate  # pylint: disable=import-outside-toplevel
    # The whole global batch on every process (one process: a plain read-back).
    host = {k: np.asarray(multihost_utils.process_allgather(batch[k], tiled=True))
            for k in ('inputs', 'weights', 'segment_ids')}
    prompts = [prompt_of(*(host[k][i] for k in ('inputs', 'weights', 'segment_ids')), self.seq_len - self.max_new)
               for i in range(host['inputs'].shape[0])]
    out = generate.generate(self.model_cfg, params, prompts, self.max_new,
                            sampling=generate.Sampling(self.temperature), seed=self.seed * 1_000_003 + step,
                            eos_id=self.stop_ids or None, mesh=self.mesh, max_len=self.seq_len)
    completions = [ids + [end] * (end is not None) for ids, end in zip(out.tokens, out.ends)]  # the stop id trained
    rows = on_policy_rows(prompts, completions, self.seq_len)
    index, count = self.row_share
    share = len(prompts) // count
    return self.to_global({k: v[index * share:(index + 1) * share] for k, v in rows.items()})


def prompt_of(inputs, weights, segment_ids, longest: int) -> list[int]:
  """A row's prompt: its first segment's tokens up to and including the one that predicts the first weighted
  target (chat: the conversation before the assistant's first token), at most the last `longest` of them."""
  first = np.flatnonzero((weights > 0) & (segment_ids == segment_ids[0]))
  end = int(first[0]) + 1 if len(first) else int((segment_ids == segment_ids[0]).sum())
  return [int(x) for x in inputs[:max(end, 1)][-longest:]]


def on_policy_rows(prompts: list, completions: list, seq_len: int) -> dict:
  """Rows of prompt + completion, one sequence each: the completion's tokens weighted 1, the prompt's 0."""
  rows = {k: np.zeros((len(prompts), seq_len), np.int32) for k in ('inputs', 'targets', 'segment_ids', 'positions')}
  rows['weights'] = np.zeros((len(prompts), seq_len), np.float32)
  for i, (prompt, completion) in enumerate(zip(prompts, completions)):
    ids = list(prompt) + list(completion)
    n = len(ids) - 1
    rows['inputs'][i, :n], rows['targets'][i, :n] = ids[:-1], ids[1:]
    rows['segment_ids'][i, :n], rows['positions'][i, :n] = 1, np.arange(n)
    rows['weights'][i, len(prompt) - 1:n] = 1.0  # targets from the first sampled token on
  return rows


# ------------------------------------------------------------------------------------------ validation


def config_errors(c) -> list[str]:
  """The `distill` section under train.objective=distill (config.validate calls it)."""
  d = c.get('distill')
  if d is None:
    return ['train.objective=distill needs a distill section (configs/base.py).']
  e = []
  if not 0.0 <= d.beta <= 1.0:
    e.append(f'distill.beta={d.beta} must lie in [0, 1] (0: forward KL, 1: reverse KL, between: generalized JSD).')
  if d.temperature <= 0:
    e.append(f'distill.temperature={d.temperature} must be positive.')
  if not 0.0 <= d.alpha <= 1.0:
    e.append(f'distill.alpha={d.alpha} must lie in [0, 1] (the weight of the hard-label cross-entropy).')
  if not 0 <= d.top_k <= c.model.vocab_size:
    e.append(f'distill.top_k={d.top_k} must lie in [0, model.vocab_size={c.model.vocab_size}] (0: full vocabulary).')
  if d.teacher_dtype not in TEACHER_DTYPES:
    e.append(f'distill.teacher_dtype={d.teacher_dtype!r} is unknown; use one of {", ".join(TEACHER_DTYPES)}.')
  if not 0.0 <= d.get('on_policy', 0.0) <= 1.0:
    e.append(f'distill.on_policy={d.on_policy} must lie in [0, 1] (the fraction of steps on the student\'s samples).')
  elif d.get('on_policy', 0.0) and not 0 < d.max_new_tokens < c.data.seq_len:
    e.append(f'distill.max_new_tokens={d.max_new_tokens} must lie in [1, data.seq_len={c.data.seq_len}).')
  if d.get('on_policy', 0.0) and d.get('cached'):
    e.append('distill.on_policy samples completions the cache cannot hold; set distill.cached=\'\' or on_policy=0.')
  if d.get('cached'):  # the teacher is never loaded: its log-probabilities come with the data
    return e + cache_errors(c)
  if not d.teacher:
    return e + ['train.objective=distill needs distill.teacher: a jaxlm run directory or import (its checkpoints), '
                'or distill.cached: its top-K log-probabilities (python -m jaxlm.tools.teacher).']
  return e + _teacher_errors(c, d.teacher)


def _teacher_errors(c, teacher: str) -> list[str]:
  """The teacher's saved config against the student's: the same vocabulary and the same tokenizer."""
  try:
    t = rundir.read_config(teacher_step_dir(teacher))
  except Exception as ex:  # pylint: disable=broad-except  # any unreadable teacher is one line naming it
    return [f'distill.teacher={teacher} is not a readable jaxlm run ({str(ex).splitlines()[0]}); give a run '
            f'directory or import with a checkpoint.']
  if t.model.vocab_size != c.model.vocab_size:
    return [f'distill.teacher={teacher} has model.vocab_size={t.model.vocab_size} but the student has '
            f'model.vocab_size={c.model.vocab_size}; distil between models of one tokenizer and vocabulary.']
  ours, theirs = tokenizer_identity(c), tokenizer_identity(t, teacher)
  if ours and theirs and ours != theirs:
    short = lambda x: f'sha256 {x[:12]}…' if re.fullmatch('[0-9a-f]{64}', x) else x  # noqa: E731
    return [f'distill.teacher={teacher} uses {short(theirs)} but the student\'s data uses {short(ours)}; '
            f'prepare the student\'s data with the teacher\'s tokenizer.']
  return []


def cached(c) -> str:
  """The teacher cache a run's batches carry (distill.cached under train.objective=distill), else ''."""
  return c.distill.get('cached', '') if c.train.get('objective') == 'distill' else ''


def cache_identity(teacher_step_dir: str, data: str, meta: dict, top_k: int, temperature: float,
                   vocab_size: int) -> dict:
  """What a teacher cache belongs to (jaxlm/tools/teacher.py writes it, `cache_errors` compares it)."""
  return {'teacher': storage.normalize(teacher_step_dir), 'data': storage.normalize(data),
          'documents': meta['splits']['train']['documents'], 'tokenizer_sha256': meta['tokenizer_sha256'],
          'top_k': int(top_k), 'temperature': float(temperature), 'vocab_size': int(vocab_size)}


def cache_errors(c) -> list[str]:
  """distill.cached against the run: one prepared chat dataset, the one the cache was made from (its tokenizer,
  its documents), at this run's top_k, temperature and vocabulary."""
  from jaxlm.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  d, cache = c.distill, c.distill.cached
  make = f'make it with `python -m jaxlm.tools.teacher --teacher=RUN --data=DATA --top_k=K --out={cache}`'
  if c.data.source != 'prepared' or ',' in c.data.paths:
    return [f'distill.cached reads one prepared chat dataset (data.source=prepared, one data.paths); {make}.']
  data = c.data.paths.strip()
  try:  # either on a bucket too (the data as pipeline.dataset_dirs reads it, the cache as the pipeline fetches it)
    saved = storage.read_json(storage.join(cache, data_lib.TEACHER_MANIFEST))
    meta = storage.read_json(storage.join(data, 'metadata.json'))
  except (OSError, ValueError) as ex:
    return [f'distill.cached={cache} or data.paths={data} is unreadable ({ex}); {make}.']
  if not saved.get('complete'):
    return [f'distill.cached={cache} is unfinished (jaxlm.tools.teacher was stopped); run the same command again '
            f'to finish it.']
  if meta.get('content') != 'chat':
    return [f'distill.cached reads chat data (prepare --format=chat), whose conversations are never split across '
            f'rows; data.paths={data} holds {meta.get("content", "text")}.']
  want = cache_identity(saved.get('teacher', ''), data, meta, d.top_k, d.temperature, c.model.vocab_size)
  for key in ('data', 'documents', 'tokenizer_sha256', 'top_k', 'temperature', 'vocab_size'):
    if saved.get(key) != want[key]:
      return [f'distill.cached={cache} was made for {key}={saved.get(key)!r} but this run has {want[key]!r}; '
              f'{make.replace("make it", "make it again")}.']
  return []
