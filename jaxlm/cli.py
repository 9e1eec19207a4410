"""One way to run a command and to fail: `cli.run(main)` at the bottom of every entry point.

Flags are parsed by absl (configs through ml_collections' config_flags); any expected failure, in parsing or
in `main`, ends with one line `jaxlm: <what>; <fix>` on stderr and the error's exit code (jaxlm.errors), never a
traceback.
"""

import ctypes
import difflib
import faulthandler
import gc
import importlib.util
import os
import re
import signal
import subprocess
import sys
import warnings
from typing import Callable, NoReturn

from absl import app, flags, logging

from jaxlm import errors
from jaxlm import locations


def fail(error: BaseException) -> NoReturn:
  """Prints the one last line for an expected failure and exits with its code.

  A message that lists several problems (config validation: 'invalid config:' then '  - ...' lines) prints
  them first, each naming its field and fix, and ends with the one summary line.
  """
  code = getattr(error, 'exit_code', 1)
  sys.stdout.flush()
  head, *details = [line for line in str(error).splitlines() if line.strip()]
  if len(details) == 1:
    last = f'{head.rstrip(": ")}: {details[0].strip().removeprefix("- ")}'
  elif details:
    print('\n'.join(details), file=sys.stderr)
    last = f'{head.rstrip(": ")}: {len(details)} problems; fix each field as the lines above say'
  else:
    last = head
  if '; ' not in last and isinstance(error, errors.ConfigError):
    last = f'{last.rstrip(".")}; change it and run again'
  gc.collect()  # what a failed library left unreachable warns now, above the line, not after it
  print(f'jaxlm: {last}', file=sys.stderr, flush=True)
  _quiet_after_the_last_line()
  sys.exit(code)


def _quiet_after_the_last_line() -> None:
  # The outcome is printed; what interpreter shutdown finds later (a coroutine a failed async save never awaited,
  # an unclosed file on a full disk) would otherwise print below it, and the last line is the contract.
  warnings.simplefilter('ignore')
  sys.unraisablehook = lambda _: None


def load_file(path: str):
  """`get_config()` of a config file, imported as a module (the one loader: presets, sweeps, tests)."""
  if not os.path.isfile(path):
    raise errors.ConfigError(f'config file {path} does not exist (working directory {os.getcwd()}); pass a '
                             f'path such as --config=configs/palm_small.py')
  spec = importlib.util.spec_from_file_location(f'jaxlm_config_{abs(hash(os.path.abspath(path)))}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def config_keys(cfg, prefix: str = '') -> list[str]:
  """Every dotted key of a ConfigDict ('train.steps', ...)."""
  keys = []
  for name, value in cfg.items():
    path = f'{prefix}{name}'
    keys += config_keys(value, f'{path}.') if hasattr(value, 'items') else [path]
  return keys


def unknown_override(argv: list[str], flag: str = 'config') -> str | None:
  """The message for the first `--config.a.b=v` whose key the config file does not have, with a suggestion."""
  path = next((a.split('=', 1)[1] for a in argv if a.startswith(f'--{flag}=')), None)
  if path is None:
    return None
  known = config_keys(load_file(path))
  for arg in argv:
    if arg.startswith(f'--{flag}.'):
      key = arg[len(flag) + 3:].split('=', 1)[0]
      if key not in known:
        near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
        hint = f'did you mean {flag}.{near[0]}?' if near else 'the keys are listed in configs/base.py'
        return f'--{flag}.{key}: {path} has no key {key}; {hint}'
  return None


def _parse_flags(argv: list[str]) -> list[str]:
  # config_flags defers a missing file's error to the first use of the config, as a traceback: check first.
  for arg in argv:
    if arg.startswith('--config=') and not os.path.isfile(path := arg.split('=', 1)[1]):
      fail(errors.ConfigError(f'config file {path} does not exist (working directory {os.getcwd()}); pass a '
                              f'path such as --config=configs/palm_small.py'))
  try:
    return flags.FLAGS(argv)
  except errors.JaxlmError as e:
    fail(e)
  except Exception as e:  # pylint: disable=broad-except  -- absl and config_flags raise many kinds
    try:
      message = unknown_override(argv)
    except errors.JaxlmError as missing:
      fail(missing)
    except Exception:  # pylint: disable=broad-except  -- the config file itself is broken: say so below
      message = None
    if message is None:
      text = ' '.join(str(e).split())
      missing = re.findall(r'Flag (--\w+) must have a value other than None', text)
      message = (f'missing {", ".join(missing)}; pass {" ".join(f"{m}=..." for m in missing)} (see --helpshort)'
                 if missing else f'bad command line: {text}; see --helpshort')
    fail(errors.ConfigError(message))


# Python's default (700, 10, 10) runs a young collection every 700 allocations; tracing a model allocates millions
# of short-lived objects, and every full collection walks each object the imports made. The older generations keep
# Python's ratios, so cyclic garbage (which may hold device arrays) still goes within a bounded number of steps.
GC_THRESHOLD = (50_000, 10, 10)


def quiet_gc() -> None:
  """Fewer, cheaper cyclic garbage collections for the rest of a command's process: what the imports made moves
  out of every later collection (it lives as long as the process), and every generation is collected 70x less
  often. Startup, tracing and steps spend less time collecting (bench/RESULTS.md, "Test suite"); memory held by
  cyclic garbage is freed a little later. No collection first: after `import jaxlm.train` one walks every object
  to find ~40 garbage ones (~0.1 s of every command's start), which the freeze keeps instead."""
  gc.freeze()
  gc.set_threshold(*GC_THRESHOLD)


def run(main: Callable[[list[str]], int | None], *, define: Callable[[], None] | None = None,
        required: tuple[str, ...] = ()) -> None:
  """Runs `main(argv)` as an absl app: quiet libraries, and every JaxlmError as one line and its exit code.

  define: defines the command's flags (only when run as a command: importing a tool defines none);
  required: flags that must be given.
  """
  quiet_gc()
  if define:
    define()
  if required:
    flags.mark_flags_as_required(list(required))

  def wrapped(argv):
    # absl turned faulthandler on for every thread. On a fatal signal (XLA's abort() from a C++ thread) walking
    # the other threads' frames while they run can crash the dump itself (seen: SIGSEGV in an abort's dump while
    # Orbax's writer thread ran), and the process then ends with the wrong signal (not the restartable abort):
    # the signalled thread's stack only.
    if faulthandler.is_enabled():
      faulthandler.enable(all_threads=False)
    check_locations()
    if not flags.FLAGS['verbosity'].present:
      logging.set_verbosity(logging.WARNING)  # libraries' INFO chatter drowns the progress lines; -v 0 shows it
    try:
      return main(argv) or 0
    except errors.JaxlmError as e:
      fail(e)

  app.run(wrapped, flags_parser=_parse_flags)


# Every command flag that names a file, directory or bucket location (prompts, templates and server URLs are not).
LOCATION_FLAGS = ('workdir', 'out', 'inputs', 'hf_dir', 'data', 'adapter_out', 'cache_dir', 'tokenizer', 'prompts',
                  'output', 'samples', 'samples_out', 'embedder', 'scorer', 'documents', 'write_jsonl', 'rewards')


def check_locations() -> None:
  """Refuses a malformed location flag (`gs://`, `gcs://b`, `./x/gs://b`) before any work, naming every one."""
  problems = []
  for name in LOCATION_FLAGS:
    if name in flags.FLAGS and flags.FLAGS[name].present:
      value = flags.FLAGS[name].value
      for part in value if isinstance(value, (list, tuple)) else [value]:
        try:
          locations.check_location(part, f'--{name}')
        except errors.ConfigError as e:
          problems.append(str(e))
  if problems:
    fail(errors.ConfigError('\n  - '.join(['bad locations:', *problems]) if len(problems) > 1 else problems[0]))


WATCHED = 'JAXLM_WATCHED'  # set in the child that a watcher runs


def run_watched() -> None:
  """Runs this very command again in a child process and ends this process as the child ended; returns in the child.

  JAX and XLA end a process they cannot keep consistent with abort() from a C++ thread (a collective whose peers
  never arrived, a lost coordination-service peer): nothing in that process can print jaxlm's last line, so the
  parent does, as launch/local.sh does for a job. Linux only (the child dies with its parent through
  PR_SET_PDEATHSIG, so a SIGKILL of this process ends the run as before); elsewhere the command runs unwatched.
  """
  if os.environ.get(WATCHED) or not sys.platform.startswith('linux'):
    gc.set_threshold(*GC_THRESHOLD)  # the process that runs the command, before its imports (see quiet_gc)
    return
  libc = ctypes.CDLL(None, use_errno=True)
  pr_set_pdeathsig = 1
  child = subprocess.Popen([sys.executable, *sys.orig_argv[1:]], env={**os.environ, WATCHED: '1'},
                           preexec_fn=lambda: libc.prctl(pr_set_pdeathsig, signal.SIGKILL))
  for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(sig, lambda signum, _: child.send_signal(signum))  # preemption notices reach the trainer
  code = child.wait()
  if code == -signal.SIGABRT:
    print('jaxlm: JAX/XLA aborted the run (SIGABRT; the lines above say why: a collective whose peers never '
          'arrived, or a lost peer); restart from the newest checkpoint with the same command '
          '(jaxlm.cluster.supervise restarts for you)', file=sys.stderr, flush=True)
    sys.exit(errors.HUNG_EXIT)
  if code < 0:  # killed by a signal: end the same way, so a launcher sees what it would have seen
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
  sys.exit(code)
