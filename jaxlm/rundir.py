"""The run directory: where a run writes what, and the readers that eval, export, report, sweep and resume use.

  <workdir>/metrics.jsonl            one JSON record per line: train / eval / system / event (jaxlm.metrics)
  <workdir>/tb/                      TensorBoard event files
  <workdir>/checkpoints/<step>/      state, data, guard, env (the run's resolved config), checksums.json
  <workdir>/checkpoints.unreadable/  steps that failed their checksums or could not be read, kept for inspection
  <workdir>/rollbacks.json           the stability guard's rollback count, across restarts
  <workdir>/profile/                 profiler traces (log.profile_steps)

A workdir may be a bucket URL (gs://, s3://; jaxlm.data.storage): the same names, except that metrics.jsonl, which a
bucket cannot append to, is kept as numbered segments under metrics.jsonl.d/ (`read_metrics` reads either), and
the TensorBoard files are uploaded as they grow.
"""

import json
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from jaxlm import errors
from jaxlm.data import storage

METRICS = 'metrics.jsonl'
CHECKPOINTS = 'checkpoints'
COMMIT_MARKER = 'commit_success.txt'  # Orbax's marker of a finished step on a bucket (no atomic rename there)
ROLLBACKS = 'rollbacks.json'
TENSORBOARD = 'tb'
PROFILE = 'profile'


class RunDirError(errors.ConfigError):
  """A run directory that does not hold what was asked for (no checkpoint, no such step, no metrics)."""


def path(workdir: str, name: str) -> str:
  """<workdir>/<name>, with ~ expanded (a bucket URL as it is)."""
  return storage.join(workdir, name)


def checkpoint_steps(workdir: str) -> list[int]:
  """The saved steps in <workdir>/checkpoints, oldest first (finished saves only: Orbax renames when done on a
  disk; on a bucket a step counts once its commit marker is written)."""
  root = path(workdir, CHECKPOINTS)
  names = storage.listdir(root)
  if storage.is_url(root):
    return sorted(int(n) for n in names if n.isdigit() and storage.exists(storage.join(root, n, COMMIT_MARKER)))
  return sorted(int(n) for n in names if n.isdigit())


def step_dir(workdir: str, step: int | None = None) -> str:
  """<workdir>/checkpoints/<step>, the newest step when `step` is None."""
  root = storage.normalize(path(workdir, CHECKPOINTS))
  steps = checkpoint_steps(workdir)
  if not steps:
    raise RunDirError(f'{root} holds no checkpoint; give the --workdir of a run that saved one.')
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise RunDirError(f'step {step} is not in {root}; saved steps: {", ".join(map(str, steps))}.')
  return storage.join(root, str(step))


def read_config(step_path: str) -> ml_collections.ConfigDict:
  """The resolved config a run saved in a step directory's `env` item."""
  try:
    env = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(storage.join(step_path, 'env'))
    return ml_collections.ConfigDict(env['config'])
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise RunDirError(f'{step_path} has no readable env item with the run\'s config ({type(e).__name__}: {e}); '
                      f'was it written by jaxlm.train or jaxlm.hf.import_llama?') from e


def load_tokenizer(cfg, workdir: str | None = None, path: str | None = None):
  """The run's tokenizer (encode, decode, separator_id, ...): the one at `path` if given (rl.tokenizer), else the
  files jaxlm.hf.import_llama put beside an import in `workdir` (when given), else the one its data was
  prepared with (`cfg.data`, `cfg.model.vocab_size`). The one way eval, generate and rl load it."""
  # Imported here: the data pipeline (grain) is heavy, and most readers of a run directory never tokenize.
  from jaxlm.data import pipeline as data_lib  # pylint: disable=import-outside-toplevel
  from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel
  if path:
    return tokenizer_lib.load(os.path.expanduser(path))
  if workdir is not None:
    workdir = os.path.expanduser(workdir)
    if any(os.path.isfile(os.path.join(workdir, n)) for n in ('tokenizer.json', 'tokenizer.model')):
      return tokenizer_lib.load(workdir)
  return data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size)


def _schedule_free(tree):
  """The schedule-free optimizer state (optax.contrib.ScheduleFreeState, saved as a dict) inside `tree`, or None."""
  if isinstance(tree, dict):
    if {'b1', 'z', 'base_optimizer_state'} <= set(tree):
      return tree
    children = tree.values()
  elif isinstance(tree, (list, tuple)):
    children = tree
  else:
    return None
  return next((found for child in children if (found := _schedule_free(child)) is not None), None)


def read_params(step_path: str, weights: str = 'raw') -> dict:
  """The `params` subtree (weights='ema': the `ema` one, on the base for LoRA) of a step's `state` item as numpy
  arrays; the rest is never read, except under optim.name=sf_adamw: there the raw weights are schedule-free's
  averaged point x (the point it is evaluated at), computed from the saved params y and the state's z."""
  item = 'ema' if weights == 'ema' else 'params'
  state_path = storage.join(step_path, 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  meta = checkpointer.metadata(state_path)
  tree = getattr(getattr(meta, 'item_metadata', meta), 'tree', meta)
  if item not in tree or not jax.tree.leaves(tree[item]):
    if item == 'ema':
      raise RunDirError(f'{state_path} holds no averaged weights: the run trained without optim.ema; use '
                        f'--weights=raw.')
    raise RunDirError(f'{state_path} has no params (keys: {", ".join(tree)}).')
  if item == 'params' and _schedule_free(tree.get('opt_state')) is not None:
    import types  # pylint: disable=import-outside-toplevel
    import optax  # pylint: disable=import-outside-toplevel
    everything = checkpointer.restore(state_path, args=ocp.args.PyTreeRestore(
        item=tree, restore_args=jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)))
    sf = _schedule_free(everything['opt_state'])
    from jaxlm import lora as lora_lib  # pylint: disable=import-outside-toplevel
    params, trained = everything['params'], everything['params']
    if jax.tree.structure(sf['z']) != jax.tree.structure(params):  # LoRA: the optimizer saw the adapters only
      trained = lora_lib.split_adapters(params)[1]
    x = optax.contrib.schedule_free_eval_params(types.SimpleNamespace(b1=sf['b1'], z=sf['z']), trained)
    return lora_lib.join_adapters(params, x) if trained is not params else x
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree[item])
  restored = checkpointer.restore(state_path, args=ocp.args.PyTreeRestore(
      item={item: tree[item]}, restore_args={item: as_numpy}, partial_restore=True))
  from jaxlm import lora as lora_lib  # pylint: disable=import-outside-toplevel
  if item == 'ema' and all(lora_lib.is_adapter(k) for k, _ in jax.tree_util.tree_flatten_with_path(tree[item])[0]):
    # A LoRA run averages its adapters alone: the averaged model is its frozen base with them.
    return lora_lib.join_adapters(read_params(step_path), restored[item])
  return restored[item]


def read_reference(step_path: str) -> dict:
  """The frozen reference copy (preference.reference=copy) in a step's `state` item, as numpy arrays."""
  state_path = storage.join(step_path, 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  meta = checkpointer.metadata(state_path)
  tree = getattr(getattr(meta, 'item_metadata', meta), 'tree', meta)
  if not jax.tree.leaves(tree.get('reference', {})):
    raise RunDirError(f'{state_path} holds no reference copy: the run did not train with '
                      f'preference.reference=copy; evaluate it with the config it trained with.')
  as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree['reference'])
  return checkpointer.restore(state_path, args=ocp.args.PyTreeRestore(
      item={'reference': tree['reference']}, restore_args={'reference': as_numpy}, partial_restore=True))['reference']


def read_metrics(workdir_or_file: str) -> list[dict]:
  """The records of a run's metrics.jsonl ([] if none); a torn last line (a crash mid-write) is skipped."""
  workdir_or_file = str(workdir_or_file)
  file = workdir_or_file if workdir_or_file.endswith('.jsonl') else path(workdir_or_file, METRICS)
  records = []
  for line in storage.read_log(file).decode().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


def latest_by_step(records: list[dict], kind: str) -> list[dict]:
  """Records of `kind`, one per step (the later wins: a resumed run logs redone steps again), by step."""
  by_step = {}
  for r in records:
    if r.get('kind') == kind:
      by_step[r['step']] = r
  return [by_step[s] for s in sorted(by_step)]
