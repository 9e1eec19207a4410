"""Chat data: rendering equals transformers' apply_chat_template, loss weights on assistant turns only, prepare
--format=chat (truncation at turn boundaries, bad records counted), and packing that keeps conversations apart."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxlm.data import chat as chat_lib
from jaxlm.data import pipeline as data_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from tests.conftest import ROOT
from tests.data import chat_fixtures
from tests.helpers import load_config

MULTI_TURN = [{'role': 'system', 'content': 'You answer briefly.'},
              {'role': 'user', 'content': 'Add 2 and 3.'},
              {'role': 'assistant', 'content': '2 plus 3 is 5.'},
              {'role': 'user', 'content': 'Spell stone.'},
              {'role': 'assistant', 'content': 's t o n e'}]


# Qwen3's behaviour, written here: an assistant turn before the last user message is rendered without its
# reasoning trace (inline <think>...</think> or `reasoning_content`); a later one with it, and the last one with an
# empty think block when it has none.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role != 'assistant' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{%- set answer = m.content %}{%- set trace = '' %}"
    "{%- if m.reasoning_content is string %}{%- set trace = m.reasoning_content %}"
    "{%- elif '</think>' in answer %}{%- set trace = answer.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_user and (loop.last or trace) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + trace.strip('\\n') + '\\n</think>\\n\\n' + answer.lstrip('\\n') "
    "+ '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + answer + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# As TRL's patched Qwen3 training template: every turn with its think block, inside {% generation %} tags.
TAGGED = (
    "{%- for m in messages %}"
    "{%- if m.role != 'assistant' %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{%- set answer = m.content %}{%- set trace = '' %}"
    "{%- if '</think>' in answer %}{%- set trace = answer.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set answer = answer.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- '<think>\\n' + trace.strip('\\n') + '\\n</think>\\n\\n' "
    "+ answer + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
REASONING = [{'role': 'system', 'content': 'You answer briefly.'},
             {'role': 'user', 'content': 'Add 2 and 3.'},
             {'role': 'assistant', 'content': '<think>\n2 and 3 make 5.\n</think>\n\n2 plus 3 is 5.'},
             {'role': 'user', 'content': 'Spell stone.'},
             {'role': 'assistant', 'content': 's t o n e'},
             {'role': 'user', 'content': 'Add 4 and 4.'},
             {'role': 'assistant', 'content': '<think>\nfour and four\n</think>\n\n4 plus 4 is 8.'}]


@pytest.fixture(scope='module')
def tok_dir(tmp_path_factory) -> str:
  return chat_fixtures.make_tokenizer(str(tmp_path_factory.mktemp('tok')))


@pytest.fixture(scope='module')
def qwen_dir(tmp_path_factory) -> str:
  return chat_fixtures.make_tokenizer(str(tmp_path_factory.mktemp('qwen')), template=QWEN3_STYLE,
                                      eos_token='<|im_end|>', added=('<think>', '</think>'))


def _weighted(tok, ids, weights) -> list[str]:
  spans = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))
  return [tok.decode(ids[a:b]) for a, b in zip(spans[::2], spans[1::2])]


def _hf_ids(hf, messages, template, **kw):
  out = hf.apply_chat_template(messages, tokenize=True, chat_template=template, **kw)
  return out if isinstance(out, list) else out['input_ids']


@pytest.mark.parametrize('template', ['llama3', 'chatml'])
def test_ids_equal_transformers_apply_chat_template(tok_dir, template):
  transformers = pytest.importorskip('transformers')
  os.environ['HF_HUB_OFFLINE'] = '1'
  hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
  tok = tokenizer_lib.load(tok_dir)
  source = chat_lib.BUILTIN[template]
  for messages in [MULTI_TURN] + [chat_lib.messages_of(r) for r in chat_fixtures.conversations(6)]:
    ids, weights, _ = chat_lib.encode(tok, source, messages)
    expected = hf.apply_chat_template(messages, tokenize=True, chat_template=source)
    expected = expected['input_ids'] if not isinstance(expected, list) else expected
    assert ids.tolist() == list(expected)
    assert chat_lib.render(messages, source, special_tokens=tok.special_tokens) == hf.apply_chat_template(
        messages, tokenize=False, chat_template=source)
    for gen in (True, False):  # what generation (#30) calls
      assert chat_lib.render(messages[:2], source, add_generation_prompt=gen,
                             special_tokens=tok.special_tokens) == hf.apply_chat_template(
          messages[:2], tokenize=False, add_generation_prompt=gen, chat_template=source)
  if template == 'llama3':  # transformers' {% generation %} tag (assistant masks) renders as its body
    tagged = source.replace('{{ content }}', '{% if message.role == "assistant" %}{% generation %}{{ content }}'
                            '{% endgeneration %}{% else %}{{ content }}{% endif %}')
    assert '{% generation %}' in tagged
    assert chat_lib.render(MULTI_TURN, tagged, special_tokens=tok.special_tokens) == hf.apply_chat_template(
        MULTI_TURN, tokenize=False, chat_template=tagged)
  # The tokenizer's own template is the one in its tokenizer_config.json (llama3 here).
  assert chat_lib.template_of(tok_dir) == chat_lib.LLAMA3 and chat_lib.template_of(tok, 'chatml') == chat_lib.CHATML


@pytest.mark.parametrize('template,end', [('llama3', '<|eot_id|>'), ('chatml', '<|im_end|>')])
def test_weights_cover_assistant_content_and_its_end_of_turn_token(tok_dir, template, end):
  tok = tokenizer_lib.load(tok_dir)
  ids, weights, turn_ends = chat_lib.encode(tok, chat_lib.BUILTIN[template], MULTI_TURN)
  spans = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))
  pieces = [tok.decode(ids[a:b]) for a, b in zip(spans[::2], spans[1::2])]
  assert pieces == [f'2 plus 3 is 5.{end}', f's t o n e{end}']  # nothing of system, user or the template
  assert turn_ends == list(spans[1::2])


def test_bad_records_are_named():
  for record, reason in [({'text': 'x'}, 'no_messages'), ({'messages': []}, 'no_messages'),
                         ({'messages': [{'role': 'bot', 'content': 'x'}]}, 'unknown_role'),
                         ({'messages': [{'role': 'user', 'content': 'x'}]}, 'no_assistant_turn'),
                         ([1, 2], 'not_an_object')]:
    with pytest.raises(chat_lib.BadRecord) as e:
      chat_lib.messages_of(record)
    assert e.value.reason == reason


def test_template_that_drops_the_assistant_text_or_raises_is_a_bad_record(tok_dir):
  tok = tokenizer_lib.load(tok_dir)
  strict = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}x"
  with pytest.raises(chat_lib.BadRecord, match='no system role') as e:
    chat_lib.encode(tok, strict, MULTI_TURN)
  assert e.value.reason == 'template_error'
  hides = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['role'] != 'assistant' else '...' }}\n"
           "{% endfor %}")
  with pytest.raises(chat_lib.BadRecord, match='assistant_text_not_found'):
    chat_lib.encode(tok, hides, MULTI_TURN)


def _prepare_chat(tmp_path, tok_dir, records, **kw):
  path = chat_fixtures.write_jsonl(tmp_path / 'chat.jsonl', records)
  kw = {'workers': 1, 'shard_docs': 16, 'eval_fraction': 0.2, 'progress': False, 'data_format': 'chat',
        'tokenizer': tok_dir, **kw}
  out = str(tmp_path / 'out')
  return prepare_lib.prepare(prepare_lib.expand_inputs([str(path)]), out, **kw), out


def test_prepare_chat_truncates_at_turn_boundaries_and_counts_what_it_skips(tmp_path, tok_dir):
  tok = tokenizer_lib.load(tok_dir)
  first_turn = len(chat_lib.encode(tok, chat_lib.LLAMA3, MULTI_TURN[:3])[0])
  whole = len(chat_lib.encode(tok, chat_lib.LLAMA3, MULTI_TURN)[0])
  long_prompt = [{'role': 'user', 'content': 'word ' * 200}, {'role': 'assistant', 'content': 'ok'}]
  records = ([{'messages': MULTI_TURN}] * 10 + [{'messages': long_prompt}] * 2 + [{'text': 'x'}]
             + [{'messages': [{'role': 'user', 'content': 'hi'}]}] + ['{not json'])
  meta, out = _prepare_chat(tmp_path, tok_dir, records, seq_len=whole - 2)
  c = meta['chat']
  assert (c['conversations'], c['truncated'], c['dropped_too_long']) == (10, 10, 2)
  assert c['skipped'] == {'no_assistant_turn': 1, 'no_messages': 1} and meta['dropped'] == {'bad_json': 1}
  assert meta['content'] == 'chat' and c['longest'] == first_turn  # cut after the first assistant turn
  all_bad = subprocess.run([sys.executable, '-m', 'jaxlm.data.prepare', '--format=chat', f'--tokenizer={tok_dir}',
                            f'--inputs={chat_fixtures.write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}] * 3)}',
                            f'--out={tmp_path / "o2"}'], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert all_bad.returncode == 2 and 'Traceback' not in all_bad.stderr
  last = all_bad.stderr.strip().splitlines()[-1]
  assert last.startswith('jaxlm: none of the 3 chat records could be used'), last


def test_packed_rows_keep_conversations_apart_with_their_weights(tmp_path, tok_dir):
  records = chat_fixtures.conversations(40)
  meta, out = _prepare_chat(tmp_path, tok_dir, records, seq_len=128)
  tok = tokenizer_lib.load(out)
  encoded = {}
  for r in records:
    ids, w, _ = chat_lib.encode(tok, chat_lib.LLAMA3, chat_lib.messages_of(r))
    encoded[tuple(ids.tolist())] = w
  c = load_config('base').data
  c.update(source='prepared', paths=out, seq_len=128)
  rows, _ = data_lib.make_train_rows(c, seed=0, vocab_size=tok.vocab_size, num_epochs=1)
  seen = 0
  for k in range(rows.rows):
    row = rows[k]
    for s in range(1, row['segment_ids'].max() + 1):
      at = row['segment_ids'] == s
      assert np.array_equal(row['positions'][at], np.arange(at.sum()))  # positions restart per conversation
      ids = tuple(row['inputs'][at].tolist()) + (int(row['targets'][at][-1]),)
      assert ids in encoded  # a whole conversation, never split across rows
      assert np.array_equal(row['weights'][at], encoded[ids][1:])  # the weight of each target token
      seen += 1
    assert not row['weights'][row['segment_ids'] == 0].any()
  assert seen == meta['splits']['train']['documents']  # one epoch: every conversation once
  ev = data_lib.eval_batches(c, batch_size=2, num_batches=1, vocab_size=tok.vocab_size, process_index=0,
                             process_count=1)
  assert ev[0]['weights'].sum() > 0 and set(ev[0]) == {'inputs', 'targets', 'segment_ids', 'positions', 'weights'}


def test_epochs_derive_steps_and_bad_epoch_settings_are_refused(tmp_path, tok_dir):
  from jaxlm import config as config_lib
  meta, out = _prepare_chat(tmp_path, tok_dir, chat_fixtures.conversations(30), seq_len=128)
  c = load_config('sft_example')
  c.data.update(paths=out, seq_len=128, cache_dir=str(tmp_path))
  c.train.update(epochs=3, batch_size=4)
  steps, rows = data_lib.steps_for_epochs(c.data, c.train, 400)
  packed, _ = data_lib.make_train_rows(c.data, seed=0, vocab_size=400)
  assert rows == packed.rows_per_epoch and steps == -(-3 * rows // 4)
  c.train.update(epochs=-1, batch_ramp='2:1000')
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(c, 8)
  assert 'train.epochs=-1 must be >= 0' in str(e.value) and 'train.batch_ramp' in str(e.value)


def test_training_refuses_conversations_longer_than_its_rows(tmp_path, tok_dir):
  meta, out = _prepare_chat(tmp_path, tok_dir, chat_fixtures.conversations(30), seq_len=128)
  c = load_config('base').data
  c.update(source='prepared', paths=out, seq_len=32, cache_dir=str(tmp_path))
  with pytest.raises(data_lib.DataError, match=r'data.seq_len=32; prepare again with --seq_len=32'):
    data_lib.make_train_rows(c, seed=0, vocab_size=400)


def test_reasoning_turns_are_trained_as_the_template_writes_them(qwen_dir):
  transformers = pytest.importorskip('transformers')
  os.environ['HF_HUB_OFFLINE'] = '1'
  hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
  tok = tokenizer_lib.load(qwen_dir)
  # The same conversation with the traces inline and as reasoning_content: the template renders both alike.
  split = [dict(m, content=m['content'].split('\n\n')[-1], reasoning_content=m['content'].split('\n')[1])
           if '</think>' in m['content'] else m for m in REASONING]
  for messages in (REASONING, chat_lib.messages_of({'messages': split})):
    ids, weights, turn_ends = chat_lib.encode(tok, QWEN3_STYLE, messages)
    assert ids.tolist() == list(_hf_ids(hf, messages, QWEN3_STYLE))
    # Turn 1 without its trace (the template drops it), turn 2 as it is, the last turn with its trace; each with
    # its end-of-turn token; nothing of the prompts or the generation prompt.
    assert _weighted(tok, ids, weights) == ['2 plus 3 is 5.<|im_end|>', 's t o n e<|im_end|>',
                                            '<think>\nfour and four\n</think>\n\n4 plus 4 is 8.<|im_end|>']
    assert turn_ends == list(np.flatnonzero(np.diff(np.concatenate([weights, [0]])) < 0) + 1)
  # A last answer without a trace gets an empty think block from the template: weight 0, or trained on request.
  plain = REASONING[:4] + [{'role': 'assistant', 'content': 'stone'}]
  for empty_think, last in [('mask', 'stone<|im_end|>'), ('train', '<think>\n\n</think>\n\nstone<|im_end|>')]:
    ids, weights, _ = chat_lib.encode(tok, QWEN3_STYLE, plain, empty_think=empty_think)
    assert ids.tolist() == list(_hf_ids(hf, plain, QWEN3_STYLE))
    assert _weighted(tok, ids, weights) == ['2 plus 3 is 5.<|im_end|>', last]


def test_generation_tags_give_transformers_assistant_mask(qwen_dir):
  transformers = pytest.importorskip('transformers')
  os.environ['HF_HUB_OFFLINE'] = '1'
  hf = transformers.AutoTokenizer.from_pretrained(qwen_dir)
  tok = tokenizer_lib.load(qwen_dir)
  for messages in [REASONING, MULTI_TURN] + [chat_lib.messages_of(r) for r in chat_fixtures.conversations(3)]:
    ids, weights, _ = chat_lib.encode(tok, TAGGED, messages)
    expected = hf.apply_chat_template(messages, tokenize=True, chat_template=TAGGED, return_dict=True,
                                      return_assistant_tokens_mask=True)
    assert ids.tolist() == list(expected['input_ids'])
    assert weights.tolist() == list(expected['assistant_masks'])
  assert _weighted(tok, *chat_lib.encode(tok, TAGGED, REASONING)[:2])[0] == (
      '<think>\n2 and 3 make 5.\n</think>\n\n2 plus 3 is 5.<|im_end|>')  # this template keeps every trace


def test_prepare_keeps_every_reasoning_conversation(tmp_path, qwen_dir):
  records = chat_fixtures.conversations(12) + [{'messages': REASONING}] * 3 + [{'messages': REASONING[:3]}]
  meta, _ = _prepare_chat(tmp_path, qwen_dir, records, empty_think='train', eval_fraction=0.0)
  c = meta['chat']
  assert c['skipped'] == {} and c['conversations'] == len(records)
