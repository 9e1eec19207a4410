"""The work of a prepare, cut so that any engine can do it: units → counts → shards (a pure function) → tasks.

  units        parquet row groups (from footers), jsonl line ranges (from file sizes), whole txt / .gz files
  line_count   the lines of a jsonl range that another range of its file follows (they number its documents)
  count_unit   reads one unit: its documents per split (the held-out split is a hash of each document's
               key) and what it dropped; the driver keeps these few numbers per unit, never a list of documents
  plan_shards  pure: the documents of each split, in input order, cut every `shard_docs` into shards; a shard is
               a list of pieces (unit, split, first, last) of that unit's documents of that split
  read_piece   the texts (or chat records) of one piece, which a shard task hands to the one shard writer

Documents are numbered, split and cut exactly as a single sequential pass over the inputs does, so the shards do
not depend on the engine, the number of workers, or how units are sized.
"""

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

from jaxlm.data import readers
from jaxlm.data.readers import Unit

SPLITS = ('train', 'eval')


def is_eval(key: str, eval_fraction: float) -> bool:
  """Whether the document named `key` is held out: a hash of the name, so stable across runs and machines."""
  h = int.from_bytes(hashlib.sha256(key.encode('utf-8')).digest()[:8], 'big')
  return h < eval_fraction * 2.0**64


@dataclasses.dataclass(frozen=True)
class Reading:
  """How documents are read from a unit (prepare's flags that decide it)."""
  text_field: str = 'text'
  txt_docs: str = 'file'
  data_format: str = 'text'  # chat: jsonl records, parsed but not cleaned
  eval_fraction: float = 0.02


@dataclasses.dataclass
class UnitCount:
  """What reading one unit found: its documents per split, and what it dropped or repaired."""
  split: dict[str, int]
  counts: collections.Counter

  @property
  def documents(self) -> int:
    return sum(self.split.values())


def items(unit: Unit, reading: Reading, counts: dict, line_offset: int = 0):
  """(index, text or chat record) of one unit's documents; `line_offset` numbers a jsonl range's lines."""
  if reading.data_format in ('chat', 'preference'):  # jsonl records, rendered by the tokenizer's template
    for key, record in readers.read_records(unit, counts, line_offset):
      yield int(key.rsplit(':', 1)[1]), record
    return
  yield from readers.read_unit(unit, counts, text_field=reading.text_field, txt_docs=reading.txt_docs,
                               line_offset=line_offset)


def needs_line_count(unit: Unit) -> bool:
  """Whether another range of the unit's file follows it (and so numbers its lines after this one's)."""
  return unit.kind == 'jsonl' and 0 <= unit.end < unit.source.size


def line_offsets(units: Sequence[Unit], lines: Sequence[int]) -> list[int]:
  """Lines of the same file before each unit (jsonl ranges; 0 elsewhere), from each unit's line count."""
  out, seen = [], collections.Counter()
  for unit, n in zip(units, lines):
    out.append(seen[unit.source.key])
    seen[unit.source.key] += n
  return out


def count_unit(unit: Unit, reading: Reading, line_offset: int = 0) -> UnitCount:
  """Reads one unit once: its documents per split, and its drops."""
  counts, n_eval, n = collections.Counter(), 0, 0
  for i, _ in items(unit, reading, counts, line_offset):
    n += 1
    n_eval += is_eval(readers.doc_key(unit.source.key, i), reading.eval_fraction)
  return UnitCount(split={'train': n - n_eval, 'eval': n_eval}, counts=counts)


@dataclasses.dataclass(frozen=True)
class Piece:
  """Documents [first, last) of one split, counted inside one unit."""
  unit: int
  split: str
  first: int
  last: int


def plan_shards(per_unit: Sequence[dict[str, int]], shard_docs: int) -> dict[str, list[list[Piece]]]:
  """Per split, its shards: each the pieces of consecutive units that fill `shard_docs` documents (the last
  shard of a split may hold fewer). A pure function of the counts."""
  plan = {}
  for split in SPLITS:
    shards, current, fill = [], [], 0
    for u, counts in enumerate(per_unit):
      first, n = 0, counts[split]
      while first < n:
        take = min(n - first, shard_docs - fill)
        current.append(Piece(u, split, first, first + take))
        first, fill = first + take, fill + take
        if fill == shard_docs:
          shards.append(current)
          current, fill = [], 0
    if current:
      shards.append(current)
    plan[split] = shards
  return plan


def read_piece(unit: Unit, piece: Piece, line_offset: int, reading: Reading) -> list:
  """The documents (texts, or chat records) of one piece, in order."""
  out, n, want_eval = [], 0, piece.split == 'eval'
  key = unit.source.key
  for i, item in items(unit, reading, collections.Counter(), line_offset):
    if is_eval(readers.doc_key(key, i), reading.eval_fraction) != want_eval:
      continue
    if n >= piece.first:
      out.append(item)
    n += 1
    if n == piece.last:
      break
  return out
