"""One Tokenizer interface for prepare, data, eval and export: SentencePiece or a Hugging Face `tokenizers` file.

`load(path)` picks the kind: a SentencePiece `.model`, a Hugging Face `tokenizer.json`, or a directory holding
either (a `tokenizer.json` is read with the `tokenizer_config.json` beside it: special tokens, chat template).
Both kinds encode documents *without* their post-processor's specials (no BOS, no EOS): the data pipeline puts
exactly one separator between documents itself, the end-of-text token `separator_id` names.

Training: SentencePiece (the default, `train`) follows PaLM's vocabulary (Chowdhery et al. 2022, section 3):
lossless (no normalisation, whitespace kept, so code indentation survives), digits split into single tokens, and
unknown characters falling back to UTF-8 bytes instead of <unk>. `train_bytelevel_bpe` trains the byte-level BPE
most 2024+ models ship (GPT-2 / Llama 3 / Qwen style) with the `tokenizers` library.
"""

import hashlib
import io
import itertools
import json
import os
from collections.abc import Iterable, Sequence

import numpy as np
import sentencepiece as spm

from jaxlm.data import format as format_lib

MODEL_TYPES = ('bpe', 'unigram')  # SentencePiece algorithms
KINDS = ('sentencepiece', 'bytelevel_bpe')  # what `prepare --tokenizer_kind` trains


def file_sha256(path: str) -> str:
  """Hex sha256 of a file (identifies a tokenizer in prepared-data metadata)."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def train(sentences: Iterable[str], out_path: str, *, vocab_size: int, model_type: str = 'bpe',
          max_sentences: int = 1_000_000, num_threads: int = 0, seed: int = 0) -> str:
  """Trains a SentencePiece model on `sentences` (lines), writes it atomically to `out_path`, returns the path."""
  if model_type not in MODEL_TYPES:
    raise ValueError(f'model_type={model_type!r} is unknown; use one of {", ".join(MODEL_TYPES)}.')
  # SentencePiece draws its reservoir sample and shuffle from a global generator: seed it so two hosts that
  # prepare the same corpus independently get byte-identical models (same checksum).
  spm.set_random_generator_seed(seed)
  model = io.BytesIO()
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        byte_fallback=True, split_digits=True,
        normalization_rule_name='identity',  # no NFKC, no lower-casing: decode(encode(x)) == x
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,  # keep indentation runs
        input_sentence_size=max_sentences, shuffle_input_sentence=True,  # bounded reservoir sample
        max_sentence_length=16384,  # bytes; longer lines are skipped by the trainer, not truncated
        hard_vocab_limit=False,  # a tiny corpus yields a smaller vocabulary instead of an error
        num_threads=num_threads or os.cpu_count() or 1, minloglevel=2)
  except RuntimeError as e:
    # SentencePiece reports problems (e.g. vocab smaller than 256 bytes + specials) as bare RuntimeErrors.
    raise ValueError(f'SentencePiece training failed (vocab_size={vocab_size}, model_type={model_type}): {e}; '
                     f'the vocabulary must hold the 256 byte pieces, the special pieces and every distinct character '
                     f'of the sample.') from e
  format_lib.write_atomic(out_path, model.getvalue())
  return out_path


def train_bytelevel_bpe(sentences: Iterable[str], out_dir: str, *, vocab_size: int,
                        end_of_text: str = '<|endoftext|>', max_sentences: int = 1_000_000) -> str:
  """Trains a byte-level BPE (GPT-2 style: every byte a base token, no <unk>) into `out_dir`; returns its
  tokenizer.json path. `end_of_text` is its one special token, the document separator (and eos_token)."""
  from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, processors, trainers

  tok = HFTok(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(trim_offsets=False)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[end_of_text], show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(itertools.islice(sentences, max_sentences), trainer=trainer)
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, 'tokenizer.json')
  format_lib.write_atomic(path, tok.to_str())
  format_lib.write_json(os.path.join(out_dir, 'tokenizer_config.json'),
                        {'tokenizer_class': 'PreTrainedTokenizerFast', 'eos_token': end_of_text,
                         'bos_token': None, 'pad_token': None, 'unk_token': None, 'add_bos_token': False,
                         'add_eos_token': False, 'clean_up_tokenization_spaces': False}, indent=2)
  return path


# Document separators by name. Llama 3, Qwen, OLMo and GPT-2 style tokenizers name their end-of-document token
# one of these; an instruct tokenizer's eos_token is its end-of-turn token instead, which must not end documents.
END_OF_TEXT = ('<|end_of_text|>', '<|endoftext|>', '</s>', '<eos>', '<|end▁of▁sentence|>')
END_OF_TURN = ('<|eot_id|>', '<|im_end|>', '<end_of_turn>', '<|end|>', '<|eom_id|>', '<|im_sep|>')


class Tokenizer:
  """What jaxlm asks of any tokenizer. Ids: `bos_id`, `eos_id` (the tokenizer's own; -1 when it has none),
  `separator_id` (the one token between documents); `vocab_size` counts every id it can produce."""
  kind: str
  path: str  # the main file (tokenizer.model or tokenizer.json); its checksum identifies the tokenizer
  vocab_size: int
  bos_id: int = -1
  eos_id: int = -1
  pad_id: int = -1
  unk_id: int = -1
  separator_id: int = -1
  separator: str = ''
  separator_reason: str = ''  # why this separator was chosen (prepare prints it)
  chat_template: str | None = None
  special_tokens: dict = {}  # bos_token / eos_token / pad_token / unk_token -> token text
  end_ids: tuple = ()  # the model's end-of-sequence ids as its generation_config.json lists them (eos_token_id)

  @property
  def stop_ids(self) -> list[int]:
    """Every id sampling stops at: the model's own list (generation_config.json), then the tokenizer's eos and the
    document separator where the list lacks them. What export writes as generation_config's eos_token_id."""
    ids = list(dict.fromkeys(self.end_ids))
    return ids + sorted({self.eos_id, self.separator_id} - set(ids) - {-1})

  @property
  def sha256(self) -> str:
    """Checksum of the main file."""
    return file_sha256(self.path)

  @property
  def files(self) -> list[str]:
    """Every file that makes up this tokenizer (copied into prepared data, imports and exports)."""
    return [self.path]

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, without post-processor specials."""
    return self.encode_documents([text])[0]

  def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
    raise NotImplementedError

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` (no post-processor specials) and each token's character span in it."""
    raise NotImplementedError

  def decode(self, ids: Sequence[int]) -> str:
    raise NotImplementedError

  def token_to_id(self, token: str) -> int | None:
    raise NotImplementedError

  def id_to_token(self, i: int) -> str:
    raise NotImplementedError

  def id_to_piece(self, i: int) -> str:
    """The vocabulary entry of id `i` (SentencePiece's name for it)."""
    return self.id_to_token(i)

  def _set_separator(self, override: str | None, candidates: Sequence[tuple[str | None, str]]) -> None:
    """Picks the end-of-document token: `override`, else the first candidate (token, reason) in the vocab."""
    if override:
      i = self.token_to_id(override)
      if i is None:
        raise ValueError(f'--separator={override!r} is not a token of {self.path}; name a token of its '
                         f'vocabulary (e.g. its end-of-text token).')
      self.separator, self.separator_id, self.separator_reason = override, i, 'given by --separator'
      return
    for token, reason in candidates:
      if token and (i := self.token_to_id(token)) is not None:
        self.separator, self.separator_id, self.separator_reason = token, i, reason
        return
    raise ValueError(f'{self.path} has no end-of-text token to separate documents (no eos_token, none of '
                     f'{", ".join(END_OF_TEXT)}); pass --separator=TOKEN naming one of its tokens.')


class SentencePiece(Tokenizer):
  """A SentencePiece model: encode/decode, special ids, and the file it came from."""
  kind = 'sentencepiece'

  def __init__(self, path: str, *, add_bos: bool = False, add_eos: bool = False, separator: str | None = None):
    self.path = os.path.abspath(path)
    try:
      self._sp = spm.SentencePieceProcessor(model_file=self.path, add_bos=add_bos, add_eos=add_eos)
    except (OSError, RuntimeError) as e:
      raise ValueError(f'{path} is not a readable SentencePiece model: {e}') from e
    self.vocab_size = self._sp.vocab_size()
    self.eos_id = self._sp.eos_id()
    self.bos_id = self._sp.bos_id()
    self.pad_id = self._sp.pad_id()
    self.unk_id = self._sp.unk_id()
    self.special_tokens = {f'{k}_token': self._sp.id_to_piece(i) for k, i in
                           (('bos', self.bos_id), ('eos', self.eos_id), ('pad', self.pad_id),
                            ('unk', self.unk_id)) if i >= 0}
    self._set_separator(separator, [(self.special_tokens.get('eos_token'), 'the model\'s EOS piece')])

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (with BOS/EOS only if this wrapper was built with add_bos/add_eos)."""
    return self._sp.encode(text)

  def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each document with no BOS/EOS: the data pipeline inserts the single separator itself."""
    out = self._sp.encode(list(texts))
    control = {self.bos_id, self.eos_id} - {-1}
    # Strip at the ends only: SentencePiece never produces control ids from raw text, so interior ones cannot
    # occur; ends carry them when the processor was configured to add them.
    for ids in out:
      while ids and ids[-1] in control:
        ids.pop()
      while ids and ids[0] in control:
        del ids[0]
    return out

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    proto = self._sp.encode(text, out_type='immutable_proto')
    # SentencePiece reports byte offsets into the input; map them to character offsets.
    char_of_byte = np.zeros(len(text.encode('utf-8')) + 1, np.int64)
    b = 0
    for c, ch in enumerate(text):
      n = len(ch.encode('utf-8'))
      char_of_byte[b:b + n] = c
      b += n
    char_of_byte[b] = len(text)
    control = {self.bos_id, self.eos_id} - {-1}
    pieces = [p for p in proto.pieces if not (p.id in control and p.begin == p.end)]
    return [p.id for p in pieces], [(int(char_of_byte[p.begin]), int(char_of_byte[p.end])) for p in pieces]

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; ids outside the tokenizer (a model vocabulary may be padded larger) are dropped."""
    return self._sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

  def token_to_id(self, token: str) -> int | None:
    i = self._sp.piece_to_id(token)
    return None if i == self.unk_id and token != self._sp.id_to_piece(i) else i

  def id_to_token(self, i: int) -> str:
    return self._sp.id_to_piece(int(i))


def _token_text(value) -> str | None:
  """A special token in tokenizer_config.json: a string, or an AddedToken dict {"content": ...}."""
  if isinstance(value, dict):
    return value.get('content')
  return value if isinstance(value, str) else None


def read_chat_template(directory: str, config: dict, name: str | None = None) -> str | None:
  """The chat template a Hugging Face tokenizer directory ships: chat_template.jinja (transformers >= 4.47 saves
  it there) or tokenizer_config.json's `chat_template` (a string, or a list of named templates)."""
  jinja = os.path.join(directory, 'chat_template.jinja')
  if name is None and os.path.isfile(jinja):
    with open(jinja) as f:
      return f.read()
  template = config.get('chat_template')
  if isinstance(template, list):
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    return named.get(name or 'default')
  return template if isinstance(template, str) and name in (None, 'default') else None


GENERATION_CONFIG = 'generation_config.json'  # travels with the tokenizer: import, prepare and export copy it


def read_end_ids(directory: str, vocab_size: int) -> tuple[int, ...]:
  """The eos_token_id (one id or a list) of the generation_config.json in `directory`; () without one."""
  path = os.path.join(directory, GENERATION_CONFIG)
  if not os.path.isfile(path):
    return ()
  try:
    with open(path) as f:
      ids = json.load(f).get('eos_token_id')
  except (OSError, json.JSONDecodeError, AttributeError) as e:
    raise ValueError(f'{path} is unreadable ({e}); restore it or remove it.') from e
  ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
  if not all(isinstance(i, int) and 0 <= i < vocab_size for i in ids):
    raise ValueError(f'{path}: eos_token_id {ids} names ids outside the tokenizer\'s {vocab_size}; correct it or '
                     f'remove the file.')
  return tuple(ids)


class HuggingFace(Tokenizer):
  """A Hugging Face fast tokenizer (tokenizer.json, read by the `tokenizers` library) with its tokenizer_config
  and, where the model directory has one beside it, generation_config.json (the end-of-sequence ids)."""
  kind = 'huggingface'

  def __init__(self, path: str, *, separator: str | None = None):
    from tokenizers import Tokenizer as HFTok
    if os.path.isdir(path):
      path = os.path.join(path, 'tokenizer.json')
    self.path = os.path.abspath(path)
    try:
      self._tok = HFTok.from_file(self.path)
    except Exception as e:  # tokenizers raises bare Exceptions for unreadable files
      raise ValueError(f'{path} is not a readable Hugging Face tokenizer.json: {e}') from e
    self.directory = os.path.dirname(self.path)
    config_path = os.path.join(self.directory, 'tokenizer_config.json')
    self.config = {}
    if os.path.isfile(config_path):
      try:
        with open(config_path) as f:
          self.config = json.load(f)
      except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f'{config_path} is unreadable ({e}); restore it or remove it.') from e
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1  # the largest id it can produce, added tokens included
    self.special_tokens = {k: t for k in ('bos_token', 'eos_token', 'pad_token', 'unk_token')
                           if (t := _token_text(self.config.get(k))) is not None}
    ids = {k: self.token_to_id(t) for k, t in self.special_tokens.items()}
    self.bos_id, self.eos_id, self.pad_id, self.unk_id = (
        -1 if ids.get(f'{k}_token') is None else ids[f'{k}_token'] for k in ('bos', 'eos', 'pad', 'unk'))
    self.chat_template = read_chat_template(self.directory, self.config)
    self.end_ids = read_end_ids(self.directory, self.vocab_size)
    eos = self.special_tokens.get('eos_token')
    candidates = []
    if eos and eos not in END_OF_TURN:
      candidates.append((eos, 'the tokenizer\'s eos_token'))
    candidates += [(t, f'the tokenizer\'s end-of-text token (eos_token {eos!r} ends a turn, not a document)'
                    if eos else 'the tokenizer\'s end-of-text token') for t in END_OF_TEXT]
    if eos:
      candidates.append((eos, 'the tokenizer\'s eos_token (an end-of-turn token: it has no end-of-text token)'))
    self._set_separator(separator, candidates)

  @property
  def files(self) -> list[str]:
    names = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja',
             GENERATION_CONFIG)
    return [p for n in names if os.path.isfile(p := os.path.join(self.directory, n))]

  def encode_documents(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each document without the post-processor's specials (batched, in Rust)."""
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

  def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    e = self._tok.encode(text, add_special_tokens=False)
    return e.ids, [tuple(o) for o in e.offsets]

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, special tokens shown; ids outside the tokenizer are dropped."""
    return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size], skip_special_tokens=False)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str:
    return self._tok.id_to_token(int(i)) or ''


def main_file(path: str) -> str:
  """The tokenizer file `path` names: itself, or the tokenizer.json / tokenizer.model of a directory."""
  if os.path.isdir(path):
    for name in ('tokenizer.json', 'tokenizer.model'):
      if os.path.isfile(os.path.join(path, name)):
        return os.path.join(path, name)
    raise ValueError(f'{path} holds neither tokenizer.json nor tokenizer.model.')
  if not os.path.isfile(path):
    raise ValueError(f'tokenizer {path} does not exist.')
  return path


def load(path: str, *, separator: str | None = None) -> Tokenizer:
  """The tokenizer at `path`: a SentencePiece .model, a tokenizer.json, or a directory with one of them."""
  path = main_file(path)
  if path.endswith('.json'):
    return HuggingFace(path, separator=separator)
  return SentencePiece(path, separator=separator)
