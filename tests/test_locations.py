"""Locations written as URLs that jaxlm cannot use — `gs://` (no bucket), an unknown scheme (`gcs://`, `s4://`), a
local path holding `://` — are refused before any work, naming the flag or config key, exit 2: never a local folder
named after a URL (issue #57)."""

import subprocess
import sys

import pytest

from jaxlm import config as config_lib
from jaxlm import locations
from tests.conftest import ROOT
from tests.helpers import assert_fails_with, load_config, train_env

MALFORMED = {'gs://': 'names no bucket', 's3://': 'names no bucket', 'gcs://bucket/run': 'unknown storage scheme gcs://',
             's4://bucket': 'unknown storage scheme s4://', 'runs/gs://bucket': 'a local path with "://" in it'}
GOOD = ('gs://bucket/run', 's3://bucket', '/tmp/run', 'runs/a', '~/runs/a', 'data.jsonl')


@pytest.mark.parametrize('path', GOOD)
def test_local_paths_and_bucket_urls_pass(path):
  assert locations.location_problem(path) is None
  locations.check_location(path, '--workdir')


@pytest.mark.parametrize('path, says', MALFORMED.items())
def test_each_malformed_form_is_named(path, says):
  assert says in locations.location_problem(path)
  with pytest.raises(locations.ConfigError, match='^--out: '):
    locations.check_location(f'good/a.jsonl,{path}', '--out')  # each of a list


@pytest.mark.parametrize('key', config_lib.LOCATION_KEYS)
def test_every_location_key_of_the_config_is_checked(key):
  cfg = load_config('grpo_example')
  section, name = key.split('.')
  forms = list(MALFORMED)
  cfg[section][name] = ';'.join(forms)  # data.paths takes mixtures: every part is checked
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(cfg, 8, rl=True)
  lines = [line for line in str(e.value).splitlines() if f'- {key}: ' in line]
  assert len(lines) == len(forms), str(e.value)


# Each command that takes a location, with every location flag it defines given a malformed form.
COMMANDS = {
    'jaxlm.train': ['--config=configs/palm_tiny.py', '--workdir=gs://'],
    'jaxlm.rl': ['--config=configs/grpo_example.py', '--rewards=r.py:f', '--workdir=gcs://bucket/run'],
    'jaxlm.data.prepare': ['--inputs=a.txt,s4://bucket/x', '--out=runs/gs://b', '--cache_dir=gs://',
                           '--tokenizer=gcs://b/t.model'],
    'jaxlm.data.clean': ['--inputs=s3://', '--out=gcs://b/out'],
    'jaxlm.tools.eval': ['--workdir=gs://', '--documents=s4://b', '--scorer=gcs://b', '--embedder=runs/gs://b',
                         '--samples_out=gs://', '--write_jsonl=s3://'],
    'jaxlm.tools.generate': ['--workdir=s4://b', '--prompts=gs://', '--output=runs/s3://b'],
    'jaxlm.tools.judge': ['--samples=gcs://b/s.jsonl', '--url=http://127.0.0.1:1/v1'],  # --url is no location
    'jaxlm.tools.reference': ['--workdir=gs://', '--data=gcs://b/d'],
    'jaxlm.tools.report': ['--workdir=runs/gs://b', '--out=s4://b/r.png'],
    'jaxlm.tools.sweep': ['--config=configs/palm_tiny.py', '--workdir=gs://'],
    'jaxlm.hf.export': ['--workdir=gs://', '--out=gcs://b', '--adapter_out=s3://', '--tokenizer=runs/gs://t'],
    'jaxlm.hf.import_llama': ['--hf_dir=gcs://b/m', '--out=gs://'],
}


@pytest.mark.parametrize('module', COMMANDS)
def test_each_command_refuses_each_malformed_location_before_any_work(module, tmp_path):
  args = [a.replace('=configs/', f'={ROOT}/configs/') for a in COMMANDS[module]]
  out = subprocess.run([sys.executable, '-m', module, *args], cwd=tmp_path, env={**train_env(), 'PYTHONPATH': str(ROOT)},
                       capture_output=True, text=True, timeout=300)
  flags = [a.split('=', 1)[0] for a in args if '://' in a and not a.startswith('--url=')]
  assert_fails_with(out, 2, *(['bad locations: '] if len(flags) > 1 else flags))
  for flag in flags:
    assert f'{flag}: ' in out.stderr, (flag, out.stderr[-2000:])
  assert '--url' not in out.stderr
  assert not [p for p in tmp_path.rglob('*') if ':' in p.name]  # no folder named after a URL
