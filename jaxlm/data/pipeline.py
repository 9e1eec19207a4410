"""Training and evaluation input: prepared ArrayRecord shards → a Grain pipeline → packed batches.

Training reads one global stream (jaxlm/data/stream.py), the same on any number of processes:

  ArrayRecord train shards + a document index     one record = one document's token ids
  → one seeded order per epoch, packed end to end  row k = tokens [k·T, (k+1)·T) of the stream
  → mixture by row (data.paths, data.weights)      mixture row k's dataset is a function of k
  → global batch = the next S rows                 process p keeps rows [p·S/P, (p+1)·S/P) of it
Per process: MapDataset.source(its rows) → to_iter_dataset → batch(S // P) → mp_prefetch(num_workers).
data.source=stream reads raw files instead, through the lanes of jaxlm/data/lanes.py and their iterator there.

The document separator: each document contributes [EOS, d1, ..., dn] to the inputs and [d1, ..., dn, EOS] to
the targets, so a packed row reads `... an EOS b1 b2 ...` with exactly one EOS between documents, every token of a
document (its first one included) is predicted from inside its own segment, and the EOS that ends a document is
predicted too. Stored documents carry no BOS/EOS (prepare strips them); they are stripped again in case a shard
came from another tool, so a tokenizer that appends its own EOS never yields two.

Batches (numpy, per process): inputs/targets/segment_ids/positions int32 (B, T), weights float32 (B, T);
see the interface contract. The training iterator's state is the global row position (`get_state()`, JSON, the
same on every process), so a checkpoint written by N processes resumes on M; `grain.checkpoint.CheckpointSave`
saves it inside an Orbax CheckpointManager step. Evaluation packs the held-out split in order
(ConcatThenSplitIterDataset) and gives each process its rows of each global batch.
"""

import dataclasses
import functools
import hashlib
import json
import os
import time
from collections.abc import Sequence

import grain
import numpy as np
from absl import flags
from absl import logging
from grain.experimental import ConcatThenSplitIterDataset

from jaxlm.data import lanes as lanes_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import storage
from jaxlm.data import stream as stream_lib
from jaxlm.data import tokenizer as tokenizer_lib


from jaxlm.errors import DataError  # noqa: F401  (missing, corrupt, or built with another tokenizer)

SOURCES = ('stdlib', 'prepared', 'stream')  # data.source
TEACHER_MANIFEST = 'teacher.json'  # distill.cached: what jaxlm.tools.teacher's cache belongs to, and its top_k

@dataclasses.dataclass(frozen=True)
class Prepared:
  """A directory written by `python -m jaxlm.data.prepare`, with its metadata."""
  path: str
  meta: dict

  def shards(self, split: str) -> list[str]:
    """Paths of the shards of `split` ('train' or 'eval')."""
    return [os.path.join(self.path, s['file']) for s in self.meta['splits'][split]['shards']]


def dataset_dirs(data_cfg, vocab_size: int) -> list[str]:
  """The prepared directories `data_cfg` reads; the stdlib corpus is prepared (once, cached) on first use."""
  if data_cfg.source == 'stdlib':
    start = time.time()
    path = prepare_lib.stdlib_dataset(data_cfg, vocab_size)
    logging.info('data: stdlib corpus at %s (%.1fs)', path, time.time() - start)
    return [path]
  if data_cfg.source == 'stream':
    raise DataError('data.source=stream reads data.paths directly; there is no prepared directory.')
  if data_cfg.source != 'prepared':
    raise DataError(f'data.source={data_cfg.source!r} is unknown; use stdlib, prepared or stream.')
  paths = [p.strip() if storage.is_url(p.strip()) else os.path.expanduser(p.strip())
           for p in data_cfg.paths.split(',') if p.strip()]
  if not paths:
    raise DataError('data.source=prepared needs data.paths: directories written by `python -m jaxlm.data.prepare`.')
  return [_local(p, data_cfg.cache_dir) for p in paths]


def _local(path: str, cache_dir: str, what: str = 'data.paths', marker: str | None = 'metadata.json') -> str:
  """A prepared dataset (or, what='distill.cached', a teacher cache) on a bucket as a verified local copy under
  `cache_dir` (ArrayRecord readers read local files only); files whose store hash is unchanged are not downloaded
  again. Local paths as they are. `marker`: the commit marker checked first (None: validation checked it; a teacher
  cache's teacher.json with complete=True)."""
  if not storage.is_url(path):
    return os.path.expanduser(path)
  storage.check(path, what=what)
  if marker and not storage.exists(storage.join(path, marker)):  # the dataset's commit marker, uploaded last
    raise DataError(f'{path} has no {marker}: it is not a prepared dataset, or its upload did not finish; '
                    f'run `python -m jaxlm.data.prepare --out={path}` (again).')
  start = time.time()
  local = storage.local_copy(path, cache_dir)
  logging.info('data: %s %s verified in %s (%.1fs)', what, path, local, time.time() - start)
  return local


def open_prepared(path: str, vocab_size: int) -> Prepared:
  """Reads and checks a prepared directory: metadata, vocabulary size, tokenizer checksum, shard files."""
  meta_path = os.path.join(path, 'metadata.json')
  if not os.path.isdir(path):
    raise DataError(f'prepared dataset {path} does not exist; create it with '
                    f'`python -m jaxlm.data.prepare --inputs=... --out={path}`.')
  if not os.path.exists(meta_path):
    raise DataError(f'{path} has no metadata.json: it is not a prepared dataset, or its preparation was '
                    f'interrupted (run the same prepare command again to finish it).')
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    fmt, vocab, sha = meta['format'], meta['vocab_size'], meta['tokenizer_sha256']
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise DataError(f'{meta_path} is unreadable or incomplete ({e!r}); prepare the data again.') from e
  if fmt != prepare_lib.FORMAT:
    raise DataError(f'{path} was prepared in format {fmt!r}; this version reads {prepare_lib.FORMAT!r}. '
                    f'Prepare it again.')
  if vocab > vocab_size:
    what = (f'{path} was tokenized with a tokenizer whose ids (added tokens included) need a {vocab}-entry '
            f'vocabulary but model.vocab_size={vocab_size}')
    if meta.get('model_type') == 'given':  # --tokenizer: its ids are fixed (a model's own), only the model can grow
      raise DataError(f'{what}; set --config.model.vocab_size={vocab} or more to hold every id (for an imported '
                      f'model, its own vocab_size: the --config.model.* flags jaxlm.hf.import_llama printed).')
    raise DataError(f'{what}; set --config.model.vocab_size={vocab} or more, or prepare again with '
                    f'--vocab_size<={vocab_size} to train a smaller tokenizer.')
  model = os.path.join(path, meta['tokenizer'])
  if not os.path.exists(model):
    raise DataError(f'{path}: tokenizer file {model} is missing; prepare the data again.')
  if tokenizer_lib.file_sha256(model) != sha:
    raise DataError(f'{path}: {meta["tokenizer"]} does not match the tokenizer the shards were made with '
                    f'(sha256 in metadata.json is {sha[:12]}…). Restore the original .model, or prepare again.')
  prepared = Prepared(path=path, meta=meta)
  for split in prepare_lib.SPLITS:
    for shard, info in zip(prepared.shards(split), meta['splits'][split]['shards']):
      _check_shard(shard, info['documents'])
  return prepared


def _check_shard(path: str, documents: int) -> None:
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  if not os.path.exists(path):
    raise DataError(f'shard {path} is missing; run the prepare command again (it rewrites only missing shards).')
  hint = 'delete it and run the prepare command again (only missing shards are rewritten).'
  try:
    # Reading the footer and index catches truncation; the count catches a shard swapped in from elsewhere.
    reader = array_record_module.ArrayRecordReader(path)
    found = reader.num_records()
    reader.close()
  except Exception as e:  # array_record raises bare RuntimeErrors with empty messages
    raise DataError(f'shard {path} is unreadable (truncated or corrupt: {e!r}); {hint}') from e
  if found != documents:
    raise DataError(f'shard {path} holds {found} documents but metadata.json lists {documents} (truncated or '
                    f'replaced); {hint}')


def _open_all(data_cfg, vocab_size: int) -> list[Prepared]:
  prepared = [open_prepared(p, vocab_size) for p in dataset_dirs(data_cfg, vocab_size)]
  if len({p.meta.get('content', 'text') for p in prepared}) > 1:
    raise DataError('data.paths mixes chat and text datasets (' + ', '.join(
        f'{p.path}: {p.meta.get("content", "text")}' for p in prepared) + '); train on one kind at a time.')
  shas = {p.meta['tokenizer_sha256'] for p in prepared}
  if len(shas) > 1:
    raise DataError('the datasets in data.paths were prepared with different tokenizers: '
                    + ', '.join(f'{p.path} ({p.meta["tokenizer_sha256"][:12]}…)' for p in prepared)
                    + '. Prepare them all with the same --tokenizer=FILE.model.')
  return prepared


def load_tokenizer(data_cfg, vocab_size: int) -> tokenizer_lib.Tokenizer:
  """The tokenizer of the data `data_cfg` reads (encode, decode, separator_id, vocab_size, path), with the
  separator its preparation chose."""
  path = tokenizer_path(data_cfg, vocab_size)
  if data_cfg.source == 'stream':
    return tokenizer_lib.load(path)
  with open(os.path.join(os.path.dirname(path), 'metadata.json')) as f:
    separator = json.load(f).get('separator')
  return tokenizer_lib.load(path, separator=separator)


def tokenizer_path(data_cfg, vocab_size: int | None = None) -> str:
  """Path of that tokenizer's main file (e.g. for a Hugging Face export); the stdlib corpus needs `vocab_size`."""
  if data_cfg.source == 'stream':
    return tokenizer_lib.main_file(os.path.expanduser(data_cfg.tokenizer))
  if vocab_size is None:
    if data_cfg.source == 'stdlib':
      raise DataError('the stdlib corpus has one tokenizer per vocabulary size; pass vocab_size '
                      '(model.vocab_size) to find it.')
    vocab_size = 2**31 - 1  # nothing to compare against: accept the data's own vocabulary
  p = _open_all(data_cfg, vocab_size)[0]
  return os.path.join(p.path, p.meta['tokenizer'])


def _source(prepared: Prepared, split: str) -> grain.MapDataset:
  paths = prepared.shards(split)
  if not paths:
    raise DataError(f'{prepared.path} has no {split} documents; prepare it with more data'
                    + (' or a larger --eval_fraction.' if split == 'eval' else '.'))
  try:
    return grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  except Exception as e:  # corrupt shards surface as bare RuntimeErrors from array_record
    raise DataError(f'cannot open the {split} shards of {prepared.path} ({e!r}); prepare the data again.') from e


def _to_example(record: bytes, *, dtype: str, eos_id: int, bos_id: int) -> dict | None:
  """One stored document → {'inputs': [EOS] + doc, 'targets': doc + [EOS]} (int32), or None if empty."""
  doc = np.frombuffer(record, dtype=dtype)
  # Stored documents have no BOS/EOS; strip them anyway so a foreign shard or a tokenizer that adds its own
  # never puts two separators between documents.
  lo, hi = 0, len(doc)
  while hi > lo and doc[hi - 1] == eos_id:
    hi -= 1
  while lo < hi and doc[lo] in (bos_id, eos_id):
    lo += 1
  if lo == hi:
    return None  # an empty document would put a second EOS in a row; Grain drops None elements
  doc = doc[lo:hi].astype(np.int32)
  inputs = np.empty(len(doc) + 1, np.int32)
  inputs[0], inputs[1:] = eos_id, doc
  targets = np.empty(len(doc) + 1, np.int32)
  targets[:-1], targets[-1] = doc, eos_id
  return {'inputs': inputs, 'targets': targets}


def _to_batch_row(packed: dict, *, cross_document_attention: bool) -> dict:
  """A packed row → the contract's fields (segment 0 = padding, weight 0 there)."""
  segment_ids = packed['inputs_segment_ids'].astype(np.int32)  # (T,)
  positions = packed['inputs_positions'].astype(np.int32)  # (T,)
  if cross_document_attention:
    # One segment per row: attention crosses documents (the EOS separators remain), positions are plain.
    segment_ids = (segment_ids > 0).astype(np.int32)
    positions = np.arange(len(positions), dtype=np.int32)
  return {'inputs': packed['inputs'].astype(np.int32), 'targets': packed['targets'].astype(np.int32),
          'segment_ids': segment_ids, 'positions': positions, 'weights': (segment_ids > 0).astype(np.float32)}


def _packed(ds: grain.MapDataset, prepared: Prepared, seq_len: int, cross_document_attention: bool,
            read_threads: int) -> grain.IterDataset:
  meta = prepared.meta
  ds = ds.map(functools.partial(_to_example, dtype=meta['dtype'], eos_id=meta['eos_id'], bos_id=meta['bos_id']))
  ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=256))
  # A document longer than T is simply split across rows: the rest continues in the next row with positions
  # restarting at 0 (it cannot attend to its first part, as with any fixed context window). Nothing is dropped.
  ds = ConcatThenSplitIterDataset(ds, length_struct={'inputs': seq_len, 'targets': seq_len})
  return ds.map(functools.partial(_to_batch_row, cross_document_attention=cross_document_attention))


def _process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
  if process_index is None or process_count is None:
    import jax  # pylint: disable=g-import-not-at-top  # only when the caller does not say
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise DataError(f'process_index={process_index} is outside [0, {process_count}).')
  return process_index, process_count


def _local_batch(batch_size: int, process_count: int) -> int:
  if batch_size % process_count:
    raise DataError(f'train.batch_size={batch_size} is not divisible by the {process_count} processes; use a '
                    f'multiple of {process_count}.')
  return batch_size // process_count


def _weights(data_cfg, prepared: Sequence[Prepared]) -> list[float]:
  if not data_cfg.weights:
    return [float(p.meta['splits']['train']['tokens']) for p in prepared]  # proportional to tokens
  try:
    weights = [float(w) for w in data_cfg.weights.split(',')]
  except ValueError as e:
    raise DataError(f'data.weights={data_cfg.weights!r} must be comma-separated numbers.') from e
  if len(weights) != len(prepared) or any(w < 0 for w in weights) or not sum(weights) > 0:
    raise DataError(f'data.weights={data_cfg.weights!r}: give one non-negative weight per data.paths entry '
                    f'({len(prepared)}), not all zero.')
  return weights


def _seed(seed: int, k: int) -> int:
  # Grain seeds are uint32; derive one per dataset so two mixed datasets are not shuffled in lockstep.
  return int.from_bytes(hashlib.sha256(f'{seed}/{k}'.encode()).digest()[:4], 'big')


def is_chat(prepared: Sequence[Prepared]) -> bool:
  """Whether the datasets hold conversations with loss weights (prepare --format=chat)."""
  return prepared[0].meta.get('content') in ('chat', 'preference')  # preference: pairs of conversations


def _conversations(data_cfg, p: Prepared, split: str, *, seed: int, num_epochs: int | None, shuffle: bool,
                   reference_logps: bool = False, teacher_cache: str = '') -> stream_lib.ConversationRows:
  source = _source(p, split)
  lengths = stream_lib.document_lengths(p.shards(split), p.meta, data_cfg.get('cache_dir') or None)
  extra = {}
  if p.meta.get('content') == 'preference':
    rows = stream_lib.PairRows
    if reference_logps:  # preference.reference=cached: tools/reference's files, shard by shard
      paths = [os.path.join(p.path, 'reference', os.path.basename(s)) for s in p.shards(split)]
      if not all(os.path.exists(x) for x in paths):
        raise DataError(f'{p.path} has no cached reference log-probabilities; compute them with `python -m '
                        f'jaxlm.tools.reference --workdir=<the run you start from> --data={p.path}`.')
      extra['reference'] = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  else:
    rows = stream_lib.ConversationRows
  if teacher_cache:  # distill.cached: tools/teacher's files, shard by shard, named as the data's
    local = _local(teacher_cache, data_cfg.cache_dir, what='distill.cached', marker=None)
    paths = [os.path.join(local, os.path.basename(s)) for s in p.shards(split)]
    if not all(os.path.exists(x) for x in paths):
      raise DataError(f'{teacher_cache} lacks the teacher log-probabilities of {p.path}\'s shards; make them with '
                      f'`python -m jaxlm.tools.teacher --teacher=RUN --data={p.path} --out={teacher_cache}`.')
    with open(os.path.join(local, TEACHER_MANIFEST)) as f:
      extra['teacher_k'] = json.load(f)['top_k']
    extra['teacher'] = grain.MapDataset.source(grain.sources.ArrayRecordDataSource(paths))
  return rows(source, lengths, **extra, seed=seed, seq_len=data_cfg.seq_len, dtype=p.meta['dtype'],
                                     epochs=num_epochs, shuffle=shuffle)


def _streams(data_cfg, prepared: Sequence[Prepared], seed: int, num_epochs: int | None,
             reference_logps: bool = False, teacher_cache: str = '') -> list[stream_lib.DocumentStream]:
  out = []
  for k, p in enumerate(prepared):
    meta = p.meta
    if meta.get('content') in ('chat', 'preference'):  # whole conversations (pairs) per row, with loss weights
      out.append(_conversations(data_cfg, p, 'train', seed=_seed(seed, k), num_epochs=num_epochs, shuffle=True,
                                reference_logps=reference_logps, teacher_cache=teacher_cache))
      continue
    if teacher_cache:  # a text document may span rows: its cached context would not be the row's
      raise DataError(f'distill.cached reads chat data (prepare --format=chat), whose conversations are never '
                      f'split across rows; {p.path} holds text: distil from the teacher itself (distill.cached=\'\').')
    source = _source(p, 'train')
    lengths = stream_lib.document_lengths(p.shards('train'), meta, data_cfg.get('cache_dir') or None)
    if len(lengths) != len(source):
      raise DataError(f'{p.path}: the document index lists {len(lengths)} documents but the shards hold '
                      f'{len(source)}; delete {data_cfg.cache_dir}/index and start again.')
    out.append(stream_lib.DocumentStream(source, lengths, seed=_seed(seed, k), seq_len=data_cfg.seq_len,
                                         eos_id=meta['eos_id'], bos_id=meta['bos_id'], dtype=meta['dtype'],
                                         epochs=num_epochs))
  return out


def fingerprint(data_cfg, prepared: Sequence[Prepared], weights: Sequence[float], seed: int) -> dict:
  """What the row stream depends on: a saved position continues exactly only where all of it is unchanged."""
  return {'data.seq_len': data_cfg.seq_len, 'train.seed': seed,
          'tokenizer': prepared[0].meta['tokenizer_sha256'],
          'data.paths': [[os.path.basename(os.path.normpath(p.path)), p.meta['splits']['train']['documents'],
                          p.meta['splits']['train']['tokens']] for p in prepared],
          'data.weights': stream_lib.Mixture(list(weights)).q}


def steps_for_epochs(data_cfg, train_cfg, vocab_size: int) -> tuple[int, int]:
  """(train.steps that make train.epochs passes over the dataset, rows of data.seq_len tokens per pass)."""
  if data_cfg.source == 'stream':
    raise DataError('train.epochs needs the dataset\'s size; data.source=stream does not count it: set train.steps.')
  rows, _ = make_train_rows(data_cfg, seed=train_cfg.seed, vocab_size=vocab_size, num_epochs=1)
  if rows.rows_per_epoch is None:
    raise DataError('train.epochs applies to a single dataset, not to a mixture of data.paths; set train.steps.')
  return -(-train_cfg.epochs * rows.rows_per_epoch // train_cfg.batch_size), rows.rows_per_epoch


def make_train_rows(data_cfg, *, seed: int, vocab_size: int, num_epochs: int | None = None,
                    reference_logps: bool = False, teacher_cache: str = ''):
  """(the global row stream as a random-access source, its fingerprint): the same on every process.

  reference_logps: preference pairs' rows carry `ref_logps`, the cached reference log-probabilities
  (preference.reference=cached: `preference.reads_cached`). teacher_cache: chat rows carry the teacher's top-K
  from this directory (distill.cached: jaxlm/tools/teacher.py).
  """
  prepared = _open_all(data_cfg, vocab_size)
  weights = _weights(data_cfg, prepared)
  rows = stream_lib.Rows(_streams(data_cfg, prepared, seed, num_epochs, reference_logps, teacher_cache), weights,
                         data_cfg.cross_document_attention)
  return rows, fingerprint(data_cfg, prepared, weights, seed)


def make_train_iterator(data_cfg, *, batch_size: int, seed: int, vocab_size: int, process_index: int | None = None,
                        process_count: int | None = None, num_epochs: int | None = None,
                        reference_logps: bool = False, teacher_cache: str = '') -> 'TrainIterator':
  """Endless iterator of this process's rows of the global batches (batch_size // process_count rows each).

  reference_logps, teacher_cache: as make_train_rows.

  `next(it)` gives a batch of `batch_size` global rows; `it.take(size)` one of any multiple of the process count.
  Checkpointable: `get_state()` is the global row position (JSON), the same on every process.
  """
  start = time.time()
  process_index, process_count = _process(process_index, process_count)
  _local_batch(batch_size, process_count)
  if data_cfg.source == 'stream':
    lanes, fp = lanes_lib.open_lanes(data_cfg, seed=seed, lanes=data_cfg.get('stream_lanes') or batch_size,
                                     vocab_size=vocab_size)
    return lanes_lib.StreamIterator(lanes, fp, unit=batch_size, process_index=process_index,
                                    process_count=process_count)
  rows, fp = make_train_rows(data_cfg, seed=seed, vocab_size=vocab_size, num_epochs=num_epochs,
                             reference_logps=reference_logps, teacher_cache=teacher_cache)
  it = TrainIterator(rows, fp, unit=batch_size, process_index=process_index, process_count=process_count,
                     num_workers=data_cfg.num_workers, prefetch=data_cfg.prefetch)
  logging.info('data: training iterator ready in %.1fs (%s, seq_len %d, %d workers)', time.time() - start,
               data_cfg.source if data_cfg.source == 'stdlib' else data_cfg.paths, data_cfg.seq_len,
               data_cfg.num_workers)
  return it


class TrainIterator(stream_lib.BatchIterator):
  """This process's rows of each global batch, read ahead by a Grain pipeline; its state is one row counter.

  The pipeline: MapDataset.source(this process's rows of batches of `size` rows from the current position)
  → batch(size // processes) → to_iter_dataset (threads read batches ahead) → mp_prefetch(data.num_workers).
  It is rebuilt when a step asks for another batch size (a batch ramp's next stage) or the position is set.
  """

  def __init__(self, rows: stream_lib.Rows, fp: dict, *, unit: int, process_index: int, process_count: int,
               num_workers: int = 0, prefetch: int = 2):
    super().__init__(fp, unit=unit, process_index=process_index, process_count=process_count)
    self.rows_source = rows
    self.num_workers, self.prefetch = num_workers, prefetch

  def _start(self, size: int) -> None:
    self._stop()
    finite = self.rows_source.rows != stream_lib.INFINITE_ROWS
    batches = -(-(self.rows_source.rows - self.rows) // size) if finite else None
    ds = grain.MapDataset.source(stream_lib.LocalRows(self.rows_source, self.rows, size, self.process_index,
                                                      self.process_count, batches))
    # Batch before leaving random access: Grain's workers (and read threads) then split whole batches, in order.
    ds = ds.batch(size // self.process_count, drop_remainder=True)
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if self.num_workers else 4, prefetch_buffer_size=8))
    if self.num_workers:
      if not flags.FLAGS.is_parsed():
        # Grain's worker start-up reads its absl flags; a caller without absl.app (tests, notebooks) has not
        # parsed any, so take the defaults rather than fail inside Grain.
        flags.FLAGS.mark_as_parsed()
      # Batches come back through the queue, not shared memory: a batch is KBs to MBs, and shared blocks still
      # queued when a worker fails are unlinked only at exit, by the resource tracker, with a warning printed
      # after the run's last line.
      ds = grain.experimental.WithOptionsIterDataset(ds, grain.experimental.DatasetOptions(min_shm_size=2**62))
      ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.num_workers,
                                                       per_worker_buffer_size=max(self.prefetch, 1)))
    self._it, self._size = iter(ds), size

  def epoch(self) -> float | None:
    """Passes over the dataset drawn so far (None for a mixture): the progress line's epoch."""
    per_epoch = self.rows_source.rows_per_epoch
    return None if not per_epoch else self.rows / per_epoch

  def take(self, size: int) -> dict:
    """This process's rows of the next global batch of `size` rows."""
    self._ready_for(size)
    try:
      batch = next(self._it)  # StopIteration at the end of a finite stream
    except (StopIteration, DataError):
      raise
    except Exception as e:  # pylint: disable=broad-except  -- a reader or Grain worker failed mid-stream
      what = ' '.join(str(e).split())[:300]
      self._stop()
      raise DataError(f'reading the training data failed after row {self.rows} ({type(e).__name__}: {what}); a '
                      f'shard changed or was damaged after the run started: delete it and run the prepare command '
                      f'again (it rewrites only missing shards), then the same command to resume') from e
    self.rows += size
    return batch

  def get_state(self) -> dict:
    return {'format': stream_lib.STATE_FORMAT, 'rows': self.rows, 'tokens': self.rows * self.rows_source.seq_len,
            'fields': {**self.fingerprint, **self.expected}, 'topology': self.topology}

  def set_state(self, state: dict) -> None:
    """Continues at the saved global row; refuses (DataError) what cannot continue exactly, unless allowed."""
    self._stop()
    self.notes = []
    self.restored = state
    if state.get('format') != stream_lib.STATE_FORMAT:
      self._changed('the data position', 'a per-process Grain iterator (jaxlm before the global stream)',
                    'the global row stream', 'the old position cannot be mapped onto the global stream')
      self.rows = 0
      self.notes.append('the checkpoint holds no global data position: the stream starts again at row 0 '
                        '(documents seen before are repeated)')
      return
    saved, now = state.get('fields', {}), {**self.fingerprint, **self.expected}
    rows, seq_len = int(state['rows']), self.rows_source.seq_len
    for field in now:
      if field in saved and saved[field] != now[field]:
        self._changed(field, saved[field], now[field], _CHANGE_EFFECT.get(field, _CHANGE_EFFECT['data.paths']))
    old_seq_len = saved.get('data.seq_len', seq_len)
    self.rows = -(-rows * old_seq_len // seq_len)  # the same token position (a partial row is skipped)
    if self.notes:
      self.notes.append(f'continuing at global row {self.rows} (token {self.rows * seq_len:,}; the checkpoint '
                        f'was at token {rows * old_seq_len:,})')


_CHANGE_EFFECT = {
    'data.seq_len': 'rows are re-cut at the same token position; at most one row is skipped',
    'train.batch_size': 'no row is skipped or repeated, but the batches from here are cut at the new size',
    'train.batch_ramp': 'no row is skipped or repeated, but the batches from here are cut at the new sizes',
    'data.paths': 'the new stream is entered at the saved row: its rows before it are skipped, and documents '
                  'trained on before may be repeated',
}


def eval_batches(data_cfg, *, batch_size: int, num_batches: int, vocab_size: int, process_index: int | None = None,
                 process_count: int | None = None, reference_logps: bool = False) -> list[dict]:
  """The first `num_batches` held-out batches (this process's rows); the same on every call and every run.

  reference_logps: as make_train_rows.
  """
  process_index, process_count = _process(process_index, process_count)
  local = _local_batch(batch_size, process_count)
  if data_cfg.source == 'stream':
    return lanes_lib.eval_batches(data_cfg, batch_size=batch_size, num_batches=num_batches, vocab_size=vocab_size,
                                  local=local, process_index=process_index)
  prepared = _open_all(data_cfg, vocab_size)

  if is_chat(prepared):  # held-out conversations packed in order; the loss is over assistant tokens only
    rows = [_conversations(data_cfg, p, 'eval', seed=0, num_epochs=1, shuffle=False,
                           reference_logps=reference_logps) for p in prepared]
    flat = [r.row(k) for r in rows for k in range(r.rows_per_epoch)]
    if len(flat) < batch_size * num_batches:
      logging.warning('data: the held-out conversations fill %d rows, fewer than %d batches of %d; cycling them '
                      '(evaluation repeats conversations).', len(flat), num_batches, batch_size)
    flat = [flat[i % len(flat)] for i in range(batch_size * num_batches)]
    return [{k: np.stack([r[k] for r in flat[b * batch_size:(b + 1) * batch_size]])[
        process_index * local:(process_index + 1) * local] for k in flat[0]} for b in range(num_batches)]

  def batches(cycle: bool) -> list[dict]:
    # Every process packs the whole held-out split in order and keeps its rows of each global batch, so all
    # processes get the same number of batches however the documents fall.
    # All datasets share one tokenizer (checked), so their documents can be concatenated in order.
    ds = grain.MapDataset.concatenate([_source(p, 'eval') for p in prepared])
    ds = _packed(ds.repeat(None if cycle else 1), prepared[0], data_cfg.seq_len, data_cfg.cross_document_attention,
                 read_threads=4)
    out = []
    for batch in ds.batch(batch_size, drop_remainder=True):
      out.append({k: v[process_index * local:(process_index + 1) * local] for k, v in batch.items()})
      if len(out) == num_batches:
        break
    return out

  out = batches(cycle=False)
  if len(out) < num_batches:
    tokens = sum(p.meta['splits']['eval']['tokens'] for p in prepared)
    logging.warning('data: the held-out split (%d tokens) fills only %d batches of %d x %d; cycling it to make '
                    '%d (evaluation repeats documents).', tokens, len(out), batch_size, data_cfg.seq_len,
                    num_batches)
    out = batches(cycle=True)
  return out
