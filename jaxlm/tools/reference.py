"""Cached reference log-probabilities for preference tuning (`preference.reference=cached`).

  python -m jaxlm.tools.reference --workdir=runs/sft [--step=N] --data=data/pairs [--batch_size=16]

Runs the reference model (the run's checkpoint; a LoRA run merged) once over every prepared pair and writes each
completion token's log-probability beside the pairs, in `<data>/reference/`: one ArrayRecord shard per pair shard
(a pair's record: float32 chosen-side then rejected-side values, one per row position the pair fills) and
`reference.json`, naming the checkpoint, the tokenizer and the chat template they belong to. Training with
`preference.reference=cached` reads them in the batch as `ref_logps` and refuses
them when they belong to another checkpoint (its checkpoint.init_from), tokenizer or template.
"""

import dataclasses
import json
import os

import jax
import numpy as np
from absl import flags

from jaxlm import cli
from jaxlm import lora as lora_lib
from jaxlm import model as model_lib
from jaxlm import preference as preference_lib
from jaxlm import rundir
from jaxlm.data import chat as chat_lib
from jaxlm.data import format as format_lib

DIRECTORY, MANIFEST = preference_lib.CACHE_DIRECTORY, preference_lib.CACHE_MANIFEST
ReferenceError = preference_lib.ReferenceError


def _logps_fn(m: model_lib.ModelConfig):
  model = model_lib.Decoder(model_lib.inference_config(m))

  @jax.jit
  def logps(params, inputs, targets, positions):
    # One sequence per row; the zero padding after it is causally invisible to its tokens.
    logits = model.apply({'params': params}, inputs, jax.numpy.ones_like(inputs), positions)
    return preference_lib.token_logps(logits, targets)

  return logps


def compute(workdir: str, data: str, *, step: int | None = None, batch_size: int = 16) -> dict:
  """Writes `<data>/reference/` for the checkpoint of `workdir` (its newest, or `step`); returns the manifest."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  meta = preference_lib.read_pairs_meta(data)
  step_dir = rundir.step_dir(workdir, step)
  cfg = rundir.read_config(step_dir)
  m = model_lib.ModelConfig.from_config(cfg.model)
  if m.vocab_size < meta['vocab_size']:
    raise ReferenceError(f'the reference model\'s vocabulary ({m.vocab_size}) is smaller than the pairs\' tokenizer\'s '
                         f'({meta["vocab_size"]}); compute the reference with the model the pairs were prepared for.')
  params = rundir.read_params(step_dir)
  if m.lora.rank:  # the model the run computes, without adapters
    params, m = lora_lib.merge_adapters(params, m.lora), dataclasses.replace(m, lora=lora_lib.LoraConfig())
  logps = _logps_fn(dataclasses.replace(m, dtype='float32'))
  out = os.path.join(data, DIRECTORY)
  os.makedirs(out, exist_ok=True)
  dtype = meta['dtype']
  for split in ('train', 'eval'):
    for shard in meta['splits'][split]['shards']:
      reader = array_record_module.ArrayRecordReader(os.path.join(data, shard['file']), 'readahead_buffer_size:0')
      try:
        pairs = [chat_lib.from_pair_record(r, dtype) for r in reader.read_all()]
      finally:
        reader.close()
      sides = [side for pair in pairs for side in pair]  # chosen, rejected, chosen, ...
      length = max((len(ids) - 1 for ids, _ in sides), default=1)
      values = []
      for start in range(0, len(sides), batch_size):
        chunk = sides[start:start + batch_size]
        inputs = np.zeros((batch_size, length), np.int32)
        targets = np.zeros((batch_size, length), np.int32)
        positions = np.zeros((batch_size, length), np.int32)
        for i, (ids, _) in enumerate(chunk):
          n = len(ids) - 1
          inputs[i, :n], targets[i, :n], positions[i, :n] = ids[:-1], ids[1:], np.arange(n)
        got = np.asarray(logps(params, inputs, targets, positions))
        values += [got[i, :len(ids) - 1] for i, (ids, _) in enumerate(chunk)]
      path = os.path.join(out, shard['file'])
      with format_lib.replacing(path) as tmp:
        writer = array_record_module.ArrayRecordWriter(tmp, 'group_size:1')
        for k in range(len(pairs)):
          writer.write(np.concatenate([values[2 * k], values[2 * k + 1]]).astype(np.float32).tobytes())
        writer.close()
  manifest = preference_lib.cached_identity(step_dir, meta)
  format_lib.write_json(os.path.join(out, MANIFEST), manifest, indent=1)
  return manifest


FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_string('workdir', None, 'The reference run (its checkpoint): usually the run DPO starts from.')
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).')
  flags.DEFINE_string('data', None, 'Prepared preference pairs (prepare --format=preference).')
  flags.DEFINE_integer('batch_size', 16, 'Sequences per forward pass.')


def main(argv):
  del argv
  manifest = compute(FLAGS.workdir, FLAGS.data, step=FLAGS.step, batch_size=FLAGS.batch_size)
  print(f'reference log-probabilities of {manifest["pairs"]} pairs from {manifest["checkpoint"]} written to '
        f'{os.path.join(FLAGS.data, DIRECTORY)}')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('workdir', 'data'))


if __name__ == '__main__':
  console()
