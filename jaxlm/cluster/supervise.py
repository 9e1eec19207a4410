"""Keep a training job running: `python -m jaxlm.cluster.supervise [options] -- <train command ...>`.

Runs the command; when it crashes, is killed, or loses a peer, runs it again after an exponential back-off (the
train command resumes from its newest checkpoint by itself). The child's exit code decides:
  0             done, or preempted after checkpointing: stop, exit 0.
  --no_restart  (default 2 and 4: a bad config or input; training unstable past its rollbacks) a restart would
                fail the same way: stop, exit with that code.
  anything else (a crash, SIGKILL, a lost peer's SIGABRT, the hang watchdog's 75) restart, at most
                --max_restarts times in a row; a run that lasted --reset_after seconds made progress, so the
                count and the back-off start over.
With --healthcheck each relaunch is preceded by `python -m jaxlm.cluster.healthcheck` (or --healthcheck_cmd): a failed
check counts as a failed attempt, so bad devices are retried, then reported, never trained on.
SIGTERM / SIGINT are passed to the whole child process group (the job checkpoints and exits) and end supervision.

Multi-process jobs: wrap the launcher of all processes (`srun ...`, launch/local.sh), or run one supervisor
per host (TPU pods): a lost peer ends every process, every supervisor restarts its own, and they meet again at
the coordinator.
"""

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from jaxlm.errors import EXIT_CODES  # a JAX-free module: the supervisor must not import JAX


def describe(code: int) -> str:
  """An exit status in words: 'exit code 2', 'killed by SIGKILL'."""
  if code < 0:
    return f'killed by {signal.Signals(-code).name}'
  if code == 128 + signal.SIGABRT:  # JAX's coordination service ends a process that lost a peer this way
    return f'exit code {code} (SIGABRT: JAX aborts a process whose peer was lost)'
  if code > 128 and code - 128 in signal.valid_signals():
    return f'exit code {code} ({signal.Signals(code - 128).name})'
  meaning = EXIT_CODES.get(code) if code else None
  return f'exit code {code}' + (f' ({meaning})' if meaning else '')


class Supervisor:
  """Runs a command again and again until it succeeds, fails for good, or the retries run out."""

  def __init__(self, command: Sequence[str], *, max_restarts: int = 10, backoff_s: float = 10.0,
               max_backoff_s: float = 600.0, reset_after_s: float = 3600.0, no_restart: Sequence[int] = (2, 4),
               healthcheck: Sequence[str] | None = None, log: Callable[[str], None] | None = None):
    self.command = list(command)
    self.max_restarts, self.backoff_s, self.max_backoff_s = max_restarts, backoff_s, max_backoff_s
    self.reset_after_s = reset_after_s
    self.no_restart = set(no_restart)
    self.healthcheck = list(healthcheck) if healthcheck else None
    self.log = log or (lambda m: print(f'jaxlm.cluster.supervise: {m}', file=sys.stderr, flush=True))
    self.stopping = threading.Event()  # set by a signal: finish the current child, start no other
    self.child: subprocess.Popen | None = None
    self.delays: list[float] = []  # back-off waits taken, in order (for tests and the log)

  def _run(self, command: list[str], attempt: int) -> int:
    env = dict(os.environ, JAXLM_ATTEMPT=str(attempt))
    # A session of its own: a signal reaches every process the command starts (srun, local.sh's children).
    self.child = subprocess.Popen(command, start_new_session=True, env=env)
    try:
      code = self.child.wait()
    finally:
      self.child = None
    return 128 - code if code < 0 else code  # like a shell: SIGKILL -> 137

  def forward(self, signum: int) -> None:
    """Passes `signum` to the running child's process group and stops supervising after it exits."""
    self.stopping.set()
    if self.child is not None:
      self.log(f'{signal.Signals(signum).name} received: passing it to the job (pid {self.child.pid}) and '
               f'stopping after it exits.')
      try:
        os.killpg(self.child.pid, signum)
      except ProcessLookupError:
        pass

  def run(self) -> int:
    """Supervises until done; returns the exit code to end with."""
    failures, attempt = 0, 0
    while True:
      attempt += 1
      if attempt > 1 and self.healthcheck:
        self.log(f'health check before attempt {attempt}: {shlex.join(self.healthcheck)}')
        code = self._run(self.healthcheck, attempt)
        if code != 0:
          self.log(f'health check failed ({describe(code)}): not relaunching on these devices.')
          failures += 1
          if (stop := self._wait_or_stop(failures, code)) is not None:
            return stop
          continue
      self.log(f'attempt {attempt}: {shlex.join(self.command)}')
      start = time.monotonic()
      code = self._run(self.command, attempt)
      lasted = time.monotonic() - start
      if code == 0:
        self.log(f'attempt {attempt} finished (exit code 0) after {lasted:.0f}s.')
        return 0
      if self.stopping.is_set():
        self.log(f'attempt {attempt} ended with {describe(code)} after a stop signal; not restarting.')
        return code
      if code in self.no_restart:
        self.log(f'attempt {attempt} failed with {describe(code)}: a restart cannot fix that; giving up. Fix the '
                 f'cause named above, then run the same command (it resumes from the newest checkpoint).')
        return code
      if lasted >= self.reset_after_s:
        failures = 0  # it trained for a while: this is a new failure, not the same one again
      failures += 1
      self.log(f'attempt {attempt} failed with {describe(code)} after {lasted:.0f}s '
               f'(failure {failures} in a row).')
      if (stop := self._wait_or_stop(failures, code)) is not None:
        return stop

  def _wait_or_stop(self, failures: int, code: int) -> int | None:
    """Backs off before the next attempt; returns an exit code instead when there must be none."""
    if failures > self.max_restarts:
      self.log(f'{failures} failures in a row, more than --max_restarts={self.max_restarts}: giving up with '
               f'{describe(code)}.')
      return code
    delay = min(self.backoff_s * 2 ** (failures - 1), self.max_backoff_s)
    self.delays.append(delay)
    self.log(f'restarting in {delay:g}s (restart {failures}/{self.max_restarts}); the job resumes from its '
             f'newest checkpoint.')
    if self.stopping.wait(delay):
      self.log('stop signal received while waiting: not restarting.')
      return code
    return None


def main(argv: Sequence[str] | None = None) -> int:
  """Parses `[options] -- command ...` and supervises the command."""
  argv = list(sys.argv[1:] if argv is None else argv)
  split = argv.index('--') if '--' in argv else len(argv)
  parser = _parser()
  args, command = parser.parse_args(argv[:split]), argv[split + 1:]
  if not command:
    parser.error('no command: give it after --, e.g. -- python -m jaxlm.train --config=configs/palm_tiny.py')
  healthcheck = None
  if args.healthcheck or args.healthcheck_cmd:
    healthcheck = shlex.split(args.healthcheck_cmd) if args.healthcheck_cmd else [
        sys.executable, '-m', 'jaxlm.cluster.healthcheck']
  supervisor = Supervisor(command, max_restarts=args.max_restarts, backoff_s=args.backoff,
                          max_backoff_s=args.max_backoff, reset_after_s=args.reset_after,
                          no_restart=[int(c) for c in args.no_restart.split(',') if c.strip()],
                          healthcheck=healthcheck)
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda signum, _: supervisor.forward(signum))
  return supervisor.run()


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog='python -m jaxlm.cluster.supervise', description=__doc__.split('\n')[0],
                              usage='%(prog)s [options] -- <train command ...>')
  p.add_argument('--max_restarts', type=int, default=10, help='failures in a row before giving up (default 10)')
  p.add_argument('--backoff', type=float, default=10.0, help='first wait before a restart, doubled each time (s)')
  p.add_argument('--max_backoff', type=float, default=600.0, help='longest wait between restarts (s)')
  p.add_argument('--reset_after', type=float, default=3600.0,
                 help='a run lasting this long resets the failure count and the back-off (s)')
  p.add_argument('--no_restart', default='2,4', help='exit codes a restart cannot fix (default 2,4)')
  p.add_argument('--healthcheck', action='store_true', help='run python -m jaxlm.cluster.healthcheck before each relaunch')
  p.add_argument('--healthcheck_cmd', default='',
                 help='the health check command instead (e.g. "srun python -m jaxlm.cluster.healthcheck"); implies it')
  return p


def console() -> None:
  """The `jaxlm-...` console command (pyproject.toml [project.scripts])."""
  sys.exit(main())


if __name__ == '__main__':
  console()
