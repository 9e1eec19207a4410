"""A pytest plugin that records where each test's time goes (bench/suite.py reads and tabulates it).

`python -m pytest -p tests.timing ...` appends one JSON line per test to $JAXLM_TIMING (default
suite-timing.jsonl): wall seconds of setup + call + teardown, CPU seconds of the test process and of the child
processes it waited for, and the in-process JAX time by phase (tracing, lowering to MLIR, XLA compile) with the
number of compiles and persistent-cache hits, read from jax.monitoring's events.

Every PROBE_EVERY tests (and at a worker's start) it also writes a probe record: the CPU seconds this thread takes
for one fixed pure-Python loop. A shared box's speed moves between hours by more than most changes save (bench/
RESULTS.md, "Test suite"), so two runs' figures are read beside their probes (bench/suite.py prints both and their
ratio; the probe catches part of the drift, not all).
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


def _write(record: dict) -> None:
  with open(os.environ.get('JAXLM_TIMING', 'suite-timing.jsonl'), 'a') as f:
    f.write(json.dumps(record) + '\n')


def _cpu(who) -> float:
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def pytest_runtest_logreport(report):
  if report.when == 'call' or report.outcome != 'passed':
    _outcomes.setdefault(report.nodeid, report.outcome)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  del nextitem
  before, start = dict(_totals), (time.monotonic(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN))
  yield
  record = dict(id=item.nodeid, outcome=_outcomes.pop(item.nodeid, 'passed'),
                e2e=item.get_closest_marker('e2e') is not None,
                wall_s=time.monotonic() - start[0], cpu_self_s=_cpu(resource.RUSAGE_SELF) - start[1],
                cpu_children_s=_cpu(resource.RUSAGE_CHILDREN) - start[2],
                **{k: _totals[k] - before[k] for k in _totals}, worker=os.environ.get('PYTEST_XDIST_WORKER', ''))
  _write(record)
  _tests_done[0] += 1
  if _tests_done[0] % PROBE_EVERY == 0:
    _write(_probe())
