"""Export a checkpoint as a Hugging Face model directory that `transformers` loads with no jaxlm code.

  python -m jaxlm.hf.export --workdir=runs/palm_small [--step=N] --out=hf/palm_small [--dtype=bfloat16]

The sequential block (`parallel_block=False`: RMSNorm, attention then SwiGLU) is Llama and is written as
`LlamaForCausalLM`; with a per-head QK-norm (`model.qk_norm=head`) it is Qwen3's and is written as
`Qwen3ForCausalLM`. PaLM's parallel block (one bias-free LayerNorm feeding attention and SwiGLU side by side) is
Cohere's block and is written as `CohereForCausalLM`. The output directory holds model.safetensors, config.json,
generation_config.json and the run's tokenizer with its chat template: a SentencePiece run's tokenizer.model plus an
equivalent tokenizer.json (so AutoTokenizer needs neither network nor the sentencepiece package); a Hugging Face
tokenizer's own tokenizer.json and tokenizer_config.json, read by the generic fast class so that AutoTokenizer
encodes exactly as `jaxlm.data.prepare` did.

Mappings that need care, each exact up to float rounding (the tests check logits to 1e-4 and greedy decoding):
  * RoPE: jaxlm pairs dims (i, i + E/2) (half-split, as Llama); Cohere pairs (2i, 2i + 1) (interleaved), so
    query and key output columns are permuted within each head for Cohere. q·k is unchanged by permuting both.
  * Tied logits are scaled by 1/sqrt(D) in jaxlm. Cohere has exactly that knob (`logit_scale`) and stays tied;
    Llama has none, so a tied sequential model is written untied with lm_head = embedding / sqrt(D): the same
    function (x·e/sqrt(D) == x·(e/sqrt(D))), at the cost of a second V x D table.
  * Cohere's LayerNorm is (x - mean) * rsqrt(var + eps) * weight with no bias, in float32: jaxlm's `Norm`.
A model that none of these covers is refused (ExportError), never exported approximately.
"""

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile

import numpy as np
from absl import flags, logging

from jaxlm import cli
from jaxlm.data import format as format_lib
from jaxlm import lora as lora_lib
from jaxlm import model as model_lib
from jaxlm import rundir
from jaxlm.data import storage
from jaxlm.hf.convert import TOKENIZER_FILES, ExportError, architecture, hf_config, to_hf  # noqa: F401

DTYPES = ('float32', 'bfloat16', 'float16')


# Reading a run (jaxlm.rundir) and the layouts (jaxlm.hf.convert): named here for export's callers.
step_dir, read_config, read_params = rundir.step_dir, rundir.read_config, rundir.read_params


# ----------------------------------------------------------------------------------------------------------------
# Writing the Hugging Face directory.


def save_safetensors(tensors: dict[str, np.ndarray], path: str, dtype: str = 'float32') -> None:
  """Writes `tensors` cast to `dtype` as one safetensors file (format 'pt', which transformers requires)."""
  try:
    import ml_dtypes  # a JAX dependency: numpy's bfloat16
    from safetensors.numpy import save_file
  except ImportError as e:
    raise ExportError(f'export needs the safetensors package: pip install safetensors ({e}).') from e
  np_dtype = {'float32': np.float32, 'float16': np.float16, 'bfloat16': ml_dtypes.bfloat16}[dtype]
  with format_lib.replacing(path) as tmp:
    save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()}, tmp,
              metadata={'format': 'pt'})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # the writer creates the file owner-only; give it the usual permissions


def _write_json(path: str, obj) -> None:
  format_lib.write_json(path, obj, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------------------------------------------
# The tokenizer: the run's SentencePiece model, also as an equivalent `tokenizers` tokenizer.json.


def find_tokenizer(data_cfg, vocab_size: int) -> str | None:
  """The tokenizer file the run's data was tokenized with, or None (with the reason logged)."""
  from jaxlm.data import pipeline as data_lib  # the data pipeline knows where prepared data keeps its tokenizer
  try:
    return data_lib.tokenizer_path(data_cfg, vocab_size)
  except Exception as e:  # pylint: disable=broad-except  -- a missing tokenizer only skips the tokenizer files
    logging.warning('the run\'s tokenizer was not found: %s', e)
    return None


def sentencepiece_to_tokenizers(model_path: str):
  """A `tokenizers.Tokenizer` that encodes and decodes exactly as the SentencePiece model at `model_path`.

  Built from the model's own pieces and scores: BPE merges are the pairs whose concatenation is a piece, ranked
  by the merged piece's score (SentencePiece merges the best-scoring adjacent pair first); Unigram keeps the
  scores. The normaliser repeats SentencePiece's: optional charsmap, whitespace collapsing, dummy prefix, and
  spaces as '▁'. No pre-tokenizer: every piece lies inside one SentencePiece "word" (a whitespace run then
  non-whitespace), so segmenting the whole string gives the same result as segmenting word by word.
  """
  from sentencepiece import sentencepiece_model_pb2
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers

  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_path, 'rb') as f:
    proto.ParseFromString(f.read())
  trainer, norm = proto.trainer_spec, proto.normalizer_spec
  if trainer.treat_whitespace_as_suffix:
    raise ExportError('the SentencePiece model treats whitespace as a suffix; tokenizers cannot mirror that.')
  pieces = [(p.piece, p.score) for p in proto.pieces]
  normal, unknown, control, user, byte = 1, 2, 3, 4, 6  # ModelProto.SentencePiece.Type
  if trainer.model_type == trainer.UNIGRAM:
    model = models.Unigram(pieces, unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback)
  elif trainer.model_type == trainer.BPE:
    vocab = {piece: i for i, (piece, _) in enumerate(pieces)}
    mergeable = {p.piece: p.score for p in proto.pieces if p.type in (normal, user)}
    merges = []
    for piece, score in mergeable.items():
      for cut in range(1, len(piece)):
        left, right = piece[:cut], piece[cut:]
        if left in mergeable and right in mergeable:
          merges.append((-score, vocab[piece], vocab[left], vocab[right], left, right))
    merges = [(left, right) for *_, left, right in sorted(merges)]
    model = models.BPE(vocab, merges, unk_token=trainer.unk_piece, fuse_unk=True,
                       byte_fallback=trainer.byte_fallback)
  else:
    raise ExportError(f'SentencePiece model type {trainer.model_type} is neither BPE nor Unigram.')
  tok = Tokenizer(model)
  steps = [normalizers.Precompiled(norm.precompiled_charsmap)] if norm.precompiled_charsmap else []
  if norm.remove_extra_whitespaces:
    steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(' {2,}'), ' ')]
  if norm.add_dummy_prefix:
    steps.append(normalizers.Prepend('▁'))
  steps.append(normalizers.Replace(' ', '▁'))
  tok.normalizer = normalizers.Sequence(steps)
  dec = [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse()]
  if norm.add_dummy_prefix:
    dec.append(decoders.Strip(' ', 1, 0))  # SentencePiece drops the dummy prefix's space when decoding
  tok.decoder = decoders.Sequence(dec)
  tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                          for p in proto.pieces if p.type in (control, unknown)])
  tok.add_tokens([AddedToken(p.piece, special=False, normalized=False) for p in proto.pieces if p.type == user])
  del byte  # byte pieces (<0x0A>) stay ordinary vocabulary: ByteFallback decodes them
  return tok


def _prepared_meta(tokenizer_path: str) -> dict:
  """metadata.json of the prepared data the tokenizer sits in ({} for a tokenizer elsewhere)."""
  meta = os.path.join(os.path.dirname(tokenizer_path), 'metadata.json')
  if not os.path.isfile(meta):
    return {}
  with open(meta) as f:
    return json.load(f)


def _chat_template(tokenizer_path: str, tok) -> str | None:
  """The chat template the run's data was rendered with: prepare's --chat_template (in the prepared metadata beside
  the tokenizer), else the tokenizer's own."""
  from jaxlm.data import chat as chat_lib  # pylint: disable=g-import-not-at-top
  return chat_lib.template_of(tok, _prepared_meta(tokenizer_path).get('settings', {}).get('chat_template') or None)


def write_hf_tokenizer(tok, out: str, *, model_max_length: int, chat_template: str | None) -> list[str]:
  """Writes a Hugging Face tokenizer's own tokenizer.json and its tokenizer_config.json (chat template included).

  The class is the generic fast one, whatever the original named: it uses tokenizer.json as it is, where a
  model-specific class (LlamaTokenizer in transformers 5) may rebuild parts of it and encode differently.
  """
  shutil.copyfile(tok.path, os.path.join(out, 'tokenizer.json'))
  config = dict(getattr(tok, 'config', {}))
  config.pop('auto_map', None)  # no remote code
  config.update(tokenizer_class='PreTrainedTokenizerFast', model_max_length=model_max_length)
  if chat_template:
    config['chat_template'] = chat_template
  _write_json(os.path.join(out, 'tokenizer_config.json'), config)
  special = {k: v for k, v in tok.special_tokens.items()}
  _write_json(os.path.join(out, 'special_tokens_map.json'), special)
  return ['tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json']


def write_tokenizer(model_path: str, out: str, *, model_max_length: int,
                    chat_template: str | None = None) -> list[str]:
  """Writes tokenizer.model, tokenizer.json, tokenizer_config.json and special_tokens_map.json; returns names.

  jaxlm feeds every document as [EOS, d1, ..., dn] (data.py): EOS is the document-start token the model was
  trained with, and SentencePiece's own <s> is never seen. So the exported tokenizer's BOS *is* the EOS piece,
  and encoding with special tokens (the transformers default; lm-eval's `add_bos_token=True`) prepends it.
  tokenizer.json is skipped (with a warning) if the `tokenizers` package is missing.
  """
  import sentencepiece as spm
  sp = spm.SentencePieceProcessor(model_file=model_path)
  if sp.eos_id() < 0:
    raise ExportError(f'{model_path} has no EOS piece; jaxlm data always has one (prepare refuses otherwise).')
  shutil.copyfile(model_path, os.path.join(out, 'tokenizer.model'))
  written = ['tokenizer.model']
  eos = sp.id_to_piece(sp.eos_id())
  special = {'bos_token': eos, 'eos_token': eos}
  for key, i in (('unk_token', sp.unk_id()), ('pad_token', sp.pad_id())):
    if i >= 0:
      special[key] = sp.id_to_piece(i)
  try:
    from tokenizers import processors
    tok = sentencepiece_to_tokenizers(model_path)
  except ImportError as e:
    logging.warning('tokenizer.json not written (%s); AutoTokenizer will convert tokenizer.model itself.', e)
    tok = None
  if tok is not None:
    tok.post_processor = processors.TemplateProcessing(single=f'{eos} $A', pair=f'{eos} $A {eos} $B:1',
                                                       special_tokens=[(eos, sp.eos_id())])
    tok.save(os.path.join(out, 'tokenizer.json'))
    written.append('tokenizer.json')
  # With tokenizer.json, the generic fast class uses it as is (LlamaTokenizer in transformers 5 rebuilds its own
  # pre-tokenizer, which differs from SentencePiece on leading spaces); without it, LlamaTokenizer converts the
  # .model (BPE only).
  config = dict(special, tokenizer_class='PreTrainedTokenizerFast' if tok else 'LlamaTokenizer',
                add_bos_token=True, add_eos_token=False, clean_up_tokenization_spaces=False, legacy=True,
                model_max_length=model_max_length)
  if chat_template:
    config['chat_template'] = chat_template
  _write_json(os.path.join(out, 'tokenizer_config.json'), config)
  _write_json(os.path.join(out, 'special_tokens_map.json'), special)
  return written + ['tokenizer_config.json', 'special_tokens_map.json']


# ----------------------------------------------------------------------------------------------------------------


def write_adapter(params: dict, m: model_lib.ModelConfig, out: str, base_model: str = '') -> list[str]:
  """Writes a LoRA run's adapters as a peft adapter directory (adapter_config.json, adapter_model.safetensors)
  that `peft.PeftModel.from_pretrained` loads onto the exported (or imported) base model."""
  from jaxlm.hf.convert import lora_to_peft, peft_config  # pylint: disable=g-import-not-at-top
  os.makedirs(out, exist_ok=True)
  save_safetensors(lora_to_peft(params, m), os.path.join(out, 'adapter_model.safetensors'))
  _write_json(os.path.join(out, 'adapter_config.json'), peft_config(m, base_model))
  return ['adapter_config.json', 'adapter_model.safetensors']


def export(workdir: str, out: str, *, step: int | None = None, dtype: str = 'float32',
           tokenizer: str | None = None, weights: str = 'raw', adapter_out: str | None = None) -> dict:
  """Writes the Hugging Face directory `out` for a run's checkpoint; returns a summary of what was written.

  A LoRA run (model.lora) is written merged: each adapted W + (alpha/r)·A·B in float32, then converted as any
  model. `adapter_out` also writes its adapters alone, as a peft adapter directory (`write_adapter`). `workdir`,
  `out` and `adapter_out` may be bucket URLs: the directories are written locally, then uploaded whole.
  """
  if dtype not in DTYPES:
    raise ExportError(f'--dtype={dtype} is unknown; use one of {", ".join(DTYPES)}.')
  with contextlib.ExitStack() as stack:
    local_out = stack.enter_context(storage.writing_dir(out, '--out'))
    local_adapter = stack.enter_context(storage.writing_dir(adapter_out, '--adapter_out')) if adapter_out else None
    summary = _export(workdir, local_out, step=step, dtype=dtype, tokenizer=tokenizer, weights=weights,
                      adapter_out=local_adapter, stack=stack)
  notes = [n.replace(os.path.abspath(local_adapter), adapter_out) if local_adapter else n for n in summary['notes']]
  return {**summary, 'out': out if storage.is_url(out) else os.path.abspath(out), 'notes': notes}


def _beside_tokenizer(workdir: str, stack: contextlib.ExitStack) -> str | None:
  """The tokenizer jaxlm.hf.import_llama put beside a run's checkpoints (a local copy for a bucket run), or None."""
  for name in ('tokenizer.json', 'tokenizer.model'):
    if storage.isfile(path := storage.join(workdir, name)):
      if not storage.is_url(path):
        return path
      local = stack.enter_context(tempfile.TemporaryDirectory(prefix='jaxlm-tokenizer-'))
      for extra in TOKENIZER_FILES:  # what the tokenizer's loader reads beside it
        if storage.isfile(source := storage.join(workdir, extra)):
          storage.download(source, os.path.join(local, extra))
      return os.path.join(local, name)
  return None


def _export(workdir: str, out: str, *, step: int | None, dtype: str, tokenizer: str | None, weights: str,
            adapter_out: str | None, stack: contextlib.ExitStack) -> dict:
  """`export` into the local directories `out` and `adapter_out`."""
  path = step_dir(workdir, step)
  cfg = read_config(path)
  m = model_lib.ModelConfig.from_config(cfg.model)
  arch = architecture(m)  # refuse before reading any weights
  params = read_params(path, weights)  # weights='ema': the moving average (optim.ema)
  if adapter_out and not m.lora.rank:
    raise ExportError(f'--adapter_out: {path} is not a LoRA run (model.lora.rank=0); export it without the flag.')
  adapter_files = write_adapter(params, m, adapter_out) if adapter_out else []
  if m.lora.rank:  # merged: the plain model that computes what the LoRA model does
    params, m = lora_lib.merge_adapters(params, m.lora), dataclasses.replace(m, lora=lora_lib.LoraConfig())
  tensors = to_hf(params, m)
  # Put beside the checkpoints by jaxlm.hf.import_llama; else the one the run's data was prepared with.
  tokenizer = tokenizer or _beside_tokenizer(workdir, stack) or find_tokenizer(cfg.data, m.vocab_size)
  eos_id = 2  # SentencePiece's default, used when the tokenizer is not found
  bos_id, stop_ids, tok, template = eos_id, [eos_id], None, None
  if tokenizer:
    from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    tok_file = tokenizer_lib.main_file(tokenizer)
    tok = tokenizer_lib.load(tok_file, separator=_prepared_meta(tok_file).get('separator'))  # the data's own
    tokenizer, template = tok.path, _chat_template(tok.path, tok)
    if tok.kind == 'sentencepiece':
      bos_id = eos_id = tok.separator_id  # documents start with the separator (EOS) in training
      stop_ids = [eos_id]
    else:  # the tokenizer's own BOS and EOS (an instruct model's end of turn), and every id sampling stops at
      bos_id = tok.bos_id if tok.bos_id >= 0 else tok.separator_id
      eos_id = tok.eos_id if tok.eos_id >= 0 else tok.separator_id
      stop_ids = tok.stop_ids  # the imported generation_config's list, the eos and the separator
  os.makedirs(out, exist_ok=True)
  save_safetensors(tensors, os.path.join(out, 'model.safetensors'), dtype)
  seq_len = int(cfg.data.seq_len)
  _write_json(os.path.join(out, 'config.json'),
              hf_config(m, max_positions=seq_len, dtype=dtype, bos_id=bos_id, eos_id=eos_id))
  _write_json(os.path.join(out, 'generation_config.json'),
              {'bos_token_id': bos_id, 'eos_token_id': stop_ids[0] if len(stop_ids) == 1 else stop_ids,
               'do_sample': False})
  files = ['model.safetensors', 'config.json', 'generation_config.json']
  if tok is not None and tok.kind == 'sentencepiece':
    files += write_tokenizer(tokenizer, out, model_max_length=seq_len, chat_template=template)
  elif tok is not None:
    files += write_hf_tokenizer(tok, out, model_max_length=seq_len, chat_template=template)
  notes = []
  if not tokenizer:
    notes.append('the run\'s tokenizer was not found (see the warning above): weights only; pass '
                 '--tokenizer=PATH (a .model, a tokenizer.json or its directory) to ship one')
  if m.tie_embeddings and arch != 'CohereForCausalLM':
    notes.append(f'tied embeddings written untied for {arch}: lm_head = embedding / sqrt(d_model)')
  if adapter_files:
    notes.append(f'peft adapter written to {os.path.abspath(adapter_out)}: load it onto the base model with '
                 f'peft.PeftModel.from_pretrained (onto the base: the model the run was warm-started from, not {out}, '
                 f'which holds the merged weights)')
  if m is not None and cfg.model.get('lora', {}).get('rank', 0):
    notes.append('LoRA adapters merged into the weights (W + alpha/r·A·B, float32)')
  return {'out': os.path.abspath(out), 'step': int(os.path.basename(path)), 'architecture': arch,
          'dtype': dtype, 'files': files, 'tokenizer': tokenizer, 'notes': notes}


FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Defined only when run as a program: tests import this module beside the trainer, whose flags would
  # otherwise collide.
  flags.DEFINE_string('workdir', None, 'Run directory (holds checkpoints/).')
  flags.DEFINE_integer('step', None, 'Checkpoint step to export (default: the newest).')
  flags.DEFINE_string('out', None, 'Output directory for the Hugging Face model, local or a bucket URL.')
  flags.DEFINE_enum('dtype', 'float32', DTYPES, 'dtype of the written weights.')
  flags.DEFINE_enum('weights', 'raw', ('raw', 'ema'), 'raw: the trained weights; ema: their moving average '
                    '(runs with optim.ema).')
  flags.DEFINE_string('adapter_out', None, 'LoRA runs: also write the adapters alone to this directory as a peft '
                      'adapter (adapter_config.json + adapter_model.safetensors).')
  flags.DEFINE_string('tokenizer', None, 'Tokenizer to ship: a SentencePiece .model, a tokenizer.json or its '
                      'directory (default: the one in <workdir> if present, else the one the run\'s data was '
                      'prepared with).')


def main(argv):
  del argv
  summary = export(FLAGS.workdir, FLAGS.out, step=FLAGS.step, dtype=FLAGS.dtype, tokenizer=FLAGS.tokenizer,
                   weights=FLAGS.weights, adapter_out=FLAGS.adapter_out)
  print(f'exported step {summary["step"]} as {summary["architecture"]} ({summary["dtype"]}) to {summary["out"]}: '
        f'{", ".join(summary["files"])}')
  for note in summary['notes']:
    print(f'note: {note}')


def console() -> None:
  """The command line (also the console script in pyproject.toml)."""
  cli.run(main, define=_define_flags, required=('workdir', 'out'))


if __name__ == '__main__':
  console()
