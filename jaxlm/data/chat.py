"""Chat data for supervised fine-tuning: templates, rendering, and per-token loss weights.

A conversation (`messages`: [{role, content}, ...], roles system / user / assistant) is rendered to text by a
chat template: the tokenizer's own Jinja `chat_template`, rendered exactly as transformers' `apply_chat_template`
renders it (a sandboxed Jinja environment with trim_blocks / lstrip_blocks, `raise_exception`, `tojson`,
`strftime_now`, the special tokens as variables), or a built-in one (`chatml`, `llama3`) for a tokenizer without
a template. The rendered text is tokenized whole (no post-processor specials, as apply_chat_template does), so
the ids equal `apply_chat_template(messages, tokenize=True)`.

Loss weights, as TRL's assistant-only loss and MaxText SFT: 1 on what the model writes in each assistant turn
and on its end-of-turn token (the model must learn to stop), 0 on system, user and template tokens. A template with
`{% generation %}` tags says it itself (weight 1 on the tagged spans, transformers' assistant mask). Otherwise the
spans come from the template's own rendering of the whole conversation: a turn starts where the template's
generation prompt for it ends and its content is the part of the text that changes when the content is replaced
by a stand-in, so a turn is trained as the template writes it (Qwen3's drops the reasoning trace of every turn but
the last). An empty `<think></think>` block the template writes before an answer stays at weight 0 unless
`empty_think='train'`. A template that does not write an assistant's content makes the record bad.
"""

import collections
import contextvars
import datetime
import functools
import re
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
# What an empty reasoning block before an answer gets (prepare --empty_think): weight 0, or trained.
EMPTY_THINK = ('mask', 'train')
_EMPTY_THINK = re.compile(r'<think>\s*</think>\s*\Z')  # Qwen3 writes one before a last answer without a trace
# Contents put in an assistant's place to see what its content becomes in the rendering; they differ from each
# other in their first and last character (no whitespace: templates trim).
_STAND_INS = ('\x01', '\x02')


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
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body as it is and,
    while `_tracking` holds (output so far, spans), records the body's character span in the output."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method('_body'), [], [], body).set_lineno(lineno)

    def _body(self, caller):
      out = caller()
      if (tracking := _TRACKING.get()) is not None:
        blocks, spans = tracking
        start = sum(map(len, blocks))  # the body is written right after what the template yielded so far
        spans.append((start, start + len(out)))
      return out

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(template)


_TRACKING = contextvars.ContextVar('generation_tracking', default=None)


def render(messages: list[dict], template: str, *, add_generation_prompt: bool = False,
           special_tokens: dict | None = None) -> str:
  """The text `template` makes of `messages`, as transformers' apply_chat_template(tokenize=False) renders it.

  `special_tokens`: bos_token, eos_token, ... (a tokenizer's `special_tokens`), visible to the template.
  """
  return _compile(template).render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **(special_tokens or {}))


def render_generation(messages: list[dict], template: str, *,
                      special_tokens: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
  """The text of `messages` and the character spans of its `{% generation %}` blocks (as transformers'
  return_assistant_tokens_mask finds them); no spans for a template without the tag."""
  blocks, spans = [], []
  token = _TRACKING.set((blocks, spans))
  try:
    for block in _compile(template).generate(messages=messages, tools=None, documents=None,
                                             add_generation_prompt=False, **(special_tokens or {})):
      blocks.append(block)
  finally:
    _TRACKING.reset(token)
  return ''.join(blocks), spans


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
    if isinstance(m.get('reasoning_content'), str):  # a trace kept apart from the answer (Qwen3's templates read it)
      out[-1]['reasoning_content'] = m['reasoning_content']
  if not any(m['role'] == 'assistant' for m in out):
    raise BadRecord('no_assistant_turn')
  return out


def _content_span(messages: list[dict], i: int, template: str, specials: dict, text: str):
  """(start, end) of what message i's content became in `text` (the whole conversation as the template writes it:
  a trace the template drops is not in it, an answer it trims is trimmed): the part that changes when the content
  is replaced by a stand-in. None when no stand-in changes the text (the template does not write the content)."""
  start = end = None
  for stand_in in _STAND_INS:
    other = render(messages[:i] + [{**messages[i], 'content': stand_in}] + messages[i + 1:], template,
                   special_tokens=specials)
    if other == text:
      continue
    p = len(os.path.commonprefix([text, other]))
    q = len(os.path.commonprefix([text[p:][::-1], other[p:][::-1]]))
    # Each bound is exact for a stand-in whose first (last) character differs from the content's; the stand-ins
    # differ from each other in both, so the narrowest start and widest end are exact.
    start, end = (p, len(text) - q) if start is None else (min(start, p), max(end, len(text) - q))
  return None if start is None else (start, end)


def _end_of_turn(text: str, end: int, specials: dict) -> tuple[int, int]:
  """The character span of the end-of-turn marker after an answer ending at `end`; (end, end + 1) without one."""
  marker = next((t for t in END_OF_TURN + (specials.get('eos_token') or '',) if t and
                 text[end:].lstrip(' \n').startswith(t)), None)
  return (end, text.index(marker, end) + len(marker)) if marker else (end, end + 1)


def _derived_spans(messages: list[dict], template: str, specials: dict, text: str, empty_think: str):
  """(turns, masked) of a template without {% generation %} tags. turns: (start, answer end, end-of-turn span) of
  each assistant turn as the full rendering writes it; masked: character spans whose tokens keep weight 0."""
  turns, masked, pos = [], [], 0
  for i, m in enumerate(messages):
    if m['role'] != 'assistant':
      continue
    anchor = None
    try:  # where the model's turn starts: after the prompt the template writes for it
      prefix = render(messages[:i], template, add_generation_prompt=True, special_tokens=specials)
      if text.startswith(prefix) and len(prefix) >= pos:
        anchor = len(prefix)
    except Exception:  # pylint: disable=broad-except  -- some templates refuse a prefix; start at the answer
      pass
    span = _content_span(messages, i, template, specials, text)
    if span is None:
      raise BadRecord('assistant_text_not_found')
    lower = pos if anchor is None else anchor
    if span[0] < lower:  # the template also writes the content elsewhere: find it after the prompt instead
      content = m['content'].strip()
      found = text.find(content, lower) if content else lower
      if found < 0:
        raise BadRecord('assistant_text_not_found')
      span = (found, found + len(content))
    start, end = span
    turn_start = start if anchor is None else anchor
    think = _EMPTY_THINK.search(text, lower, start)
    if think:  # an empty reasoning block right before the answer (Qwen3's last turn without a trace)
      if empty_think == 'train':
        turn_start = min(turn_start, think.start())
      else:
        masked.append(think.span())
    eot = _end_of_turn(text, end, specials)
    turns.append((turn_start, end, eot))
    pos = eot[1]
  return turns, masked


def encode(tokenizer, template: str, messages: list[dict], *,
           empty_think: str = 'mask') -> tuple[np.ndarray, np.ndarray, list[int]]:
  """(ids, loss weights, turn ends) of one conversation. Turn ends: the token counts after each assistant turn's
  end-of-turn token, where the conversation may be cut. Raises BadRecord when a turn cannot be aligned.

  A template with {% generation %} tags: weight 1 on the tokens of each tagged span (transformers'
  assistant_tokens_mask). Otherwise each assistant turn as the whole conversation's rendering writes it, from
  the end of its generation prompt to its end-of-turn marker; `empty_think` 'mask' keeps an empty
  `<think></think>` block the template writes before an answer at weight 0, 'train' trains it.
  """
  if empty_think not in EMPTY_THINK:
    raise ValueError(f'empty_think={empty_think!r} is unknown; use one of {", ".join(EMPTY_THINK)}.')
  specials = tokenizer.special_tokens
  try:
    text, tagged = render_generation(messages, template, special_tokens=specials)
    if tagged:
      turns, masked = [(a, b, None) for a, b in tagged if b > a], []
    else:
      turns, masked = _derived_spans(messages, template, specials, text, empty_think)
  except BadRecord:
    raise
  except Exception as e:  # a template's raise_exception (e.g. roles must alternate) or a Jinja error
    raise BadRecord('template_error', str(e)) from e
  ids, offsets = tokenizer.encode_with_offsets(text)
  ids = np.asarray(ids, np.int64)
  weights = np.zeros(len(ids), np.uint8)
  starts = np.asarray([o[0] for o in offsets], np.int64)
  ends = np.asarray([o[1] for o in offsets], np.int64)
  turn_ends = []
  for start, end, eot_span in turns:
    turn = (ends > start) & (starts < end)  # every token that overlaps the turn
    if eot_span is not None:
      eot = (ends > eot_span[0]) & (starts < eot_span[1]) & (starts >= end)
      if not eot.any():  # no end-of-turn marker: the token right after the answer
        eot[np.nonzero(starts >= end)[0][:1]] = True
      turn |= eot
    weights[turn] = 1
    if turn.any():
      turn_ends.append(int(np.nonzero(turn)[0][-1]) + 1)
  for start, end in masked:
    weights[(starts >= start) & (ends <= end)] = 0
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


def encode_conversations(tokenizer, template: str, records: list, *, max_tokens: int,
                         empty_think: str) -> tuple[list, collections.Counter]:
  """The (ids, weights) of one shard's conversation records, each cut at a turn end to fit `max_tokens` (0 = kept
  whole) or dropped, and counts of what was kept, cut or skipped."""
  out, counts = [], collections.Counter()
  for record in records:
    try:
      ids, weights, turn_ends = encode(tokenizer, template, messages_of(record), empty_think=empty_think)
    except BadRecord as e:
      counts[f'bad_{e.reason}'] += 1
      continue
    fitted = fit(ids, weights, turn_ends, max_tokens) if max_tokens else (ids, weights, 'kept')
    if fitted is None:
      counts['dropped_too_long'] += 1
      continue
    ids, weights, what = fitted
    counts[what] += 1
    counts['longest'] = max(counts['longest'], len(ids))
    counts['weighted_tokens'] += int(weights.sum())
    out.append((ids, weights))
  return out, counts


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


def encode_pairs(tokenizer, template: str, records: list, *, max_tokens: int) -> tuple[list, collections.Counter]:
  """The (chosen, rejected) sides of one shard's preference records, each pair whole or dropped (both sides are
  packed in one row of `max_tokens` ids, 0 = any length), and counts of what was kept or skipped."""
  out, counts = [], collections.Counter()
  for record in records:
    try:
      chosen, rejected = encode_pair(tokenizer, template, record)
    except BadRecord as e:
      counts[f'bad_{e.reason}'] += 1
      continue
    positions = len(chosen[0]) - 1 + len(rejected[0]) - 1
    if max_tokens and positions > max_tokens - 1:  # a pair is packed as one unit: both sides in one row
      counts['dropped_too_long'] += 1
      continue
    counts['kept'] += 1
    counts['longest'] = max(counts['longest'], positions)
    counts['weighted_tokens'] += int(chosen[1].sum() + rejected[1].sum())
    out.append((chosen, rejected))
  return out, counts


def encode_shard(tokenizer, records: list, settings: tuple, dtype: str) -> tuple[list[bytes], list, dict]:
  """prepare --format=chat|preference: one shard's jsonl records → (stored records, the ids of each, counts of
  what was kept, cut or skipped). settings: (template, most ids a record may keep or 0, empty_think, pairs?)."""
  template, max_tokens, empty_think, pairs = settings
  if pairs:  # preference pairs: both sides of a pair in one record
    encoded, counts = encode_pairs(tokenizer, template, records, max_tokens=max_tokens)
    stored = [to_pair_record(c, r, dtype) for c, r in encoded]
    ids = [np.concatenate([c[0], r[0]]) for c, r in encoded]
  else:  # conversations: stored as ids then one uint8 loss weight per token
    encoded, counts = encode_conversations(tokenizer, template, records, max_tokens=max_tokens,
                                           empty_think=empty_think)
    stored = [to_record(i, w, dtype) for i, w in encoded]
    ids = [i for i, _ in encoded]
  return stored, ids, dict(sorted(counts.items()))
