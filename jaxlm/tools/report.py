"""Summary of a run from its metrics.jsonl: a table on stdout and a PNG of the curves.

  python -m jaxlm.tools.report --workdir=runs/base [--out=runs/base/report.png]
"""

import collections
import math
import os
import tempfile
import statistics

from absl import flags

from jaxlm import cli
from jaxlm import errors
from jaxlm import metrics
from jaxlm import rundir
from jaxlm.data import storage
from jaxlm.rundir import latest_by_step as _by_step, read_metrics


def _mean(values: list) -> float | None:
  values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
  return statistics.fmean(values) if values else None


def summarize(records: list[dict]) -> dict:
  """Headline numbers of a run: steps, losses, tokens, throughput, MFU, goodput, events by name."""
  train, evals = _by_step(records, 'train'), _by_step(records, 'eval')
  s = {'steps': train[-1]['step'] if train else 0,
       'final_loss': train[-1]['loss'] if train else None,
       'tokens': train[-1].get('tokens') if train else None,
       'epochs': train[-1].get('epoch') if train else None,  # train.epochs runs only
       'mean_tokens_per_s': _mean([r['tokens_per_s'] for r in train]),
       'mean_mfu': _mean([r.get('mfu') for r in train]),
       'mean_mfu_causal': _mean([r.get('mfu_causal') for r in train])}
  best = min((r for r in evals if math.isfinite(r['eval_loss'])), key=lambda r: r['eval_loss'], default=None)
  s['best_eval_loss'], s['best_eval_step'] = (best['eval_loss'], best['step']) if best else (None, None)
  # Goodput over all restarts: each process's accounting starts at its own start, so a drop in wall_s marks
  # a new process; sum the last report of each.
  segments = []
  for r in records:
    if 'wall_s' in r and 'step_s' in r:
      if not segments or r['wall_s'] < segments[-1]['wall_s']:
        segments.append(r)
      else:
        segments[-1] = r
  wall = sum(r['wall_s'] for r in segments)
  s['goodput'] = sum(r['step_s'] for r in segments) / wall if wall > 0 else None
  s['processes'] = len(segments)
  s['events'] = dict(collections.Counter(r['event'] for r in records if r.get('kind') == 'event'))
  return s


def _fmt(value, spec: str = '.4f', suffix: str = '') -> str:
  return '-' if value is None else f'{value:{spec}}{suffix}'


def summary_table(s: dict) -> str:
  """The summary as aligned 'name  value' rows."""
  pct = lambda x: None if x is None else 100 * x  # noqa: E731
  rows = [
      ('steps', str(s['steps'])),
      ('final loss', _fmt(s['final_loss'])),
      ('best eval loss', _fmt(s['best_eval_loss']) + (f' (step {s["best_eval_step"]})' if s['best_eval_step']
                                                      is not None else '')),
      ('tokens', _fmt(s['tokens'], ',')),
      *([('epochs', _fmt(s['epochs'], '.2f'))] if s.get('epochs') is not None else []),
      ('mean tokens/s', _fmt(s['mean_tokens_per_s'], ',.0f')),
      ('mean MFU', _fmt(pct(s['mean_mfu']), '.1f', '%')),
      ('mean MFU (causal)', _fmt(pct(s['mean_mfu_causal']), '.1f', '%')),
      ('goodput', _fmt(pct(s['goodput']), '.1f', '%') + (f' over {s["processes"]} processes'
                                                         if s['processes'] > 1 else '')),
      ('events', ', '.join(f'{k} {v}' for k, v in sorted(s['events'].items())) or 'none'),
  ]
  return metrics.format_table(rows)


GEN_KEYS = ('perplexity', 'coherence_loglik', 'coherence_cosine', 'mauve', 'token_rep_4', 'token_diversity',
            'token_seq_rep_4', 'rep_4', 'diversity', 'distinct_2')  # the Generations table's columns, when logged


def generations(records: list[dict], samples: int = 3) -> str:
  """The Generations section (train.gen_eval): metrics by step with the human row, a few samples of the last
  step, and warnings where repetition or diversity leaves the human range; '' when the run logged none."""
  from jaxlm import textgen  # pylint: disable=import-outside-toplevel
  gens = _by_step(records, 'gen')
  if not gens:
    return ''
  keys = [k for k in GEN_KEYS if any(k in r for r in gens)]
  fmt = lambda v: '-' if v is None else f'{v:.4f}'  # noqa: E731
  rows = [(str(r['step']), *(fmt(r.get(k)) for k in keys)) for r in gens]
  rows.append(('human', *(fmt(gens[-1].get(f'human_{k}')) for k in keys)))
  lines = ['Generations (train.gen_eval; scored by the run itself):',
           metrics.format_table(rows, header=('step', *keys), right=(True,) * (len(keys) + 1), rule=True)]
  last = gens[-1]['step']
  shown = [r for r in records if r.get('kind') == 'event' and r.get('event') == 'gen_sample' and r['step'] == last]
  for r in shown[:samples]:
    lines.append(f'  step {last}: {r.get("prompt")!r} -> {r.get("completion")!r}')
    lines.append(f'      human: {r.get("human")!r}')
  model = {k: gens[-1].get(k) for k in gens[-1]}
  human = {k[len('human_'):]: v for k, v in gens[-1].items() if k.startswith('human_')}
  lines += [f'WARNING step {last}: {w}' for w in textgen.warnings(model, human)]
  return '\n'.join(lines)


def harness_keys(evals: list[dict]) -> list[str]:
  """The harness/<task>/<metric> keys the eval records carry (train.harness_tasks), in first-seen order."""
  return list(dict.fromkeys(k for r in evals for k in r if k.startswith('harness/')))


def harness(records: list[dict]) -> str:
  """The Harness section (train.harness_tasks): each lm-eval metric by step; '' when the run logged none."""
  evals = [r for r in _by_step(records, 'eval') if any(k.startswith('harness/') for k in r)]
  keys = harness_keys(evals)
  if not keys:
    return ''
  rows = [(str(r['step']), *('-' if r.get(k) is None else f'{r[k]:.4f}' for k in keys)) for r in evals]
  header = ('step', *(k.removeprefix('harness/') for k in keys))
  return '\n'.join(['Harness (train.harness_tasks; lm-eval tasks scored by the run itself):',
                    metrics.format_table(rows, header=header, right=(True,) * len(header), rule=True)])


def plot(records: list[dict], out: str) -> None:
  """Writes a PNG of loss (with eval loss), learning rate, gradient norm and tokens/s over steps, and of the
  harness metrics (train.harness_tasks) when the run logged any."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')  # no display on a training host
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  train, evals = _by_step(records, 'train'), _by_step(records, 'eval')
  steps = [r['step'] for r in train]
  keys = harness_keys(evals)
  fig, axes = plt.subplots(3 if keys else 2, 2, figsize=(11, 10.5 if keys else 7), sharex=True)
  panels = (('loss', 'loss'), ('lr', 'learning rate'), ('grad_norm', 'gradient norm'),
            ('tokens_per_s', 'tokens/s'))
  for ax, (key, title) in zip(axes.flat, panels):
    ax.plot(steps, [r[key] for r in train], label='train' if key == 'loss' else None)
    ax.set_title(title)
    ax.grid(alpha=0.3)
  if evals:
    axes[0, 0].plot([r['step'] for r in evals], [r['eval_loss'] for r in evals], 'o-', label='eval')
  axes[0, 0].legend()
  for ax, bounded in zip(axes[2] if keys else (), (True, False)):  # scores in [0, 1] apart from perplexities
    shown = [k for k in keys if all(0 <= r[k] <= 1 for r in evals if k in r) == bounded]
    for k in shown:
      ax.plot([r['step'] for r in evals if k in r], [r[k] for r in evals if k in r], 'o-', label=k[8:])
    ax.set_title('harness scores' if bounded else 'harness (other)')
    ax.grid(alpha=0.3)
    if shown:
      ax.legend(fontsize='small')
  for ax in axes[-1]:
    ax.set_xlabel('step')
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)


def report(workdir: str, out: str = '') -> str:
  """Prints the summary table of `workdir`'s metrics.jsonl and writes the plot; returns the PNG's path."""
  metrics = rundir.path(workdir, rundir.METRICS)
  if not (storage.exists(metrics) or storage.is_url(metrics) and storage.isdir(f'{metrics}.d')):
    raise rundir.RunDirError(f'no metrics.jsonl in {workdir}; give the --workdir of a run')
  records = read_metrics(workdir)
  print(summary_table(summarize(records)))
  for section in (generations(records), harness(records)):
    if section:
      print(section)
  out = out or rundir.path(workdir, 'report.png')
  try:
    if storage.is_url(out):  # matplotlib writes local files: plot beside, then upload
      with tempfile.TemporaryDirectory() as tmp:
        plot(records, os.path.join(tmp, 'report.png'))
        storage.upload(os.path.join(tmp, 'report.png'), out)
    else:
      plot(records, out)
  except OSError as e:
    raise errors.StorageError(f'cannot write {out} ({type(e).__name__}: {e}); pass --out on a writable disk') from e
  print(f'plot: {out}')
  return out


def main(argv) -> None:
  del argv
  report(flags.FLAGS.workdir, flags.FLAGS.out)


def _define_flags() -> None:
  flags.DEFINE_string('workdir', None, 'The run directory holding metrics.jsonl.')
  flags.DEFINE_string('out', '', 'PNG path (default <workdir>/report.png).')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('workdir',))


if __name__ == '__main__':
  console()
