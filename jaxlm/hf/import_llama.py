"""Import a local Hugging Face checkpoint as a jaxlm warm start, for continued pre-training or fine-tuning.

One command for every family jaxlm computes exactly (convert.IMPORTABLE): Llama, Qwen3 (dense, QK-norm), Mixtral,
Qwen3-MoE, OLMoE, (hf/families.py) Gemma 2, Gemma 3 (text), Mistral, OLMo 2 and OLMo 3, (hf/gpt_oss.py) gpt-oss,
and (hf/deepseek.py) DeepSeek-V3 and -V2; config.json's model_type picks the mapping.

  python -m jaxlm.hf.import_llama --hf_dir=path/to/llama --out=runs/llama_import [--config=configs/base.py]

Writes <out>/checkpoints/0/ with a `state` item holding {step: 0, params} in the TrainState layout and an `env`
item with the resolved config, copies the model's tokenizer files (tokenizer.json, tokenizer_config.json,
special_tokens_map.json, chat_template.jinja, tokenizer.model, and generation_config.json for its end-of-sequence
ids: whichever it has) into <out>, and prints the exact
prepare commands that tokenize with them and the config overrides that build the same model and point
`checkpoint.init_from` at it; train with those in a new --workdir (fresh optimizer, step 0).

Only safetensors files are read: pickled PyTorch files (*.bin, *.pt) are refused, because unpickling one can run
arbitrary code. Only what jaxlm's sequential block computes exactly is accepted: RoPE plain or scaled (linear,
llama3, yarn: model.rope_scaling); a config with dynamic or longrope RoPE, attention or MLP biases (but gpt-oss's),
another activation, a layer type or window pattern jaxlm lacks, a vision tower, or quantisation is refused by name.
Tied Hugging Face embeddings become untied jaxlm ones (jaxlm ties with a 1/sqrt(D) logit scale Llama lacks).
"""

import glob
import json
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import flags

from jaxlm import cli
from jaxlm import model as model_lib
from jaxlm.data import storage
from jaxlm.hf.convert import (TOKENIZER_FILES, HFImportError, checkpoint_overrides, from_hf,  # noqa: F401
                              model_overrides)

PICKLE_SUFFIXES = ('.bin', '.pt', '.pth', '.ckpt', '.pkl')
# Keys that change what a Llama-family config computes; any of them set to something jaxlm cannot do is refused.


def read_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
  """All tensors of a directory's *.safetensors files as numpy; refuses pickled weights."""
  files = sorted(glob.glob(os.path.join(hf_dir, '*.safetensors')))
  if not files:
    pickled = [f for f in os.listdir(hf_dir) if f.endswith(PICKLE_SUFFIXES)]
    if pickled:
      raise HFImportError(f'{hf_dir} has only pickled weights ({", ".join(sorted(pickled)[:3])}): loading a '
                          f'pickle can run arbitrary code, so jaxlm reads safetensors only. Convert them in a '
                          f'sandbox you trust (load with transformers, then save_pretrained(..., '
                          f'safe_serialization=True)).')
    raise HFImportError(f'{hf_dir} has no *.safetensors files.')
  try:
    from safetensors.numpy import load_file
  except ImportError as e:
    raise HFImportError(f'importing needs the safetensors package: pip install safetensors ({e}).') from e
  tensors = {}
  for f in files:
    tensors.update(load_file(f))
  return tensors


def write_checkpoint(workdir: str, state, config: dict, step: int = 0) -> str:
  """Writes `state` and {'config': config} as <workdir>/checkpoints/<step> in the trainer's layout; returns it."""
  directory = storage.join(workdir if storage.is_url(workdir) else os.path.abspath(workdir), 'checkpoints')
  manager = ocp.CheckpointManager(directory, item_names=('state', 'env'))
  try:
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               env=ocp.args.JsonSave({'config': config})), force=True)
    manager.wait_until_finished()
  finally:
    manager.close()
  return storage.join(directory, str(step))


def _default_config() -> ml_collections.ConfigDict:
  """configs/base.py of this checkout."""
  base = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, 'configs', 'base.py')
  if not os.path.isfile(base):
    raise HFImportError('configs/base.py not found beside the jaxlm package; pass --config=FILE.')
  return cli.load_file(base)


def import_hf(hf_dir: str, out: str, cfg: ml_collections.ConfigDict | None = None,
              cache_dir: str = '~/.cache/jaxlm') -> dict:
  """Converts `hf_dir` into a jaxlm checkpoint under `out`; returns the overrides and paths.

  Either may be a bucket URL: a model on a bucket is read from a verified local copy under `cache_dir`; a bucket
  `out` gets the checkpoint through Orbax and the tokenizer files uploaded beside it.
  """
  if problem := storage.checkpoints_unsupported(out):
    raise HFImportError(problem)
  storage.check(out, what='--out')  # a wrong endpoint fails in seconds (local paths pass)
  storage.check(hf_dir, what='--hf_dir')
  given, hf_dir = hf_dir, storage.local_copy(hf_dir, cache_dir)
  config_path = os.path.join(hf_dir, 'config.json')
  if not os.path.isfile(config_path):
    raise HFImportError(f'{given} has no config.json; give a Hugging Face model directory.')
  with open(config_path) as f:
    hf = json.load(f)
  overrides = model_overrides(hf)  # a config jaxlm refuses fails before hundreds of GB of tensors are read
  tensors = read_safetensors(hf_dir)
  overrides.update(checkpoint_overrides(hf, tensors))
  cfg = (cfg or _default_config()).copy_and_resolve_references()
  cfg.model.update(**overrides)
  m = model_lib.ModelConfig.from_config(cfg.model)
  params = from_hf(tensors, m, scan_layers=cfg.model.scan_layers)
  params = jax.tree.map(lambda x: x.astype(np.dtype(m.param_dtype)), params)
  path = write_checkpoint(out, {'step': np.zeros((), np.int32), 'params': params}, cfg.to_dict(), step=0)
  flags_line = ' '.join(f'--config.model.{k}={v}' for k, v in overrides.items())
  flags_line += f' --config.checkpoint.init_from={storage.dirname(path)}'
  copied = []
  for name in TOKENIZER_FILES:  # beside the checkpoints, where `jaxlm.hf.export` looks first
    if os.path.isfile(source := os.path.join(hf_dir, name)):
      storage.upload(source, storage.join(out, name))
      copied.append(name)
  tokenizer, tokenizer_vocab = None, None
  if {'tokenizer.json', 'tokenizer.model'} & set(copied):
    from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    # prepare reads a local tokenizer: for a bucket `out`, the model directory's own (the same files)
    tokenizer = hf_dir if storage.is_url(out) else os.path.abspath(out)
    try:
      tokenizer_vocab = tokenizer_lib.load(tokenizer).vocab_size
    except ValueError as e:
      raise HFImportError(f'the model\'s tokenizer in {hf_dir} is unreadable: {e}') from e
  return {'checkpoint': path, 'overrides': overrides, 'flags': flags_line, 'tokenizer': tokenizer,
          'tokenizer_files': copied, 'tokenizer_vocab_size': tokenizer_vocab,
          'tied': bool(hf.get('tie_word_embeddings', False)),
          'max_position_embeddings': hf.get('max_position_embeddings')}


def prepare_commands(tokenizer: str, max_positions: int | None) -> list[str]:
  """The prepare command lines (text, chat) that tokenize with the imported tokenizer."""
  seq_len = min(max_positions or 2048, 2048)
  return [f'python -m jaxlm.data.prepare --tokenizer={tokenizer} --inputs=CORPUS --out=data/text',
          f'python -m jaxlm.data.prepare --format=chat --tokenizer={tokenizer} --seq_len={seq_len} '
          f'--inputs=CHATS.jsonl --out=data/chat']


FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program: tests import this module beside the trainer, whose flags would
  # otherwise collide.
  flags.DEFINE_string('hf_dir', None, 'Hugging Face model directory (config.json + *.safetensors), local or a bucket URL.')
  flags.DEFINE_string('out', None, 'Directory to write the jaxlm checkpoint into (<out>/checkpoints/0), local or a bucket URL.')
  flags.DEFINE_string('config', None, 'jaxlm config file for everything but the model (default: '
                      'configs/base.py).')


def main(argv):
  del argv
  cfg = cli.load_file(FLAGS.config) if FLAGS.config else None
  r = import_hf(FLAGS.hf_dir, FLAGS.out, cfg)
  print(f'wrote {r["checkpoint"]} (params at step 0).')
  if r['tied']:
    print('note: tied embeddings imported untied (lm_head = embed_tokens); jaxlm ties with a 1/sqrt(D) scale.')
  if r['tokenizer']:
    print(f'tokenizer: copied {", ".join(r["tokenizer_files"])} into {r["tokenizer"]}; prepare data with it so '
          f'token ids match the weights:')
    for line in prepare_commands(r['tokenizer'], r['max_position_embeddings']):
      print(f'  {line}')
    vocab = r['overrides'].get('vocab_size')
    if vocab and r['tokenizer_vocab_size'] > vocab:
      print(f'warning: the tokenizer produces ids up to {r["tokenizer_vocab_size"] - 1} but the model\'s '
            f'vocab_size is {vocab}; training will refuse such data.')
  else:
    print('tokenizer: no tokenizer.json or tokenizer.model in the directory; jaxlm needs the tokenizer the '
          'weights were trained with, or the token ids will not match.')
  if r['max_position_embeddings']:
    print(f'the model was trained on up to {r["max_position_embeddings"]} positions: keep data.seq_len at most that.')
  print('train with (in a new --workdir):')
  print(f'  {r["flags"]}')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('hf_dir', 'out'))


if __name__ == '__main__':
  console()
