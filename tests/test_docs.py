#!/usr/bin/env python3
"""The documentation against the program: README.md and docs/.

- every option that `$RUN --help` prints, and every option run.c's parser
  accepts (read from its source, not from the help), is documented in
  docs/options.md, and every option that page lists for run is in --help;
- every option of `export.py COMMAND --help` is in docs/options.md;
- every relative link of README.md, docs/*.md and bench/*.md resolves: the
  file exists and, for `#anchor`, the target has a heading with that
  GitHub-style anchor;
- the `./run` command lines shown in README.md and docs/ use only options
  that --help lists;
- README.md stays short (at most 420 lines).

Prints PASS/FAIL lines as every suite does. Standard library only.
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.environ.get('RUN', './run')
README_MAX_LINES = 420

failures = 0


def verdict(name, problems):
    global failures
    if problems:
        failures += 1
        print('FAIL %s: %s' % (name, '; '.join(problems[:8]) + (' (and %d more)' % (len(problems) - 8) if len(problems) > 8 else '')))
    else:
        print('PASS %s' % name)


def read(rel):
    with open(os.path.join(ROOT, rel), encoding='utf-8') as f:
        return f.read()


# An option as the help and the docs write it: -x or --long-name.
OPTION = re.compile(r'(?<![\w-])(--[a-z][a-z0-9-]*|-[A-Za-z])(?![\w-])')


def help_options(text):
    """The options --help describes: the first word(s) of its indented lines
    (e.g. '  -t <float>  ...', '  -h, --help  ...')."""
    opts = set()
    for line in text.splitlines():
        m = re.match(r"^  (-[^ ,]+(?:, -[^ ,]+)?)", line)
        if m:
            opts.update(o.rstrip(',') for o in m.group(1).split(', '))
    return opts


def parser_options(source):
    """The options run.c's parser accepts, read from section 9 of its source:
    the short flags' string and each long option's strcmp."""
    opts = set()
    m = re.search(r'strchr\("([A-Za-z]+)", flag\[1\]\)\)\s*(?:\n\s*usage_error\("unknown option|unknown_option\(flag\))', source)
    if m:
        opts.update('-' + c for c in m.group(1))
    opts.update(re.findall(r'strcmp\(flag, "(--[a-z-]+)"\) == 0', source))
    opts.update(re.findall(r'strcmp\(arg, "(-[-a-z]+)"\) == 0', source))
    return opts


def options_page_run_options(page):
    """The options docs/options.md lists for run: the first cell of the
    table rows before the export.py section."""
    run_part = page.split('\n## export.py', 1)[0]
    opts = set()
    for line in run_part.splitlines():
        if line.startswith('| `-'):
            cell = line.split('|')[1]
            opts.update(OPTION.findall(cell))
    return opts


def check_options():
    try:
        out = subprocess.run([RUN, '--help'], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except OSError as e:
        print('FAIL options: cannot run %s: %s' % (RUN, e))
        return set()
    helped = help_options(out.stdout)
    page = read('docs/options.md')
    documented = set(OPTION.findall(page))
    verdict('--help lists options (exit 0, stdout)', [] if out.returncode == 0 and len(helped) > 30 else
            ['status %d, %d options found' % (out.returncode, len(helped))])
    verdict('every --help option is in docs/options.md',
            ['%s is not documented' % o for o in sorted(helped - documented)])
    listed = options_page_run_options(page)
    verdict('every option docs/options.md lists for run is in --help',
            ['%s is in docs/options.md but not in --help' % o for o in sorted(listed - helped)])
    parsed = parser_options(read('run.c'))
    verdict('every option run.c parses is in --help',
            ['%s is parsed but not in --help' % o for o in sorted(parsed - helped)] if len(parsed) > 30 else
            ['only %d options found in run.c\'s parser (has section 9 changed shape?)' % len(parsed)])
    verdict('every --help option is one run.c parses',
            ['%s is in --help but not parsed' % o for o in sorted(helped - parsed)])
    lines = out.stdout.count('\n')
    verdict('--help fits about two screens (<= 80 lines, <= 100 columns)',
            ([] if lines <= 80 else ['%d lines' % lines]) +
            ['line over 100 columns: %r' % l for l in out.stdout.splitlines() if len(l) > 100])
    headings = ['Model and files', 'Generation', 'Sampling and controls', 'Beam search',
                'Engines and modes', 'Server', 'Performance']
    verdict('--help is grouped under the headings',
            ['no heading %r' % h for h in headings if not re.search(r'^%s\b.*:$' % re.escape(h), out.stdout, re.M)])
    return helped


def check_export_options():
    page = read('docs/options.md')
    problems = []
    for cmd in ['tokenizer', 'model', 'random', 'info']:
        out = subprocess.run([sys.executable, 'export.py', cmd, '--help'], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            problems.append('export.py %s --help: status %d' % (cmd, out.returncode))
            continue
        if ('`%s ' % cmd) not in page:
            problems.append('the command %s is not documented' % cmd)
        for o in set(re.findall(r'(?<![\w-])(--[a-z][a-z0-9-]*)', out.stdout)) - {'--help'}:
            if o not in page:
                problems.append('export.py %s %s is not documented' % (cmd, o))
    verdict('every export.py command and option is in docs/options.md', problems)


def github_anchor(heading, seen):
    """GitHub's anchor for a heading: lower case, markup and punctuation
    dropped (letters, digits, '-', '_' and spaces kept), spaces to '-';
    repeated headings get -1, -2, ..."""
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading)   # links keep their text
    text = text.strip().lower()
    text = re.sub(r'[^\w\- ]', '', text)
    text = text.replace(' ', '-')
    n = seen.get(text, 0)
    seen[text] = n + 1
    return text if n == 0 else '%s-%d' % (text, n)


def anchors(rel):
    seen, found, fence = {}, set(), False
    for line in read(rel).splitlines():
        if line.startswith('```'):
            fence = not fence
        if not fence and re.match(r'^#{1,6} ', line):
            found.add(github_anchor(line.lstrip('#').strip(), seen))
    return found


def markdown_files():
    files = ['README.md']
    for d in ['docs', 'bench']:
        p = os.path.join(ROOT, d)
        if os.path.isdir(p):
            files += sorted(os.path.join(d, f) for f in os.listdir(p) if f.endswith('.md'))
    return files


def links(rel):
    """The (target, line number) of every inline link outside code."""
    out, fence = [], False
    for n, line in enumerate(read(rel).splitlines(), 1):
        if line.startswith('```'):
            fence = not fence
            continue
        if fence or line.startswith('    '):
            continue
        line = re.sub(r'`[^`]*`', '', line)
        for target in re.findall(r'\]\(([^)\s]+)\)', line):
            out.append((target, n))
    return out


def check_links():
    problems, count = [], 0
    for rel in markdown_files():
        for target, n in links(rel):
            if re.match(r'^[a-z]+:', target):   # http:, https:, mailto:
                continue
            count += 1
            path, _, anchor = target.partition('#')
            dest = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
            if not os.path.exists(os.path.join(ROOT, dest)):
                problems.append('%s:%d: %s: no file %s' % (rel, n, target, dest))
                continue
            if anchor and dest.endswith('.md') and anchor not in anchors(dest):
                problems.append('%s:%d: %s: no heading #%s in %s' % (rel, n, target, anchor, dest))
    if count < 20:
        problems.append('only %d relative links found' % count)
    verdict('relative links of README.md, docs/ and bench/ resolve (%d links)' % count, problems)
    docs = ['docs/%s' % f for f in ['options.md', 'formats.md', 'engine.md', 'serving.md', 'speed.md']]
    readme_targets = {os.path.normpath(t.partition('#')[0]) for t, _ in links('README.md')}
    verdict('README.md links every reference page',
            ['README.md does not link %s' % d for d in docs if d not in readme_targets])


def check_command_lines(helped):
    """Each `./run ...` line in the docs' code uses only options --help lists."""
    problems = []
    for rel in markdown_files():
        for n, line in enumerate(read(rel).splitlines(), 1):
            m = re.search(r'(?:^|\$ |\s)\./run(?:omp|fast)?\s+(.*)', line)
            if not m or not helped:
                continue
            cmd = re.split(r'\s[|>]|\s2>', m.group(1))[0]
            cmd = re.sub(r'"[^"]*"|\'[^\']*\'', '""', cmd)
            for o in OPTION.findall(cmd):
                if o not in helped:
                    problems.append('%s:%d: %s' % (rel, n, o))
    verdict('the ./run command lines of the docs use existing options', problems)


def check_readme_length():
    lines = read('README.md').count('\n')
    verdict('README.md is at most %d lines (%d)' % (README_MAX_LINES, lines),
            [] if lines <= README_MAX_LINES else ['%d lines' % lines])


def main():
    os.chdir(ROOT)
    helped = check_options()
    check_export_options()
    check_links()
    check_command_lines(helped)
    check_readme_length()
    return 0


if __name__ == '__main__':
    sys.exit(main())
