"""lm-evaluation-harness tasks scored by jaxlm itself: a run's sharded model as an lm-eval `LM`.

`jaxlm.tools.eval --tasks` (any checkpoint) and the training loop (train.harness_tasks, on the live parameters)
both score through `JaxlmLM` here, so the two give the same numbers for the same parameters. No export and no
torch: lm-eval's task machinery (`lm_eval.simple_evaluate`, `TaskManager`) hands requests to this class, which
answers them with the run's forward and sampler on its mesh.

The requests are answered as lm-eval's Hugging Face backend (lm_eval/models/huggingface.py) answers them for the
run's export, so the two agree request by request (tests/test_harness.py):
  - loglikelihood: context + continuation left-truncated to data.seq_len + 1 tokens, the last data.seq_len fed;
    the continuation's summed log-probability and whether greedy decoding would have produced it.
  - loglikelihood_rolling: lm-eval's disjoint rolling windows of the document after the start token.
  - generate_until: the context left-truncated to data.seq_len - max_gen_toks, continued by jaxlm's sampler until
    the tokenizer's stop ids, decoded and cut at the first stop sequence.
Requests are sorted by length and padded to power-of-two lengths in batches of a fixed row count, so a task
compiles a handful of shapes, not one per request.

This module imports lm_eval at the top: the core imports it only where harness tasks are asked for.
"""

import dataclasses
import functools
import json
import math
import os
import random

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlm import errors
from jaxlm import generate as generate_lib
from jaxlm import sharding
from jaxlm.data import chat as chat_lib

try:
  import lm_eval
  import lm_eval.evaluator
  from lm_eval import utils as lm_eval_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.models import utils as model_utils
  from lm_eval.tasks import TaskManager
except ImportError as _e:  # pragma: no cover - the message is the test
  raise errors.JaxlmError(f'lm-evaluation-harness is not installed ({_e}); pip install -e ".[eval]"') from _e


# lm-evaluation-harness tasks shipped with jaxlm (always on the include path).
TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'lm_eval_tasks')


class HarnessError(errors.JaxlmError, ValueError):
  """Harness tasks or settings that cannot run; the message says what to change."""
  exit_code = 2


def _bucket(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=16)
def _score_program(model_cfg, mesh=None):
  """Jitted (params, inputs, targets, segments, positions) -> (log p(target), target == argmax), each (B, L).

  The outputs are replicated: on a multi-process mesh every process computes its devices' rows of one SPMD
  program and reads back the whole batch, so each holds the same results for lm-eval's single-process side.
  """
  model = generate_lib.inference_model(model_cfg)

  def score(params, inputs, targets, segments, positions):
    logits = model.apply({'params': params}, inputs, segments, positions).astype(jnp.float32)  # (B, L, V)
    # The target's logit less the log-normalizer: no second (B, L, V) array beside the logits (large vocabularies).
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # (B, L)
    logp = picked - jax.nn.logsumexp(logits, axis=-1)  # (B, L)
    return logp, jnp.argmax(logits, axis=-1) == targets

  return jax.jit(score, out_shardings=None if mesh is None else NamedSharding(mesh, P()))


@dataclasses.dataclass
class Scoring:
  """What answers requests: a model config, its parameters (placed as the run places them), its mesh, the run's
  tokenizer and sequence length; `batch_size` rows per forward (rounded up to the mesh's batch ways)."""
  model_cfg: object
  params: object
  tokenizer: object
  seq_len: int
  mesh: object = None
  batch_size: int = 8

  def rows(self) -> int:
    ways = 1 if self.mesh is None else sharding.ways(self.mesh, _batch_axes(self.mesh))
    return math.ceil(self.batch_size / ways) * ways

  def score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(summed log-probability, is greedy) of each continuation after its context, as lm-eval's HF backend."""
    seqs = []
    for ctx, cont in pairs:
      if not ctx or not cont or len(cont) > self.seq_len:
        raise HarnessError(f'a request with {len(ctx)} context and {len(cont)} continuation tokens cannot be '
                           f'scored in {self.seq_len}-token sequences; give each a context and a continuation of '
                           f'at most data.seq_len tokens')
      ids = (list(ctx) + list(cont))[-(self.seq_len + 1):]  # left-truncated, as HFLM._loglikelihood_tokens
      seqs.append((ids[:-1], ids[1:], len(cont)))
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))  # longest first: few shapes per batch
    B, out = self.rows(), [None] * len(seqs)
    for lo in range(0, len(order), B):
      chunk = order[lo:lo + B]
      L = min(_bucket(len(seqs[chunk[0]][0])), self.seq_len)
      arrays = np.zeros((4, B, L), np.int32)  # inputs, targets, segments, positions; padding is segment 0
      for row, i in enumerate(chunk):
        inputs, targets, _ = seqs[i]
        n = len(inputs)
        arrays[:, row, :n] = inputs, targets, np.ones(n, np.int32), np.arange(n)
      logp, greedy = self._forward(arrays)
      for row, i in enumerate(chunk):
        n, k = len(seqs[i][0]), seqs[i][2]
        out[i] = (float(logp[row, n - k:n].sum()), bool(greedy[row, n - k:n].all()))
    return out

  def _forward(self, arrays):
    fn = _score_program(self.model_cfg, self.mesh)
    with _rules(self.mesh):
      batch = tuple(arrays)
      if self.mesh is not None:
        batch = jax.device_put(batch, NamedSharding(self.mesh, P(_batch_axes(self.mesh))))
      logp, greedy = fn(self.params, *batch)
      return np.asarray(jax.device_get(logp), np.float64), np.asarray(jax.device_get(greedy))

  def generate(self, prompts: list[list[int]], max_new: int, sampling, seed: int) -> list[list[int]]:
    """Continuations (token ids, stop id excluded) of `prompts` by jaxlm's sampler, in batches of `rows()`."""
    B, out = self.rows(), []
    for lo in range(0, len(prompts), B):
      chunk = prompts[lo:lo + B]
      got = generate_lib.generate(self.model_cfg, self.params, chunk, max_new, sampling=sampling, seed=seed + lo,
                                  eos_id=self.tokenizer.stop_ids or None, mesh=self.mesh, max_len=self.seq_len)
      out.extend(got.tokens)
    return out


def _rules(mesh):
  return sharding.activate(mesh) if mesh is not None else nn.logical_axis_rules(())


def _batch_axes(mesh):
  return generate_lib._batch_axes(mesh)  # pylint: disable=protected-access  # the sampler's row axes, shared


class JaxlmLM(TemplateLM):
  """A jaxlm model as an lm-eval `LM`. `add_bos_token`: put the start token every training document begins with
  (the tokenizer's separator) before each context, as HFLM(add_bos_token=True) does on the export."""

  def __init__(self, scoring: Scoring, *, add_bos_token: bool = True, chat_template: str | None = None,
               seed: int = 0):
    super().__init__()
    self.scoring, self.add_bos_token, self.seed = scoring, add_bos_token, seed
    self.tok = scoring.tokenizer
    self._chat_template = chat_template if chat_template is not None else self.tok.chat_template

  @property
  def eot_token_id(self) -> int:
    return self.tok.separator_id

  @property
  def max_length(self) -> int:
    return self.scoring.seq_len

  @property
  def tokenizer_name(self) -> str:
    return os.path.basename(self.tok.path)

  def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
    start = self.add_bos_token if add_special_tokens is None else add_special_tokens
    return ([self.tok.separator_id] if start else []) + self.tok.encode(string)

  def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
    results = self.scoring.score([(ctx, cont) for _, ctx, cont in requests])
    for (key, _, _), result in zip(requests, results):
      self.cache_hook.add_partial('loglikelihood', key, result)
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
    # lm-eval puts the start token (prefix_token_id) before each document itself: the tokenizer must not too.
    windows, owners = [], []
    for i, (string,) in enumerate(req.args for req in requests):
      for ctx, cont in map(lm_eval_utils.make_disjoint_window, lm_eval_utils.get_rolling_token_windows(
          token_list=self.tok_encode(string, add_special_tokens=False), prefix_token=self.prefix_token_id,
          max_seq_len=self.max_length, context_len=1)):
        windows.append((ctx, cont))
        owners.append(i)
    totals = [0.0] * len(requests)
    for i, (logp, _) in zip(owners, self.scoring.score(windows)):
      totals[i] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial('loglikelihood_rolling', req.args, total)
    return totals

  def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
    groups = {}  # one sampler call per distinct generation settings, as HFLM groups them
    for i, (context, kwargs) in enumerate(req.args for req in requests):
      groups.setdefault(json.dumps(kwargs, sort_keys=True, default=str), []).append(i)
    out = [None] * len(requests)
    for members in groups.values():
      kwargs = model_utils.normalize_gen_kwargs(dict(requests[members[0]].args[1]), 256)
      until = model_utils.handle_stop_sequences(kwargs.pop('until', None), eos=None)
      max_new = kwargs.pop('max_gen_toks')
      if max_new >= self.max_length:
        raise HarnessError(f'max_gen_toks={max_new} leaves no room for a context in {self.max_length}-token '
                           f'sequences; lower the task\'s generation_kwargs.max_gen_toks')
      sampling = generate_lib.Sampling()
      if kwargs.get('do_sample'):
        sampling = generate_lib.Sampling(float(kwargs.get('temperature', 1.0)), int(kwargs.get('top_k') or 0),
                                         float(kwargs.get('top_p') or 1.0))
      members = sorted(members, key=lambda i: -len(self.tok_encode(requests[i].args[0])))
      prompts = [self.tok_encode(requests[i].args[0])[-(self.max_length - max_new):] for i in members]
      for i, ids in zip(members, self.scoring.generate(prompts, max_new, sampling, self.seed)):
        out[i] = model_utils.postprocess_generated_text(self.tok.decode(ids), until, None)
        self.cache_hook.add_partial('generate_until', requests[i].args, out[i])
    return out

  def chat_template(self, chat_template: bool | str = False) -> str | None:
    return self._chat_template if chat_template else None

  def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
    """The text the chat template makes of `chat_history`; without a generation prompt the final message is left
    open to be continued (as HFLM asks transformers for: continue_final_message)."""
    if not self._chat_template:
      raise HarnessError('--apply_chat_template: the run\'s tokenizer has no chat template; drop the flag, or '
                         'prepare the run with a tokenizer that has one')
    history = [dict(m) for m in chat_history]
    if not add_generation_prompt and history:  # a marker after the final message shows where to cut
      history[-1]['content'] += _OPEN_END
    text = chat_lib.render(history, self._chat_template, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.tok.special_tokens)
    if add_generation_prompt or not history:
      return text
    cut = text.rindex(_OPEN_END.strip())
    # A template that strips the message's trailing space drops the marker's too: strip what precedes it then.
    return text[:cut] if text[cut:cut + len(_OPEN_END)] == _OPEN_END else text[:cut].rstrip()


_OPEN_END = '\x00jaxlm-continue\x00 '


def task_manager(include_path: str | None = None, tasks=()) -> TaskManager:
  """lm-eval's task index: jaxlm's own tasks (jaxlm/lm_eval_tasks) and those under `include_path`, and lm-eval's
  registry too unless all of `tasks` are found without it (indexing the registry reads thousands of YAMLs)."""
  paths = tuple([TASKS_DIR] + [p for p in (include_path or '').split(',') if p])
  local = _task_manager(paths, False)
  return local if tasks and all(t in local.all_tasks for t in tasks) else _task_manager(paths, True)


@functools.lru_cache(maxsize=8)
def _task_manager(paths: tuple, registry: bool) -> TaskManager:
  # One index per include path for the process: an in-loop evaluation does not index the task files again.
  return TaskManager(include_path=list(paths), include_defaults=registry)


def check_tasks(tasks, include_path: str | None = None) -> None:
  """Refuses, in one line, a task lm-eval does not know or whose dataset cannot be read on this machine now."""
  manager = task_manager(include_path, tasks)
  unknown = [t for t in tasks if t not in manager.all_tasks]
  if unknown:
    raise HarnessError(f'harness task(s) {", ".join(unknown)} unknown to lm-eval; give registered task names, or '
                       f'put their YAML in a folder passed as include_path')
  for task in tasks:
    try:
      manager.load([task])
    except Exception as e:  # pylint: disable=broad-except  # datasets raises many kinds; all mean "not here"
      reason = ' '.join(str(e).split())[:300]
      raise HarnessError(f'harness task {task}: its dataset cannot be loaded offline ({type(e).__name__}: '
                         f'{reason}); download it where there is network (python -c "from lm_eval.tasks import '
                         f'TaskManager; TaskManager().load([\'{task}\'])"), then copy HF_DATASETS_CACHE '
                         f'({os.environ.get("HF_DATASETS_CACHE", "~/.cache/huggingface/datasets")}) to this '
                         f'machine, or point the task\'s YAML at local files') from e


def evaluate(lm, tasks, *, include_path: str | None = None, num_fewshot: int | None = None,
             limit: float | None = None, apply_chat_template: bool = False, log_samples: bool = False,
             tracker=None, model_args: str = '') -> dict:
  """lm-eval's results dict of `tasks` on `lm` (with per-request samples if `log_samples`), as simple_evaluate
  makes it with its default seeds.

  lm_eval.evaluator.evaluate on tasks set up as simple_evaluate sets them up: simple_evaluate itself also records
  its environment, which imports torch and transformers wherever they are installed. `tracker`: an lm_eval
  EvaluationTracker to record the settings in; `model_args` names the model there.
  """
  if limit is not None and limit >= 1:
    limit = int(limit)  # lm-eval reads a float as a fraction of the examples
  random.seed(0)  # simple_evaluate's default seeds: the same few-shot draws and shuffles as `lm_eval` gives
  np.random.seed(1234)
  loaded = task_manager(include_path, tasks).load(list(tasks))
  for task in loaded['tasks'].values():
    if num_fewshot is not None and task.get_config('num_fewshot') != 0:  # a task fixed at 0 shots stays there
      task.set_config(key='num_fewshot', value=num_fewshot)
    elif num_fewshot is None and task.get_config('num_fewshot') is None:
      task.set_config(key='num_fewshot', value=0)
    task.set_fewshot_seed(seed=1234)
  if tracker is not None:
    tracker.general_config_tracker.log_experiment_args(
        model_source='jaxlm', model_args=model_args, system_instruction=None,
        chat_template=lm.chat_template(apply_chat_template) if apply_chat_template else None,
        fewshot_as_multiturn=False)
  results = lm_eval.evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0,
                                       log_samples=log_samples, apply_chat_template=apply_chat_template)
  results['config'] = {'model': type(lm).__name__, 'model_args': model_args, 'limit': limit,
                       'num_fewshot': num_fewshot, 'bootstrap_iters': 0, 'random_seed': 0, 'numpy_seed': 1234,
                       'fewshot_seed': 1234, 'batch_sizes': []}
  return results


def metrics(results: dict) -> dict:
  """{'harness/<task>/<metric>': value} of the numeric task metrics (a filter other than `none` is appended)."""
  out = {}
  for task, values in results['results'].items():
    for key, value in values.items():
      metric, _, filt = key.partition(',')
      if not filt or '_stderr' in metric or isinstance(value, bool) or not isinstance(value, (int, float)):
        continue
      out[f'harness/{task}/{metric if filt == "none" else f"{metric}_{filt}"}'] = float(value)
  return out


class InLoop:
  """train.harness_tasks, scored at evaluations on the weights the loop hands over, with the run's tokenizer,
  sequence length and mesh (the trainer refuses tasks that cannot run here at start-up: check_tasks)."""

  def __init__(self, train_cfg, tokenizer, model_cfg, *, seq_len: int, mesh):
    self.tasks, self.every = tuple(train_cfg.harness_tasks), train_cfg.harness_every
    self.limit = train_cfg.harness_limit or None
    self.include_path = train_cfg.harness_include_path or None
    self.tokenizer, self.model_cfg, self.seq_len, self.mesh = tokenizer, model_cfg, seq_len, mesh
    self.batch_size = train_cfg.batch_size

  def due(self, step: int, last_step: int) -> bool:
    return not self.every or step % self.every == 0 or step == last_step

  def __call__(self, params, suffix: str = '') -> dict:
    """{'harness/<task>/<metric><suffix>': value} of `params`, as `jaxlm.tools.eval --tasks` scores a checkpoint."""
    lm = JaxlmLM(Scoring(self.model_cfg, params, self.tokenizer, self.seq_len, self.mesh, self.batch_size))
    results = evaluate(lm, self.tasks, include_path=self.include_path, limit=self.limit)
    return {k + suffix: v for k, v in metrics(results).items()}
