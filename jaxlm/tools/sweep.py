"""Sweeps and ablations: a grid of config overrides, one training run per trial.

  python -m jaxlm.tools.sweep --config=configs/palm_small.py --grid optim.lr=1e-3,3e-4 --grid model.d_model=128,256 \
      [--random=N --seed=S] [--set train.steps=100 ...] [--workdir=runs/sweep] [--print_commands]

Every trial is the cartesian product of the --grid values (or N distinct random draws from it) on top of the
--set overrides, validated before anything runs. Trials run one after another on this host, each in its own
`python -m jaxlm.train` process writing to <workdir>/<trial>: a crash is recorded and the sweep goes on. Run
the same command again after an interruption: finished trials are not rerun, unfinished ones resume from their
own checkpoints (train does that by itself). At the end: a table, results.json / results.csv and a bar chart
of held-out loss per trial (sweep.png). --print_commands prints one launch command per trial for a cluster.

Exit codes: 0 every trial finished, 1 some trial did not, 2 a bad sweep or trial config, 130 interrupted.
"""

import collections
import csv
import dataclasses
import itertools
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import time

from absl import flags
import ml_collections

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm import errors
from jaxlm import model as model_lib
from jaxlm.tools import report
from jaxlm import metrics
from jaxlm import rundir
from jaxlm.data import format as format_lib
from jaxlm.rundir import read_metrics

FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program: tests import this module beside jaxlm.train, which owns --config.
  flags.DEFINE_string('config', None, 'Config file every trial starts from, e.g. configs/palm_small.py.')
  flags.DEFINE_multi_string('grid', [], 'A swept field and its values, e.g. optim.lr=1e-3,3e-4; repeat the flag '
                            'for more fields (trials are their cartesian product).')
  flags.DEFINE_multi_string('set', [], 'A fixed override for every trial, e.g. train.steps=100.')
  flags.DEFINE_integer('random', 0, 'Run N distinct trials drawn at random from the grid (0 = all).')
  flags.DEFINE_integer('seed', 0, 'Seed of the --random draw.')
  flags.DEFINE_string('workdir', None, 'Sweep directory; trial runs go in subdirectories. '
                      'Default: runs/<config name>_sweep.')
  flags.DEFINE_boolean('print_commands', False, 'Print one launch command per trial and exit.')
  flags.DEFINE_integer('num_devices', 0, "Devices each trial will see, for validation; 0 = this host's (for "
                       "--print_commands, give the cluster's).")
  flags.DEFINE_integer('num_processes', 1, 'Processes (hosts) each trial runs on, for validation of a '
                       '--print_commands sweep on a multi-host cluster.')


# A field's type -> (its name in messages, absl's parser of its text, as train's `--config.a.b=v` parses it).
_PARSERS = {bool: ('a boolean', flags.BooleanParser()), int: ('an integer', flags.IntegerParser()),
            float: ('a float', flags.FloatParser()), str: ('a string', None)}
PYTHON = 'python'  # interpreter named in --print_commands (a cluster's, not this host's sys.executable)


class SweepError(errors.ConfigError):
  """A sweep that cannot run; the message names the flag or field and the fix."""


@dataclasses.dataclass
class Trial:
  """One point of the sweep: its overrides (grid fields only), resolved config and run directory name."""
  index: int  # position in the full grid, so a random draw keeps its grid order
  name: str  # its directory under the sweep's
  overrides: dict[str, object]  # dotted field -> typed value
  config: ml_collections.ConfigDict


def load_config(path: str) -> ml_collections.ConfigDict:
  """The ConfigDict of a config file (its get_config()), unlocked so overrides can be applied."""
  if not os.path.isfile(path):
    raise SweepError(f'--config={path}: no such file.')
  return cli.load_file(path)


def parse_override(cfg, flag: str, text: str, many: bool) -> tuple[str, list]:
  """'a.b=v1,v2' -> ('a.b', [typed values]); the values take the field's type, as train's flags would."""
  key, eq, values = text.partition('=')
  key = key.strip()
  if not eq or not key or not values:
    raise SweepError(f'--{flag} {text!r}: write it as field=value{",value..." if many else ""}, e.g. '
                     f'{"optim.lr=1e-3,3e-4" if many else "train.steps=100"}.')
  section, _, leaf = key.rpartition('.')
  node = cfg
  for part in section.split('.') if section else ():
    node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
    raise SweepError(f'--{flag} {key}: there is no such config field; see configs/base.py for every key')
  kind = type(node[leaf])
  if kind not in _PARSERS:
    raise SweepError(f'--{flag} {key}: a {kind.__name__} field cannot be swept; sweep one of its fields.')
  kind_name, parser = _PARSERS[kind]
  parsed = []
  for value in values.split(',') if many else [values]:
    try:
      parsed.append(parser.parse(value.strip()) if parser else value.strip())
    except ValueError:
      raise SweepError(f'--{flag} {key}={value}: {key} is {kind_name} field and {value.strip()!r} is not '
                       f'one.') from None
  if len(set(parsed)) != len(parsed):
    raise SweepError(f'--{flag} {key}: a value is repeated in {values!r}.')
  return key, parsed


def format_value(value) -> str:
  """A value as train's `--config.a.b=...` flag reads it back (repr keeps every digit of a float)."""
  return repr(value) if isinstance(value, float) else str(value)


def short_keys(keys: list[str]) -> dict[str, str]:
  """Each dotted field by its shortest suffix that no other of `keys` ends with: 'optim.lr' -> 'lr'."""
  short = {}
  for key in keys:
    parts = key.split('.')
    for n in range(1, len(parts) + 1):
      suffix = '.'.join(parts[-n:])
      if sum(k == suffix or k.endswith('.' + suffix) for k in keys) == 1:
        short[key] = suffix
        break
  return short


def trial_names(keys: list[str], trials: list[dict]) -> list[str]:
  """Readable, unique directory names like 'lr=0.001,d_model=128' (fields by their short_keys)."""
  short = short_keys(keys)
  # Hydra's override_dirname convention (key=value joined by ','); '/' in a value would make a subdirectory.
  return [','.join(f'{short[k]}={format_value(v)}'.replace('/', '_') for k, v in t.items()) or 'base'
          for t in trials]


def expand(cfg, grid: list[str], fixed: list[str], n_random: int = 0, seed: int = 0) -> list[Trial]:
  """The trials of a sweep: cartesian product of `grid` on top of `fixed` (or `n_random` distinct draws)."""
  base = cfg.copy_and_resolve_references()  # the caller's config stays as it was
  axes = [parse_override(base, 'grid', g, many=True) for g in grid]
  sets = [parse_override(base, 'set', s, many=False) for s in fixed]
  keys = [k for k, _ in axes]
  for key, count in collections.Counter(keys + [k for k, _ in sets]).items():
    if count > 1:
      raise SweepError(f'{key} is given more than once in --grid / --set; give each field once.')
  for key, (value,) in sets:
    set_field(base, key, value)
  points = [dict(zip(keys, values)) for values in itertools.product(*(v for _, v in axes))]
  indices = list(range(len(points)))
  if n_random:
    # Distinct draws, reproducible by seed; run in grid order so the table reads like the grid.
    indices = sorted(random.Random(seed).sample(indices, min(n_random, len(points))))
  names = trial_names(keys, points)
  trials = []
  for i in indices:
    c = base.copy_and_resolve_references()
    for key, value in points[i].items():
      set_field(c, key, value)
    trials.append(Trial(index=i, name=names[i], overrides=points[i], config=c))
  return trials


def set_field(cfg, key: str, value) -> None:
  """cfg.a.b = value for key 'a.b'."""
  *path, leaf = key.split('.')
  node = cfg
  for part in path:
    node = node[part]
  node[leaf] = value


def overrides_text(overrides: dict) -> str:
  """'model.d_model=128 optim.lr=0.001', as shown in the table."""
  return ' '.join(f'{k}={format_value(v)}' for k, v in overrides.items()) or '(base config)'


def validate(trials: list[Trial], num_devices: int, num_processes: int = 1) -> None:
  """Runs jaxlm.config.validate on every trial; one SweepError lists each bad trial with its fields."""
  bad = []
  for t in trials:
    try:
      config_lib.validate(t.config, num_devices, num_processes)
    except config_lib.ConfigError as e:
      bad.append(f'trial {t.name} ({overrides_text(t.overrides)}) on {num_devices} devices: {e}')
  if bad:
    raise SweepError('\n'.join(bad))


def local_device_count() -> int:
  """Devices a trial process will see, asked of JAX in a child so this process never holds the accelerator."""
  out = subprocess.run([sys.executable, '-c', 'import jax; print(jax.device_count())'], capture_output=True,
                       text=True, check=True)
  return int(out.stdout.strip().splitlines()[-1])


def train_command(python: str, config_path: str, workdir: str, trial: Trial, fixed: list[str]) -> list[str]:
  """The `python -m jaxlm.train` command line of one trial (fixed overrides first, then the trial's own)."""
  overrides = [s.strip() for s in fixed] + [f'{k}={format_value(v)}' for k, v in trial.overrides.items()]
  return [python, '-m', 'jaxlm.train', f'--config={config_path}', f'--workdir={workdir}',
          *(f'--config.{o}' for o in overrides)]


def finished(workdir: str, steps: int) -> bool:
  """Whether the run in `workdir` reached its last step: train evaluates there, so an eval record says so."""
  return any(r.get('kind') == 'eval' and r.get('step', 0) >= steps for r in read_metrics(workdir))


def results_of(workdir: str) -> dict:
  """Final train loss, latest held-out loss, mean tokens/s and steps from a trial's metrics.jsonl."""
  records = read_metrics(workdir)
  s = report.summarize(records)
  evals = {r['step']: r['eval_loss'] for r in records if r.get('kind') == 'eval'}  # a redone step: later wins
  return {'final_loss': s['final_loss'], 'eval_loss': evals[max(evals)] if evals else None,
          'tokens_per_s': s['mean_tokens_per_s'], 'steps': s['steps']}


class _Runner:
  """Runs one trial's process at a time. Ctrl-C or SIGTERM stops the sweep: the running trial gets the signal
  (train then checkpoints and exits), the trials after it are not started, the results so far are written."""

  SIGNALS = (signal.SIGINT, signal.SIGTERM)

  def __init__(self):
    self.proc = None
    self.stopped = False
    self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

  def _on_signal(self, signum, _):
    self.stopped = True
    if self.proc is not None:  # a Ctrl-C in a terminal reached it already; once more does no harm
      self.proc.send_signal(signum)

  def run(self, command: list[str], log_path: str) -> int:
    """Runs `command` with its output appended to `log_path`; returns its exit code."""
    with open(log_path, 'a') as log:
      log.write(f'\n$ {shlex.join(command)}\n')
      log.flush()
      self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED='1'))
      try:
        return self.proc.wait()
      finally:
        self.proc = None

  def close(self) -> None:
    """Gives the signals back to their previous handlers."""
    for s, handler in self._previous.items():
      signal.signal(s, handler)


def status_of(code: int | None, done: bool, stopped: bool) -> str:
  """A trial's status from its exit code, whether its run reached the last step, and whether it was stopped."""
  if done:
    return 'done'
  if stopped or code == 0:  # exit 0 short of the last step: preempted, checkpointed
    return 'stopped (rerun resumes)'
  if code == 2:
    return 'failed: bad config/input (exit 2)'
  if code < 0:
    return f'failed: killed by {signal.Signals(-code).name}'
  return f'failed (exit {code})'


def run_sweep(trials: list[Trial], config_path: str, fixed: list[str], sweep_dir: str,
              python: str = sys.executable) -> list[dict]:
  """Runs the unfinished trials one after another; returns one result row per trial, in trial order."""
  runner = _Runner()
  try:
    return [_run_trial(runner, n, t, len(trials), config_path, fixed, sweep_dir, python)
            for n, t in enumerate(trials, 1)]
  finally:
    runner.close()


def _run_trial(runner: _Runner, n: int, t: Trial, total: int, config_path: str, fixed: list[str],
               sweep_dir: str, python: str) -> dict:
  """Runs trial `t` unless it is finished (or the sweep was stopped); its result row."""
  workdir = os.path.join(sweep_dir, t.name)
  command = train_command(python, config_path, workdir, t, fixed)
  steps = t.config.train.steps
  params = model_lib.param_count(model_lib.ModelConfig.from_config(t.config.model))  # ablations change it
  row = {'trial': t.index, 'name': t.name, 'overrides': overrides_text(t.overrides), 'params': params,
         'workdir': workdir, 'command': shlex.join(command), 'returncode': None, 'seconds': None}
  prefix = f'[{n}/{total}] {t.name}:'
  if finished(workdir, steps):
    print(f'{prefix} finished in an earlier run, not rerun', flush=True)
    row['status'] = 'done (earlier run)'
  elif runner.stopped:
    row['status'] = 'not run (sweep stopped)'
  else:
    resuming = os.path.exists(rundir.path(workdir, rundir.METRICS))
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, 'train.log')
    print(f'{prefix} {"resuming" if resuming else "running"} (log: {log_path})', flush=True)
    start = time.monotonic()
    row['returncode'] = runner.run(command, log_path)
    row['seconds'] = round(time.monotonic() - start, 1)
    row['status'] = status_of(row['returncode'], finished(workdir, steps), runner.stopped)
    if row['status'] == 'done' and resuming:
      row['status'] = 'done (resumed)'
    print(f'{prefix} {row["status"]} after {row["seconds"]:.0f}s', flush=True)
    if row['status'].startswith('failed'):
      with open(log_path) as f:
        print(''.join('    ' + line for line in f.readlines()[-8:]), end='', flush=True)
  return {**row, **results_of(workdir)}


def _fmt(value, spec: str) -> str:
  return '-' if value is None or not math.isfinite(value) else format(value, spec)


def table(rows: list[dict]) -> str:
  """The results as an aligned text table; the best held-out loss is marked."""
  losses = [r['eval_loss'] for r in rows if r['eval_loss'] is not None and math.isfinite(r['eval_loss'])]
  best = min(losses, default=None)
  header = ('trial', 'overrides', 'params', 'train loss', 'eval loss', 'tokens/s', 'status')
  lines = [(str(r['trial']), r['overrides'], f'{r["params"]:,}', _fmt(r['final_loss'], '.4f'),
            _fmt(r['eval_loss'], '.4f') + (' *' if best is not None and r['eval_loss'] == best else ''),
            _fmt(r['tokens_per_s'], ',.0f'), r['status']) for r in rows]
  right = (True, False, True, True, False, True, False)  # numbers right-aligned; eval loss keeps its '*' last
  out = [metrics.format_table(lines, header=header, right=right, rule=True)]
  if best is not None:
    out.append('* lowest held-out loss')
  return '\n'.join(out)


def plot(rows: list[dict], out: str, title: str) -> None:
  """A horizontal bar chart of held-out loss per trial (trials without one are labelled, not drawn)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')  # no display on a training host
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  losses = [r['eval_loss'] if r['eval_loss'] is not None and math.isfinite(r['eval_loss']) else None
            for r in rows]
  known = [x for x in losses if x is not None]
  fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(rows)))
  best = min(known, default=None)
  y = range(len(rows))
  ax.barh(y, [x or 0.0 for x in losses],
          color=['tab:green' if x is not None and x == best else 'tab:blue' for x in losses])
  for i, (x, r) in enumerate(zip(losses, rows)):
    ax.text(x if x is not None else 0.0, i, f' {x:.4f}' if x is not None else f' {r["status"]}', va='center')
  ax.set_yticks(list(y), [r['name'] for r in rows])
  ax.invert_yaxis()  # first trial on top, as in the table
  if known:
    # Trials of one sweep differ by a few percent: a zero-based axis would hide exactly that.
    low, high = min(known), max(known)
    pad = max(high - low, 0.01 * high)
    ax.set_xlim(max(low - pad, 0.0), high + pad)
  ax.set_xlabel('held-out loss (lower is better)')
  ax.set_title(title)
  ax.grid(axis='x', alpha=0.3)
  fig.tight_layout()
  fig.savefig(out, dpi=100)
  plt.close(fig)


def write_results(rows: list[dict], keys: list[str], trials: list[Trial], sweep_dir: str, spec: dict) -> None:
  """results.json (the sweep's flags and every row) and results.csv (one column per swept field)."""
  format_lib.write_json(os.path.join(sweep_dir, 'results.json'), {**spec, 'trials': rows}, indent=2)
  columns = ['trial', 'name', *keys, 'params', 'final_loss', 'eval_loss', 'tokens_per_s', 'steps', 'status',
             'workdir']
  with open(os.path.join(sweep_dir, 'results.csv'), 'w', newline='') as f:
    w = csv.DictWriter(f, columns, extrasaction='ignore')
    w.writeheader()
    for row, t in zip(rows, trials):
      w.writerow({**row, **{k: format_value(v) for k, v in t.overrides.items()}})


def main(argv):
  """Expands and validates the sweep, then prints its commands or runs it and reports."""
  del argv
  cfg = load_config(FLAGS.config)
  trials = expand(cfg, FLAGS.grid, FLAGS.set, FLAGS.random, FLAGS.seed)
  if FLAGS.random > len(trials):
    print(f'--random={FLAGS.random}, but the grid has only {len(trials)} trials: running them all.')
  validate(trials, FLAGS.num_devices or local_device_count(), FLAGS.num_processes)
  sweep_dir = FLAGS.workdir or os.path.join('runs', f'{cfg.name}_sweep')
  if FLAGS.print_commands:
    for t in trials:
      print(shlex.join(train_command(PYTHON, FLAGS.config, os.path.join(sweep_dir, t.name), t, FLAGS.set)))
    return 0
  os.makedirs(sweep_dir, exist_ok=True)
  print(f'sweep of {len(trials)} trials from {FLAGS.config} in {sweep_dir}', flush=True)
  rows = run_sweep(trials, FLAGS.config, FLAGS.set, sweep_dir)
  keys = list(trials[0].overrides)
  spec = {'config': FLAGS.config, 'grid': FLAGS.grid, 'set': FLAGS.set, 'random': FLAGS.random,
          'seed': FLAGS.seed}
  write_results(rows, keys, trials, sweep_dir, spec)
  png = os.path.join(sweep_dir, 'sweep.png')
  plot(rows, png, f'{cfg.name}: {" × ".join(short_keys(keys).values()) or "base config"}')
  print(table(rows))
  print(f'results: {os.path.join(sweep_dir, "results.json")}, results.csv; chart: {png}')
  if any(r['status'].startswith(('not run', 'stopped')) for r in rows):
    return 130  # interrupted: the same command resumes
  return 0 if all(r['status'].startswith('done') for r in rows) else 1


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('config',))


if __name__ == '__main__':
  console()
