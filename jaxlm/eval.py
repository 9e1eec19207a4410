"""Evaluate a run's checkpoint: held-out loss, perplexity, bits per byte, and a sample continuation.

  python -m jaxlm.eval --workdir=runs/palm_small [--step=N] [--batches=16] [--prompt='def '] [--max_tokens=64]
                       [--temperature=0]

The run's own config (saved with every checkpoint) says how to build the model and where its data and tokenizer
are, so no --config is needed. Loss is on the held-out split the run used: the prepared `eval-*` shards, or the
held-out documents of the embedded stdlib corpus.

Bits per byte = total nats / ln 2 / total UTF-8 bytes of the evaluated text, where the text is what the tokenizer
decodes from the evaluated target tokens, one contiguous run per document and row (separators decode to nothing).
Unlike perplexity it does not depend on the tokenizer, so runs with different vocabularies compare. Decoding a run
that starts mid-document can drop one leading space or split a multi-byte character: an error below 0.1% at
typical row lengths.
"""

import functools
import json
import math
import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxlm import checkpoint as checkpoint_lib
from jaxlm import config as config_lib
from jaxlm import data as data_lib
from jaxlm import export as export_lib
from jaxlm import sharding
from jaxlm import train as train_lib


@functools.partial(jax.jit, static_argnums=0)
def _next_logits(model, params, tokens, n):
  """Float32 logits (V,) after the first `n` tokens of `tokens` (1, T); the rest is padding (segment 0)."""
  T = tokens.shape[1]
  segment_ids = (jnp.arange(T) < n).astype(jnp.int32)[None]  # (1, T)
  positions = jnp.arange(T, dtype=jnp.int32)[None]  # (1, T)
  logits = model.apply({'params': params}, tokens, segment_ids, positions)  # (1, T, V)
  return jax.lax.dynamic_index_in_dim(logits[0], n - 1, keepdims=False).astype(jnp.float32)


def generate(model, params, prompt, max_tokens: int, *, temperature: float = 0.0, seed: int = 0,
             stop_id: int | None = None) -> list[int]:
  """Continues `prompt` (token ids) by up to `max_tokens` tokens: greedy at temperature 0, else sampled.

  Re-runs the full forward each step (no KV cache) over a fixed-length buffer whose unwritten tail is padding
  that causal attention never lets the written tokens see: one compile per model and length.
  """
  prompt = [int(t) for t in prompt]
  tokens = np.zeros((1, len(prompt) + max_tokens), np.int32)
  tokens[0, :len(prompt)] = prompt
  key = jax.random.PRNGKey(seed)
  out = []
  for n in range(len(prompt), tokens.shape[1]):
    logits = _next_logits(model, params, tokens, n)
    if temperature == 0.0:
      token = int(np.argmax(logits))
    else:
      token = int(jax.random.categorical(jax.random.fold_in(key, n), logits / temperature))
    out.append(token)
    tokens[0, n] = token
    if token == stop_id:
      break
  return out


def text_bytes(batch: dict, decode) -> int:
  """UTF-8 bytes of the text the evaluated targets (weight > 0) decode to, one run per (row, document)."""
  total = 0
  targets, weights, segments = batch['targets'], batch['weights'], batch['segment_ids']
  for row in range(targets.shape[0]):
    keep = weights[row] > 0
    for segment in np.unique(segments[row][keep]):
      ids = targets[row][keep & (segments[row] == segment)]
      total += len(decode(ids.tolist()).encode('utf-8'))
  return total


def summarize(nats: float, tokens: float, num_bytes: int) -> dict:
  """Loss per token, perplexity and bits per byte from totals."""
  loss = nats / max(tokens, 1.0)
  return {'loss': loss, 'perplexity': math.exp(min(loss, 700.0)), 'tokens': int(tokens), 'bytes': num_bytes,
          'bits_per_byte': nats / math.log(2) / num_bytes if num_bytes else float('nan')}


def _mesh_cfg(cfg):
  """The run's mesh if it fits the devices here, else all devices as FSDP (one host: no dcn axes)."""
  mesh_cfg = cfg.mesh
  multi_host = max(mesh_cfg.dcn_data, mesh_cfg.dcn_fsdp, mesh_cfg.dcn_tensor) > 1
  if (multi_host and jax.process_count() == 1) or (
      math.prod(config_lib.mesh_shape(mesh_cfg, jax.device_count())) != jax.device_count()):
    mesh_cfg = mesh_cfg.copy_and_resolve_references()
    mesh_cfg.update(data=1, fsdp=-1, tensor=1, dcn_data=1, dcn_fsdp=1, dcn_tensor=1)
  return mesh_cfg


def evaluate_run(workdir: str, *, step: int | None = None, batches: int | None = None,
                 batch_size: int | None = None, prompt: str | None = None, max_tokens: int = 64,
                 temperature: float = 0.0, seed: int = 0) -> dict:
  """Held-out metrics (and a sample, if `prompt` is given) of a run's checkpoint, as a dict."""
  path = export_lib.step_dir(workdir, step)
  cfg = export_lib.read_config(path)
  t = cfg.train
  batch_size = batch_size or t.batch_size
  batches = batches or t.eval_batches
  mesh = sharding.make_mesh(_mesh_cfg(cfg))
  vocab = cfg.model.vocab_size
  with jax.sharding.set_mesh(mesh):
    with nn.logical_axis_rules(sharding.RULES):
      program = train_lib.build(cfg.model, cfg.optim, steps=t.steps, seed=t.seed, mesh=mesh)
      params = checkpoint_lib.load_params(path, program.abstract_state.params, program.state_shardings.params)
      eval_data = data_lib.eval_batches(cfg.data, batch_size=batch_size, num_batches=batches, vocab_size=vocab)
      totals = [program.eval_step(params, train_lib.global_batch(b, program.batch_sharding)) for b in eval_data]
    tokenizer = data_lib.load_tokenizer(cfg.data, vocab)
    nats = sum(float(x['loss_sum']) for x in totals)
    tokens = sum(float(x['tokens']) for x in totals)
    result = summarize(nats, tokens, sum(text_bytes(b, tokenizer.decode) for b in eval_data))
    result.update(step=int(os.path.basename(path)), batches=len(eval_data), batch_size=batch_size)
    if prompt is not None:
      ids = [tokenizer.eos_id] + tokenizer.encode(prompt)  # EOS starts every document in training (data.py)
      stop = tokenizer.eos_id if tokenizer.eos_id >= 0 else None
      out = generate(program.model, params, ids, max_tokens, temperature=temperature, seed=seed, stop_id=stop)
      result.update(prompt=prompt, continuation=tokenizer.decode(out))
  return result


FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program; --workdir is the trainer's flag (jaxlm.train, imported above, defines it).
  flags.DEFINE_integer('step', None, 'Checkpoint step (default: the newest).')
  flags.DEFINE_integer('batches', None, 'Held-out batches (default: the run\'s train.eval_batches).')
  flags.DEFINE_integer('batch_size', None, 'Sequences per batch (default: the run\'s).')
  flags.DEFINE_string('prompt', None, 'Text to continue; no sample if unset.')
  flags.DEFINE_integer('max_tokens', 64, 'Tokens to generate after the prompt.')
  flags.DEFINE_float('temperature', 0.0, 'Sampling temperature; 0 = greedy.')
  flags.DEFINE_integer('seed', 0, 'Sampling seed.')
  flags.DEFINE_bool('json', False, 'Print the result as one JSON line instead of a table.')


def main(argv):
  del argv
  try:
    r = evaluate_run(FLAGS.workdir, step=FLAGS.step, batches=FLAGS.batches, batch_size=FLAGS.batch_size,
                     prompt=FLAGS.prompt, max_tokens=FLAGS.max_tokens, temperature=FLAGS.temperature,
                     seed=FLAGS.seed)
  except (export_lib.ExportError, checkpoint_lib.CheckpointError, data_lib.DataError) as e:
    print(f'jaxlm.eval: {e}', file=sys.stderr)
    sys.exit(2)
  if FLAGS.json:
    print(json.dumps(r))
    return
  print(f'step {r["step"]}: {r["batches"]} held-out batches of {r["batch_size"]}, {r["tokens"]:,} tokens, '
        f'{r["bytes"]:,} bytes')
  print(f'  loss           {r["loss"]:.4f} nats/token')
  print(f'  perplexity     {r["perplexity"]:.2f}')
  print(f'  bits per byte  {r["bits_per_byte"]:.4f}')
  if 'continuation' in r:
    print(f'sample ({"greedy" if FLAGS.temperature == 0 else f"temperature {FLAGS.temperature}"}):')
    print(r['prompt'] + r['continuation'])


if __name__ == '__main__':
  _define_flags()
  flags.mark_flag_as_required('workdir')
  app.run(main)
