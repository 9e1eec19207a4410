"""Tokenizer files travel with the model: import_llama copies them, export writes them back so that transformers'
AutoTokenizer encodes text and renders chats to exactly the ids `jaxlm.data.prepare` wrote."""

import json
import os

import pytest

from jaxlm.data import chat as chat_lib
from jaxlm.data import prepare as prepare_lib
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.hf import export
from jaxlm.hf import import_llama
from tests.data import chat_fixtures


def ids_of(rendered) -> list[int]:
  """apply_chat_template(tokenize=True)'s ids: a list (transformers 4) or a BatchEncoding (5)."""
  return list(rendered) if isinstance(rendered, list) else list(rendered['input_ids'])


def tiny_hf_llama(transformers, torch, path: str, vocab_size: int, eos_token_id=None):
  """A random tiny Llama saved by transformers itself. Its config and generation_config name the tokenizer's ids
  at `path`, as a model ships them: BOS, and end-of-sequence ids `eos_token_id` (default: the document separator
  and the end of turn, as Llama 3 Instruct lists <|end_of_text|> and <|eot_id|>)."""
  tok = tokenizer_lib.load(path)
  ids = dict(bos_token_id=tok.bos_id, eos_token_id=eos_token_id or [tok.separator_id, tok.eos_id])
  rope = dict(rope_parameters={'rope_type': 'default', 'rope_theta': 1000.0})
  if not hasattr(transformers.LlamaConfig(), 'rope_parameters'):  # transformers 4.x
    rope = dict(rope_theta=1000.0)
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False, max_position_embeddings=256, **ids, **rope)
  model = transformers.LlamaForCausalLM(config).float().eval()
  model.save_pretrained(path, safe_serialization=True)
  return model


def test_import_copies_tokenizer_and_export_gives_autotokenizer_the_same_ids(tmp_path, capsys):
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  os.environ['HF_HUB_OFFLINE'] = '1'
  hf_dir = str(tmp_path / 'hf')
  tok_dir = chat_fixtures.make_tokenizer(hf_dir, post='bos')
  tok = tokenizer_lib.load(tok_dir)
  # The model's end-of-sequence list holds an id that is neither the tokenizer's eos nor its separator.
  end_ids = [tok.eos_id, tok.token_to_id('<|im_end|>')]
  tiny_hf_llama(transformers, torch, hf_dir, tok.vocab_size, eos_token_id=end_ids)
  result = import_llama.import_hf(hf_dir, str(tmp_path / 'run'))
  assert result['tokenizer_files'] == ['tokenizer.json', 'tokenizer_config.json', 'generation_config.json']
  assert result['tokenizer'] == os.path.abspath(tmp_path / 'run')
  commands = import_llama.prepare_commands(result['tokenizer'], 256)
  assert commands[1].startswith(f'python -m jaxlm.data.prepare --format=chat --tokenizer={result["tokenizer"]} ')

  # Prepare text and chat data with the imported tokenizer, as the printed commands do.
  chat_fixtures.write_jsonl(tmp_path / 'docs.jsonl', [{'text': t} for t in chat_fixtures.corpus(20)])
  chat_fixtures.write_jsonl(tmp_path / 'chat.jsonl', chat_fixtures.conversations(12))
  text_meta = prepare_lib.prepare(prepare_lib.expand_inputs([str(tmp_path / 'docs.jsonl')]), str(tmp_path / 'text'),
                                  tokenizer=result['tokenizer'], workers=1, progress=False, eval_fraction=0.2)
  summary = export.export(str(tmp_path / 'run'), str(tmp_path / 'back'))
  assert {'tokenizer.json', 'tokenizer_config.json'} <= set(summary['files'])
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'back'))
  ours = tokenizer_lib.load(str(tmp_path / 'text'))
  held_out = 'Zed has 7 quartzs.\n    return y  # ü held out'
  assert theirs(held_out, add_special_tokens=False)['input_ids'] == ours.encode(held_out)
  assert theirs(held_out)['input_ids'][0] == ours.bos_id  # its own post-processor (BOS) is kept
  for record in chat_fixtures.conversations(6):
    messages = chat_lib.messages_of(record)
    ids, _, _ = chat_lib.encode(ours, chat_lib.template_of(ours), messages)
    assert ids.tolist() == ids_of(theirs.apply_chat_template(messages, tokenize=True))
    assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat_lib.render(
        messages, chat_lib.template_of(str(tmp_path / 'back')), add_generation_prompt=True,
        special_tokens=ours.special_tokens)
  config = json.loads((tmp_path / 'back' / 'generation_config.json').read_text())
  # Sampling's stop ids (read from the generation_config.json import and prepare carried along) are what the
  # export lists: the model's own, then the document separator it lacked.
  assert config['eos_token_id'] == ours.stop_ids == end_ids + [ours.separator_id]
  assert text_meta['separator'] == '<|end_of_text|>'


def test_export_writes_a_builtin_chat_template_the_data_used(tmp_path):
  """A tokenizer without a template, chat data rendered with --chat_template=chatml: the export carries chatml."""
  transformers = pytest.importorskip('transformers')
  tok_dir = chat_fixtures.make_tokenizer(str(tmp_path / 'tok'), template=None)
  chat_fixtures.write_jsonl(tmp_path / 'chat.jsonl', chat_fixtures.conversations(12))
  out = str(tmp_path / 'chat')
  prepare_lib.prepare(prepare_lib.expand_inputs([str(tmp_path / 'chat.jsonl')]), out, tokenizer=tok_dir, workers=1,
                      progress=False, data_format='chat', chat_template='chatml', eval_fraction=0.2)
  tok = tokenizer_lib.load(out)
  os.makedirs(tmp_path / 'back')
  export.write_hf_tokenizer(tok, str(tmp_path / 'back'), model_max_length=64,
                            chat_template=export._chat_template(tok.path, tok))  # pylint: disable=protected-access
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'back'))
  messages = chat_lib.messages_of(chat_fixtures.conversations(3)[2])
  assert theirs.apply_chat_template(messages, tokenize=False) == chat_lib.render(messages, chat_lib.CHATML,
                                                                                special_tokens=tok.special_tokens)
  assert chat_lib.encode(tok, chat_lib.CHATML, messages)[0].tolist() == ids_of(
      theirs.apply_chat_template(messages, tokenize=True))
