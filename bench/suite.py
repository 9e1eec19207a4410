"""Where the test suite's time goes: tables from the records tests/timing.py writes.

  JAXLM_TIMING=/tmp/after.jsonl python -m pytest -q -n 3 --dist worksteal -p tests.timing
  python bench/suite.py /tmp/after.jsonl [--before=/tmp/before.jsonl] [--top=25] [--budget=60]

Kinds, summed over tests (seconds): `children` is the CPU time of the processes a test started and waited for
(JAX import, compiles and steps of trainer subprocesses, launchers); `compile` / `trace+lower` the in-process
XLA compile and JAX tracing time; `in-process rest` the test process's other CPU time (steps, data, I/O);
`waiting` the wall time that neither the test process nor its children spent on a CPU (sleeps, timeouts, a
subprocess's start before it is counted, or a loaded machine's queue). With -n N the suite's wall time is about
the summed wall over N, plus collection.

--budget=S: the developer's check of the suite's budget (tests/timing.py: Budget): lists every test whose call
cost over S reference CPU seconds (CPU scaled by the box-speed probe) and exits 1 if one of them is not marked
`slow(reason=...)`. The run itself never fails a test for its cost unless JAXLM_TEST_BUDGET_STRICT=1.
"""

import argparse
import collections
import json
import statistics
import sys


def load(path: str) -> tuple[list[dict], list[float]]:
  """(the test records, the box-speed probes' seconds, sorted): tests/timing.py writes both kinds into one file;
  files from before the probes have none."""
  with open(path) as f:
    lines = [json.loads(line) for line in f if line.strip()]
  return [r for r in lines if 'id' in r], sorted(r['probe_s'] for r in lines if 'probe_s' in r)


def speed_line(after: list[float], before: list[float]) -> str:
  """The probes' median and spread; with both runs' probes, how much slower the box ran for `after`."""
  if not after:
    return 'box speed: no probes in this file'
  median = lambda xs: statistics.median(xs) * 1e3
  line = (f'box speed: fixed-loop probe median {median(after):.0f} ms over {len(after)} probes '
          f'({after[0] * 1e3:.0f}-{after[-1] * 1e3:.0f} ms)')
  if before:
    line += (f'; before {median(before):.0f} ms: this box ran {median(after) / median(before):.2f}x as slow by '
             f'the probe (it catches part of a box\'s drift, not all)')
  return line


def kinds(r: dict) -> dict:
  jax_s = r['compile_s'] + r['trace_s'] + r['lower_s']
  return {'children': r['cpu_children_s'], 'compile': r['compile_s'], 'trace+lower': r['trace_s'] + r['lower_s'],
          'in-process rest': max(0.0, r['cpu_self_s'] - jax_s),
          'waiting': max(0.0, r['wall_s'] - max(r['cpu_self_s'], jax_s) - r['cpu_children_s'])}


def tail_line(records: list[dict]) -> str:
  """When each worker ran out of tests, from the first test's start: a worker idle at the end leaves its core to
  the others, so the spread is the run's tail (files from before the records carried `ended_at` have none)."""
  timed = [r for r in records if 'ended_at' in r]
  if not timed:
    return ''
  start = min(r['ended_at'] - r['wall_s'] for r in timed)
  ends = collections.defaultdict(float)
  for r in timed:
    ends[r['worker']] = max(ends[r['worker']], r['ended_at'] - start)
  done = sorted(ends.values())
  return (f'workers out of tests at {", ".join(f"{t:.0f}" for t in done)} s after the first test started '
          f'(tail: {done[-1] - done[0]:.0f} s with fewer workers than at the start)')


def summary(records: list[dict]) -> dict:
  total = collections.Counter()
  for r in records:
    total.update(kinds(r))
  return dict(total)


def by_file(records: list[dict]) -> dict:
  files = collections.defaultdict(lambda: [0, 0.0])
  for r in records:
    f = files[r['id'].split('::')[0]]
    f[0] += 1
    f[1] += r['wall_s']
  return files


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('after')
  p.add_argument('--before', default='')
  p.add_argument('--top', type=int, default=25)
  p.add_argument('--budget', type=float, default=0.0, help='reference CPU seconds a test; over it (unmarked): exit 1')
  a = p.parse_args()
  after, after_probes = load(a.after)
  before, before_probes = load(a.before) if a.before else ([], [])
  speed = speed_line(after_probes, before_probes)
  wall, workers = sum(r['wall_s'] for r in after), max(len({r['worker'] for r in after}), 1)
  print(f'{len(after)} tests, {wall:.0f} s summed wall ({wall / workers / 60:.1f} min over {workers} workers), '
        f'{sum(r["e2e"] for r in after)} e2e; in-process compiles {sum(r["compiles"] for r in after):.0f}, '
        f'persistent-cache hits {sum(r["cache_hits"] for r in after):.0f}')
  print(speed)
  if line := tail_line(after):
    print(line)
  failed = [r['id'] for r in after if r.get('outcome', 'passed') == 'failed']
  if failed:
    print(f'{len(failed)} failed: ' + ', '.join(failed))
  print(f'\n{"kind":<18}{"after s":>10}{"share":>8}' + (f'{"before s":>10}{"share":>8}' if before else ''))
  sa, sb = summary(after), summary(before) if before else {}
  for k in sa:
    line = f'{k:<18}{sa[k]:>10.0f}{sa[k] / max(sum(sa.values()), 1e-9):>8.0%}'
    if before:
      line += f'{sb.get(k, 0):>10.0f}{sb.get(k, 0) / max(sum(sb.values()), 1e-9):>8.0%}'
    print(line)
  for label, keep in (('e2e', True), ('fast loop', False)):
    part = [r for r in after if r['e2e'] == keep]
    line = f'{label:<18}{sum(r["wall_s"] for r in part):>10.0f} s wall, {len(part)} tests'
    if before:
      was = [r for r in before if r['e2e'] == keep]
      line += f'; before {sum(r["wall_s"] for r in was):.0f} s, {len(was)} tests'
    print(line)
  fa, fb = by_file(after), by_file(before)
  print(f'\n{"file":<48}{"tests":>6}{"wall s":>9}' + (f'{"before":>9}{"ratio":>7}' if before else ''))
  for name, (n, w) in sorted(fa.items(), key=lambda kv: -kv[1][1])[:a.top]:
    line = f'{name:<48}{n:>6}{w:>9.0f}'
    if before and name in fb:
      line += f'{fb[name][1]:>9.0f}{w / max(fb[name][1], 1e-9):>7.2f}'
    print(line)
  print(f'\n{"slowest tests":<100}{"wall s":>8}{"child":>7}{"comp":>7}{"wait":>7}')
  for r in sorted(after, key=lambda r: -r['wall_s'])[:a.top]:
    k = kinds(r)
    print(f'{r["id"][:99]:<100}{r["wall_s"]:>8.1f}{k["children"]:>7.1f}{k["compile"]:>7.1f}{k["waiting"]:>7.1f}')
  if a.budget and not over_budget(after, a.budget):
    sys.exit(1)


def over_budget(records: list[dict], budget: float) -> bool:
  """Prints the tests whose call cost more than `budget`; False if one of them is not marked slow(reason=...)."""
  costed = [r for r in records if 'budget' in r]
  over = sorted((r for r in costed if r['budget']['cost_s'] > budget), key=lambda r: -r['budget']['cost_s'])
  print(f'\nbudget {budget:g} s a test (call CPU at the reference box speed): {len(over)} over, of {len(costed)} '
        'tests costed')
  for r in over:
    b = r['budget']
    print(f'  {b["cost_s"]:7.1f} s  {r["id"]}' + (f'  [slow: {b["slow"]}]' if b['slow'] else '  NOT MARKED SLOW'))
  return all(r['budget']['slow'] for r in over)


if __name__ == '__main__':
  main()
