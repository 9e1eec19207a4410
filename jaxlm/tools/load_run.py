"""A trained run loaded to be used here: its mesh fitted to this machine's devices, its program and parameters.

What the tools that run a checkpoint share (eval, generate): neither imports the other. The run's config, step
directory and tokenizer come from jaxlm.rundir.
"""

import jax
import numpy as np

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import rundir
from jaxlm import sharding
from jaxlm import step as step_lib


def mesh_cfg(cfg):
  """The run's mesh if it fits the devices here, else all devices as FSDP (one host: no dcn axes).

  Never a pipeline: sampling runs one sequence at a time, and a pipelined run's checkpoint stores its layers in
  the plain order (jaxlm/pipeline.py), so its stage devices simply become fsdp ones.
  """
  mesh_cfg = cfg.mesh
  if mesh_cfg.get('stage', 1) * mesh_cfg.get('dcn_stage', 1) > 1:
    mesh_cfg = mesh_cfg.copy_and_resolve_references()
    mesh_cfg.update(stage=1, dcn_stage=1, fsdp=-1)
  return sharding.single_host_mesh_cfg(mesh_cfg, jax.device_count(), jax.process_count())


def restore(path: str, cfg, mesh, weights: str = 'raw'):
  """The run's program and checkpointed parameters (weights='ema': their moving average, optim.ema)."""
  program = step_lib.build_program(cfg, mesh)
  abstract, shardings = program.abstract_state.params, program.state_shardings.params
  if cfg.optim.get('name') == 'sf_adamw' and weights == 'raw':  # schedule-free is evaluated at its averaged point
    x = rundir.read_params(path)
    return program, jax.device_put(jax.tree.map(lambda a, w: np.asarray(a, w.dtype), x, abstract), shardings)
  return program, checkpoint_lib.load_params(path, abstract, shardings, weights)
