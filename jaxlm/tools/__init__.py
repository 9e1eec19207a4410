"""Tools around training runs: evaluation, sizing, sweeps, run reports. They import the core, never train's flags."""
