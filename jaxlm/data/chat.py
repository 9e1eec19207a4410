"""Chat data for supervised fine-tuning: templates, rendering, and per-token loss weights.

A conversation (`messages`: [{role, content}, ...], roles system / user / assistant) is rendered to text by a
chat template: the tokenizer's own Jinja `chat_template`, rendered exactly as transformers' `apply_chat_template`
renders it (a sandboxed Jinja environment with trim_blocks / lstrip_blocks, `raise_exception`, `tojson`,
`strftime_now`, the special tokens as variables), or a built-in one (`chatml`, `llama3`) for a tokenizer without
a template. The rendered text is tokenized whole (no post-processor specials, as apply_chat_template does), so
the ids equal `apply_chat_template(messages, tokenize=True)`.

Loss weights, as TRL's assistant-only loss and MaxText SFT: 1 on every token of each assistant turn's content
and on its end-of-turn token (the model must learn to stop), 0 on system, user and template tokens. The assistant
spans are found in the rendered text; a template that does not reproduce an assistant's text makes the record bad.
"""

import datetime
import functools
import json
import os

import numpy as np

ROLES = ('system', 'user', 'assistant')

# The ChatML template (Qwen, many fine-tunes) and Llama 3's (as it ships in Llama-3-8B-Instruct's tokenizer_config).
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          "{% endif %}")
BUILTIN = {'chatml': CHATML, 'llama3': LLAMA3}
# Tokens that end a turn: the whole marker gets the assistant's weight when a template writes one of these.
END_OF_TURN = ('<|im_end|>', '<|eot_id|>', '<end_of_turn>', '<|end|>', '</s>', '<|endoftext|>', '<|end_of_text|>')


class BadRecord(ValueError):
  """A conversation that cannot be trained on; `reason` is the counter it is reported under."""

  def __init__(self, reason: str, message: str = ''):
    super().__init__(message or reason)
    self.reason = reason


@functools.lru_cache(maxsize=8)
def _compile(template: str):
  import jinja2  # pylint: disable=g-import-not-at-top
  import jinja2.ext  # pylint: disable=g-import-not-at-top
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: Jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) renders its body as it is."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      return caller()

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


def render(messages: list[dict], template: str, *, add_generation_prompt: bool = False,
           special_tokens: dict | None = None) -> str:
  """The text `template` makes of `messages`, as transformers' apply_chat_template(tokenize=False) renders it.

  `special_tokens`: bos_token, eos_token, ... (a tokenizer's `special_tokens`), visible to the template.
  """
  return _compile(template).render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **(special_tokens or {}))


def template_of(tokenizer_or_dir, name: str | None = None) -> str | None:
  """The named built-in template (`chatml`, `llama3`), else the tokenizer's own; None if it has none.

  `tokenizer_or_dir`: a jaxlm Tokenizer, or a path that `tokenizer.load` reads (a directory or a file).
  """
  if name in BUILTIN:
    return BUILTIN[name]
  if name:
    raise ValueError(f'chat template {name!r} is unknown; use one of {", ".join(BUILTIN)}, or leave it empty to '
                     f'use the tokenizer\'s own.')
  if isinstance(tokenizer_or_dir, (str, os.PathLike)):
    from jaxlm.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
    tokenizer_or_dir = tokenizer_lib.load(os.fspath(tokenizer_or_dir))
  return getattr(tokenizer_or_dir, 'chat_template', None)


def messages_of(record) -> list[dict]:
  """The conversation of a jsonl record: its `messages`, or a `prompt` / `completion` pair; else BadRecord."""
  if not isinstance(record, dict):
    raise BadRecord('not_an_object')
  if 'messages' in record:
    messages = record['messages']
  elif isinstance(record.get('prompt'), str) and isinstance(record.get('completion'), str):
    messages = [{'role': 'user', 'content': record['prompt']}, {'role': 'assistant', 'content': record['completion']}]
  else:
    raise BadRecord('no_messages')
  if not isinstance(messages, list) or not messages:
    raise BadRecord('no_messages')
  out = []
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get('content'), str):
      raise BadRecord('bad_message')
    if m.get('role') not in ROLES:
      raise BadRecord('unknown_role')
    out.append({'role': m['role'], 'content': m['content']})
  if not any(m['role'] == 'assistant' for m in out):
    raise BadRecord('no_assistant_turn')
  return out


def encode(tokenizer, template: str, messages: list[dict]) -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(ids, loss weights, turn ends) of one conversation. Turn ends: the token counts after each assistant turn's
  end-of-turn token, where the conversation may be cut. Raises BadRecord when a span cannot be found."""
  specials = tokenizer.special_tokens
  try:
    text = render(messages, template, special_tokens=specials)
  except Exception as e:  # a template's raise_exception (e.g. roles must alternate) or a Jinja error
    raise BadRecord('template_error', str(e)) from e
  spans, pos = [], 0
  for i, m in enumerate(messages):
    if m['role'] != 'assistant':
      continue
    try:  # where the assistant's turn starts: after the prompt the template writes for it
      prefix = render(messages[:i], template, add_generation_prompt=True, special_tokens=specials)
      if text.startswith(prefix):
        pos = max(pos, len(prefix))
    except Exception:  # pylint: disable=broad-except  -- some templates refuse a prefix; search from pos instead
      pass
    content = m['content'].strip()  # templates often trim the content (Llama 3's does)
    start = text.find(content, pos) if content else pos
    if start < 0:
      raise BadRecord('assistant_text_not_found')
    end = start + len(content)
    marker = next((t for t in END_OF_TURN + (specials.get('eos_token') or '',) if t and
                   text[end:].lstrip(' \n').startswith(t)), None)
    if marker:
      end_of_turn = (end, text.index(marker, end) + len(marker))
    else:
      end_of_turn = (end, end + 1)  # the token right after the content
    spans.append((start, end, end_of_turn))
    pos = end_of_turn[1]
  ids, offsets = tokenizer.encode_with_offsets(text)
  ids = np.asarray(ids, np.int64)
  weights = np.zeros(len(ids), np.uint8)
  starts = np.asarray([o[0] for o in offsets], np.int64)
  ends = np.asarray([o[1] for o in offsets], np.int64)
  turn_ends = []
  for start, end, (eot_start, eot_end) in spans:
    weights[(ends > start) & (starts < end)] = 1  # content: every token that overlaps it
    eot = (ends > eot_start) & (starts < eot_end) & (starts >= end)
    if not eot.any():  # no end-of-turn marker: the token right after the content
      after = np.nonzero(starts >= end)[0]
      eot[after[:1]] = True
    weights[eot] = 1
    last = np.nonzero(eot | ((ends > start) & (starts < end)))[0]
    if len(last):
      turn_ends.append(int(last[-1]) + 1)
  if not weights.any():
    raise BadRecord('assistant_text_not_found')
  return ids, weights, turn_ends


def fit(ids: np.ndarray, weights: np.ndarray, turn_ends: list[int], max_tokens: int):
  """(ids, weights, 'kept' | 'truncated'), cut at the last turn end within `max_tokens`; None if none fits."""
  if len(ids) <= max_tokens:
    return ids, weights, 'kept'
  cuts = [c for c in turn_ends if c <= max_tokens and weights[:c].any()]
  if not cuts:
    return None
  return ids[:cuts[-1]], weights[:cuts[-1]], 'truncated'


def to_record(ids: np.ndarray, weights: np.ndarray, dtype: str) -> bytes:
  """A stored conversation: its ids in `dtype`, then one uint8 loss weight per token."""
  return np.asarray(ids, dtype).tobytes() + np.asarray(weights, np.uint8).tobytes()


def from_record(record: bytes, dtype: str) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32, weights float32) of a stored conversation."""
  n = len(record) // (np.dtype(dtype).itemsize + 1)
  ids = np.frombuffer(record, dtype, n)
  weights = np.frombuffer(record, np.uint8, n, offset=n * np.dtype(dtype).itemsize)
  return ids.astype(np.int32), weights.astype(np.float32)


def record_tokens(record_bytes: int, dtype: str) -> int:
  """Tokens of a stored conversation, from its size."""
  return record_bytes // (np.dtype(dtype).itemsize + 1)


# Preference pairs (prepare --format=preference): TRL's two dataset shapes, each side rendered whole.


def _as_messages(value, role: str) -> list[dict]:
  """A TRL field: a string (one `role` message) or a list of messages."""
  if isinstance(value, str):
    return [{'role': role, 'content': value}]
  if isinstance(value, list):
    return messages_of({'messages': value}) if role == 'assistant' or any(
        isinstance(m, dict) and m.get('role') == 'assistant' for m in value) else _plain(value)
  raise BadRecord('bad_message')


def _plain(messages) -> list[dict]:
  out = []
  for m in messages:
    if not isinstance(m, dict) or not isinstance(m.get('content'), str) or m.get('role') not in ROLES:
      raise BadRecord('bad_message')
    out.append({'role': m['role'], 'content': m['content']})
  return out


def pair_of(record) -> tuple[list[dict], list[dict]]:
  """(chosen conversation, rejected conversation) of a jsonl preference record, each ending in the assistant
  completion that is compared: `{prompt, chosen, rejected}` (strings or message lists, TRL's explicit prompt) or
  `{chosen, rejected}` message lists whose common prefix is the prompt (TRL's implicit prompt)."""
  if not isinstance(record, dict) or 'chosen' not in record or 'rejected' not in record:
    raise BadRecord('no_pair')
  if 'prompt' in record:
    prompt = _as_messages(record['prompt'], 'user')
    chosen = prompt + _as_messages(record['chosen'], 'assistant')
    rejected = prompt + _as_messages(record['rejected'], 'assistant')
  else:
    if not isinstance(record['chosen'], list) or not isinstance(record['rejected'], list):
      raise BadRecord('implicit_prompt_not_messages')
    chosen, rejected = _plain(record['chosen']), _plain(record['rejected'])
  for side in (chosen, rejected):
    if not side or side[-1]['role'] != 'assistant':
      raise BadRecord('no_final_assistant_turn')
  return chosen, rejected


def encode_completion(tokenizer, template: str, messages: list[dict]) -> tuple[np.ndarray, np.ndarray, str]:
  """(ids, weights, rendered prompt) of a conversation rendered whole, weights 1 only on its final assistant
  completion and end-of-turn token (the tokens after the rendered prompt `messages[:-1]` + generation prompt)."""
  ids, weights, _ = encode(tokenizer, template, messages)
  try:
    prompt = render(messages[:-1], template, add_generation_prompt=True, special_tokens=tokenizer.special_tokens)
  except Exception as e:  # pylint: disable=broad-except
    raise BadRecord('template_error', str(e)) from e
  text = render(messages, template, special_tokens=tokenizer.special_tokens)
  if not text.startswith(prompt):
    raise BadRecord('prompt_not_a_prefix')
  _, offsets = tokenizer.encode_with_offsets(text)
  starts = np.asarray([o[0] for o in offsets], np.int64)
  weights = np.where(starts >= len(prompt), weights, 0).astype(np.uint8)
  if not weights.any():
    raise BadRecord('assistant_text_not_found')
  return ids, weights, prompt


def encode_pair(tokenizer, template: str, record) -> tuple[tuple, tuple]:
  """((chosen ids, weights), (rejected ids, weights)) of a preference record; BadRecord when its two sides'
  rendered prompts differ (the pair would not compare two answers to one prompt)."""
  chosen, rejected = pair_of(record)
  c_ids, c_w, c_prompt = encode_completion(tokenizer, template, chosen)
  r_ids, r_w, r_prompt = encode_completion(tokenizer, template, rejected)
  if c_prompt != r_prompt:
    raise BadRecord('prompts_differ')
  return (c_ids, c_w), (r_ids, r_w)


def to_pair_record(chosen: tuple, rejected: tuple, dtype: str) -> bytes:
  """A stored pair: the chosen side's token count (uint32), then each side as `to_record` writes it."""
  return (np.asarray([len(chosen[0])], np.uint32).tobytes() + to_record(*chosen, dtype)
          + to_record(*rejected, dtype))


def from_pair_record(record: bytes, dtype: str) -> tuple[tuple, tuple]:
  """((chosen ids, weights), (rejected ids, weights)) of a stored pair (ids int32, weights float32)."""
  n = int(np.frombuffer(record[:4], np.uint32)[0])
  cut = 4 + n * (np.dtype(dtype).itemsize + 1)
  return from_record(record[4:cut], dtype), from_record(record[cut:], dtype)


def pair_positions(record_bytes: bytes, dtype: str) -> int:
  """Row positions a stored pair fills: (chosen ids - 1) + (rejected ids - 1)."""
  (c, _), (r, _) = from_pair_record(record_bytes, dtype)
  return len(c) - 1 + len(r) - 1
