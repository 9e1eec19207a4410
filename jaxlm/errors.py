"""Expected failures: each error class carries the exit code the run ends with (the table `supervise` reads).

An expected failure ends the process with one line, `jaxlm: <what>; <fix>`, and its code; never a traceback.
"""

EXIT_CODES = {
    0: 'done, or preempted and saved',
    2: 'bad config or data: a restart will not help',
    3: 'the run directory cannot be written (checkpoints, metrics): free space or fix permissions, then resume',
    4: 'training is unstable past the configured remedies',
    75: 'no step finished in time, or a peer process was lost: a restart from the checkpoint may work',
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


class StabilityError(JaxlmError, RuntimeError):
  """Training cannot continue safely."""
  exit_code = 4


class DistributedError(JaxlmError, RuntimeError):
  """The job's processes cannot join or lost each other."""
  exit_code = 75
