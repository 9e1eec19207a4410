"""Show the first training batches as the model sees them: `python -m jaxlm.tools.show_batch --config=FILE`.

  python -m jaxlm.tools.show_batch --config=configs/sft_example.py [--batches=N] [--json]

Each row of each batch is decoded segment by segment (a segment is one document or conversation: attention does
not cross it). Tokens the loss ignores (weight 0: prompts, system and template tokens, padding) are shown inside
«…»; every other token is trained on. `--json` prints one JSON record per row instead: `ids` (the inputs),
`targets`, `weights`, `segment_ids` and `text`. Reads the data exactly as `python -m jaxlm.train` does (same
seed, same order); touches no accelerator.
"""

import json
from collections.abc import Sequence

import numpy as np
from absl import flags
from ml_collections import config_flags

from jaxlm import cli
from jaxlm.data import pipeline as data_lib

MASK_OPEN, MASK_CLOSE = '«', '»'


def batches(cfg, count: int) -> list[dict]:
  """The first `count` global training batches of `cfg` (numpy, all rows)."""
  it = data_lib.make_train_iterator(cfg.data, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                                    vocab_size=cfg.model.vocab_size, process_index=0, process_count=1)
  try:
    return [it.take(cfg.train.batch_size) for _ in range(count)]
  finally:
    if hasattr(it, 'close'):
      it.close()


def segments(row: dict) -> list[np.ndarray]:
  """Index arrays of each segment of a row, in order (padding left out)."""
  ids = row['segment_ids']
  starts = np.flatnonzero((ids > 0) & np.concatenate([[True], ids[1:] != ids[:-1]]))
  return [np.arange(s, s + int(np.argmax(np.concatenate([ids[s:] != ids[s], [True]])))) for s in starts]


def render_row(row: dict, decode) -> str:
  """A row as text: each segment's first input token, then its targets, loss-masked runs inside «…»."""
  out = []
  for k, at in enumerate(segments(row)):
    ids = np.concatenate([row['inputs'][at[:1]], row['targets'][at]])  # the segment's tokens, in order
    weights = np.concatenate([[0.0], row['weights'][at]])  # the first input token is never a target
    runs, start = [], 0
    for i in range(1, len(ids) + 1):
      if i == len(ids) or (weights[i] > 0) != (weights[start] > 0):
        text = decode(ids[start:i].tolist())
        runs.append(text if weights[start] > 0 else f'{MASK_OPEN}{text}{MASK_CLOSE}')
        start = i
    trained = int((row['weights'][at] > 0).sum())
    out.append(f'── segment {k + 1}: {len(at)} tokens, {trained} trained ──\n{"".join(runs)}')
  return '\n'.join(out)


def main(argv: Sequence[str]) -> None:
  del argv
  cfg = _CONFIG.value
  tokenizer = data_lib.load_tokenizer(cfg.data, cfg.model.vocab_size)
  for b, batch in enumerate(batches(cfg, _BATCHES.value)):
    for r in range(len(batch['inputs'])):
      row = {k: v[r] for k, v in batch.items()}
      if _JSON.value:
        print(json.dumps({'batch': b, 'row': r, 'ids': row['inputs'].tolist(), 'targets': row['targets'].tolist(),
                          'weights': row['weights'].tolist(), 'segment_ids': row['segment_ids'].tolist(),
                          'text': tokenizer.decode(row['inputs'][row['segment_ids'] > 0].tolist())}))
        continue
      weighted, real = int((row['weights'] > 0).sum()), int((row['segment_ids'] > 0).sum())
      print(f'=== batch {b} row {r}: {len(segments(row))} segments, {real} tokens ({len(row["inputs"]) - real} '
            f'padding), {weighted} trained; {MASK_OPEN}…{MASK_CLOSE} = not in the loss ===')
      print(render_row(row, tokenizer.decode))


_CONFIG = _BATCHES = _JSON = None


def _define_flags() -> None:
  # Defined only when run as a program (importing this module defines no flags).
  global _CONFIG, _BATCHES, _JSON
  _CONFIG = config_flags.DEFINE_config_file('config', None, 'Config file, e.g. configs/sft_example.py.')
  _BATCHES = flags.DEFINE_integer('batches', 1, 'How many batches to show.')
  _JSON = flags.DEFINE_bool('json', False, 'One JSON record per row (ids, targets, weights, segment_ids, text).')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('config',))


if __name__ == '__main__':
  console()
