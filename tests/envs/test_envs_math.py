"""Math env: answer extraction, equivalence table, generator, MATH500 real data."""

import json
import os
import random
import re
import time

import pytest

from nlac_jax.envs.base import BatchedRunner
from nlac_jax.envs.math_env import (MathEnv, MathGeneratorTaskSource, MathJsonlTaskSource, generate_problem,
                                    load_math_jsonl)
from nlac_jax.envs.math_grading import answers_equal, extract_answer, extract_boxed, normalize_answer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MATH500 = os.environ.get('NLAC_MATH500', os.path.join(REPO, '..', 'shared', 'data', 'math500', 'test.jsonl'))

EQUAL = [
    ('5', '5'), ('5.0', '5'), ('0.5', '\\frac{1}{2}'), ('.5', '1/2'), ('\\dfrac{3}{4}', '\\frac34'),
    ('\\tfrac{3}{4}', '0.75'), ('1,000', '1000'), ('1{,}000', '1000'), ('\\$36', '36'), ('36 \\text{ dollars}', '36'),
    ('5\\text{ cm}', '5'), ('12 inches', '12'), ('30^\\circ', '30'), ('30^{\\circ}', '30'), ('45°', '45'),
    ('50\\%', '50'), ('x = 3', '3'), ('\\text{Evelyn}', 'Evelyn'), ('\\text{(B)}', '(B)'),
    ('2\\sqrt{3}', '\\sqrt{12}'), ('\\sqrt2/2', '\\frac{\\sqrt{2}}{2}'), ('\\frac{1}{\\sqrt{2}}', '\\frac{\\sqrt{2}}{2}'),
    ('1\\frac{4}{5}', '\\frac{9}{5}'), ('(1,2)', '\\left( 1, 2 \\right)'), ('(2,\\infty)', '(2, \\infty)'),
    ('[-1,3)', '[-1, 3)'), ('3,5,7', '7, 5, 3'), ('(0,9) \\cup (9,36)', '(0,9)\\cup(9,36)'), ('6+9i', '9i+6'),
    ('-2 + 7i', '7i-2'), ('15x - 80', '-80+15x'), ('288\\pi', '288 \\pi'), ('\\frac{\\pi}{2}', '\\pi/2'),
    ('2^{10}', '1024'), ('-\\frac{24}{25}', '\\frac{-24}{25}'), ('0.0000672', '.0000672'),
    ('1 \\pm \\sqrt{19}', '1\\pm\\sqrt{19}'), ('\\boxed{4}', '4'), ('\\left(3,\\frac{\\pi}{2}\\right)', '(3, \\pi/2)'),
    ('x^2+2x+1', '(x+1)^2'), ('\\sqrt[3]{8}', '2'), ('007', '7'), ('-0', '0'), ('\\{1,2\\}', '\\{2,1\\}'),
    ('y = -2x', '-2x'), ('3 \\sqrt{2}', '\\sqrt{18}'), ('\\$1,250.50', '1250.5'),
]
NOT_EQUAL = [
    ('5', '6'), ('0.5', '\\frac{1}{3}'), ('0.333', '\\frac{1}{3}'), ('(1,2)', '(2,1)'), ('(1,2)', '[1,2]'),
    ('[-1,3)', '[-1,3]'), ('3,5,7', '3,5'), ('2\\sqrt{3}', '3\\sqrt{2}'), ('6+9i', '6-9i'), ('\\text{Evelyn}', 'Bob'),
    ('\\text{(B)}', '(C)'), ('15x-80', '15x+80'), ('1000', '100'), ('1,000', '1'), ('30^\\circ', '60'),
    ('\\frac{9}{5}', '1\\frac{4}{6}'), ('x^2', '2x'), ('\\pi', '3.14'), ('(2,\\infty)', '(3,\\infty)'),
    ('-\\frac{24}{25}', '\\frac{24}{25}'), ('12', '12.5'), ('\\sqrt{2}', '2'), ('(0,9)\\cup(9,36)', '(0,36)'),
    ('4', ''), (None, '4'), ('', ''),
]


@pytest.mark.parametrize('a,b', EQUAL)
def test_equal_pairs(a, b):
    assert answers_equal(a, b), (normalize_answer(a), normalize_answer(b))
    assert answers_equal(a, b, use_math_verify=False), 'hand-written fallback must agree'


@pytest.mark.parametrize('a,b', NOT_EQUAL)
def test_unequal_pairs(a, b):
    assert not answers_equal(a, b)
    assert not answers_equal(a, b, use_math_verify=False)


def test_table_size():
    assert len(EQUAL) + len(NOT_EQUAL) >= 40


def test_extraction():
    assert extract_boxed('so \\boxed{\\frac{1}{2}} and finally \\boxed{\\frac{\\sqrt{3}}{2}}.') == '\\frac{\\sqrt{3}}{2}'
    assert extract_boxed('\\boxed{\\{1, 2\\}}') == '\\{1, 2\\}'
    assert extract_boxed('\\fbox{7}') == '7' and extract_boxed('\\boxed 5$') == '5'
    assert extract_boxed('no box \\boxed{unclosed') is None
    assert extract_answer('blah\nAnswer: $42$.') == '42'
    assert extract_answer('work\nFinal answer: \\frac{3}{4}\nthanks') == '\\frac{3}{4}'
    assert extract_answer('x\n#### 1,234') == '1,234'
    assert extract_answer('Answer: 3 \n ... \\boxed{4}') == '4'  # boxed wins over an answer line
    assert extract_answer('I think it is 5') is None


def test_env_step():
    src = MathGeneratorTaskSource(num_train=3, num_test=3, seed=1)
    task = src.tasks('test')[0]
    env = MathEnv(max_action_chars=200)
    msgs = env.reset(task)
    assert task.payload['problem'] in msgs[1]['content']
    r = env.step(f'Easy. \\boxed{{{task.payload["answer"]}}}')
    assert r.done and r.reward == 1.0 and r.info['success']
    env.reset(task)
    r = env.step('The answer is \\boxed{123456789}')
    assert r.done and r.reward == 0.0 and not r.info['success'] and not r.info['error']
    env.reset(task)
    r = env.step('no final answer here')
    assert r.done and r.reward == 0.0 and r.info['no_answer']
    env.reset(task)
    r = env.step('')
    assert r.done and r.info['error'] and r.observation.startswith('Error')
    env.reset(task)
    assert env.step('x' * 201).info['error']


def test_generator_answers_verified_by_checker():
    src = MathGeneratorTaskSource(num_train=300, num_test=100, seed=0)
    train, test = src.tasks('train'), src.tasks('test')
    assert {t.payload['problem'] for t in test} != {t.payload['problem'] for t in train}
    kinds = set()
    for t in train + test:
        kinds.add(t.payload['subject'])
        ans = t.payload['answer']
        assert answers_equal(extract_answer(f'... so the result is \\boxed{{{ans}}}.'), ans)
    assert len(kinds) >= 8
    # independent recomputation of a few kinds from the problem text
    for i in range(200):
        p = generate_problem(random.Random(f'x:{i}'))
        if p['kind'] == 'add':
            a, b = [int(x) for x in p['problem'].replace('Compute $', '').replace(')$.', '').split(' + (')]
            assert answers_equal(str(a + b), p['answer'])
            assert not answers_equal(str(a + b + 1), p['answer'])
    assert MathGeneratorTaskSource(seed=0).tasks('test')[5] == MathGeneratorTaskSource(seed=0).tasks('test')[5]


def test_batched_single_step():
    src = MathGeneratorTaskSource(num_train=1, num_test=4, seed=2)
    tasks = src.tasks('test')
    answers = {t.payload['problem']: t.payload['answer'] for t in tasks}

    def policy(hs):
        out = []
        for i, h in enumerate(hs):
            prob = next(p for p in answers if p in h[1]['content'])
            out.append(f'\\boxed{{{answers[prob]}}}' if i % 2 == 0 else '\\boxed{999999}')
        return out

    eps = BatchedRunner([MathEnv() for _ in tasks], policy).run(tasks)
    assert [e.total_return for e in eps] == [1.0, 0.0, 1.0, 0.0]
    assert all(e.length == 1 and e.transitions[0].done for e in eps)


def test_jsonl_loader(tmp_path):
    p = tmp_path / 'm.jsonl'
    rows = [{'problem': 'p1', 'solution': 'so \\boxed{3}', 'level': 'Level 5', 'type': 'Algebra'},
            {'problem': 'p2', 'answer': '4', 'level': 2, 'subject': 'Geometry'}]
    p.write_text('\n'.join(json.dumps(r) for r in rows) + '\n')
    ts = load_math_jsonl(str(p))
    assert [t.payload['answer'] for t in ts] == ['3', '4'] and ts[0].payload['level'] == 5
    assert [t.payload['problem'] for t in load_math_jsonl(str(p), hard_only=True)] == ['p1']
    src = MathJsonlTaskSource({'test': str(p)}, hard_only=True)
    assert len(src.tasks('test')) == 1
    bad = tmp_path / 'bad.jsonl'
    bad.write_text('{"problem": "x"}\n')
    with pytest.raises(ValueError, match='bad.jsonl:1: no .answer.'):
        load_math_jsonl(str(bad))
    with pytest.raises(FileNotFoundError, match='nope.jsonl'):
        load_math_jsonl(str(tmp_path / 'nope.jsonl'))


def _rewrites(a):
    """(equivalent rewrites, non-equivalent perturbations) of a MATH reference answer."""
    good, bad = [], []
    if re.fullmatch(r'-?\d+', a):
        v = int(a)
        good += [f'{v:,}', f'{v}.0', f'\\${v}', f'{v}\\text{{ units}}', f'${v}$']
        bad.append(str(v + 1))
    m = re.fullmatch(r'(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}', a)
    if m:
        s, p, q = m.group(1), int(m.group(2)), int(m.group(3))
        good += [f'{s}{p}/{q}', f'{s}\\dfrac{{{p}}}{{{q}}}', f'{s}\\frac{{{2 * p}}}{{{2 * q}}}']
        bad.append(f'{s}\\frac{{{p + 1}}}{{{q}}}')
    m = re.fullmatch(r'(.+)\^\\circ', a)
    if m:
        good += [m.group(1), m.group(1) + '°']
    m = re.fullmatch(r'\\text\{(.+)\}', a)
    if m:
        good.append(m.group(1))
    return good, bad


# MATH500: the checker must agree with the dataset's own answers. Allowed misses: none are expected
# (0 of 500 at the time of writing); a small slack of 2 keeps the test meaningful if the file is re-exported.
MAX_MATH500_MISSES = 2


@pytest.mark.skipif(not os.path.isfile(MATH500), reason=f'MATH500 not found at {MATH500} (set NLAC_MATH500)')
def test_math500_reference_solutions():
    rows = [json.loads(line) for line in open(MATH500, encoding='utf-8') if line.strip()]
    assert len(rows) == 500
    no_box, misses = [], []
    for r in rows:
        boxed = extract_answer(r['solution'])
        if boxed is None:
            no_box.append(r.get('unique_id'))
        elif not answers_equal(boxed, r['answer']):
            misses.append((r.get('unique_id'), boxed, r['answer']))
    assert not no_box, no_box
    assert len(misses) <= MAX_MATH500_MISSES, misses
    # negative control: answers of OTHER problems must (almost always) be judged different
    false_pos = [(a['answer'], b['answer']) for a, b in zip(rows, rows[1:] + rows[:1])
                 if normalize_answer(a['answer']) != normalize_answer(b['answer'])
                 and answers_equal(a['answer'], b['answer'])]
    assert len(false_pos) <= 2, false_pos
    # rewrites of the real reference answers: equivalent forms must match, perturbed ones must not
    pos_miss, neg_hit, n_pos = [], [], 0
    for r in rows:
        good, bad = _rewrites(r['answer'].strip())
        n_pos += len(good)
        pos_miss += [(g, r['answer']) for g in good if not answers_equal(g, r['answer'])]
        neg_hit += [(b, r['answer']) for b in bad if answers_equal(b, r['answer'])]
    assert n_pos > 1000
    assert not pos_miss, pos_miss[:10]
    assert not neg_hit, neg_hit[:10]
    hard = load_math_jsonl(MATH500, hard_only=True)
    assert len(hard) == sum(1 for r in rows if int(r['level']) == 5) > 0


# --- hostile answers: the grader must stay fast and bounded ----------------------------------------------------

BOMBS = ['(9^{9999})^{9999}', '(x+1)^{9999}-(x-1)^{9999}', '9^{9^{9^9}}', '(10^{6})!', '2^{10^{100}}',
         '(x+y+z)^{100}', '\\binom{10^{6}}{500000}', '\\prod_{k=1}^{10^{6}} k', '\\sqrt[10^{99}]{2}',
         '(' * 200 + '1' + ')' * 200, '{' * 14 + '1' + '}' * 14, '(0,1)\\cup' * 100 + '(0,1)', '1,' * 400 + '1']


def test_grader_bombs_are_refused_in_process():
    # On the old code these ran for minutes (a 95-million-digit integer, a 10,000-term expansion in simplify, a
    # million-digit factorial in math-verify). The size bounds must decide every one of them in-process: none may
    # reach the grader pool, whose wall-clock budget is the only other thing that would stop it. Counted, not timed;
    # the child process and its 240 s timeout only keep a regression from hanging the test session.
    import subprocess
    import sys
    script = (
        "import json, sys\n"
        "from nlac_jax.envs.math_grading import grade_answer, sandbox\n"
        "pooled = []\n"
        "sandbox._POOL.check = lambda pred, *a: pooled.append(pred[:30])\n"
        "out = []\n"
        "for a in json.loads(sys.argv[1]):\n"
        "    for mv in (False, True):\n"
        "        r = grade_answer(a, '5', use_math_verify=mv)\n"
        "        out.append([a[:30], mv, r.equal if r is not None else None, r.status if r is not None else None])\n"
        "print(json.dumps({'rows': out, 'pooled': pooled}))\n")
    res = subprocess.run([sys.executable, '-c', script, json.dumps(BOMBS)], capture_output=True, text=True,
                         timeout=240, cwd=REPO)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got['pooled'] == [], f"bombs sent to the grader pool instead of refused by the size bounds: {got['pooled']}"
    assert len(got['rows']) == 2 * len(BOMBS)
    assert [r for r in got['rows'] if r[2] is not False or r[3] != 'ok'] == [], 'a bomb graded equal, or undecided'


def test_bounded_parser():
    from nlac_jax.envs.math_grading.latex import _parse_scalar
    assert _parse_scalar('2^{10}') == 1024 and _parse_scalar('(2^{10})^{3}') == 2 ** 30
    assert str(_parse_scalar('(x+1)^{3}')) == '(x + 1)**3'
    for bomb in ['(9^{9999})^{9999}', '9^{9^{9^9}}', '(x+1)^{9999}', 'x^{60}x^{60}', '(x+y+z)^{100}',
                 '\\sqrt[10^{99}]{2}', '(' * 50 + '1' + ')' * 50]:
        assert _parse_scalar(bomb) is None, bomb


def test_grade_timeout_works_off_the_main_thread():
    # math-verify's own timeout is signal-based and only works on the main thread; ours works from any thread.
    import threading
    from nlac_jax.envs.math_grading import grade_answer
    assert answers_equal('x^2+2x+1', '(x+1)^2', use_math_verify=False)  # start a worker outside the timing
    out = {}

    def work():
        t = time.perf_counter()
        out['res'] = grade_answer('\\sum_{k=1}^{9999} k^{k}', '5', timeout_s=0.5)  # math-verify computes it
        out['secs'] = time.perf_counter() - t

    th = threading.Thread(target=work, daemon=True)
    th.start()
    # 'timeout' is the pool's verdict at its 0.5 s deadline (math-verify itself would grind on for minutes); the
    # 120 s join is only a hang guard, far above the budget, that a loaded machine cannot trip
    th.join(120)
    assert 'res' in out, "grade_answer did not return: the timeout does not work off the main thread"
    assert out['res'].equal is False and out['res'].status == 'timeout'
    assert out['secs'] < 120.0
    assert answers_equal('\\frac{\\sqrt{2}}{2}', '\\frac{1}{\\sqrt{2}}', timeout_s=5)  # the pool still works


def test_stuck_worker_is_killed_and_replaced():
    import signal
    from nlac_jax.envs.math_grading import sandbox as math_grading
    pool = math_grading._GraderPool(max_workers=1)
    try:
        assert pool.check('x^2+2x+1', '(x+1)^2', False, 30.0) == math_grading.GradeResult(True, 'ok')
        (w,) = pool._idle
        os.kill(w.proc.pid, signal.SIGSTOP)  # stuck inside one long C call: its own timer cannot fire
        t = time.perf_counter()
        assert pool.check('x^2+2x+1', '(x+1)^2', False, 0.3) == math_grading.GradeResult(False, 'timeout')
        # the 0.3 s budget is enforced by the pool's kill, not the worker's own timer: a stuck worker that was never
        # killed would block this call forever (a hang guard of 60 s, far above the budget, cannot trip on a busy
        # machine); the exit status says it was killed
        assert time.perf_counter() - t < 60.0 and w.proc.poll() is not None
        assert pool.check('x^2+2x+1', '(x+1)^2', False, 30.0) == math_grading.GradeResult(True, 'ok')  # replacement
    finally:
        pool.shutdown()


def test_math_env_logs_one_short_line_per_timeout(caplog):
    task = MathGeneratorTaskSource(num_train=1, num_test=1, seed=0).tasks('test')[0]
    env = MathEnv(grade_timeout_s=0.3)
    env.reset(task)
    answer = '\\sum_{k=1}^{9999} k^{k}' + ' + 0' * 2000  # a long answer must not be logged in full
    with caplog.at_level('WARNING', logger='nlac_jax.envs.math_env'):
        r = env.step(f'\\boxed{{{answer}}}')
    assert r.done and r.reward == 0.0 and not r.info['success']
    # over the 1000-character cap: compared as normal forms only, no worker, no log
    assert r.info['grader'] == 'ok' and not caplog.records
    env.reset(task)
    with caplog.at_level('WARNING', logger='nlac_jax.envs.math_env'):
        r = env.step('\\boxed{\\sum_{k=1}^{9999} k^{k}}')
    assert r.reward == 0.0 and r.info['grader'] == 'timeout'
    recs = [x for x in caplog.records if x.name == 'nlac_jax.envs.math_env']
    assert len(recs) == 1 and len(recs[0].getMessage()) < 250
    assert 'over its 0.3 s budget' in recs[0].getMessage() and task.id in recs[0].getMessage()


def test_extraction_is_linear_on_hostile_text():
    # at 16k characters each of these took 1.5-6 s before (quadratic regex backtracking / brace scanning); at 10x that
    # length a quadratic scan takes minutes and a linear one milliseconds, so a 10 s guard separates them on any
    # machine; CPU time of this thread (a loaded machine stretches wall time, not that)
    k = 10
    for text in ['\n' * 16000 * k, ' \n' * 8000 * k, '\\boxed{' * 2285 * k, 'answer' + ' ' * 15990 * k + 'x',
                 'Answer: x' + ' ' * 15990 * k + 'y', '####' + '\n' * 15990 * k]:
        t = time.thread_time()
        extract_answer(text)
        assert time.thread_time() - t < 10.0, repr(text[:20])
    assert extract_answer('Answer:\n  42\n') == '42'  # the answer may follow on the next line
