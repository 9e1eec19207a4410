"""SentencePiece tokenizer: training on a bounded sample, and a small wrapper used by prepare, data and export.

The settings follow PaLM's vocabulary (Chowdhery et al. 2022, section 3): lossless (no normalisation, whitespace
kept, so code indentation survives), digits split into single tokens, and unknown characters falling back to
UTF-8 bytes instead of <unk>.
"""

import hashlib
import io
import os
from collections.abc import Iterable, Sequence

import sentencepiece as spm

from jaxlm.data import format as format_lib

MODEL_TYPES = ('bpe', 'unigram')


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


class Tokenizer:
  """A SentencePiece model: encode/decode, special ids, and the file it came from."""

  def __init__(self, path: str, *, add_bos: bool = False, add_eos: bool = False):
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

  @property
  def sha256(self) -> str:
    """Checksum of the .model file."""
    return file_sha256(self.path)

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

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`; ids outside the tokenizer (a model vocabulary may be padded larger) are dropped."""
    return self._sp.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

  def id_to_piece(self, i: int) -> str:
    """The vocabulary entry of id `i`."""
    return self._sp.id_to_piece(int(i))
