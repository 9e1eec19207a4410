"""Muon against AdamW in quality: reads a finished `jaxlm.tools.sweep` over optim.name × optim.lr and prints
the comparison issue #33 asks for.

  python -m jaxlm.tools.sweep --config=configs/palm_small.py --grid optim.name=adamw,muon \
      --grid optim.lr=1e-3,3e-3,1e-2,3e-2 --set train.eval_every=25 --set optim.schedule=wsd \
      --set optim.ema=0.99 --workdir=runs/optim_sweep
  python bench/optim_quality.py --sweep=runs/optim_sweep [--baseline=adamw --candidate=muon]

Three tables: every trial's final held-out loss (raw and EMA weights); the best run of each optimizer and the
step at which the candidate's best run first reaches the baseline's best final loss (the lower of its raw and
EMA weights'), once with the candidate's raw weights and once with its EMA weights (linearly interpolated between
the two evaluations around it; the baseline needs every step, so the ratio is that step / steps); and,
for each trial, the evaluations of the stable phase (after warmup, before the wsd decay starts) where the EMA
weights' held-out loss is above the raw weights'. Nothing is trained here: the figures are the sweep's own
metrics.jsonl records.
"""

import json
import math
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).absolute().parents[1]))
from absl import app, flags  # noqa: E402

from jaxlm.metrics import format_table  # noqa: E402
from jaxlm.rundir import read_metrics  # noqa: E402
from jaxlm.tools import sweep  # noqa: E402

_SWEEP = flags.DEFINE_string('sweep', 'runs/optim_sweep', 'The sweep directory (its results.json).')
_BASELINE = flags.DEFINE_string('baseline', 'adamw', 'optim.name of the reference optimizer.')
_CANDIDATE = flags.DEFINE_string('candidate', 'muon', 'optim.name of the optimizer compared with it.')


def evals(workdir: str) -> dict[int, dict]:
  """step → that step's eval record (a redone step: the later record wins)."""
  return {r['step']: r for r in read_metrics(workdir) if r.get('kind') == 'eval'}


def reaches(curve: dict[int, dict], target: float, key: str = 'eval_loss') -> float | None:
  """The first step at which `curve`'s held-out loss (`key`: eval_loss for the raw weights, eval_loss_ema for the
  EMA's) is ≤ target, interpolated linearly between evaluations."""
  previous = None
  for step in sorted(s for s in curve if curve[s].get(key) is not None):
    loss = curve[step][key]
    if loss <= target:
      if previous is None:
        return float(step)
      p_step, p_loss = previous
      return p_step + (step - p_step) * (p_loss - target) / (p_loss - loss)
    previous = (step, loss)
  return None


def stable_phase(optim_cfg, steps: int) -> tuple[int, int]:
  """(first, last) step of the schedule's stable phase: after warmup, before a wsd decay (as optimizer.schedule)."""
  decay_start = max(optim_cfg.warmup_steps, int(steps * (1 - optim_cfg.decay_fraction)))
  return optim_cfg.warmup_steps, decay_start if optim_cfg.schedule == 'wsd' else steps


def main(argv):
  del argv
  with open(os.path.join(_SWEEP.value, 'results.json')) as f:
    spec = json.load(f)
  trials = sweep.expand(sweep.load_config(spec['config']), spec['grid'], spec['set'], spec['random'], spec['seed'])
  runs = []
  for t in trials:
    curve = evals(os.path.join(_SWEEP.value, t.name))
    if not curve:
      continue
    last = curve[max(curve)]
    runs.append({'trial': t, 'name': t.config.optim.name, 'lr': t.config.optim.lr, 'curve': curve,
                 'final': last['eval_loss'], 'final_ema': last.get('eval_loss_ema'), 'steps': t.config.train.steps})
  fmt = lambda x, spec='.4f': '-' if x is None or not math.isfinite(x) else format(x, spec)

  print(format_table([(r['name'], f'{r["lr"]:g}', fmt(r['final']), fmt(r['final_ema']), max(r['curve']))
                      for r in runs], header=('optimizer', 'lr', 'final held-out loss', 'EMA weights',
                                              'last eval step'), rule=True))
  best = {}
  for r in runs:
    if math.isfinite(r['final']) and (r['name'] not in best or r['final'] < best[r['name']]['final']):
      best[r['name']] = r
  rows = [(name, f'{r["lr"]:g}', fmt(r['final'])) for name, r in sorted(best.items())]
  print()
  print(format_table(rows, header=('optimizer', 'best lr', 'best final held-out loss'), rule=True))
  if _BASELINE.value in best and _CANDIDATE.value in best:
    base, cand = best[_BASELINE.value], best[_CANDIDATE.value]
    # The baseline's own EMA counts too: the target is the lower of its best run's two final losses.
    target = min(x for x in (base['final'], base['final_ema']) if x is not None and math.isfinite(x))
    print(f'\n{_CANDIDATE.value} (lr {cand["lr"]:g}) reaches {_BASELINE.value}\'s best final held-out loss '
          f'{target:.4f} (lr {base["lr"]:g}, step {base["steps"]}):')
    for weights, key in (('raw weights', 'eval_loss'), ('EMA weights', 'eval_loss_ema')):
      step = reaches(cand['curve'], target, key)
      print(f'  with its {weights} at step '
            + (f'{step:.0f}: {step / base["steps"]:.0%} of the steps' if step is not None else '-: never in this run'))
  print()
  rows = []
  for r in runs:
    first, last = stable_phase(r['trial'].config.optim, r['steps'])
    stable = [s for s in sorted(r['curve']) if first < s <= last and r['curve'][s].get('eval_loss_ema') is not None]
    above = [s for s in stable if r['curve'][s]['eval_loss_ema'] > r['curve'][s]['eval_loss']]
    gaps = [r['curve'][s]['eval_loss_ema'] - r['curve'][s]['eval_loss'] for s in stable]
    rows.append((r['name'], f'{r["lr"]:g}', f'{first + 1}–{last}', len(stable),
                 ', '.join(map(str, above)) or 'none', fmt(min(gaps, default=None), '+.4f'),
                 fmt(max(gaps, default=None), '+.4f')))
  print(format_table(rows, header=('optimizer', 'lr', 'stable steps', 'evals', 'EMA above raw at',
                                   'min EMA−raw', 'max EMA−raw'), rule=True))
  return 0


if __name__ == '__main__':
  app.run(main)
