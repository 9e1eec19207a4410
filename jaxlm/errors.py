"""Expected failures: each error class carries the exit code the run ends with (the table `supervise` reads).

An expected failure ends the process with one line, `jaxlm: <what>; <fix>`, and its code; never a traceback.
"""

HUNG_EXIT = 75  # EX_TEMPFAIL ("try again"): a restart from the checkpoint may work

# The exit codes of an expected failure, in words (`jaxlm.cluster.supervise` reads this table; this module
# imports no JAX, so the supervisor stays light). Codes 2 and 4 are not restarted: a restart cannot fix them.
EXIT_CODES = {
    0: 'done, or preempted and saved',
    2: 'bad config or input',
    3: 'checkpoints failing',  # or any write to the run directory (full disk, permissions)
    4: 'training unstable',
    HUNG_EXIT: 'no step finished in time',
}


class JaxlmError(Exception):
  """An expected failure; the message says what happened and how to fix it."""
  exit_code = 1


class ConfigError(JaxlmError, ValueError):
  """A config that cannot run; one line per problem, naming the field."""
  exit_code = 2


class DataError(JaxlmError, ValueError):
  """Bad or missing training data."""
  exit_code = 2


class StorageError(JaxlmError, OSError):
  """The run directory cannot be written (full disk, permissions): checkpoints, metrics, reports."""
  exit_code = 3


class CheckpointError(StorageError):
  """Checkpoints cannot be written or read."""
  exit_code = 3


class CheckpointMismatchError(CheckpointError):
  """A checkpoint that reads fine but does not fit this run's config (checkpoint.init_from: a parameter missing or
  of another shape): the config, not the store, must change."""
  exit_code = 2


class StabilityError(JaxlmError, RuntimeError):
  """Training cannot continue safely."""
  exit_code = 4


class DistributedError(JaxlmError, RuntimeError):
  """The job's processes cannot join or lost each other."""
  exit_code = HUNG_EXIT
