"""A small corpus with the shapes that real ones have, for the prepare-at-scale and streaming tests."""

import gzip
import json
import os

WORDS = ('alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau '
         'upsilon phi chi psi omega').split()


def text(i: int) -> str:
  """Document i: a few deterministic sentences of varying length."""
  n = 3 + (i * 7) % 23
  words = [WORDS[(i * 31 + j * 17) % len(WORDS)] for j in range(n)]
  return f'Doc {i}. ' + ' '.join(words).capitalize() + f'.\n  Line two of {i} with {i * 13 % 97} things.'


def write(root) -> dict:
  """Writes the corpus under `root`: 8 parquet files of 3 row groups, 3 jsonl files (bad JSON, blank records,
  blank lines), a .jsonl.gz and a txt; returns {'docs': good documents in input order}."""
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  os.makedirs(root, exist_ok=True)
  i, docs = 0, []
  for f in range(8):
    rows = []
    for _ in range(3 * 7 + f):  # row groups of 7 rows (the last shorter)
      rows.append('   ' if i % 29 == 5 else text(i))  # a blank document now and then
      i += 1
    docs += [r for r in rows if r.strip()]
    pq.write_table(pa.table({'text': rows, 'id': list(range(len(rows)))}), os.path.join(root, f'p{f}.parquet'),
                   row_group_size=7)
  for f in range(3):
    with open(os.path.join(root, f'j{f}.jsonl'), 'w') as out:
      for k in range(40):
        if k % 11 == 3:
          out.write('{"text": "broken json\n')
        elif k % 13 == 7:
          out.write('\n')
        elif k % 17 == 9:
          out.write(json.dumps({'text': ''}) + '\n')
        else:
          docs.append(text(i))
          out.write(json.dumps({'text': text(i), 'meta': k}) + '\n')
        i += 1
  with gzip.open(os.path.join(root, 'z.jsonl.gz'), 'wt') as out:
    for _ in range(15):
      docs.append(text(i))
      out.write(json.dumps({'text': text(i)}) + '\n')
      i += 1
  with open(os.path.join(root, 't.txt'), 'w') as out:
    docs.append(text(i) * 3)
    out.write(text(i) * 3)
  return {'docs': docs}
