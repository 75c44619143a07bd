#!/usr/bin/env python3
"""Constrained decoding (--json, --json-schema, response_format): answers
drawn greedily and sampled (several seeds) from the real stories260K model
under many schemas of the supported subset, through the command line
(generate and chat), --batch and the HTTP server (plain HTTP, and the
official `openai` npm client where node and npm are there), each checked by
an independent validator, Debian's python3-jsonschema: every answer ends
with "stop" (a bounded schema cannot run to the length limit) or, when
max_tokens cuts it, "length", and every finished answer validates. No white
space between JSON tokens; schemas outside the subset are refused with the
keyword named (exit status 2, or 400); the token mask, read through the
scores of greedy steps, equals a brute-force reference: the tokens t for
which text + bytes(t) is a valid prefix per a JSON-prefix checker written
here.

Environment: RUN, MODELS_DIR, TEST_TMP, as the other suites.
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from verdicts import COUNTS, Skip, case  # noqa: E402

RUN = os.environ.get('RUN', './run')
MODELS_DIR = os.environ.get('MODELS_DIR', '../shared/models')
MODEL = os.path.join(MODELS_DIR, 'stories260K.bin')
TOK = os.path.join(MODELS_DIR, 'tok512.bin')
TMP = os.environ.get('TEST_TMP') or tempfile.mkdtemp()
os.makedirs(TMP, exist_ok=True)

try:
    import jsonschema
except ImportError:  # the validator is a Debian package (.ci/run installs it)
    jsonschema = None

NAME = {'type': 'string', 'minLength': 1, 'maxLength': 12}
# (name, schema): every string, array and number bounded, so every answer
# must end with the value ("stop")
SCHEMAS = [
    ('person', {'type': 'object', 'properties': {
        'name': NAME, 'age': {'type': 'integer', 'minimum': 1, 'maximum': 120},
        'pet': {'enum': ['cat', 'dog', None]}, 'ok': {'type': 'boolean'},
        'tags': {'type': 'array', 'items': {'type': 'string', 'maxLength': 5}, 'minItems': 1, 'maxItems': 3}},
        'required': ['name', 'age', 'pet', 'ok', 'tags'], 'additionalProperties': False}),
    ('integer_range', {'type': 'integer', 'minimum': -37, 'maximum': 512}),
    ('negative_integers', {'type': 'array', 'items': {'type': 'integer', 'minimum': -2000, 'maximum': -15},
                           'minItems': 2, 'maxItems': 4}),
    ('string_bounds', {'type': 'string', 'minLength': 3, 'maxLength': 7}),
    ('enum_mixed', {'enum': ['red', 'green', 12, 1.5, True, None, {'a': [1, 2]}, [None]]}),
    ('const', {'const': {'kind': 'story', 'n': 3}}),
    ('type_list', {'type': ['integer', 'null', 'boolean'], 'minimum': 0, 'maximum': 99}),
    ('string_or_null_list', {'type': 'array', 'items': {'type': ['string', 'null'], 'maxLength': 4}, 'maxItems': 5}),
    ('any_of', {'anyOf': [{'type': 'string', 'maxLength': 6},
                          {'type': 'object', 'properties': {'x': {'type': 'integer', 'minimum': 0, 'maximum': 9}},
                           'required': ['x'], 'additionalProperties': False},
                          {'type': 'array', 'items': {'type': 'boolean'}, 'maxItems': 3}]}),
    ('any_of_objects', {'type': 'array', 'maxItems': 3, 'items': {'anyOf': [
        {'type': 'object', 'properties': {'a': {'const': 1}, 'b': NAME}, 'required': ['a', 'b'],
         'additionalProperties': False},
        {'type': 'object', 'properties': {'a': {'const': 2}, 'c': {'type': 'boolean'}}, 'required': ['a', 'c'],
         'additionalProperties': False}]}}),
    ('defs_and_ref', {'$defs': {'point': {'type': 'object', 'properties': {
        'x': {'type': 'integer', 'minimum': -9, 'maximum': 9}, 'y': {'type': 'integer', 'minimum': -9, 'maximum': 9}},
        'required': ['x', 'y'], 'additionalProperties': False}},
        'type': 'object', 'properties': {'from': {'$ref': '#/$defs/point'}, 'to': {'$ref': '#/$defs/point'}},
        'required': ['from', 'to'], 'additionalProperties': False}),
    ('recursive_tree', {'$defs': {'node': {'type': 'object', 'properties': {
        'v': {'type': 'integer', 'minimum': 0, 'maximum': 9},
        'kids': {'type': 'array', 'items': {'$ref': '#/$defs/node'}, 'maxItems': 2}},
        'required': ['v'], 'additionalProperties': False}}, '$ref': '#/$defs/node'}),
    ('optional_properties', {'type': 'object', 'properties': {'a': NAME, 'b': {'type': 'boolean'}, 'c': {'type': 'null'}},
                             'additionalProperties': False}),
    ('nested', {'type': 'object', 'properties': {'story': {'type': 'object', 'properties': {
        'title': NAME, 'chapters': {'type': 'array', 'minItems': 1, 'maxItems': 2, 'items': {
            'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': 1, 'maximum': 3}, 'text': NAME},
            'required': ['n', 'text'], 'additionalProperties': False}}},
        'required': ['title', 'chapters'], 'additionalProperties': False}}, 'required': ['story'],
        'additionalProperties': False, 'title': 'annotations are read past', 'description': 'x'}),
    ('booleans', {'type': 'array', 'items': {'type': 'boolean'}, 'minItems': 3, 'maxItems': 3}),
    ('null', {'type': 'null'}),
    ('definitions_draft7', {'definitions': {'c': {'enum': ['a', 'b']}}, 'type': 'array',
                            'items': {'$ref': '#/definitions/c'}, 'maxItems': 4}),
    # numbers with bounds: at most 12 digits before the point and 6 after, no exponent
    ('number_range', {'type': 'number', 'minimum': 2.5, 'maximum': 3.75}),
    ('number_exclusive', {'type': 'object', 'properties': {
        'x': {'type': 'number', 'exclusiveMinimum': -1, 'exclusiveMaximum': 0.001},
        'y': {'type': 'number', 'minimum': 0.0015, 'maximum': 0.0025}}, 'required': ['x', 'y'],
        'additionalProperties': False}),
    ('integer_exclusive', {'type': 'array', 'items': {'type': 'integer', 'exclusiveMinimum': 5, 'exclusiveMaximum': 8},
                           'minItems': 2, 'maxItems': 4}),
]
# bounded except for numbers and open objects: "length" is allowed, and then
# the text is not checked
OPEN_SCHEMAS = [
    ('number', {'type': 'number'}),
    ('open_object_required', {'type': 'object', 'properties': {'id': {'type': 'integer', 'minimum': 0, 'maximum': 5}},
                              'required': ['id', 'extra']}),
    ('empty_schema', {}),
]
SEEDS = [1, 2, 3]


def need_model():
    if not (os.path.exists(MODEL) and os.path.exists(TOK)):
        raise Skip('%s or %s not found (set MODELS_DIR)' % (MODEL, TOK))


def need_validator():
    if jsonschema is None:
        raise Skip('python3-jsonschema is not installed (apt-get install python3-jsonschema)')


def write_schema(name, schema):
    path = os.path.join(TMP, 'schema_%s.json' % name)
    with open(path, 'w') as f:
        json.dump(schema, f)
    return path


def run(args, stdin=None):
    p = subprocess.run([RUN, MODEL, '-z', TOK] + args, capture_output=True, timeout=120,
                       input=stdin.encode() if stdin is not None else None,
                       stdin=None if stdin is not None else subprocess.DEVNULL)
    return p.returncode, p.stdout.decode('utf-8'), p.stderr.decode('utf-8', 'replace')


def compact_outside_strings(text):
    """Whether the JSON text has no white space outside its strings."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == '\\':
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in ' \t\r\n':
            return False
    return True


def check_answer(schema, text, stop, bounded, where):
    """An answer's verdict: finished by the value (CLI stop "json" or "eos";
    server "stop") and valid, or cut by the length limit."""
    if stop == 'length':
        assert not bounded, '%s: a bounded schema ran to the length limit: %r' % (where, text)
        return
    assert stop in ('json', 'eos', 'stop'), '%s: stop %r for %r' % (where, stop, text)
    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError('%s: not JSON (%s): %r' % (where, e, text))
    errors = list(jsonschema.validators.validator_for(schema)(schema).iter_errors(value))
    assert not errors, '%s: %r does not validate: %s' % (where, text, errors[0].message)
    assert compact_outside_strings(text), '%s: white space between tokens: %r' % (where, text)


def cli_cases(name, schema, bounded):
    def fn():
        need_model()
        need_validator()
        path = write_schema(name, schema)
        for sampling in [['-t', '0']] + [['-s', str(s)] for s in SEEDS]:
            code, out, err = run(['-i', 'Once upon a time', '--json-schema', path, '-f', 'json', '-n', '256'] + sampling)
            assert code == 0, err[-300:]
            r = json.loads(out.splitlines()[0])
            check_answer(schema, r['text'], r['stop'], bounded, '%s %s' % (name, ' '.join(sampling)))
    return fn


def test_json_object_generate():
    need_model()
    need_validator()
    for sampling in [['-t', '0']] + [['-s', str(s)] for s in SEEDS + [7, 8, 9]]:
        code, out, err = run(['-i', 'Lily', '--json', '-f', 'json', '-n', '256', '--top-k', '20'] + sampling)
        assert code == 0, err[-300:]
        r = json.loads(out.splitlines()[0])
        check_answer({'type': 'object'}, r['text'], r['stop'], False, 'json %s' % sampling)
        assert r['text'].startswith('{'), r['text']


def test_chat_each_reply():
    need_model()
    need_validator()
    schema = SCHEMAS[0][1]
    path = write_schema('chat', schema)
    code, out, err = run(['-m', 'chat', '-y', 'You are kind.', '-i', 'hi there', '--json-schema', path, '-f', 'json',
                          '-s', '5'], stdin='tell me more\nand a name\n')
    assert code == 0, err[-300:]
    replies = [json.loads(line) for line in out.splitlines() if line.startswith('{')]
    assert len(replies) == 3, out
    for i, r in enumerate(replies):
        check_answer(schema, r['text'], r['stop'], True, 'chat reply %d' % i)


def test_batch_response_format():
    need_model()
    need_validator()
    lines, want = [], {}
    for i, (name, schema) in enumerate(SCHEMAS[:8]):
        for seed in (0, 4):
            rid = '%s-%d' % (name, seed)
            lines.append({'id': rid, 'prompt': 'Once upon a time', 'seed': seed or 1, 'temperature': 0 if seed == 0 else 1,
                          'response_format': {'type': 'json_schema', 'json_schema': {'name': name, 'schema': schema,
                                                                                     'strict': True}}})
            want[rid] = schema
    lines.append({'id': 'obj', 'prompt': 'Lily', 'temperature': 0, 'response_format': {'type': 'json_object'}})
    lines.append({'id': 'text', 'prompt': 'Lily', 'max_new_tokens': 5, 'response_format': {'type': 'text'}})
    code, out, err = run(['--batch', '-', '--parallel', '4'], stdin='\n'.join(json.dumps(x) for x in lines) + '\n')
    assert code == 0, err[-300:]
    got = {r['id']: r for r in map(json.loads, out.splitlines())}
    assert set(got) == set(want) | {'obj', 'text'}, sorted(got)
    for rid, schema in want.items():
        check_answer(schema, got[rid]['text'], got[rid]['stop'], True, 'batch ' + rid)
    check_answer({'type': 'object'}, got['obj']['text'], got['obj']['stop'], False, 'batch json_object')
    assert got['text']['stop'] == 'length' and len(got['text']['tokens']) == 5, got['text']


def strict_version(schema):
    """OpenAI's strict mode spelt out: every object schema closed
    (additionalProperties false) with every property required."""
    if isinstance(schema, dict):
        out = {k: strict_version(v) if k in ('items', 'anyOf', 'properties', '$defs') else v for k, v in schema.items()}
        if 'properties' in schema:
            out['properties'] = {k: strict_version(v) for k, v in schema['properties'].items()}
        if schema.get('type') == 'object' or 'properties' in schema:
            out['additionalProperties'] = False
            out['required'] = sorted(set(schema.get('properties', {})) | set(schema.get('required', [])))
        return out
    if isinstance(schema, list):
        return [strict_version(x) for x in schema]
    return schema


STRICT_SCHEMA = {'type': 'object', 'properties': {
    'name': {'type': 'string', 'maxLength': 8}, 'age': {'type': 'integer', 'minimum': 0, 'maximum': 99},
    'ok': {'type': 'boolean'}, 'pet': {'type': 'object', 'properties': {'kind': {'enum': ['cat', 'dog']}}}}}


def test_strict():
    """"strict": true: objects closed and every property required (greedy
    and sampled answers valid under the schema spelt out so); a schema that
    cannot be strict is refused naming the keyword."""
    need_model()
    need_validator()
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'x', 'strict': True, 'schema': STRICT_SCHEMA}}
    lines = [{'id': 's%d' % seed, 'prompt': 'Lily', 'seed': seed or 1, 'temperature': 0 if seed == 0 else 1,
              'response_format': fmt} for seed in (0, 1, 2, 3)]
    loose = dict(STRICT_SCHEMA, additionalProperties=True)
    lines.append({'id': 'bad', 'prompt': 'Lily', 'response_format': {
        'type': 'json_schema', 'json_schema': {'name': 'x', 'strict': True, 'schema': loose}}})
    code, out, err = run(['--batch', '-'], stdin='\n'.join(json.dumps(x) for x in lines) + '\n')
    got = {r['id']: r for r in map(json.loads, out.splitlines())}
    for seed in (0, 1, 2, 3):
        r = got['s%d' % seed]
        check_answer(strict_version(STRICT_SCHEMA), r['text'], r['stop'], True, 'strict seed %d' % seed)
    assert code == 1 and 'additionalProperties' in got['bad'].get('error', ''), got['bad']


def test_batch_alone_equals_together():
    """A constrained line's answer does not depend on the lines beside it:
    the same as the command line's for the same schema and seed."""
    need_model()
    name, schema = SCHEMAS[0]
    path = write_schema(name, schema)
    code, out, err = run(['-i', 'Once upon a time', '--json-schema', path, '-f', 'json', '-s', '11', '-n', '256'])
    assert code == 0, err
    alone = json.loads(out.splitlines()[0])['text']
    rf = {'type': 'json_schema', 'json_schema': {'name': name, 'schema': schema}}
    lines = [{'id': 'x', 'prompt': 'Once upon a time', 'seed': 11, 'response_format': rf}]
    lines += [{'id': 'o%d' % i, 'prompt': 'Lily', 'seed': i + 1} for i in range(5)]
    code, out, err = run(['--batch', '-'], stdin='\n'.join(json.dumps(x) for x in lines) + '\n')
    assert code == 0, err
    got = {r['id']: r for r in map(json.loads, out.splitlines())}
    assert got['x']['text'] == alone, (got['x']['text'], alone)


REFUSED = [
    ({'type': 'string', 'format': 'date'}, 'format'),
    ({'type': 'string', 'pattern': '^a'}, 'pattern'),
    ({'oneOf': [{'type': 'string'}]}, 'oneOf'),
    ({'allOf': [{'type': 'string'}]}, 'allOf'),
    ({'not': {'type': 'string'}}, 'not'),
    ({'type': 'object', 'patternProperties': {'a': {}}}, 'patternProperties'),
    ({'type': 'array', 'prefixItems': [{}]}, 'prefixItems'),
    ({'type': 'string', 'exclusiveMinimum': 3}, 'exclusiveMinimum'),
    ({'type': 'number', 'multipleOf': 2}, 'multipleOf'),
    ({'type': 'array', 'uniqueItems': True}, 'uniqueItems'),
    ({'type': 'object', 'minProperties': 1}, 'minProperties'),
    ({'type': 'object', 'properties': {'a': {'type': 'string', 'contentEncoding': 'base64'}}}, 'contentEncoding'),
    ({'type': 'number', 'minimum': 1e13}, 'minimum'),
    ({'type': 'object', 'additionalProperties': {'type': 'string'}}, 'additionalProperties'),
    ({'type': 'strin'}, 'strin'),
    ({'$ref': '#/$defs/missing'}, 'missing'),
    ({'$ref': 'http://example.com/s.json'}, '$ref'),
    ({'$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'}, 'refers to itself'),
    ({'type': 'integer', 'minimum': 5, 'maximum': 2}, 'minimum'),
    ({'type': 'object', 'properties': {}, 'required': ['a'], 'additionalProperties': False}, 'required'),
    ({'enum': []}, 'enum'),
    ({'type': 'string', 'enum': [1, 2]}, 'enum'),
    (False, 'false'),
    # nested anyOf opening 2^30 alternatives at once
    (dict([('$defs', dict([('a%d' % i, {'anyOf': [{'$ref': '#/$defs/a%d' % (i + 1)}] * 2}) for i in range(30)] +
                          [('a30', {'type': 'string'})])), ('$ref', '#/$defs/a0')]), 'alternatives'),
]


def test_cli_refusals():
    need_model()
    for i, (schema, word) in enumerate(REFUSED):
        path = write_schema('refused%d' % i, schema)
        code, out, err = run(['-i', 'x', '--json-schema', path])
        assert code == 2, (schema, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and word in lines[0] and lines[0].startswith('run: '), (schema, err)
    for text in ['{"type": "string"', '{"type": "string"} x', '', '[' * 100 + ']' * 100, '{"type": "str\\uD800"}']:
        path = os.path.join(TMP, 'bad.json')
        with open(path, 'w') as f:
            f.write(text)
        code, out, err = run(['-i', 'x', '--json-schema', path])
        assert code in (1, 2) and len(err.strip().splitlines()) == 1, (text, code, err)
    code, out, err = run(['-i', 'x', '--json', '--json-schema', path])
    assert code == 2 and '--json' in err, err
    code, out, err = run(['-i', 'x', '--json', '-m', 'tokenize'])
    assert code == 2, err


def test_speculative_off():
    need_model()
    need_validator()
    code, out, err = run(['-i', 'Once upon a time', '--json', '-t', '0', '--lookup', '2', '-f', 'json', '-n', '100'])
    assert code == 0, err
    assert err.count('speculative decoding is off') == 1, err
    code2, out2, err2 = run(['-i', 'Once upon a time', '--json', '-t', '0', '-f', 'json', '-n', '100'])
    assert json.loads(out.splitlines()[0])['text'] == json.loads(out2.splitlines()[0])['text']


def test_beam_search():
    """Beam search under a schema: every beam is masked, so every returned
    hypothesis is a valid answer."""
    need_model()
    need_validator()
    for name, schema in SCHEMAS[:6]:
        path = write_schema(name, schema)
        code, out, err = run(['-i', 'Once upon a time', '--json-schema', path, '-f', 'json', '-n', '200', '-b', '3',
                              '-r', '3'])
        assert code == 0, err[-300:]
        for line in out.splitlines():
            r = json.loads(line)
            check_answer(schema, r['text'], r['stop'], True, 'beam %s rank %d' % (name, r['rank']))


# ---- The mask against a brute-force reference -------------------------------

class PrefixChecker:
    """Whether a text is a prefix of some JSON value valid under a small
    schema subset (objects with fixed properties, arrays, strings, integers
    in a range, booleans, null): a recursive-descent reader over the text
    that answers 'prefix' when the text runs out inside a value. Written
    apart from run.c's automaton."""

    class Out(Exception):
        pass

    def __init__(self, schema):
        self.schema = schema

    def is_prefix(self, text):
        return self.read(text) in ('prefix', 'complete')

    def is_complete(self, text):
        return self.read(text) == 'complete'

    def read(self, text):
        self.t, self.i = text, 0
        try:
            self.value(self.schema)
        except self.Out:
            return 'prefix'
        except ValueError:
            return 'invalid'
        if self.i < len(self.t):
            return 'invalid'
        # a complete integer may still take digits: both
        return 'complete'

    def peek(self):
        if self.i >= len(self.t):
            raise self.Out()
        return self.t[self.i]

    def eat(self, s):
        for ch in s:
            if self.peek() != ch:
                raise ValueError
            self.i += 1

    def value(self, s):
        ty = s.get('type')
        ch = self.peek()
        if 'enum' in s:
            options = [json.dumps(v, separators=(',', ':')) for v in s['enum']]
            rest = self.t[self.i:]
            for o in options:
                if o.startswith(rest):
                    raise self.Out()
            for o in sorted(options, key=len, reverse=True):
                if rest.startswith(o) and not (o[-1].isdigit() and rest[len(o):len(o) + 1].isdigit()):
                    self.i += len(o)
                    return
            raise ValueError
        if ty == 'object':
            self.eat('{')
            props, seen, first = s.get('properties', {}), set(), True
            while True:
                if self.peek() == '}' and set(s.get('required', [])) <= seen:
                    self.i += 1
                    return
                if not first:
                    self.eat(',')
                first = False
                self.eat('"')
                j = self.t.find('"', self.i)
                key = self.t[self.i:] if j < 0 else self.t[self.i:j]
                cands = [k for k in props if k not in seen and k.startswith(key)]
                if j < 0:
                    if cands:
                        raise self.Out()
                    raise ValueError
                if key not in cands:
                    raise ValueError
                self.i = j + 1
                self.eat(':')
                self.value(props[key])
                seen.add(key)
                if seen == set(props) and self.peek() != '}':
                    raise ValueError
        if ty == 'array':
            self.eat('[')
            n = 0
            while True:
                if self.peek() == ']' and n >= s.get('minItems', 0):
                    self.i += 1
                    return
                if n >= s.get('maxItems', 10 ** 9):
                    raise ValueError
                if n:
                    self.eat(',')
                self.value(s.get('items', {}))
                n += 1
        if ty == 'string':
            self.eat('"')
            n = 0
            while True:
                ch = self.peek()
                if ch == '"':
                    if n < s.get('minLength', 0):
                        raise ValueError
                    self.i += 1
                    return
                if ord(ch) < 0x20 or n >= s.get('maxLength', 10 ** 9):
                    raise ValueError
                self.i += 1
                n += 1
                if ch == '\\':  # an escape: one character
                    e = self.peek()
                    self.i += 1
                    if e == 'u':  # as docs/options.md says: no \u0000, no surrogates
                        digits = ''
                        for _ in range(4):
                            d = self.peek()
                            if d not in '0123456789abcdefABCDEF':
                                raise ValueError
                            digits += d
                            self.i += 1
                            if len(digits) == 2 and 0xD8 <= int(digits, 16) <= 0xDF:
                                raise ValueError
                        if int(digits, 16) == 0:
                            raise ValueError
                    elif e not in '"\\/bfnrt':
                        raise ValueError
        if ty == 'integer':
            j = self.i
            if self.peek() == '-':
                self.i += 1
            digits = ''
            while self.i < len(self.t) and self.t[self.i].isdigit():
                digits += self.t[self.i]
                self.i += 1
            lo, hi = s.get('minimum', -10 ** 18 + 1), s.get('maximum', 10 ** 18 - 1)
            neg = self.t[j] == '-'
            if len(digits) > 1 and digits[0] == '0':
                raise ValueError
            if self.i == len(self.t):  # the number may go on
                if not self.reachable(neg, digits, lo, hi):
                    raise ValueError
                raise self.Out()
            if (len(digits) > 1 and digits[0] == '0') or not lo <= int(('-' if neg else '') + digits) <= hi:
                raise ValueError
            return
        if ty == 'boolean':
            for word in ('true', 'false'):
                rest = self.t[self.i:self.i + len(word)]
                if word.startswith(rest) and self.i + len(word) > len(self.t):
                    raise self.Out()
                if rest == word:
                    self.i += len(word)
                    return
            raise ValueError
        if ty == 'null':
            self.eat('null')
            return
        raise ValueError

    @staticmethod
    def reachable(neg, digits, lo, hi):
        """Whether an integer written as digits so far (more may follow) can
        end in [lo, hi], with at most 18 digits."""
        if digits == '0':
            return lo <= 0 <= hi
        if not digits:
            return lo <= -1 if neg else True
        for extra in range(0, 19 - len(digits)):
            a = int(digits) * 10 ** extra
            b = a + 10 ** extra - 1
            if neg:
                a, b = -b, -a
            if b >= lo and a <= hi:
                return True
        return False


def vocabulary():
    """The tokens' texts of tok512.bin as run prints them: byte tokens as
    their byte when printable or white space, else nothing (None); BOS and
    EOS, which never come inside an answer, None."""
    import struct
    with open(TOK, 'rb') as f:
        data = f.read()
    pos, pieces = 4, []
    while pos < len(data):
        _, n = struct.unpack_from('<fi', data, pos)
        piece = data[pos + 8:pos + 8 + n]
        pos += 8 + n
        if piece.startswith(b'<0x') and piece.endswith(b'>') and len(piece) == 6:
            b = int(piece[3:5], 16)
            piece = bytes([b]) if (0x20 <= b < 0x7f or 9 <= b <= 13) else None
        pieces.append(piece)
    pieces[1] = pieces[2] = None
    return pieces


MASK_SCHEMA = {'type': 'object', 'properties': {'name': {'type': 'string', 'maxLength': 8},
                                                'n': {'type': 'integer', 'minimum': -30, 'maximum': 250},
                                                'ok': {'type': 'boolean'},
                                                'l': {'type': 'array', 'items': {'enum': ['a', 12, None]}, 'maxItems': 3}},
               'required': ['name', 'n', 'ok', 'l'], 'additionalProperties': False}
MASK_PREFIXES = ['', '{', '{"', '{"n', '{"n":', '{"n":-', '{"n":-3', '{"n":2', '{"n":25', '{"n":250', '{"n":0',
                 '{"name":"', '{"name":"a\\', '{"name":"a\\u', '{"name":"a\\u00', '{"name":"a\\ud', '{"name":"a\\u0041',
                 '{"name":"12345678', '{"name":"1234567', '{"ok":t', '{"ok":false', '{"l":[', '{"l":[1', '{"l":[12',
                 '{"l":["a",null,12', '{"l":[],"ok":true,"n":7', '{"l":[],"ok":true,"n":7,"name":""',
                 '{"l":[],"ok":true,"n":7,"name":""}']


def test_mask_brute_force():
    """The mask equals a brute-force reference: after each text, the tokens t
    for which text + bytes(t) is still a valid start of an answer per
    PrefixChecker (EOS once the text is a whole answer), over the whole of
    tok512's vocabulary. The texts: hand-made ones (escapes, number bounds,
    enum values, a full answer) and every character boundary of greedy and
    sampled answers. The mask comes from tests/.bin/json_mask_dump (run.c's own
    compiler, trie and mask)."""
    need_model()
    dump = os.path.join(HERE, '.bin', 'json_mask_dump')
    assert os.path.exists(dump), '%s is missing (make tests/.bin/json_mask_dump)' % dump
    pieces = vocabulary()
    try:  # the checker reads characters: every piece must be whole ones
        texts_of = [p.decode('utf-8') if p is not None else None for p in pieces]
    except UnicodeDecodeError:
        raise AssertionError('a tok512 piece is not whole UTF-8 characters')
    path = write_schema('mask', MASK_SCHEMA)
    checker = PrefixChecker(MASK_SCHEMA)
    texts = list(MASK_PREFIXES)
    for sampling in (['-t', '0'], ['-s', '1'], ['-s', '2']):
        code, out, err = run(['-i', 'Once upon a time', '--json-schema', path, '-f', 'json', '-n', '200'] + sampling)
        assert code == 0, err
        answer = json.loads(out.splitlines()[0])['text']
        texts += [answer[:k] for k in range(len(answer) + 1)]
    texts = list(dict.fromkeys(texts))
    p = subprocess.run([dump, path, TOK, '512'], input=''.join(t.encode().hex() + '\n' for t in texts).encode(),
                       capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-300:]
    lines = p.stdout.decode().splitlines()
    assert len(lines) == len(texts), (len(lines), len(texts))
    for text, line in zip(texts, lines):
        if not checker.is_prefix(text):
            assert line == 'dead', 'after %r the reference refuses the text, run.c allows %s' % (text, line[:80])
            continue
        got = set(map(int, line.split())) if line != 'dead' else None
        assert got is not None, 'run.c refuses %r, a valid start' % text
        want = {i for i, piece in enumerate(texts_of) if piece is not None and checker.is_prefix(text + piece)}
        if checker.is_complete(text):
            want.add(2)
        assert got == want, 'after %r: run.c allows %d tokens, the reference %d; only run.c: %s; only the reference: %s' % (
            text, len(got), len(want), sorted(got - want)[:8], sorted(want - got)[:8])
    assert len(texts) > 60, len(texts)


# ---- The server ----------------------------------------------------------------

def test_server():
    need_model()
    need_validator()
    import test_serve as ts
    srv = ts.Server()
    try:
        for name, schema in SCHEMAS[:10]:
            for chat in (False, True):
                for extra in ({'temperature': 0}, {'seed': 3}, {'seed': 9, 'top_k': 40}):
                    body = dict(extra, max_tokens=300,
                                response_format={'type': 'json_schema',
                                                 'json_schema': {'name': name, 'schema': schema, 'strict': True}})
                    if chat:
                        body['messages'] = [{'role': 'user', 'content': 'Tell me about %s.' % name}]
                    else:
                        body['prompt'] = 'Once upon a time'
                    status, out = srv.post('/v1/chat/completions' if chat else '/v1/completions', body)
                    assert status == 200, (status, out)
                    ch = out['choices'][0]
                    text = ch['message']['content'] if chat else ch['text']
                    check_answer(schema, text, ch['finish_reason'], True, 'serve %s %s %s' % (name, chat, extra))
        status, out = srv.post('/v1/chat/completions', {'messages': [{'role': 'user', 'content': 'hi'}], 'temperature': 0,
                                                        'response_format': {'type': 'json_object'}, 'max_tokens': 400})
        assert status == 200, out
        check_answer({'type': 'object'}, out['choices'][0]['message']['content'], out['choices'][0]['finish_reason'],
                     False, 'serve json_object')
        # null and {"type": "text"} are no constraint: the plain completion
        plain = srv.post('/v1/completions', {'prompt': 'Lily', 'max_tokens': 12, 'temperature': 0})
        for rf in (None, {'type': 'text'}):
            got = srv.post('/v1/completions', {'prompt': 'Lily', 'max_tokens': 12, 'temperature': 0, 'response_format': rf})
            assert got[0] == 200 and got[1]['choices'][0]['text'] == plain[1]['choices'][0]['text'], (rf, got, plain)
        # a max_tokens cut: "length"
        rf = {'type': 'json_schema', 'json_schema': {'name': 's', 'schema': {'type': 'string', 'minLength': 50}}}
        status, out = srv.post('/v1/completions', {'prompt': 'x', 'max_tokens': 4, 'response_format': rf})
        assert status == 200 and out['choices'][0]['finish_reason'] == 'length', out
        # streamed: the pieces make a valid answer
        schema = SCHEMAS[0][1]
        events, done = srv.stream('/v1/completions', {'prompt': 'Once upon a time', 'temperature': 0, 'max_tokens': 300,
                                                      'response_format': {'type': 'json_schema',
                                                                          'json_schema': {'name': 'p', 'schema': schema}}})
        text = ''.join(e['choices'][0]['text'] for e in events)
        finish = [e['choices'][0]['finish_reason'] for e in events if e['choices'][0]['finish_reason']]
        assert done and finish == ['stop'], (done, finish)
        check_answer(schema, text, 'stop', True, 'serve streamed')
        # refusals: 400 naming the keyword, OpenAI's error body
        for schema, word in REFUSED[:8] + [({'type': 'strin'}, 'strin')]:
            status, out = srv.post('/v1/completions', {'prompt': 'x', 'response_format': {
                'type': 'json_schema', 'json_schema': {'name': 'r', 'schema': schema}}})
            assert status == 400 and word in out['error']['message'], (schema, status, out)
        for rf, word in (({'type': 'xml'}, 'type'), ({'type': 'json_schema'}, 'json_schema'), ('json', 'object'),
                         ({'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {}, 'extra': 1}}, 'extra')):
            status, out = srv.post('/v1/completions', {'prompt': 'x', 'response_format': rf})
            assert status == 400 and word in out['error']['message'], (rf, status, out)
    finally:
        code = srv.stop()
    assert code == 0, code


def test_openai_client():
    """The official openai npm client's structured outputs: a chat
    completion with response_format json_schema, and JSON mode."""
    need_model()
    need_validator()
    import test_serve as ts
    import test_serve_openai as tso
    tso.install()
    schema = SCHEMAS[0][1]
    path = write_schema('openai', schema)
    srv = ts.Server()
    try:
        p = subprocess.run(['node', os.path.join(HERE, 'serve_openai_json.mjs'), 'http://127.0.0.1:%d/v1' % srv.port, path],
                           capture_output=True, timeout=120, env=dict(os.environ, OPENAI_PREFIX=tso.PREFIX))
        assert p.returncode == 0, p.stderr.decode()[-400:]
        got = json.loads(p.stdout.decode().strip().splitlines()[-1])
    finally:
        srv.stop()
    check_answer(schema, got['schema_text'], got['schema_finish'], True, 'openai json_schema')
    check_answer({'type': 'object'}, got['object_text'], got['object_finish'], False, 'openai json_object')
    assert got['bad'] == 400, got['bad']


def main():
    if not shutil.which(RUN) and not os.path.exists(RUN):
        print('FAIL setup: %s not found' % RUN)
        return 1
    for name, schema in SCHEMAS:
        case('cli_%s' % name, cli_cases(name, schema, True))
    for name, schema in OPEN_SCHEMAS:
        case('cli_%s' % name, cli_cases(name, schema, False))
    case('json_object_generate', test_json_object_generate)
    case('chat_each_reply', test_chat_each_reply)
    case('batch_response_format', test_batch_response_format)
    case('batch_alone_equals_together', test_batch_alone_equals_together)
    case('strict_closes_objects_and_requires_properties', test_strict)
    case('cli_refusals', test_cli_refusals)
    case('speculative_off', test_speculative_off)
    case('beam_search', test_beam_search)
    case('mask_brute_force', test_mask_brute_force)
    case('server', test_server)
    case('openai_client', test_openai_client)
    print('%d passed, %d failed, %d skipped' % (COUNTS['PASS'], COUNTS['FAIL'], COUNTS['SKIP']))
    return 1 if COUNTS['FAIL'] else 0


if __name__ == '__main__':
    sys.exit(main())
