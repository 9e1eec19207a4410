"""Tiny tokenizers and chat data made on the spot (nothing downloaded), shared by the data, hf and tools tests.

`make_tokenizer` trains a byte-level BPE with the `tokenizers` library, adds Llama-3 / ChatML special tokens, and
writes tokenizer.json + tokenizer_config.json as a Hugging Face instruct model ships them: its post-processor adds
BOS (optionally BOS and EOS), its eos_token is the end-of-turn token, and it carries a chat template.
"""

import json
import os
import random

from jaxlm.data import chat as chat_lib

SPECIALS = ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>', '<|end_header_id|>', '<|eot_id|>',
            '<|im_start|>', '<|im_end|>']
NAMES = ['Ada', 'Bob', 'Cleo', 'Dan', 'Eve', 'Finn', 'Gus', 'Hana']
WORDS = ['apple', 'river', 'stone', 'cloud', 'tiger', 'piano', 'lemon', 'orbit', 'maple', 'quartz']


def corpus(n: int = 400, seed: int = 0) -> list[str]:
  """Plain-text documents with code, numbers and unicode, for training the tokenizer and text-data tests."""
  rng = random.Random(seed)
  docs = []
  for i in range(n):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    docs.append(f'{rng.choice(NAMES)} has {a} {rng.choice(WORDS)}s and {b} {rng.choice(WORDS)}s.\n'
                f'def add(x, y):\n    return x + y  # {a} + {b} = {a + b} ü 日本\n')
  return docs


def conversations(n: int = 48, seed: int = 0) -> list[dict]:
  """Chat records: multi-turn with a system message, single-turn, and prompt/completion pairs."""
  rng = random.Random(seed)
  out = []
  for i in range(n):
    a, b, w = rng.randint(0, 9), rng.randint(0, 9), rng.choice(WORDS)
    if i % 3 == 0:
      out.append({'prompt': f'Add {a} and {b}.', 'completion': f'{a} plus {b} is {a + b}.'})
    elif i % 3 == 1:
      out.append({'messages': [{'role': 'user', 'content': f'Spell {w}.'},
                               {'role': 'assistant', 'content': ' '.join(w)}]})
    else:
      out.append({'messages': [{'role': 'system', 'content': 'You answer briefly.'},
                               {'role': 'user', 'content': f'Add {a} and {b}.'},
                               {'role': 'assistant', 'content': f'{a} plus {b} is {a + b}.'},
                               {'role': 'user', 'content': f'Spell {w}.'},
                               {'role': 'assistant', 'content': ' '.join(w)}]})
  return out


def write_jsonl(path: str, records) -> str:
  with open(path, 'w') as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
  return path


def make_tokenizer(out_dir: str, *, post: str = 'bos', template: str | None = 'llama3', vocab_size: int = 400,
                   eos_token: str = '<|eot_id|>', added: tuple = (), eos_token_ids: list | None = None) -> str:
  """A byte-level BPE tokenizer directory; post: 'bos' | 'bos_eos' | 'none' (its post-processor's specials).

  `added`: tokens added after training (ids from `vocab_size` on), as Qwen3 adds <think> and </think>.
  `eos_token_ids`: written as generation_config.json's eos_token_id list, as a model directory ships it.
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  text = corpus() + [json.dumps(c) for c in conversations()]
  tok.train_from_iterator(text, trainer=trainer)
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
  tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
  bos, eos = '<|begin_of_text|>', '<|end_of_text|>'
  ids = {t: tok.token_to_id(t) for t in (bos, eos)}
  if post == 'bos':
    tok.post_processor = processors.TemplateProcessing(single=f'{bos} $A', pair=f'{bos} $A {bos} $B:1',
                                                       special_tokens=[(bos, ids[bos])])
  elif post == 'bos_eos':
    tok.post_processor = processors.TemplateProcessing(single=f'{bos} $A {eos}', pair=f'{bos} $A {eos} $B:1 {eos}:1',
                                                       special_tokens=[(bos, ids[bos]), (eos, ids[eos])])
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, 'tokenizer.json'))
  config = {'tokenizer_class': 'PreTrainedTokenizerFast', 'bos_token': bos, 'eos_token': eos_token,
            'clean_up_tokenization_spaces': False, 'model_max_length': 4096}
  if template:
    config['chat_template'] = chat_lib.BUILTIN.get(template, template)
  with open(os.path.join(out_dir, 'tokenizer_config.json'), 'w') as f:
    json.dump(config, f, indent=2)
  if eos_token_ids is not None:
    with open(os.path.join(out_dir, 'generation_config.json'), 'w') as f:
      json.dump({'eos_token_id': eos_token_ids}, f, indent=2)
  return out_dir
