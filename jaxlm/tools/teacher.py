"""Cached teacher log-probabilities for distillation (`distill.cached`).

  python -m jaxlm.tools.teacher --teacher=runs/teacher --data=data/chat --top_k=64 --out=data/chat_teacher

Runs the teacher (a run directory or import: its newest checkpoint, a LoRA run merged) once over every
conversation of a prepared chat dataset's train split and writes, for each position, its K most likely next
tokens, their log-probabilities and the log of the mass left over (at --temperature), one ArrayRecord shard per
data shard under the same name, plus `teacher.json` naming the teacher, the data, its tokenizer, K and the
temperature. A distillation run with `distill.cached=DIR` reads them beside its batches and never loads the
teacher; a cache made for other data, another tokenizer, K or temperature is refused at validation. --out may be
a bucket (gs://, s3://): each shard is uploaded whole, teacher.json last, and the run fetches a verified copy
under data.cache_dir.
Per token it costs 4·(2K + 1) bytes (int32 ids, float32 log-probs, the leftover). Killed, the same command resumes:
finished shards are kept (each is written whole, then renamed), the rest are made.
"""

import contextlib
import dataclasses
import json
import os
import tempfile

import jax
import numpy as np
from absl import flags

from jaxlm import cli
from jaxlm import distill as distill_lib
from jaxlm import errors
from jaxlm import lora as lora_lib
from jaxlm import model as model_lib
from jaxlm import rundir
from jaxlm.data import chat as chat_lib
from jaxlm.data import format as format_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import storage
from jaxlm.data import stream as stream_lib


class TeacherCacheError(errors.ConfigError):
  """A teacher cache that cannot be made as asked; the message says what to do."""


def _targets_fn(m: model_lib.ModelConfig, temperature: float, top_k: int):
  model = model_lib.Decoder(model_lib.inference_config(m))

  @jax.jit
  def targets(params, inputs, positions):
    # One conversation per row; the zero padding after it is causally invisible to its tokens.
    logits = model.apply({'params': params}, inputs, jax.numpy.ones_like(inputs), positions)
    return distill_lib.teacher_targets(logits, temperature, top_k)

  return targets


def _read_meta(data: str) -> dict:
  try:
    with open(os.path.join(data, 'metadata.json')) as f:
      meta = json.load(f)
  except (OSError, ValueError) as e:
    raise TeacherCacheError(f'--data={data} holds no readable metadata.json ({e}); give the directory '
                            f'`python -m jaxlm.data.prepare --format=chat` wrote.') from e
  if meta.get('content') != 'chat':
    raise TeacherCacheError(f'--data={data} holds {meta.get("content", "text")} data; give chat data (prepare '
                            f'--format=chat): its conversations are never split across rows, a text document may be.')
  return meta


def _teacher(teacher: str, data_vocab: int):
  """The teacher's step directory, model config and (numpy) parameters, a LoRA run's adapters merged."""
  step_dir = distill_lib.teacher_step_dir(teacher)
  m = model_lib.ModelConfig.from_config(rundir.read_config(step_dir).model)
  if m.vocab_size < data_vocab:
    raise TeacherCacheError(f'the teacher\'s vocabulary ({m.vocab_size}) is smaller than the data\'s tokenizer\'s '
                            f'({data_vocab}); make the cache with the teacher the data was prepared for.')
  params = rundir.read_params(step_dir)
  if m.lora.rank:
    params, m = lora_lib.merge_adapters(params, m.lora), dataclasses.replace(m, lora=lora_lib.LoraConfig())
  return step_dir, m, params


def compute(teacher: str, data: str, out: str, *, top_k: int, temperature: float = 1.0,
            batch_size: int = 16) -> dict:
  """Writes the cache of `teacher` over `data` into `out` (resuming one there); returns its manifest."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  meta = _read_meta(data)
  step_dir, m, params = _teacher(teacher, meta['vocab_size'])
  if not 0 < top_k <= m.vocab_size:
    raise TeacherCacheError(f'--top_k={top_k} must lie in [1, the vocabulary size {m.vocab_size}].')
  manifest = distill_lib.cache_identity(step_dir, data, meta, top_k, temperature, m.vocab_size)
  path = storage.join(out, data_lib.TEACHER_MANIFEST)
  storage.check(out, what='--out')  # before the work: a wrong endpoint or bucket fails in seconds
  if storage.exists(path):  # a resume: only of the same cache
    saved = {k: v for k, v in storage.read_json(path).items() if k != 'complete'}
    if saved != manifest:
      raise TeacherCacheError(f'--out={out} holds a cache for {saved}; give another --out or delete it.')
  storage.makedirs(out)
  storage.write_json(path, dict(manifest, complete=False), indent=1)
  targets = _targets_fn(dataclasses.replace(m, dtype='float32'), temperature, top_k)
  for shard in meta['splits']['train']['shards']:
    dest = storage.join(out, os.path.basename(shard['file']))
    if storage.exists(dest):  # made before the kill
      continue
    reader = array_record_module.ArrayRecordReader(os.path.join(data, shard['file']), 'readahead_buffer_size:0')
    try:
      conversations = [chat_lib.from_record(r, meta['dtype'])[0] for r in reader.read_all()]
    finally:
      reader.close()
    _write_shard(dest, _records(targets, params, conversations, batch_size))
  storage.write_json(path, dict(manifest, complete=True), indent=1)  # last: the cache's commit marker
  return manifest


def _write_shard(dest: str, records) -> None:
  """One ArrayRecord shard at `dest`, whole or not at all: written beside it and renamed, or (a bucket) written
  locally and uploaded as one object; either way a killed run leaves no partial shard to be taken as finished."""
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  with contextlib.ExitStack() as stack:
    if storage.is_url(dest):
      local = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix='jaxlm-teacher-')), 'shard')
    else:
      local = stack.enter_context(format_lib.replacing(dest))
    writer = array_record_module.ArrayRecordWriter(local, 'group_size:1')
    for record in records:
      writer.write(record)
    writer.close()
    if storage.is_url(dest):
      storage.upload(local, dest)


def _records(targets, params, conversations: list, batch_size: int):
  """Each conversation's stream_lib.teacher_record, in order, from batches of `batch_size` padded rows."""
  length = max((len(ids) - 1 for ids in conversations), default=1)
  for start in range(0, len(conversations), batch_size):
    chunk = conversations[start:start + batch_size]
    inputs = np.zeros((batch_size, length), np.int32)
    positions = np.zeros((batch_size, length), np.int32)
    for i, ids in enumerate(chunk):
      inputs[i, :len(ids) - 1], positions[i, :len(ids) - 1] = ids[:-1], np.arange(len(ids) - 1)
    got = jax.device_get(targets(params, inputs, positions))
    for i, ids in enumerate(chunk):
      n = len(ids) - 1
      yield stream_lib.teacher_record(got['teacher_ids'][i, :n], got['teacher_logps'][i, :n],
                                      got['teacher_rest'][i, :n])


FLAGS = flags.FLAGS


def _define_flags() -> None:
  flags.DEFINE_string('teacher', None, 'The teacher: a jaxlm run directory or import, or one step directory.')
  flags.DEFINE_string('data', None, 'Prepared chat data (prepare --format=chat) the student trains on.')
  flags.DEFINE_integer('top_k', None, 'Tokens kept per position (the vocabulary size: all of them).')
  flags.DEFINE_string('out', None, 'Directory of the cache (distill.cached): local, gs:// or s3://.')
  flags.DEFINE_float('temperature', 1.0, 'The teacher\'s logits are divided by it (distill.temperature).')
  flags.DEFINE_integer('batch_size', 16, 'Conversations per forward pass.')


def main(argv):
  del argv
  manifest = compute(FLAGS.teacher, FLAGS.data, FLAGS.out, top_k=FLAGS.top_k, temperature=FLAGS.temperature,
                     batch_size=FLAGS.batch_size)
  print(f'teacher top-{manifest["top_k"]} log-probabilities of {manifest["documents"]} conversations from '
        f'{manifest["teacher"]} written to {FLAGS.out} ({4 * (2 * manifest["top_k"] + 1)} bytes per token)')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('teacher', 'data', 'top_k', 'out'))


if __name__ == '__main__':
  console()
