"""The global training stream: rows of packed tokens numbered from 0, the same on any number of hosts.

Per prepared dataset (its train split):

  documents, in one seeded order per epoch (Grain's index shuffle, reseeded every epoch; empty ones add nothing)
  → one token stream: each document adds [EOS] + doc to the inputs and doc + [EOS] to the targets
  → row k = stream tokens [k·T, (k+1)·T): segment ids and positions follow the documents inside the row
Then a mixture picks, for mixture row k, dataset d(k) by a smooth weighted round robin over the weights (a pure
function of k), and takes that dataset's next row. A global batch of S rows at row position R is mixture rows
[R, R + S); process p of P holds rows [R + p·S/P, R + (p+1)·S/P), which is the block
`jax.make_array_from_process_local_data` gives process p for batch sharding P(('data', 'fsdp'), None) (the
processes' devices are contiguous in the mesh's batch axes: sharding.make_mesh).

So the batches are a function of the data, the seed and the row position only: not of processes, devices, mesh
or Grain workers, and a checkpoint's data position is one number, `rows`.

The document index: each document's token count is read once from the shards and cached under data.cache_dir
(keyed by the shards' paths, sizes and mtimes); per epoch, a permutation and its cumulative token offsets find the
document holding any token with np.searchsorted.
"""

import collections
import hashlib
import json
import math
import os
import time
from concurrent import futures

import grain
import numpy as np
from absl import logging

from jaxlm.data import chat as chat_lib
from jaxlm.errors import DataError

# The C++ function behind grain.MapDataset.shuffle (one call per index; the dataset API would add ~2 µs each).
from grain._src.python.experimental.index_shuffle.python.index_shuffle_module import index_shuffle as _index_shuffle  # noqa: E402,E501  pylint: disable=g-import-not-at-top

STATE_FORMAT = 'jaxlm-stream-1'  # the data position's format in checkpoints
INFINITE_ROWS = 2**48  # an endless stream, as a length Grain can slice


def strip(doc: np.ndarray, eos_id: int, bos_id: int) -> np.ndarray:
  """A stored document without leading BOS/EOS and trailing EOS (a foreign tokenizer may have added them)."""
  lo, hi = 0, len(doc)
  while hi > lo and doc[hi - 1] == eos_id:
    hi -= 1
  while lo < hi and doc[lo] in (bos_id, eos_id):
    lo += 1
  return doc[lo:hi]


def _shard_lengths(path: str, dtype: str, eos_id: int, bos_id: int, chat: bool = False) -> np.ndarray:
  from array_record.python import array_record_module  # pylint: disable=g-import-not-at-top
  reader = array_record_module.ArrayRecordReader(path, 'readahead_buffer_size:0')
  try:
    records = reader.read_all()
  finally:
    reader.close()
  itemsize = np.dtype(dtype).itemsize
  if chat == 'preference':  # a pair fills both sides' positions, in one row
    return np.asarray([chat_lib.pair_positions(r, dtype) for r in records], np.int64)
  if chat:  # a conversation of n ids (+ n weights) fills n - 1 positions of a row: inputs ids[:-1]
    return np.asarray([max(len(r) // (itemsize + 1) - 1, 0) for r in records], np.int64)
  out = np.empty(len(records), np.int64)
  for i, r in enumerate(records):
    n = len(r) // itemsize
    if n and (r[-itemsize:] == _token(eos_id, dtype) or r[:itemsize] in (_token(eos_id, dtype),
                                                                          _token(bos_id, dtype))):
      n = len(strip(np.frombuffer(r, dtype), eos_id, bos_id))
    out[i] = n + 1 if n else 0  # + the separator; an empty document adds nothing
  return out


def _token(token_id: int, dtype: str) -> bytes:
  return np.asarray([max(token_id, 0)], dtype).tobytes() if token_id >= 0 else b'\xff' * np.dtype(dtype).itemsize


def document_lengths(shards: list[str], meta: dict, cache_dir: str | None) -> np.ndarray:
  """Tokens each document adds to the stream (len + 1 separator; 0 if empty), cached by the shards' identity."""
  content = meta.get('content', 'text')
  chat = content if content in ('chat', 'preference') else False
  key = json.dumps([[os.path.abspath(s), os.path.getsize(s), os.stat(s).st_mtime_ns] for s in shards]
                   + [meta['dtype'], meta['eos_id'], meta['bos_id'], STATE_FORMAT] + ([chat] if chat else []))
  cache = (os.path.join(os.path.expanduser(cache_dir), 'index', hashlib.sha256(key.encode()).hexdigest()[:24]
                        + '.npy') if cache_dir else None)
  if cache and os.path.exists(cache):
    try:
      return np.load(cache)
    except (OSError, ValueError):
      pass  # a damaged cache file: read the shards again
  start = time.time()
  with futures.ThreadPoolExecutor(min(8, len(shards))) as pool:
    lengths = np.concatenate(list(pool.map(
        lambda s: _shard_lengths(s, meta['dtype'], meta['eos_id'], meta['bos_id'], chat), shards)))
  logging.info('data: indexed %d documents of %d shards in %.1fs', len(lengths), len(shards), time.time() - start)
  if cache:
    try:
      os.makedirs(os.path.dirname(cache), exist_ok=True)
      tmp = f'{cache}.{os.getpid()}.tmp.npy'
      np.save(tmp, lengths)
      os.replace(tmp, cache)  # atomic: processes indexing at once never read a partial file
    except OSError as e:
      logging.warning('data: could not cache the document index in %s (%s); it is rebuilt on every start.',
                      cache, e)
  return lengths


class DocumentStream:
  """One dataset's packed rows: `row(k)` is stream tokens [k·T, (k+1)·T), endless unless `epochs` is given."""

  def __init__(self, source, lengths: np.ndarray, *, seed: int, seq_len: int, eos_id: int, bos_id: int,
               dtype: str, epochs: int | None = None):
    self.source, self.seed, self.seq_len = source, seed, seq_len
    self.eos_id, self.bos_id, self.dtype = eos_id, bos_id, dtype
    self.lengths = lengths
    self.epoch_tokens = int(lengths.sum())
    if not self.epoch_tokens:
      raise DataError('the training split holds only empty documents; prepare it with more data.')
    self.end = math.inf if epochs is None else epochs * self.epoch_tokens  # tokens in the stream
    self.rows = INFINITE_ROWS if epochs is None else -(-self.end // seq_len)
    self.rows_per_epoch = -(-self.epoch_tokens // seq_len)
    self._epochs = collections.OrderedDict()  # epoch -> (document order, cumulative token offsets)
    self._docs = collections.OrderedDict()  # a few decoded documents: a long one spans several rows

  def __getstate__(self):
    return dict(self.__dict__, _epochs=collections.OrderedDict(), _docs=collections.OrderedDict())

  def epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Epoch e's document order and the stream offset (within the epoch) where each document starts."""
    if e not in self._epochs:
      # Grain's index shuffle with its per-epoch seed, as `MapDataset.shuffle(seed).repeat()` orders documents: a
      # 1-process run reads the same stream as the per-process pipeline did. Empty documents stay in the order
      # with length 0; the search below never lands on them.
      n = len(self.lengths)
      seed = (self.seed + e) % 2**32
      order = (np.fromiter((_index_shuffle(i, n - 1, seed, 4) for i in range(n)), np.int64, n) if n > 1
               else np.zeros(n, np.int64))
      starts = np.zeros(len(order) + 1, np.int64)
      np.cumsum(self.lengths[order], out=starts[1:])
      self._epochs[e] = (order, starts)
      while len(self._epochs) > 2:  # rows near an epoch's end read two epochs
        self._epochs.popitem(last=False)
    return self._epochs[e]

  def _example(self, doc: int) -> tuple[np.ndarray, np.ndarray]:
    if doc not in self._docs:
      tokens = strip(np.frombuffer(self.source[int(doc)], self.dtype), self.eos_id, self.bos_id).astype(np.int32)
      inputs = np.concatenate([[self.eos_id], tokens]).astype(np.int32)  # [EOS] + doc
      targets = np.concatenate([tokens, [self.eos_id]]).astype(np.int32)  # doc + [EOS]
      self._docs[doc] = (inputs, targets)
      while len(self._docs) > 8:
        self._docs.popitem(last=False)
    return self._docs[doc]

  def row(self, k: int) -> dict:
    """Row k: inputs, targets, segment ids (1, 2, … per document piece; 0 = padding) and positions (T,)."""
    T = self.seq_len
    out = {key: np.zeros(T, np.int32) for key in ('inputs', 'targets', 'segment_ids', 'positions')}
    pos, end = k * T, min((k + 1) * T, self.end)
    fill, segment = 0, 0
    while pos < end:
      e, offset = divmod(pos, self.epoch_tokens)
      order, starts = self.epoch(e)
      i = int(np.searchsorted(starts, offset, side='right')) - 1
      inputs, targets = self._example(order[i])
      first = offset - int(starts[i])  # where the row enters this document
      n = int(min(len(inputs) - first, end - pos))
      segment += 1
      out['inputs'][fill:fill + n] = inputs[first:first + n]
      out['targets'][fill:fill + n] = targets[first:first + n]
      out['segment_ids'][fill:fill + n] = segment
      # A document continued from the previous row restarts its positions (it cannot see its first part).
      out['positions'][fill:fill + n] = np.arange(n, dtype=np.int32)
      fill, pos = fill + n, pos + n
    return out


def _shuffled(n: int, seed: int) -> np.ndarray:
  """Grain's index shuffle of range(n) with `seed`."""
  if n <= 1:
    return np.zeros(n, np.int64)
  return np.fromiter((_index_shuffle(i, n - 1, seed % 2**32, 4) for i in range(n)), np.int64, n)


class ConversationRows:
  """Chat data: whole conversations packed into rows, never split; `row(k)` as DocumentStream's, with weights.

  The conversations are packed once (in one seeded order, each into the current row while it fits, else into a
  new one; the rest of a row is padding), then each epoch visits the packed rows in its own seeded order. So a
  row's conversations are a function of the data and the seed, and an epoch is a whole number of rows.
  Each conversation of ids c (stored weights w) adds inputs c[:-1], targets c[1:], weights w[1:], its own
  segment id and positions from 0: attention never crosses conversations.
  """

  def __init__(self, source, lengths: np.ndarray, *, seed: int, seq_len: int, dtype: str,
               epochs: int | None = None, shuffle: bool = True, teacher=None, teacher_k: int = 0):
    self.dtype = dtype
    # distill.cached: per conversation, its positions' teacher top-K (jaxlm/tools/teacher.py), K = teacher_k
    self.teacher, self.teacher_k = teacher, teacher_k
    self.source, self.seq_len, self.seed, self.shuffle = source, seq_len, seed, shuffle
    if (longest := int(lengths.max(initial=0))) > seq_len:
      raise DataError(f'a stored conversation fills {longest} positions but data.seq_len={seq_len}; prepare '
                      f'again with --seq_len={seq_len} (it cuts conversations at a turn boundary), or raise '
                      f'data.seq_len to {longest}.')
    order = _shuffled(len(lengths), seed) if shuffle else np.arange(len(lengths))
    bins, current, fill = [], [], 0
    for i in order:
      n = int(lengths[i])
      if not n:
        continue
      if fill + n > seq_len:
        bins.append(current)
        current, fill = [], 0
      current.append(int(i))
      fill += n
    if current:
      bins.append(current)
    if not bins:
      raise DataError('the chat split holds no conversation with an assistant token; prepare it with more data.')
    self.bins, self.lengths = bins, lengths
    self.rows_per_epoch = len(bins)
    self.rows = INFINITE_ROWS if epochs is None else epochs * len(bins)
    self._orders = collections.OrderedDict()

  def __getstate__(self):
    return dict(self.__dict__, _orders=collections.OrderedDict())

  def _order(self, e: int) -> np.ndarray:
    if not self.shuffle:
      return np.arange(len(self.bins))
    if e not in self._orders:
      self._orders[e] = _shuffled(len(self.bins), self.seed + 1 + e)
      while len(self._orders) > 2:
        self._orders.popitem(last=False)
    return self._orders[e]

  def row(self, k: int) -> dict:
    """Row k: inputs, targets, weights, segment ids (1, 2, … per conversation; 0 = padding) and positions."""
    T = self.seq_len
    out = {key: np.zeros(T, np.int32) for key in ('inputs', 'targets', 'segment_ids', 'positions')}
    out['weights'] = np.zeros(T, np.float32)
    if self.teacher is not None:
      out.update(teacher_rows(T, self.teacher_k))
    e, j = divmod(int(k), self.rows_per_epoch)
    fill = 0
    for segment, conv in enumerate(self.bins[int(self._order(e)[j])], 1):
      ids, weights = chat_lib.from_record(self.source[conv], self.dtype)
      n = len(ids) - 1
      if self.teacher is not None:
        for key, value in from_teacher_record(self.teacher[conv], n, self.teacher_k).items():
          out[key][fill:fill + n] = value
      out['inputs'][fill:fill + n] = ids[:-1]
      out['targets'][fill:fill + n] = ids[1:]
      out['weights'][fill:fill + n] = weights[1:]
      out['segment_ids'][fill:fill + n] = segment
      out['positions'][fill:fill + n] = np.arange(n, dtype=np.int32)
      fill += n
    return out


TEACHER_KEYS = ('teacher_ids', 'teacher_logps', 'teacher_rest')  # distill.cached: (T, K), (T, K), (T,)


def teacher_rows(seq_len: int, k: int) -> dict:
  """A row's teacher keys before its conversations fill them: padding positions are weighted 0 by the loss."""
  return {'teacher_ids': np.zeros((seq_len, k), np.int32), 'teacher_logps': np.zeros((seq_len, k), np.float32),
          'teacher_rest': np.zeros(seq_len, np.float32)}


def teacher_record(ids, logps, rest) -> bytes:
  """One conversation's cached teacher top-K (jaxlm/tools/teacher.py): int32 ids (n, K), float32 log-probs
  (n, K), then float32 log of the mass left over (n,), for its n positions."""
  return (np.asarray(ids, np.int32).tobytes() + np.asarray(logps, np.float32).tobytes()
          + np.asarray(rest, np.float32).tobytes())


def from_teacher_record(record: bytes, n: int, k: int) -> dict:
  """teacher_record's arrays for a conversation of n positions; a record of another size is refused."""
  if len(record) != 4 * n * (2 * k + 1):
    raise DataError(f'a cached teacher record holds {len(record)} bytes, not the {4 * n * (2 * k + 1)} of {n} '
                    f'positions at top_k={k}; the cache belongs to other data: make it again (jaxlm.tools.teacher).')
  ids = np.frombuffer(record, np.int32, n * k).reshape(n, k)
  logps = np.frombuffer(record, np.float32, n * k, offset=4 * n * k).reshape(n, k)
  rest = np.frombuffer(record, np.float32, n, offset=8 * n * k)
  return {'teacher_ids': ids, 'teacher_logps': logps, 'teacher_rest': rest}


class PairRows(ConversationRows):
  """Preference data: whole pairs packed into rows as ConversationRows packs conversations, never split.

  Each pair adds its chosen side then its rejected side as two adjacent segments (their own segment ids and
  positions from 0) and `pairs`: +k on the chosen side's tokens, -k on the rejected side's, for the row's k-th pair
  (jaxlm/preference.py).
  """

  def __init__(self, *args, reference=None, **kwargs):
    super().__init__(*args, **kwargs)
    self.reference = reference  # reference=cached: per pair, its positions' reference log-probs (tools/reference)

  def row(self, k: int) -> dict:
    T = self.seq_len
    out = {key: np.zeros(T, np.int32) for key in ('inputs', 'targets', 'segment_ids', 'positions', 'pairs')}
    out['weights'] = np.zeros(T, np.float32)
    if self.reference is not None:
      out['ref_logps'] = np.zeros(T, np.float32)
    e, j = divmod(int(k), self.rows_per_epoch)
    fill, segment = 0, 0
    for pair, index in enumerate(self.bins[int(self._order(e)[j])], 1):
      if self.reference is not None:
        out['ref_logps'][fill:fill + self.lengths[index]] = np.frombuffer(self.reference[index], np.float32)
      for sign, (ids, weights) in zip((1, -1), chat_lib.from_pair_record(self.source[index], self.dtype)):
        n = len(ids) - 1
        segment += 1
        out['inputs'][fill:fill + n] = ids[:-1]
        out['targets'][fill:fill + n] = ids[1:]
        out['weights'][fill:fill + n] = weights[1:]
        out['segment_ids'][fill:fill + n] = segment
        out['positions'][fill:fill + n] = np.arange(n, dtype=np.int32)
        out['pairs'][fill:fill + n] = sign * pair
        fill += n
    return out


def _quantize(weights: list[float], total: int = 4096) -> list[int]:
  """Integer weights summing to `total` (largest remainder; a positive weight gets at least 1), gcd-reduced."""
  w = np.asarray(weights, np.float64) / sum(weights) * total
  q = np.floor(w).astype(np.int64)
  for i in np.argsort(-(w - q), kind='stable')[:total - q.sum()]:
    q[i] += 1
  q[(q == 0) & (w > 0)] = 1
  g = math.gcd(*(int(x) for x in q))
  return [int(x) // g for x in q]


class Mixture:
  """Which dataset mixture row k comes from, and its row number there: a smooth weighted round robin.

  Over each period of sum(q) rows dataset d gets exactly q_d rows, spread evenly (nginx's smooth weighted round
  robin), so any prefix of the stream follows the weights closely and row k's source is a function of k alone.
  """

  def __init__(self, weights: list[float]):
    self.q = _quantize(weights)
    self.period = sum(self.q)
    credit = np.zeros(len(self.q), np.int64)
    labels = np.empty(self.period, np.int64)
    for r in range(self.period):
      credit += self.q
      labels[r] = d = int(np.argmax(credit))
      credit[d] -= self.period
    self.labels = labels
    # before[r, d]: rows of dataset d among the first r rows of a period.
    self.before = np.zeros((self.period + 1, len(self.q)), np.int64)
    np.cumsum(np.eye(len(self.q), dtype=np.int64)[labels], axis=0, out=self.before[1:])

  def locate(self, k: int) -> tuple[int, int]:
    """(dataset, row in that dataset's stream) of mixture row k."""
    period, r = divmod(k, self.period)
    d = int(self.labels[r])
    return d, period * self.q[d] + int(self.before[r, d])


class Rows:
  """Mixture row k (a random-access source); rows past the end of a finite stream are padding."""

  def __init__(self, streams: list[DocumentStream], weights: list[float], cross_document_attention: bool):
    self.streams, self.cross = streams, cross_document_attention
    self.mixture = Mixture(weights)
    self.seq_len = streams[0].seq_len
    self.rows_per_epoch = streams[0].rows_per_epoch if len(streams) == 1 else None
    if len(streams) == 1:
      self.rows = streams[0].rows
    elif any(s.rows != INFINITE_ROWS for s in streams):
      raise DataError('num_epochs applies to a single dataset, not to a mixture.')
    else:
      self.rows = INFINITE_ROWS

  def __len__(self) -> int:
    return self.rows

  def __getitem__(self, k: int) -> dict:
    if k >= self.rows:
      row = {key: np.zeros(self.seq_len, np.int32) for key in ('inputs', 'targets', 'segment_ids', 'positions')}
      if isinstance(self.streams[0], PairRows):
        row['pairs'] = np.zeros(self.seq_len, np.int32)
        if self.streams[0].reference is not None:
          row['ref_logps'] = np.zeros(self.seq_len, np.float32)
      if getattr(self.streams[0], 'teacher', None) is not None:
        row.update(teacher_rows(self.seq_len, self.streams[0].teacher_k))
    else:
      d, j = self.mixture.locate(int(k))
      row = self.streams[d].row(j)
    segment_ids, positions = row['segment_ids'], row['positions']
    if self.cross:
      # One segment per row: attention crosses documents (the EOS separators remain), positions are plain.
      segment_ids = (segment_ids > 0).astype(np.int32)
      positions = np.arange(self.seq_len, dtype=np.int32)
    return {'inputs': row['inputs'], 'targets': row['targets'], 'segment_ids': segment_ids,
            'positions': positions, 'weights': row.get('weights', (segment_ids > 0).astype(np.float32)),
            **{k: row[k] for k in ('pairs', 'ref_logps', *TEACHER_KEYS) if k in row}}


class LocalRows:
  """This process's rows of the global batches of `size` rows from row `start`, in order (a Grain source)."""

  def __init__(self, rows: Rows, start: int, size: int, process_index: int, process_count: int,
               batches: int | None = None):
    self.rows, self.start, self.size = rows, start, size
    self.local = size // process_count
    self.offset = process_index * self.local
    self.length = (INFINITE_ROWS if batches is None else batches) * self.local

  def __len__(self) -> int:
    return self.length

  def __getitem__(self, j: int) -> dict:
    batch, i = divmod(int(j), self.local)
    return self.rows[self.start + batch * self.size + self.offset + i]


class BatchIterator(grain.DatasetIterator):
  """This process's rows of each global batch, with the run fields saved beside its position and checked on resume.

  The readers are the subclasses' (pipeline.TrainIterator: prepared shards; lanes.StreamIterator: raw files by
  lanes): `_start(size)` opens one for batches of `size` rows, `take(size)` draws a batch, `get_state` /
  `set_state` save and restore the position.
  """

  def __init__(self, fp: dict, *, unit: int, process_index: int, process_count: int):
    super().__init__()
    self.fingerprint = fp
    self.unit, self.process_index, self.process_count = unit, process_index, process_count
    self.rows = 0  # global rows drawn so far (every process the same)
    self.topology = {'processes': process_count}
    self.expected: dict = {}  # train.batch_size / train.batch_ramp, set by the trainer (see `expect`)
    self.allow_change = False
    self.notes: list[str] = []  # what a resume with allowed data changes skipped or repeated
    self.restored: dict | None = None  # the state last set
    self._it, self._size = None, None

  def expect(self, *, allow_change: bool = False, topology: dict | None = None, **fields) -> None:
    """Run fields saved with the position and checked on restore (e.g. train.batch_size), and this topology."""
    self.expected.update(fields)
    self.topology.update(topology or {})
    self.allow_change = allow_change

  def _start(self, size: int) -> None:
    raise NotImplementedError

  def _stop(self) -> None:
    if self._it is not None and hasattr(self._it, 'close'):
      self._it.close()
    self._it, self._size = None, None

  def _ready_for(self, size: int) -> None:
    """Checks that `size` rows split over the processes and (re)starts the iterator for that batch size."""
    if size % self.process_count:
      raise DataError(f'a batch of {size} rows does not split over {self.process_count} processes; use a '
                      f'multiple of {self.process_count}.')
    if size != self._size:
      self._start(size)

  def take(self, size: int) -> dict:
    raise NotImplementedError

  def __next__(self) -> dict:
    return self.take(self.unit)

  def _changed(self, field: str, old, new, effect: str) -> None:
    if not self.allow_change:
      fix = f'set --config.{field}={old}' if field.startswith(('data.', 'train.')) and not isinstance(old, list) \
          else 'use the original data'
      raise DataError(f'cannot resume exactly: {field} was {_short(old)} when the checkpoint was written, now '
                      f'{_short(new)}. Fix: {fix}, or start a new --workdir, or pass '
                      f'--config.checkpoint.allow_data_change=True to continue ({effect}).')
    self.notes.append(f'{field} changed from {_short(old)} to {_short(new)}: {effect}')

  def close(self) -> None:
    self._stop()


def _short(value) -> str:
  text = json.dumps(value) if not isinstance(value, str) else repr(value)
  return text if len(text) <= 80 else text[:77] + '...'
