"""Streaming: train straight from parquet / jsonl / txt, tokenized on the fly, the same batches on any host count.

  units (readers.units: row groups, line ranges, whole files), enumerated from sizes and footers only
  → per epoch e, one seeded order of the units; lane j of K reads units order[j], order[j + K], ...
  → each lane packs its own documents end to end ([EOS] + doc → inputs, doc + [EOS] → targets), into rows of T
  → global row k = row k // K of lane k % K

A global batch of S rows (S divides K) at row R is rows [R, R + S): lane j always lands at batch position j % S, so
process p of P always holds the same lanes and tokenizes only those. The batches are a function of the data, the
seed, K and T: not of the process count. A lane's position is a cursor (epoch, unit, document, token); the
checkpointed position is every lane's cursor, so a resume on another process count reads the same rows.

Chat data (data.stream_format=chat: jsonl conversations) streams as `prepare --format=chat` stores it: each
record rendered through the chat template with its loss weights (chat.encode), cut at a turn end to fit (chat.fit),
and packed whole: a lane adds conversations to its row while the next fits, then pads the row (weight 0) and starts
the next with it, so no conversation is split and attention never crosses one.

What it gives up against `prepare`: no global document shuffle (documents keep their order inside a unit; units
are shuffled per epoch) and no held-out split (evaluate on explicit held-out files).
"""

import collections
import hashlib
import os

import grain
import numpy as np

from jaxlm.data import chat as chat_lib
from jaxlm.data import readers
from jaxlm.data import stream as stream_lib
from jaxlm.errors import DataError

UNITS_OPENED = collections.Counter()  # units read by lanes in this process (start-up reads none: a test checks)


def _unit_order(n: int, seed: int, epoch: int) -> np.ndarray:
  """Epoch `epoch`'s seeded order of n units (Grain's index shuffle)."""
  s = int.from_bytes(hashlib.sha256(f'lanes/{seed}/{epoch}'.encode()).digest()[:4], 'big')
  return stream_lib._shuffled(n, s)  # pylint: disable=protected-access


class Lanes:
  """The units, the tokenizer and the lane layout that every lane iterator of one run shares.

  `units` holds one list of units per dataset of a mixture; each dataset's units are dealt over the K lanes on
  their own, and lane row r comes from dataset d(r) of the mixture's smooth weighted round robin (stream.Mixture),
  so every lane mixes the datasets in the same proportions.
  """

  def __init__(self, units: list[list], tokenizer, *, lanes: int, seq_len: int, seed: int,
               weights: list[float] | None = None, text_field: str = 'text', txt_docs: str = 'file',
               cross_document_attention: bool = False, shuffle: bool = True, chat: tuple | None = None):
    for d, found in enumerate(units):
      if len(found) < lanes:
        raise DataError(f'data.source=stream: dataset {d} of data.paths holds {len(found)} units (parquet row '
                        f'groups, jsonl ranges, files) but data.stream_lanes={lanes}; every lane needs a unit of '
                        f'each dataset: set data.stream_lanes <= {len(found)}, or give more (or smaller) files')
    self.units = [u for found in units for u in found]  # flat: a unit's number is its index here
    starts = np.cumsum([0] + [len(found) for found in units])
    self.dataset_units = [np.arange(starts[d], starts[d + 1]) for d in range(len(units))]
    self.mixture = stream_lib.Mixture(list(weights or [1.0] * len(units)))
    self.tok, self.lanes, self.seq_len, self.seed = tokenizer, lanes, seq_len, seed
    self.text_field, self.txt_docs = text_field, txt_docs
    self.cross, self.shuffle = cross_document_attention, shuffle
    self.chat = chat  # (template, empty_think) for chat data, else None
    self.eos = tokenizer.separator_id
    self._orders = collections.OrderedDict()

  def lane_units(self, lane: int, epoch: int, dataset: int = 0) -> list[int]:
    """Units (flat numbers) lane `lane` reads of `dataset` in `epoch`, in order."""
    key = (dataset, epoch)
    if key not in self._orders:
      mine = self.dataset_units[dataset]
      order = _unit_order(len(mine), self.seed + 7919 * dataset, epoch) if self.shuffle else np.arange(len(mine))
      self._orders[key] = mine[order]
      while len(self._orders) > 2 * len(self.dataset_units):
        self._orders.popitem(last=False)
    return [int(u) for u in self._orders[key][lane::self.lanes]]

  def texts(self, unit: int):
    """The documents of one unit, in order: texts, or for chat data the parsed records of its lines."""
    UNITS_OPENED[unit] += 1
    if self.chat:
      for _, record in readers.read_records(self.units[unit], collections.Counter()):
        yield record
      return
    for _, text in readers.read_unit(self.units[unit], collections.Counter(), text_field=self.text_field,
                                     txt_docs=self.txt_docs):
      yield text

  def lane_documents(self, lane: int, epoch: int, dataset: int = 0):
    """(unit, document index, text) of one lane's epoch of `dataset`, in the order the lane packs them."""
    for u in self.lane_units(lane, epoch, dataset):
      for d, text in enumerate(self.texts(u)):
        yield u, d, text

  def example(self, text) -> tuple[np.ndarray, np.ndarray] | None:
    """A document's inputs [EOS] + ids and targets ids + [EOS], as the prepared stream packs them; for chat data
    a record's (ids, loss weights) as prepare stores them, or None where prepare skips it (a bad record, or one
    with no turn end within seq_len + 1 tokens)."""
    if self.chat:
      template, empty_think = self.chat
      try:
        ids, weights, turn_ends = chat_lib.encode(self.tok, template, chat_lib.messages_of(text),
                                                  empty_think=empty_think)
      except chat_lib.BadRecord:
        return None
      fitted = chat_lib.fit(ids, weights, turn_ends, self.seq_len + 1)
      return None if fitted is None else (fitted[0].astype(np.int32), fitted[1].astype(np.float32))
    ids = stream_lib.strip(np.asarray(self.tok.encode_documents([text])[0], np.int32), self.eos, -1)
    return (np.concatenate([[self.eos], ids]).astype(np.int32),
            np.concatenate([ids, [self.eos]]).astype(np.int32))


START = {'epoch': 0, 'unit': 0, 'doc': 0, 'token': 0}


class LaneIterator(grain.DatasetIterator):
  """One lane's rows; its state is a cursor: the lane's epoch, its unit there, a document in it, a token."""

  def __init__(self, lanes: Lanes, lane: int, dataset: int = 0):
    super().__init__()
    self.lanes, self.lane, self.dataset = lanes, lane, dataset
    self.cursor = dict(START)
    self._docs = None  # the texts of the unit at the cursor, read up to the cursor's document
    self._current = None  # (inputs, targets) of the document at the cursor

  def _next_document(self) -> tuple[np.ndarray, np.ndarray]:
    """The document at the cursor (opening units as needed); advances `unit`/`epoch` past exhausted units."""
    c, empty_units = self.cursor, 0
    while True:
      units = self.lanes.lane_units(self.lane, c['epoch'], self.dataset)
      if self._docs is None:
        texts = self.lanes.texts(units[c['unit']])
        for _ in range(c['doc']):  # a restored cursor: skip the documents before it (read, not tokenized)
          next(texts, None)
        self._docs = texts
      text = next(self._docs, None)
      if text is not None:
        if (example := self.lanes.example(text)) is not None:
          return example
        c['doc'] += 1  # skipped, as prepare skips it (chat data only: text documents are never empty here)
        continue
      self._docs = None
      c['unit'], c['doc'], c['token'] = c['unit'] + 1, 0, 0
      if c['unit'] == len(units):
        c['epoch'], c['unit'] = c['epoch'] + 1, 0
      empty_units += 1
      if empty_units > 2 * len(units):
        raise DataError(f'data.source=stream: lane {self.lane} found no document in any of its units; check '
                        f'data.paths and data.text_field')

  def _next_chat_row(self) -> dict:
    """Whole conversations while the next fits (ids c, weights w add c[:-1], c[1:], w[1:]: stream.ConversationRows'
    layout), then padding; the one that did not fit stays at the cursor and opens the next row."""
    T, c = self.lanes.seq_len, self.cursor
    out = {k: np.zeros(T, np.int32) for k in ('inputs', 'targets', 'segment_ids', 'positions')}
    out['weights'] = np.zeros(T, np.float32)
    fill, segment = 0, 0
    while True:
      if self._current is None:
        self._current = self._next_document()
      ids, weights = self._current
      n = len(ids) - 1  # <= T: chat.fit kept at most T + 1 tokens
      if fill + n > T:
        return out
      segment += 1
      out['inputs'][fill:fill + n], out['targets'][fill:fill + n] = ids[:-1], ids[1:]
      out['weights'][fill:fill + n] = weights[1:]
      out['segment_ids'][fill:fill + n] = segment
      out['positions'][fill:fill + n] = np.arange(n, dtype=np.int32)
      fill += n
      self._current = None
      c['doc'] += 1

  def __next__(self) -> dict:
    if self.lanes.chat:
      return self._next_chat_row()
    T, c = self.lanes.seq_len, self.cursor
    out = {k: np.zeros(T, np.int32) for k in ('inputs', 'targets', 'segment_ids', 'positions')}
    fill, segment = 0, 0
    while fill < T:
      if self._current is None:
        self._current = self._next_document()
      inputs, targets = self._current
      n = min(len(inputs) - c['token'], T - fill)
      segment += 1
      out['inputs'][fill:fill + n] = inputs[c['token']:c['token'] + n]
      out['targets'][fill:fill + n] = targets[c['token']:c['token'] + n]
      out['segment_ids'][fill:fill + n] = segment
      out['positions'][fill:fill + n] = np.arange(n, dtype=np.int32)  # a continued document restarts at 0
      fill, c['token'] = fill + n, c['token'] + n
      if c['token'] == len(inputs):
        self._current = None
        c['doc'], c['token'] = c['doc'] + 1, 0
    if self.lanes.cross:  # one segment per row: attention crosses documents (the separators remain)
      out['segment_ids'][:] = 1
      out['positions'] = np.arange(T, dtype=np.int32)
    out['weights'] = np.ones(T, np.float32)  # a lane's rows are always full
    return out

  def get_state(self) -> dict:
    return dict(self.cursor)

  def set_state(self, state: dict) -> None:
    self.cursor = {k: int(state[k]) for k in START}
    self._docs = self._current = None
    if self.cursor['token']:  # inside a document: read it again up to the cursor
      token = self.cursor['token']
      self.cursor['token'] = 0
      self._current = self._next_document()
      self.cursor['token'] = token


def initial_state(lanes: Lanes) -> dict:
  """A lane's state before its first row."""
  return {'row': 0, 'datasets': [dict(START) for _ in lanes.dataset_units]}


class MixedLane(grain.DatasetIterator):
  """Lane row r from dataset d(r) of the mixture; its state: r and the lane's cursor in each dataset."""

  def __init__(self, lanes: Lanes, lane: int):
    super().__init__()
    self.lanes, self.row = lanes, 0
    self.parts = [LaneIterator(lanes, lane, d) for d in range(len(lanes.dataset_units))]

  def __next__(self) -> dict:
    d, _ = self.lanes.mixture.locate(self.row)
    self.row += 1
    return self.parts[d].__next__()

  def get_state(self) -> dict:
    return {'row': self.row, 'datasets': [p.get_state() for p in self.parts]}

  def set_state(self, state: dict) -> None:
    self.row = int(state['row'])
    for p, s in zip(self.parts, state['datasets'], strict=True):
      p.set_state(s)


class LocalRows(grain.IterDataset):
  """This process's rows of the global batches (of `size` rows, from global row `start`): from its lanes."""

  def __init__(self, lanes: Lanes, *, start: int, size: int, process_index: int, process_count: int,
               cursors: dict):
    super().__init__()
    if lanes.lanes % size:
      raise DataError(f'a batch of {size} rows does not divide data.stream_lanes={lanes.lanes}; use batch sizes '
                      f'that divide it (it defaults to the largest batch size)')
    self.lanes, self.start, self.size = lanes, start, size
    self.local = size // process_count
    self.offset = process_index * self.local
    self.cursors = cursors

  def owned(self) -> list[int]:
    """The lanes this process reads: those whose rows land in its block of every batch."""
    return [j for j in range(self.lanes.lanes) if self.offset <= j % self.size < self.offset + self.local]

  def __iter__(self) -> 'LocalRowsIterator':
    return LocalRowsIterator(self)


class LocalRowsIterator(grain.DatasetIterator):
  """Rows in global order, this process's only; its state: the global row and the owned lanes' cursors."""

  def __init__(self, ds: LocalRows):
    super().__init__()
    self.ds = ds
    self.row = ds.start  # next global row of this process's block
    self.iters = {}
    for j in ds.owned():
      it = MixedLane(ds.lanes, j)
      if str(j) in ds.cursors:
        it.set_state(ds.cursors[str(j)])
      self.iters[j] = it

  def __next__(self) -> dict:
    b, i = divmod(self.row - self.ds.start, self.ds.local)
    k = self.ds.start + b * self.ds.size + self.ds.offset + i  # the global row
    self.row += 1
    return self.iters[k % self.ds.lanes.lanes].__next__()

  def get_state(self) -> dict:
    return {str(j): it.get_state() for j, it in self.iters.items()}

  def set_state(self, state: dict) -> None:
    for j, it in self.iters.items():
      it.set_state(state[str(j)])


def open_lanes(data_cfg, *, seed: int, lanes: int, vocab_size: int, paths: str | None = None,
               shuffle: bool = True) -> tuple[Lanes, dict]:
  """The lanes of `data_cfg` (data.source=stream; `paths` instead of data.paths) and the fingerprint of what
  their rows depend on. Datasets of a mixture are separated by ';' in data.paths, weighted by data.weights."""
  from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  groups = [[p.strip() for p in group.split(',') if p.strip()]
            for group in (data_cfg.paths if paths is None else paths).split(';')]
  if not all(groups):
    raise DataError('data.source=stream needs data.paths: parquet / jsonl / txt files, directories or globs '
                    '(datasets of a mixture separated by ";").')
  if not data_cfg.get('tokenizer'):
    raise DataError('data.source=stream needs data.tokenizer: a SentencePiece .model, a tokenizer.json, or a '
                    'directory holding one (e.g. the one a prepare wrote)')
  weights = None
  if paths is None and data_cfg.get('weights'):
    try:
      weights = [float(w) for w in data_cfg.weights.split(',')]
    except ValueError as e:
      raise DataError(f'data.weights={data_cfg.weights!r} must be comma-separated numbers.') from e
    if len(weights) != len(groups) or any(w < 0 for w in weights) or not sum(weights) > 0:
      raise DataError(f'data.weights={data_cfg.weights!r}: give one non-negative weight per dataset of data.paths '
                      f'({len(groups)}, separated by ";"), not all zero.')
  try:
    sources = [readers.expand_inputs(group) for group in groups]
    tok = tokenizer_lib.load(tokenizer_lib.main_file(os.path.expanduser(data_cfg.tokenizer)))
  except ValueError as e:  # PrepareError is a DataError (a ValueError); a bad tokenizer path a ValueError
    raise DataError(str(e).rstrip('.') + '; check data.paths and data.tokenizer') from e
  if tok.vocab_size > vocab_size:
    raise DataError(f'data.tokenizer {data_cfg.tokenizer} has {tok.vocab_size} ids but model.vocab_size='
                    f'{vocab_size}; set --config.model.vocab_size={tok.vocab_size} (or more)')
  text_field = data_cfg.get('text_field', 'text')
  units = [[u for s in found for u in readers.units(s, collections.Counter(), text_field=text_field)]
           for found in sources]
  chat = None
  if data_cfg.get('stream_format', 'text') == 'chat':
    try:
      template = chat_lib.template_of(tok, data_cfg.get('chat_template') or None)
    except ValueError as e:
      raise DataError(f'{e}; check data.chat_template') from e
    if template is None:
      raise DataError(f'data.tokenizer {data_cfg.tokenizer} has no chat template; set data.chat_template (chatml, '
                      f'llama3) or give the model\'s tokenizer directory')
    chat = (template, data_cfg.get('empty_think', 'mask'))
  result = Lanes(units, tok, lanes=lanes, seq_len=data_cfg.seq_len, seed=seed, weights=weights,
                 text_field=text_field, cross_document_attention=data_cfg.cross_document_attention,
                 shuffle=shuffle, chat=chat)
  fp = {'data.seq_len': data_cfg.seq_len, 'train.seed': seed, 'tokenizer': tok.sha256, 'data.stream_lanes': lanes,
        'data.paths': [[[s.key, s.size] for s in found] for found in sources], 'data.weights': result.mixture.q}
  if chat:  # what a chat row holds depends on the template too
    fp['chat'] = [hashlib.sha256(chat[0].encode()).hexdigest()[:16], chat[1]]
  return result, fp


class StreamIterator(stream_lib.BatchIterator):
  """data.source=stream: this process's rows of each global batch, from the lanes it holds.

  Its state: the global row, and the cursors of this process's lanes; the checkpoint joins every process's
  cursors (checkpoint._read_data), so a resume on any process count finds each lane's cursor.
  """

  def __init__(self, lanes: Lanes, fp: dict, *, unit: int, process_index: int, process_count: int):
    super().__init__(fp, unit=unit, process_index=process_index, process_count=process_count)
    self.lanes = lanes
    self.cursors: dict = {}  # lane -> cursor, where the lanes start (restored ones)

  def _local(self, size: int) -> LocalRows:
    return LocalRows(self.lanes, start=self.rows, size=size, process_index=self.process_index,
                     process_count=self.process_count, cursors=self.cursors)

  def _start(self, size: int) -> None:
    if self._it is not None:
      if self.process_count > 1 and self._local(size).owned() != self._local(self._size).owned():
        raise DataError(f'data.source=stream: a batch of {size} rows moves lanes between processes (from batches '
                        f'of {self._size}); with several processes keep one batch size (no train.batch_ramp)')
      self.cursors.update(self._it.get_state())
    self._stop()
    ds = self._local(size).batch(size // self.process_count, drop_remainder=True)
    self._it, self._size = iter(ds), size

  def epoch(self) -> float | None:
    return None

  def take(self, size: int) -> dict:
    self._ready_for(size)
    batch = next(self._it)
    self.rows += size
    return batch

  def get_state(self) -> dict:
    if self._it is not None:
      lanes = self._it.get_state()
    else:
      owned = self._local(self.unit).owned()
      lanes = {str(j): self.cursors.get(str(j), initial_state(self.lanes)) for j in owned}
    return {'format': stream_lib.STATE_FORMAT, 'rows': self.rows, 'tokens': self.rows * self.lanes.seq_len,
            'fields': {**self.fingerprint, **self.expected}, 'topology': self.topology, 'lanes': lanes}

  def set_state(self, state: dict) -> None:
    """Continues every lane at its saved cursor; refuses (DataError) what cannot continue exactly."""
    self._stop()
    self.notes, self.restored = [], state
    saved, now = state.get('fields', {}), {**self.fingerprint, **self.expected}
    changed = [f for f in now if f in saved and saved[f] != now[f]]
    for field in changed:
      self._changed(field, saved[field], now[field], 'the lanes start again from their first unit')
    if changed or 'lanes' not in state:
      self.rows, self.cursors = 0, {}
      self.notes.append('the stream starts again at row 0 (documents seen before are repeated)')
      return
    self.rows, self.cursors = int(state['rows']), dict(state['lanes'])
    missing = [j for j in self._local(self.unit).owned() if str(j) not in self.cursors]
    if missing:
      raise DataError(f'the checkpoint\'s data position has no cursor for lanes {missing[:8]}: not every process '
                      f'saved its lanes; resume from an older checkpoint')


def eval_batches(data_cfg, *, batch_size: int, num_batches: int, vocab_size: int, local: int,
                 process_index: int) -> list[dict]:
  """data.source=stream: data.eval_paths (held-out files) packed in order by one lane, cycled if short."""
  if not data_cfg.get('eval_paths'):
    raise DataError('data.source=stream has no held-out split: set data.eval_paths to held-out files (kept out '
                    'of data.paths)')
  lanes, _ = open_lanes(data_cfg, seed=0, lanes=1, vocab_size=vocab_size, paths=data_cfg.eval_paths, shuffle=False)
  it = LaneIterator(lanes, 0)
  rows = [next(it) for _ in range(batch_size * num_batches)]
  return [{k: np.stack([r[k] for r in rows[b * batch_size:(b + 1) * batch_size]])[
      process_index * local:(process_index + 1) * local] for k in rows[0]} for b in range(num_batches)]
