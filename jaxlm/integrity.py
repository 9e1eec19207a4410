"""What a restore checks before it trusts a checkpoint step: that its files are the ones written (checksums.json,
hashed once a save is confirmed), and that it fits this run's state (optimizer, shapes, dtypes) — read from
metadata, before any array is restored.

Orbax 0.12's TensorStore specs checksum only the zarr3 shard index, not the chunk data, so flipped bytes inside an
array file would otherwise restore silently. The checkpointer (checkpoint.py) decides what a failed check means:
a corrupt step is moved aside and the one before it used; a misfit is refused and left in place.
"""

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from jaxlm.data import storage

CHECKSUMS = 'checksums.json'


def file_checksums(step_dir: str) -> tuple[str, dict[str, str]]:
  """(algorithm, {relative path: hash}) of every file under a step directory but checksums.json itself."""
  return storage.hashes(step_dir, skip=(CHECKSUMS,))


def verify_checksums(step_dir: str) -> str | None:
  """None if every file matches its recorded checksum (or none were recorded); else what is wrong."""
  path = storage.join(step_dir, CHECKSUMS)
  if not storage.exists(path):
    return None
  recorded = storage.read_json(path)
  algorithm, got = file_checksums(step_dir)
  if algorithm not in recorded:  # copied between a disk and a bucket: the hashes are of another kind
    return None
  want = recorded[algorithm]
  bad = sorted(k for k in want if got.get(k) != want[k])
  if bad:
    missing = [k for k in bad if k not in got]
    return (f'{len(bad)} file(s) differ from the checksums written at save time'
            + (f' ({len(missing)} missing)' if missing else '') + f', e.g. {bad[0]}')
  return None


class Misfit(Exception):
  """A readable checkpoint that does not fit this run's state: refused, never moved aside."""


def _leaf_name(key) -> str:
  return str(getattr(key, 'key', getattr(key, 'name', getattr(key, 'idx', key))))


def misfit(step_dir: str, target, identity: dict | None) -> str | None:
  """How the checkpoint in `step_dir` does not fit the state `target` (optimizer, shapes, dtypes), or None.

  Read from the saved optimizer identity (`environment`) and the state's metadata, before any array is restored;
  an unreadable checkpoint raises (it is corrupt, not a misfit). Layout (mesh, shardings) never misfits.
  """
  env_file = storage.join(step_dir, 'env', 'metadata')
  saved_env = storage.read_json(env_file) if storage.isfile(env_file) else {}
  saved_id = saved_env.get('optimizer') or {'name': saved_env.get('config', {}).get('optim', {}).get('name')}
  if identity and saved_id.get('name') and any(saved_id.get(k, v) != v for k, v in identity.items()):
    show = lambda i: f"optim.name={i.get('name')}" + (', optim.ema on' if i.get('ema') else '')
    return f'it was written by {show(saved_id)}, this run has {show(identity)}'
  tree = ocp.StandardCheckpointHandler().metadata(epath.Path(storage.join(step_dir, 'state')))
  flat = lambda t: {'.'.join(map(_leaf_name, k)): (tuple(v.shape), np.dtype(v.dtype).name)
                    for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}
  saved, want = flat(tree), flat(target)
  for name in sorted(set(saved) | set(want), key=lambda n: (not n.startswith('params.'), n)):  # params first
    if name not in want:
      return f'it holds {name}, which this run\'s state has not (another optimizer or model config?)'
    if name not in saved:
      return f'it lacks {name}, which this run\'s state has (another optimizer or model config?)'
    if saved[name] != want[name]:
      (s_shape, s_dtype), (w_shape, w_dtype) = saved[name], want[name]
      return f'{name} is {s_shape} {s_dtype} in it but {w_shape} {w_dtype} in this run'
  return None
