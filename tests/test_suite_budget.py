"""The suite's budget (tests/timing.py: Budget) reports a test over it by name and never fails it, unless a
developer asks (JAXLM_TEST_BUDGET_STRICT=1); `slow(reason=...)` exempts it even then."""

from tests.conftest import ROOT

pytest_plugins = ['pytester']

# A dummy suite: one test burns ~0.3 s of CPU in pure Python against a 0.1 s budget, one is cheap, one is as
# costly but marked slow. Its conftest registers the budget as tests/conftest.py does, from the environment.
DUMMY = {
    'conftest': f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests import timing

def pytest_configure(config):
  config.pluginmanager.register(timing.Budget.from_env(), 'jaxlm-budget')
""",
    'test_dummy': """
import time
import pytest

def burn(seconds):
  end = time.thread_time() + seconds
  while time.thread_time() < end:
    pass

def test_costly():
  burn(0.3)

@pytest.mark.slow(reason='a dummy that must cost this much')
def test_costly_but_marked():
  burn(0.3)

def test_cheap():
  pass
""",
}


def _dummy_suite(pytester, monkeypatch, strict: bool):
  monkeypatch.setenv('JAXLM_TEST_LIMIT_S', '0.1')
  monkeypatch.setenv('JAXLM_TEST_BUDGET_STRICT', '1' if strict else '0')
  monkeypatch.setenv('PYTEST_DISABLE_PLUGIN_AUTOLOAD', '1')  # none of the environment's plugins: ~2 s less
  pytester.makepyfile(**DUMMY)
  result = pytester.runpytest('-p', 'no:cacheprovider', '-q')
  print(result.stdout.str())
  return result


def test_a_test_over_the_budget_passes_and_is_reported_by_name(pytester, monkeypatch):
  result = _dummy_suite(pytester, monkeypatch, strict=False)
  result.assert_outcomes(passed=3)
  for line in ('*= suite budget =*', '*reported, not failed*', 'over budget: test_dummy.py::test_costly *',
               'over budget: test_dummy.py::test_costly_but_marked *[[]slow: a dummy that must*',
               '2 tests over the budget (1 not marked slow) of 3*'):
    result.stdout.fnmatch_lines([line])  # one at a time: the report orders tests by cost
  assert 'over budget: test_dummy.py::test_cheap' not in result.stdout.str()


def test_a_test_over_the_budget_fails_when_a_developer_asks(pytester, monkeypatch):
  result = _dummy_suite(pytester, monkeypatch, strict=True)
  result.assert_outcomes(passed=2, failed=1)  # the marked one still passes
  result.stdout.fnmatch_lines(['*test_dummy.py::test_costly cost *over the suite\'s budget of 0.1 s*',
                               'FAILED test_dummy.py::test_costly*'])


def test_a_test_near_the_budget_is_costed_at_the_box_speed_of_its_hour(pytester, monkeypatch):
  """The worker's first probe read the box twice as slow as it runs by the time a test near the budget ends (every
  worker was importing at once): that test is costed at a fresh probe, so it is reported at its true cost instead of
  half of it (the busy run of #58 costed a deliberately slow test 55.5 s against a 60 s budget this way)."""
  monkeypatch.setenv('JAXLM_TEST_LIMIT_S', '0.1')
  monkeypatch.setenv('PYTEST_DISABLE_PLUGIN_AUTOLOAD', '1')
  pytester.makepyfile(conftest=f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from tests import timing

probes = iter([2 * timing.REFERENCE_PROBE_S])  # at the start; the box's usual speed afterwards

def pytest_configure(config):
  timing._probe_s = lambda: next(probes, timing.REFERENCE_PROBE_S)
  config.pluginmanager.register(timing.Budget.from_env(), 'jaxlm-budget')
""", test_dummy=DUMMY['test_dummy'].replace('burn(0.3)', 'burn(0.15)'))
  result = pytester.runpytest('-p', 'no:cacheprovider', '-q')
  print(result.stdout.str())
  result.assert_outcomes(passed=3)
  # At the start-up probe's scale (x0.5) the 0.15 s test would cost 0.075 s, under the budget, and go unreported.
  result.stdout.fnmatch_lines(['over budget: test_dummy.py::test_costly * s (CPU * s x 1.00 *'])


def test_the_timeline_says_when_each_worker_ran_out_of_tests():
  from bench import suite
  records = [dict(worker='gw0', ended_at=110.0, wall_s=10.0), dict(worker='gw0', ended_at=130.0, wall_s=20.0),
             dict(worker='gw1', ended_at=190.0, wall_s=40.0), dict(worker='gw2', ended_at=150.0, wall_s=50.0)]
  # The first test started at 100 (gw0's first and gw2's only); workers ran out at 30, 50 and 90 s.
  assert suite.tail_line(records) == ('workers out of tests at 30, 50, 90 s after the first test started (tail: '
                                      '60 s with fewer workers than at the start)')
  assert suite.tail_line([dict(worker='gw0', wall_s=1.0)]) == ''  # a file from before `ended_at`
