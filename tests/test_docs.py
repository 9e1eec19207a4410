"""The docs stay true: every command names a real module, its real flags and real config keys; links resolve.

README.md and docs/*.md are read as text. A command is `python -m jaxlm.<module> ...` or a console script
`jaxlm-<name> ...` ([project.scripts] in pyproject.toml), in a code block (lines joined at a trailing `\\`) or an
inline code span. Its flags are compared with the flags the module's source defines (absl `flags.DEFINE_*`,
ml_collections' `DEFINE_config_file`, argparse `add_argument`), read with `ast`, so nothing is imported and a
renamed flag fails here before a reader meets it. `--config.a.b` keys, and `tools.sweep`'s `--grid`/`--set` keys,
must be keys of configs/base.py. Placeholders (`<...>`) and the brackets of optional flags (`[--step=N]`) are
read through. Links are checked as GitHub and mkdocs both resolve them.
"""

import ast
import functools
import pathlib
import re
import shlex
import tomllib
import unicodedata

import pytest

from jaxlm import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS_DIR = ROOT / 'docs'

# What absl.app and absl.logging define for every command; argparse adds --help.
ABSL_BUILTINS = {'help', 'helpshort', 'helpfull', 'helpxml', 'flagfile', 'undefok', 'only_check_args', 'pdb',
                 'pdb_post_mortem', 'run_with_pdb', 'run_with_profiling', 'profile_file',
                 'use_cprofile_for_profiling', 'verbosity', 'v', 'logtostderr', 'alsologtostderr', 'log_dir',
                 'stderrthreshold', 'showprefixforinfo', 'logger_levels'}
ARGPARSE_BUILTINS = {'help'}

FENCE = re.compile(r'^ {0,3}(```|~~~).*?^ {0,3}\1[ \t]*$', re.M | re.S)
INLINE_CODE = re.compile(r'(`+)(.+?)\1', re.S)
PLACEHOLDER = re.compile(r'<[^<>\n]*>')
OPTIONAL = re.compile(r'\[(\s*--[^\[\]]*)\]')
LINK = re.compile(r'(?<!!)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s>]+)>?(?:\s+"[^"]*")?\s*\)')
HEADING = re.compile(r'^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$', re.M)
SEPARATORS = {'&&', '||', '|', ';'}


def doc_files() -> list[pathlib.Path]:
  return [ROOT / 'README.md'] + sorted(DOCS_DIR.rglob('*.md'))


def _rel(path: pathlib.Path) -> str:
  return str(path.relative_to(ROOT))


@functools.cache
def console_scripts() -> dict[str, str]:
  """`jaxlm-train` -> `jaxlm.train`."""
  scripts = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
  return {name: target.split(':')[0] for name, target in scripts.items()}


@functools.cache
def base_keys() -> frozenset[str]:
  return frozenset(cli.config_keys(cli.load_file(str(ROOT / 'configs' / 'base.py'))))


def module_file(module: str) -> pathlib.Path | None:
  """The source file `python -m <module>` runs, or None."""
  parts = module.split('.')
  for path in (ROOT.joinpath(*parts).with_suffix('.py'), ROOT.joinpath(*parts, '__main__.py')):
    if path.is_file():
      return path
  return None


@functools.cache
def module_flags(module: str) -> tuple[frozenset[str], frozenset[str], bool]:
  """(flags, boolean flags, has a --config file flag) that the module's source defines."""
  tree = ast.parse(module_file(module).read_text())
  names, bools, config_file, argparse_used = set(), set(), False, False
  for node in ast.walk(tree):
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
      continue
    attr = node.func.attr
    args = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    args += [k.value.value for k in node.keywords
             if k.arg == 'name' and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)]
    if attr.startswith('DEFINE_') and args:
      names.add(args[0])
      if attr in ('DEFINE_bool', 'DEFINE_boolean'):
        bools.add(args[0])
      if attr.startswith('DEFINE_config_'):
        config_file = True
    elif attr == 'add_argument':
      argparse_used = True
      for arg in args:
        if arg.startswith('--'):
          names.add(arg[2:])
          if any(k.arg == 'action' and getattr(k.value, 'value', '') in ('store_true', 'store_false')
                 for k in node.keywords):
            bools.add(arg[2:])
  names |= ARGPARSE_BUILTINS if argparse_used else ABSL_BUILTINS
  return frozenset(names), frozenset(bools), config_file


def strip_code(text: str) -> str:
  """The prose of a Markdown file: fenced blocks and inline code blanked (newlines kept for line numbers)."""
  blank = lambda m: re.sub(r'[^\n]', ' ', m.group(0))  # noqa: E731
  return INLINE_CODE.sub(blank, FENCE.sub(blank, text))


def command_texts(text: str) -> list[tuple[int, str]]:
  """(line, text) of every code line (continuations joined) and inline code span that may hold a command."""
  out = []
  for block in FENCE.finditer(text):
    first = text.count('\n', 0, block.start()) + 1
    lines = block.group(0).split('\n')[1:-1]
    i = 0
    while i < len(lines):
      start, line = i, lines[i]
      while line.rstrip().endswith('\\') and i + 1 < len(lines):
        i += 1
        line = line.rstrip()[:-1] + ' ' + lines[i]
      out.append((first + 1 + start, line))
      i += 1
  no_fences = FENCE.sub(lambda m: re.sub(r'[^\n]', ' ', m.group(0)), text)
  lines = no_fences.split('\n')
  for i, line in enumerate(lines):  # an indented code block's commands
    if re.match(r' {4,}(python -m jaxlm|jaxlm-)', line):
      j = i
      while line.rstrip().endswith('\\') and j + 1 < len(lines):
        j += 1
        line = line.rstrip()[:-1] + ' ' + lines[j]
      out.append((i + 1, line))
  for span in INLINE_CODE.finditer(no_fences):
    out.append((no_fences.count('\n', 0, span.start()) + 1, span.group(2).replace('\n', ' ')))
  return out


def split_words(line: str) -> list[str]:
  line = OPTIONAL.sub(r'\1', PLACEHOLDER.sub(' ', line))
  try:
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split, lexer.commenters = True, '#'
    return list(lexer)
  except ValueError:  # an unbalanced quote: a fragment in prose
    return line.split()


def commands(text: str) -> list[tuple[int, str, list[str]]]:
  """(line, module, its arguments) of each jaxlm command; a console script is given as its module."""
  found = []
  for line, code in command_texts(text):
    if 'jaxlm' not in code:
      continue
    segment: list[str] = []
    for word in split_words(code) + [';']:
      if word not in SEPARATORS:
        segment.append(word)
        continue
      for i, w in enumerate(segment):
        if w == 'python' and segment[i + 1:i + 2] == ['-m'] and segment[i + 2:i + 3] \
            and re.fullmatch(r'jaxlm(\.\w+)*', segment[i + 2]):  # not `python -m jaxlm.<module>`
          found.append((line, segment[i + 2], segment[i + 3:]))
          break
        if re.fullmatch(r'jaxlm-[a-z][a-z_-]*', w):
          found.append((line, w, segment[i + 1:]))
          break
      segment = []
  return found


def check_command(module: str, args: list[str]) -> list[str]:
  """What is wrong with one command, as messages."""
  if module.startswith('jaxlm-'):
    if module not in console_scripts():
      return [f'{module} is not a console script in pyproject.toml [project.scripts]']
    module = console_scripts()[module]
  if module_file(module) is None:
    return [f'python -m {module}: no such module']
  names, bools, config_file = module_flags(module)
  problems = []
  for i, arg in enumerate(args):
    if arg == '--':  # what follows is another command's (supervise -- <command>)
      break
    if not arg.startswith('--') or arg == '--':
      continue
    name, _, value = arg[2:].partition('=')
    if name.startswith('config.'):
      key = name[len('config.'):]
      if not config_file:
        problems.append(f'{module} takes no --config.<key> overrides (--{name})')
      elif '*' not in key and key not in base_keys():
        problems.append(f'--{name}: configs/base.py has no key {key}')
      continue
    if name not in names and not (name.startswith('no') and name[2:] in bools):
      problems.append(f'{module} defines no flag --{name}')
      continue
    if name == 'config' and value.endswith('.py') and not (ROOT / value).is_file():
      problems.append(f'--config={value}: no such file')
    if module == 'jaxlm.tools.sweep' and name in ('grid', 'set'):
      setting = value or (args[i + 1] if i + 1 < len(args) else '')
      key = setting.partition('=')[0]
      if key and key not in base_keys():
        problems.append(f'--{name} {setting}: configs/base.py has no key {key}')
  return problems


def test_commands_name_real_modules_flags_and_config_keys():
  problems, seen = [], 0
  for path in doc_files():
    text = path.read_text()
    for line, module, args in commands(text):
      seen += 1
      problems += [f'{_rel(path)}:{line}: {p}' for p in check_command(module, args)]
    prose = strip_code(text)
    for m in re.finditer(r'python -m (jaxlm(?:\.\w+)*)', prose):
      if module_file(m.group(1)) is None:
        problems.append(f'{_rel(path)}:{prose.count(chr(10), 0, m.start()) + 1}: python -m {m.group(1)}: no such module')
  assert seen > 50, f'only {seen} commands found: is the parser still reading the docs?'
  assert not problems, '\n'.join(problems)


def test_the_checker_catches_what_rots():
  """The checks above fail on a renamed flag, a missing module, an unknown config key and a stale script."""
  text = ('```bash\npython -m jaxlm.train --config=configs/palm_small.py \\\n  --config.train.stepz=3 --work_dir=x\n'
          'python -m jaxlm.nothing --a=1\njaxlm-nothing\npython -m jaxlm.tools.sweep --config=configs/palm_tiny.py '
          '--grid optim.lrr=1,2\n```\n`python -m jaxlm.tools.eval [--stepp=N] <flags>`\n')
  found = [(module, check_command(module, args)) for _, module, args in commands(text)]
  assert [m for m, _ in found] == ['jaxlm.train', 'jaxlm.nothing', 'jaxlm-nothing', 'jaxlm.tools.sweep',
                                   'jaxlm.tools.eval']
  assert [len(p) for _, p in found] == [2, 1, 1, 1, 1], found
  good = ('```bash\npython -m jaxlm.rl --config=configs/grpo_example.py --rewards=f.py:g \\\n  --config.rl.top_k=5\n'
          'jaxlm-eval --workdir=runs/x --nojson -- --other\n```')
  assert [check_command(m, a) for _, m, a in commands(good)] == [[], []]


def github_slug(heading: str) -> str:
  """GitHub's anchor for a heading (github-slugger): lower case, punctuation dropped, each space a hyphen."""
  return re.sub(r'[^\w\- ]', '', heading.lower()).replace(' ', '-')


def mkdocs_slug(heading: str) -> str:
  """Python-Markdown's toc anchor (mkdocs' default): ASCII only, punctuation dropped, runs of space/- one hyphen."""
  value = unicodedata.normalize('NFKD', heading).encode('ascii', 'ignore').decode('ascii')
  return re.sub(r'[-\s]+', '-', re.sub(r'[^\w\s-]', '', value).strip().lower())


def heading_text(raw: str) -> str:
  """A heading's text as rendered: links become their text, code and emphasis marks go."""
  raw = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', raw)
  return re.sub(r'[`*]|(?<!\w)_|_(?!\w)', '', raw)


@functools.cache
def anchors(path: pathlib.Path) -> tuple[frozenset[str], frozenset[str]]:
  """(GitHub's, mkdocs') anchors of a Markdown file's headings, duplicates numbered as each numbers them."""
  text = FENCE.sub('', path.read_text())
  github, mkdocs = [], []
  for m in HEADING.finditer(text):
    heading = heading_text(m.group(2))
    for slug, seen, sep in ((github_slug(heading), github, '-'), (mkdocs_slug(heading), mkdocs, '_')):
      n, unique = 0, slug
      while unique in seen:
        n += 1
        unique = f'{slug}{sep}{n}'
      seen.append(unique)
  return frozenset(github), frozenset(mkdocs)


def test_links_and_anchors_resolve():
  problems = []
  for path in doc_files() + [ROOT / 'bench' / 'RESULTS.md']:
    prose = strip_code(path.read_text())
    for m in LINK.finditer(prose):
      target = m.group(1)
      where = f'{_rel(path)}:{prose.count(chr(10), 0, m.start()) + 1}: ({target})'
      if re.match(r'[a-z][a-z0-9+.-]*:', target):  # https:, mailto:
        continue
      file_part, _, anchor = target.partition('#')
      dest = (path.parent / file_part).resolve() if file_part else path
      if not dest.exists():
        problems.append(f'{where}: no such file')
        continue
      if DOCS_DIR in path.parents and DOCS_DIR not in dest.parents:
        problems.append(f'{where}: leaves docs/, which the site does not hold: name the file in a code span')
        continue
      if anchor:
        if dest.suffix != '.md':
          problems.append(f'{where}: an anchor into a file that is not Markdown')
          continue
        github, mkdocs = anchors(dest)
        if anchor not in github or anchor not in mkdocs:
          problems.append(f'{where}: no heading with anchor #{anchor} (on GitHub and on the site alike)')
  assert not problems, '\n'.join(problems)


def test_every_guide_is_in_the_site():
  """mkdocs.yml's nav lists every guide in docs/, and the README links to each."""
  nav = (ROOT / 'mkdocs.yml').read_text()
  readme = (ROOT / 'README.md').read_text()
  for path in sorted(DOCS_DIR.glob('*.md')):
    assert re.search(rf'\b{re.escape(path.name)}\b', nav), f'{path.name} is not in mkdocs.yml nav'
    if path.name != 'index.md':
      assert f'docs/{path.name}' in readme, f'README.md does not link docs/{path.name}'


def test_the_site_builds_strict(tmp_path):
  """`mkdocs build --strict`, in this process: a warning (a broken link, a page outside nav's files) fails."""
  pytest.importorskip('material')
  config = pytest.importorskip('mkdocs.config')
  build = pytest.importorskip('mkdocs.commands.build')
  cfg = config.load_config(str(ROOT / 'mkdocs.yml'), strict=True, site_dir=str(tmp_path / 'site'))
  build.build(cfg)
  assert (tmp_path / 'site' / 'index.html').is_file()
