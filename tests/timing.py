"""Two pytest plugins: one records where each test's time goes (bench/suite.py reads and tabulates it), the
other (Budget, which tests/conftest.py always registers) holds every test to the suite's budget.

`python -m pytest -p tests.timing ...` appends one JSON line per test to $JAXLM_TIMING (default
suite-timing.jsonl): wall seconds of setup + call + teardown, CPU seconds of the test process and of the child
processes it waited for, and the in-process JAX time by phase (tracing, lowering to MLIR, XLA compile) with the
number of compiles and persistent-cache hits, read from jax.monitoring's events.

Every PROBE_EVERY tests (and at a worker's start) it also writes a probe record: the CPU seconds this thread takes
for one fixed pure-Python loop. A shared box's speed moves between hours by more than most changes save (bench/
RESULTS.md, "Test suite"), so two runs' figures are read beside their probes (bench/suite.py prints both and their
ratio; the probe catches part of the drift, not all).

Budget: the suite's budget a test, measured so that neither a busy nor a slower box moves it. A test's cost is the
CPU time of its call (every thread of the test process plus the child processes it waited for: waiting in a queue
for a core is not counted), scaled to the box at its usual speed by the probe (REFERENCE_PROBE_S / this process's
probe; taken again right after any test whose cost comes near the budget, so the scale is the box's speed at
that hour). Tests over the budget are listed by name at the end of every run, with the costliest ones; they fail only
when a developer asks for it (JAXLM_TEST_BUDGET_STRICT=1), and `@pytest.mark.slow(reason=...)` exempts a test even
then. A check of the budget never fails a correct test by itself: a wall-clock guard did, on a busy box (#58).
"""

import json
import os
import resource
import time

import pytest

_EVENTS = {'/jax/core/compile/jaxpr_trace_duration': 'trace_s',
           '/jax/core/compile/jaxpr_to_mlir_module_duration': 'lower_s',
           '/jax/core/compile/backend_compile_duration': 'compile_s'}
_totals = dict.fromkeys([*_EVENTS.values(), 'compiles', 'cache_hits'], 0.0)
_outcomes = {}
_budgets = {}
PROBE_EVERY = 20
_tests_done = [0]


def _on_duration(event, duration, **_):
  if event in _EVENTS:
    _totals[_EVENTS[event]] += duration
    _totals['compiles'] += event.endswith('backend_compile_duration')


def _on_event(event, **_):
  _totals['cache_hits'] += event.endswith('/compilation_cache/cache_hits')


def pytest_configure(config):
  del config
  import jax
  jax.monitoring.register_event_duration_secs_listener(_on_duration)
  jax.monitoring.register_event_listener(_on_event)
  _write(_probe())


def _probe() -> dict:
  """CPU seconds of this thread for a fixed loop (~0.05 s): the box's speed now, whatever else runs beside it."""
  start, total = time.thread_time(), 0
  for i in range(1_000_000):
    total += i
  return dict(probe_s=time.thread_time() - start, worker=os.environ.get('PYTEST_XDIST_WORKER', ''))


def _probe_s() -> float:
  """The probe's seconds, the median of three (one loop can lose its core to an interrupt)."""
  return sorted(_probe()['probe_s'] for _ in range(3))[1]


def _write(record: dict) -> None:
  with open(os.environ.get('JAXLM_TIMING', 'suite-timing.jsonl'), 'a') as f:
    f.write(json.dumps(record) + '\n')


def _cpu(who) -> float:
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def pytest_runtest_logreport(report):
  if report.when == 'call' or report.outcome != 'passed':
    _outcomes.setdefault(report.nodeid, report.outcome)
  if report.when == 'call':  # the budget's cost of the call (Budget, below), for bench/suite.py --budget
    _budgets.update({report.nodeid: value for key, value in report.user_properties if key == BUDGET_KEY})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  before, start = dict(_totals), (time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))
  yield
  record = dict(id=item.nodeid, outcome=_outcomes.pop(item.nodeid, 'passed'),
                e2e=item.get_closest_marker('e2e') is not None,
                wall_s=time.monotonic() - start[0], cpu_self_s=_cpu(resource.RUSAGE_SELF) - start[1],
                cpu_children_s=_cpu(resource.RUSAGE_CHILDREN) - start[2],
                **{k: _totals[k] - before[k] for k in _totals}, worker=os.environ.get('PYTEST_XDIST_WORKER', ''),
                ended_at=time.time())  # the run's timeline: when each worker ran out of tests (bench/suite.py)
  if budget := _budgets.pop(item.nodeid, None):
    record['budget'] = budget
  _write(record)
  _tests_done[0] += 1
  if _tests_done[0] % PROBE_EVERY == 0:
    _write(_probe())


# The probe on the 2-core box at its usual speed (bench/RESULTS.md, "Test suite": 31 ms in runs 21 and 29): the
# speed the budget is counted at.
REFERENCE_PROBE_S = 0.031
NEAR = 0.5  # a test whose cost passes this fraction of the budget is costed again at a fresh probe
BUDGET_KEY = 'jaxlm_budget'  # the report's user_properties entry: what carries a cost from an xdist worker


class Budget:
  """Costs each test's call in reference CPU seconds; reports those over `limit_s`; fails them only if `strict`."""

  def __init__(self, limit_s: float, strict: bool, top: int = 5):
    self.limit_s, self.strict, self.top = limit_s, strict, top
    self.scale = REFERENCE_PROBE_S / _probe_s()  # this process's box against the reference box
    self.costs = []  # (nodeid, cost) from every test's report: this process's or, under xdist, the workers'

  @classmethod
  def from_env(cls) -> 'Budget':
    """JAXLM_TEST_LIMIT_S: the budget a test, reference CPU seconds (default 60; 0: no budget, nothing measured);
    JAXLM_TEST_BUDGET_STRICT=1: a test over it fails."""
    return cls(float(os.environ.get('JAXLM_TEST_LIMIT_S', '60')),
               os.environ.get('JAXLM_TEST_BUDGET_STRICT', '') not in ('', '0'))

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_call(self, item):
    start = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN)
    yield
    item.stash[_CPU] = _cpu(resource.RUSAGE_SELF) + _cpu(resource.RUSAGE_CHILDREN) - start

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_makereport(self, item, call):
    report = (yield).get_result()
    if call.when != 'call' or not self.limit_s or _CPU not in item.stash:
      return
    marker = item.get_closest_marker('slow')
    reason = marker.kwargs.get('reason', '') if marker else ''
    if item.stash[_CPU] * self.scale > self.limit_s * NEAR:
      # A test near the budget is costed at the box's speed now, not the worker's start-up one: the load at start
      # (every worker importing at once) or later (another process joining) moves a core's speed by ~30 %.
      self.scale = REFERENCE_PROBE_S / _probe_s()
    cost = dict(cost_s=item.stash[_CPU] * self.scale, cpu_s=item.stash[_CPU], wall_s=call.duration,
                scale=self.scale, slow=reason)
    report.user_properties.append((BUDGET_KEY, cost))
    if self.strict and report.passed and cost['cost_s'] > self.limit_s and not reason:
      report.outcome = 'failed'
      report.longrepr = (f'{item.nodeid} cost {_describe(cost)}, over the suite\'s budget of {self.limit_s:g} s a '
                         'test (JAXLM_TEST_BUDGET_STRICT=1): make it cheaper, or mark it '
                         '@pytest.mark.slow(reason=...) saying why it must cost this much')

  def pytest_runtest_logreport(self, report):
    if report.when == 'call':
      self.costs += [(report.nodeid, value) for key, value in report.user_properties if key == BUDGET_KEY]

  def pytest_terminal_summary(self, terminalreporter):
    if not self.limit_s or not self.costs:
      return
    write = terminalreporter.write_line
    terminalreporter.section('suite budget')
    over = [(n, c) for n, c in self.costs if c['cost_s'] > self.limit_s]
    write(f'{self.limit_s:g} s a test: CPU of the call (test process + waited-for children) at the reference box '
          f'speed (probe {REFERENCE_PROBE_S * 1e3:.0f} ms; this box x{1 / self.scale:.2f}). '
          + ('Over it fails (JAXLM_TEST_BUDGET_STRICT=1).' if self.strict else
             'Over it is reported, not failed (JAXLM_TEST_BUDGET_STRICT=1 fails it).'))
    for nodeid, c in sorted(over, key=lambda nc: -nc[1]['cost_s']):
      allowed = f' [slow: {c["slow"]}]' if c['slow'] else ''
      write(f'over budget: {nodeid} {_describe(c)}{allowed}')
    unmarked = sum(not c['slow'] for _, c in over)
    write(f'{len(over)} tests over the budget ({unmarked} not marked slow) of {len(self.costs)}; the costliest:')
    for nodeid, c in sorted(self.costs, key=lambda nc: -nc[1]['cost_s'])[:self.top]:
      write(f'  {c["cost_s"]:7.1f} s  {nodeid}')


_CPU = pytest.StashKey[float]()


def _describe(cost: dict) -> str:
  return (f'{cost["cost_s"]:.1f} s (CPU {cost["cpu_s"]:.1f} s x {cost["scale"]:.2f} for the box\'s speed; wall '
          f'{cost["wall_s"]:.1f} s)')
