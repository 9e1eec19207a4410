"""Training and evaluation input: prepared ArrayRecord shards → a Grain pipeline → packed batches.

Per prepared dataset, every process builds the same pipeline and keeps its own slice of it:

  ArrayRecordDataSource(train shards)            one record = one document's token ids
  → MapDataset.shuffle(seed)                     global shuffle; `repeat` re-seeds it each epoch
  → [process_index::process_count]               disjoint per process; together exactly one epoch
  → repeat()                                     endless epochs, each shuffled differently
  → {'inputs': [EOS] + doc, 'targets': doc + [EOS]}
  → ConcatThenSplitIterDataset(T)                pack documents into rows of T tokens
→ IterDataset.mix(weights) → contract fields → batch(B // process_count) → mp_prefetch(num_workers).

The document separator: each document contributes [EOS, d1, ..., dn] to the inputs and [d1, ..., dn, EOS] to
the targets, so a packed row reads `... an EOS b1 b2 ...` with exactly one EOS between documents, every token of a
document (its first one included) is predicted from inside its own segment, and the EOS that ends a document is
predicted too. Stored documents carry no BOS/EOS (prepare strips them); `_to_example` strips them again in
case a shard came from another tool, so a tokenizer that appends its own EOS never yields two.

Batches (numpy, per process): inputs/targets/segment_ids/positions int32 (B, T), weights float32 (B, T);
see the interface contract. The returned iterator is a Grain `DatasetIterator`: `get_state()` is a JSON-ready
dict and `set_state(state)` resumes exactly; `grain.checkpoint.CheckpointSave/CheckpointRestore` save it inside
an Orbax CheckpointManager step.
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

from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib


from jaxlm.errors import DataError  # noqa: F401  (missing, corrupt, or built with another tokenizer)

SOURCES = ('stdlib', 'prepared')  # data.source

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
  if data_cfg.source != 'prepared':
    raise DataError(f'data.source={data_cfg.source!r} is unknown; use stdlib or prepared.')
  paths = [os.path.expanduser(p.strip()) for p in data_cfg.paths.split(',') if p.strip()]
  if not paths:
    raise DataError('data.source=prepared needs data.paths: directories written by `python -m jaxlm.data.prepare`.')
  return paths


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
    raise DataError(f'{path} was tokenized with a {vocab}-entry vocabulary but model.vocab_size={vocab_size}; '
                    f'set --config.model.vocab_size={vocab} (or more), or prepare with --vocab_size<={vocab_size}.')
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
  shas = {p.meta['tokenizer_sha256'] for p in prepared}
  if len(shas) > 1:
    raise DataError('the datasets in data.paths were prepared with different tokenizers: '
                    + ', '.join(f'{p.path} ({p.meta["tokenizer_sha256"][:12]}…)' for p in prepared)
                    + '. Prepare them all with the same --tokenizer=FILE.model.')
  return prepared


def load_tokenizer(data_cfg, vocab_size: int) -> tokenizer_lib.Tokenizer:
  """The SentencePiece model of the data `data_cfg` reads (encode, decode, eos_id, vocab_size, path)."""
  return tokenizer_lib.Tokenizer(tokenizer_path(data_cfg, vocab_size))


def tokenizer_path(data_cfg, vocab_size: int | None = None) -> str:
  """Path of that .model file (e.g. for a Hugging Face export); the stdlib corpus needs `vocab_size`."""
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


def make_train_dataset(data_cfg, *, batch_size: int, seed: int, vocab_size: int, process_index: int | None = None,
                       process_count: int | None = None, num_epochs: int | None = None) -> grain.IterDataset:
  """The Grain pipeline behind `make_train_iterator` (num_epochs=None repeats forever)."""
  process_index, process_count = _process(process_index, process_count)
  local = _local_batch(batch_size, process_count)
  prepared = _open_all(data_cfg, vocab_size)
  weights = _weights(data_cfg, prepared)
  parts = []
  for k, p in enumerate(prepared):
    ds = _source(p, 'train').shuffle(seed=_seed(seed, k))
    ds = ds[process_index::process_count]
    if len(ds) == 0:
      raise DataError(f'{p.path} has {p.meta["splits"]["train"]["documents"]} training documents, fewer than the '
                      f'{process_count} processes; prepare more data.')
    ds = ds.repeat(num_epochs)
    # With Grain workers, reading happens in them; in-process, a few threads read ahead.
    parts.append(_packed(ds, p, data_cfg.seq_len, data_cfg.cross_document_attention,
                         read_threads=1 if data_cfg.num_workers else 4))
  ds = parts[0] if len(parts) == 1 else grain.IterDataset.mix(parts, weights)
  ds = ds.batch(local, drop_remainder=True)
  if data_cfg.num_workers:
    if not flags.FLAGS.is_parsed():
      # Grain's worker start-up reads its absl flags; a caller without absl.app (tests, notebooks) has not
      # parsed any, so take the defaults rather than fail inside Grain.
      flags.FLAGS.mark_as_parsed()
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.num_workers,
                                                     per_worker_buffer_size=max(data_cfg.prefetch, 1)))
  return ds


def make_train_iterator(data_cfg, *, batch_size: int, seed: int, vocab_size: int, process_index: int | None = None,
                        process_count: int | None = None, num_epochs: int | None = None) -> grain.DatasetIterator:
  """Endless iterator of this process's training batches (batch_size // process_count rows); checkpointable."""
  start = time.time()
  it = iter(make_train_dataset(data_cfg, batch_size=batch_size, seed=seed, vocab_size=vocab_size,
                               process_index=process_index, process_count=process_count, num_epochs=num_epochs))
  logging.info('data: training iterator ready in %.1fs (%s, seq_len %d, %d workers)', time.time() - start,
               data_cfg.source if data_cfg.source == 'stdlib' else data_cfg.paths, data_cfg.seq_len,
               data_cfg.num_workers)
  return it


def eval_batches(data_cfg, *, batch_size: int, num_batches: int, vocab_size: int, process_index: int | None = None,
                 process_count: int | None = None) -> list[dict]:
  """The first `num_batches` held-out batches (this process's rows); the same on every call and every run."""
  process_index, process_count = _process(process_index, process_count)
  local = _local_batch(batch_size, process_count)
  prepared = _open_all(data_cfg, vocab_size)

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
