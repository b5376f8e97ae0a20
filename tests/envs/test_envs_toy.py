"""Toy number-guessing env: binary search wins, turn limits, malformed actions, optimality hook."""

import itertools
import random

import pytest

from nlac_jax.envs.base import Task
from nlac_jax.envs.toy import (GuessNumberEnv, GuessNumberTaskSource, _covered, binary_search_policy,
                               binary_search_turns, parse_guess)


def play(env, task, policy, max_steps=100):
    msgs = list(env.reset(task))
    rewards, infos = [], []
    for _ in range(max_steps):
        a = policy(msgs)
        r = env.step(a)
        msgs += [{'role': 'assistant', 'content': a}, {'role': 'user', 'content': r.observation}]
        rewards.append(r.reward)
        infos.append(r.info)
        if r.done:
            return msgs, rewards, infos
    raise AssertionError('episode did not end')


@pytest.mark.parametrize('n', [1, 2, 3, 7, 8, 10, 100, 1000])
def test_binary_search_always_wins_within_log_turns(n):
    turns = binary_search_turns(n)
    assert turns == (n).bit_length()  # ceil(log2(n+1)) == bit_length(n)
    env = GuessNumberEnv(n=n, max_turns=turns)
    targets = range(1, n + 1) if n <= 100 else range(1, n + 1, 37)
    worst = 0
    for x in targets:
        _, rewards, infos = play(env, Task(f't{x}', 'test', {'target': x, 'n': n}),
                                 lambda m: binary_search_policy(m, n))
        assert rewards[-1] == 1.0 and sum(rewards) == 1.0, (n, x, rewards)
        assert infos[-1]['success']
        worst = max(worst, len(rewards))
    if n <= 100:
        assert worst == turns  # the bound is tight: some target needs every turn


def test_turn_limit_off_by_one():
    n = 100
    # One turn fewer than binary search needs: some target must be missed, and the episode ends exactly at the limit.
    env = GuessNumberEnv(n=n, max_turns=binary_search_turns(n) - 1)
    lost = 0
    for x in range(1, n + 1):
        _, rewards, infos = play(env, Task('t', 'test', {'target': x, 'n': n}), lambda m: binary_search_policy(m, n))
        assert len(rewards) <= env.max_turns
        if rewards[-1] == 0.0:
            lost += 1
            assert len(rewards) == env.max_turns and not infos[-1]['success']
    assert lost == n - (2 ** env.max_turns - 1)  # exactly the values binary search cannot reach


def test_exactly_at_limit_counts_as_win():
    env = GuessNumberEnv(n=10, max_turns=3)
    env.reset(Task('t', 'x', {'target': 7, 'n': 10}))
    assert env.step('1').observation == 'higher'
    assert env.step('2').observation == 'higher'
    r = env.step('7')  # third (last) guess is right
    assert r.done and r.reward == 1.0 and r.info['success']


def test_malformed_actions_are_error_observations():
    env = GuessNumberEnv(n=10, max_turns=5, max_action_chars=50)
    env.reset(Task('t', 'x', {'target': 4, 'n': 10}))
    for bad in ['', '   ', 'no idea', 'x' * 51]:
        r = env.step(bad)
        assert r.info['error'] is True and r.observation.startswith('Error') and r.reward == 0.0
    r = env.step('I guess 4, or maybe 5')  # first integer wins
    assert r.done and r.reward == 1.0 and not r.info['error']
    assert env.step('4').info['error']  # stepping a finished game is an error, not an exception
    assert parse_guess('between -3 and 9') == -3


def test_errors_consume_turns():
    env = GuessNumberEnv(n=10, max_turns=2)
    env.reset(Task('t', 'x', {'target': 4, 'n': 10}))
    assert not env.step('hmm').done
    r = env.step('???')
    assert r.done and r.reward == 0.0 and not r.info['success']


def test_optimality_rule():
    env = GuessNumberEnv(n=10, max_turns=4)  # 2^4 - 1 = 15 >= 10: guaranteed
    env.reset(Task('t', 'x', {'target': 9, 'n': 10}))
    hist = [{'role': 'system', 'content': ''}, {'role': 'user', 'content': ''}]
    # r=4: both sides must be <= 7 -> guesses 3..8 are optimal
    assert env.optimal_actions(hist) == set(range(3, 9))
    assert env.is_action_optimal(hist, '5') and env.is_action_optimal(hist, 'guess 3')
    assert not env.is_action_optimal(hist, '2') and not env.is_action_optimal(hist, '11')
    assert not env.is_action_optimal(hist, 'no number')
    # after guessing 5 (-> higher), interval [6, 10], r=3: sides <= 3 -> 7, 8, 9 optimal
    hist2 = hist + [{'role': 'assistant', 'content': '5'}, {'role': 'user', 'content': 'higher'}]
    assert env.optimal_actions(hist2) == {7, 8, 9}
    assert not env.is_action_optimal(hist2, '5')  # outside the feasible interval
    # a game already lost its guarantee: n=10 with 2 turns covers at most 3 values; optimal = cover 3
    env2 = GuessNumberEnv(n=10, max_turns=2)
    env2.reset(Task('t', 'x', {'target': 9, 'n': 10}))
    assert env2.optimal_actions(hist) == set(range(2, 10))
    # brute force: the rule equals "maximise guaranteed-findable values" for every state of small games
    for n, r in itertools.product(range(1, 12), range(1, 5)):
        best = min(n, 2 ** r - 1)
        assert max(_covered(g, 1, n, r) for g in range(0, n + 2)) == best


def test_optimal_play_is_optimal_under_rule():
    n = 50
    env = GuessNumberEnv(n=n)
    for x in (1, 17, 50):
        msgs = env.reset(Task('t', 'x', {'target': x, 'n': n}))
        while True:
            a = binary_search_policy(msgs, n)
            assert env.is_action_optimal(msgs, a), (x, msgs)
            r = env.step(a)
            msgs = msgs + [{'role': 'assistant', 'content': a}, {'role': 'user', 'content': r.observation}]
            if r.done:
                assert r.reward == 1.0
                break


def test_default_turn_limit_follows_task_n():
    env = GuessNumberEnv(n=100)
    env.reset(Task('t', 'x', {'target': 3, 'n': 1000}))
    assert env.max_turns == 10
    env.reset(Task('t', 'x', {'target': 3, 'n': 7}))
    assert env.max_turns == 3


def test_task_source_splits_and_cursor():
    src = GuessNumberTaskSource(n=20, test_every=5)
    train, test = src.tasks('train'), src.tasks('test')
    assert [t.payload['target'] for t in test] == [5, 10, 15, 20]
    assert len(train) == 16 and not {t.id for t in train} & {t.id for t in test}
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        src.tasks('dev')


def test_huge_guesses_are_clamped_not_crashing():
    # int() of more than 4300 digits raises ValueError; with a raised action limit that escaped env.step
    assert parse_guess('9' * 5000) == 10 ** 18 and parse_guess('-' + '9' * 5000) == -10 ** 18
    assert parse_guess('0' * 5000 + '7') == 7 and parse_guess('guess 42') == 42
    env = GuessNumberEnv(n=100, max_action_chars=100_000)
    env.reset(Task('t', 'test', {'target': 50, 'n': 100}))
    r = env.step('9' * 50_000)
    assert r.observation == 'lower' and not r.info['error']
    assert env.step('-' + '9' * 50_000).observation == 'higher'


def _reply(env, action):
    return env.step(action)


def test_waste_rule_multiples_of_three():
    """Multiples of 3 get "no answer" (turn used, interval unchanged); the hidden number itself is still found,
    even when it is a multiple of 3; other guesses answer as usual."""
    env = GuessNumberEnv(n=32, waste_every=3)
    env.reset(Task(id='t', split='test', payload={'target': 12, 'n': 32}))
    r = env.step('9')
    assert (r.observation, r.reward, r.done, r.info['wasted']) == ('no answer', 0.0, False, True)
    assert (env.lo, env.hi, env.turn) == (1, 32, 1)  # nothing learned, a turn gone
    assert env.step('10').observation == 'higher' and env.lo == 11
    assert env.step('14').observation == 'lower' and env.hi == 13
    assert env.step('13').observation == 'lower'
    r = env.step('12')  # the target is a multiple of 3: still "correct"
    assert (r.reward, r.done, r.info['success']) == (1.0, True, True)
    assert [g for g in range(1, 33) if env.wasted(g)] == [3, 6, 9, 12, 15, 18, 21, 24, 27, 30]


def test_waste_rule_off_by_default_and_even_rule():
    env = GuessNumberEnv(n=32)
    env.reset(Task(id='t', split='test', payload={'target': 5, 'n': 32}))
    assert env.step('6').observation == 'lower' and not env.has_waste
    env = GuessNumberEnv(n=32, waste_every=2, wasted_numbers=(7,))
    env.reset(Task(id='t', split='test', payload={'target': 5, 'n': 32}))
    assert [env.step(a).observation for a in ('6', '7', '3')] == ['no answer', 'no answer', 'higher']
    with pytest.raises(ValueError, match='waste_every'):
        GuessNumberEnv(n=32, waste_every=-1)


def test_waste_rule_out_of_turns_and_optimality():
    env = GuessNumberEnv(n=8, max_turns=2, waste_every=3)
    task = Task(id='t', split='test', payload={'target': 5, 'n': 8})
    env.reset(task)
    env.step('3')
    r = env.step('6')
    assert r.done and not r.info['success'] and r.observation.startswith('no answer. You are out of guesses')
    # optimality with waste: inside the consistent interval and answered (or the target itself)
    env.reset(task)
    state = [{'role': 'system', 'content': 's'}, {'role': 'user', 'content': 'u'},
             {'role': 'assistant', 'content': '3'}, {'role': 'user', 'content': 'no answer'},
             {'role': 'assistant', 'content': '4'}, {'role': 'user', 'content': 'higher'}]
    env = GuessNumberEnv(n=8, max_turns=4, waste_every=3)
    env.reset(task)
    assert env.optimal_actions(state) == {5, 7, 8}  # interval 5..8 after "4 higher"; 6 is wasted
    assert [env.is_action_optimal(state, a) for a in ('5', '6', '4', 'x')] == [True, False, False, False]
    env.reset(Task(id='t6', split='test', payload={'target': 6, 'n': 8}))
    assert env.is_action_optimal(state, '6')  # the target is always worth guessing


def test_waste_rule_is_a_gin_binding():
    import gin
    from nlac_jax.envs import make_env_factory  # noqa: F401  (registers the env classes)
    with gin.unlock_config():
        gin.parse_config('nlac_jax.envs.GuessNumberEnv.waste_every = 3')
    try:
        env = GuessNumberEnv(n=32)
        assert env.waste_every == 3 and env.wasted(27) and not env.wasted(28)
    finally:
        gin.clear_config()


def test_action_categories_by_hand():
    """action_category: the first label that applies, in ACTION_CATEGORIES order, checked against hand-worked
    states of the odd-wasting game (target 20), and action_breakdown's fractions over a scripted episode."""
    from nlac_jax.envs.base import Episode
    from nlac_jax.envs.transition import Transition
    from nlac_jax.nlac.evaluation import action_breakdown
    env = GuessNumberEnv(n=32, wasted_numbers=tuple(range(1, 33, 2)))
    task = Task(id='t', split='test', payload={'target': 20, 'n': 32})
    env.reset(task)

    def state(*turns):
        msgs = [{'role': 'system', 'content': 'You have 6 guesses.'}, {'role': 'user', 'content': '1 and 32.'}]
        for g, reply in turns:
            msgs += [{'role': 'assistant', 'content': g}, {'role': 'user', 'content': reply}]
        return msgs
    s = state(('16', 'higher'), ('25', 'no answer'))  # the feedback allows 17..32; 25 was wasted
    assert [env.action_category(s, a) for a in ('hmm', '16', '25', '8', '23', '24', '20')] == [
        'invalid', 'repeat', 'repeat', 'outside', 'wasted', 'informative', 'informative']
    assert env.action_category(state(), '19') == 'wasted' and env.action_category(state(), '33') == 'outside'
    steps = [(state(), '16'), (s[:4], '25'), (s, '8'), (s, '24')]
    ep = Episode(task=task, messages=[], transitions=[Transition(st, a, 0.0, None, True) for st, a in steps],
                 total_return=0.0, success=False, length=4, num_errors=0)
    assert action_breakdown([ep], env) == {'actions/invalid': 0.0, 'actions/repeat': 0.0, 'actions/outside': 0.25,
                                           'actions/wasted': 0.25, 'actions/informative': 0.5}
    assert action_breakdown([ep], None) == {}


def test_success_by_group_by_hand():
    """success_by_group over the odd-wasting game's task_group: targets 3 and 7 are "rule_target" (the rule covers
    them), 4 "free_target"; rates and counts worked by hand; {} for a game that wastes nothing."""
    from nlac_jax.envs.base import Episode, success_by_group
    env = GuessNumberEnv(n=32, wasted_numbers=tuple(range(1, 33, 2)))

    def ep(target, success):
        return Episode(task=Task(id=f'g{target}', split='test', payload={'target': target, 'n': 32}), messages=[],
                       transitions=[], total_return=0.0, success=success, length=1, num_errors=0)
    eps = [ep(3, True), ep(7, False), ep(3, False), ep(4, True)]
    assert success_by_group(eps, env) == {'success/free_target': 1.0, 'episodes/free_target': 1.0,
                                          'success/rule_target': 1 / 3, 'episodes/rule_target': 3.0}
    assert GuessNumberEnv(n=32, waste_every=3).task_group(eps[0].task) == 'rule_target'
    assert GuessNumberEnv(n=32, waste_every=3).task_group(eps[3].task) == 'free_target'
    assert success_by_group(eps, GuessNumberEnv(n=32)) == {}


def test_dominated_guess_reads_the_public_transcript_as_the_env_categorises():
    """envs.dominated_guess (public transcript only) == the env's own categories 'repeat' or 'outside' (which replay
    the hidden target), on random games with waste, repeats and out-of-range guesses."""
    from nlac_jax.envs.toy import dominated_guess
    rng = random.Random(3)
    checked = {True: 0, False: 0}
    for _ in range(60):
        n, target = 32, rng.randint(1, 32)
        env = GuessNumberEnv(n=n, max_turns=8, wasted_numbers=(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21))
        state = env.reset(Task('t', 'test', {'target': target, 'n': n}))
        for _ in range(8):
            g = str(rng.choice([rng.randint(-2, 35), rng.randint(1, 32)]))
            want = env.action_category(state, g) in ("repeat", "outside")
            assert dominated_guess(state, g) == want, (state, g)
            assert not dominated_guess(state, "no number here")
            checked[want] += 1
            r = env.step(g)
            state = state + [{'role': 'assistant', 'content': g}, {'role': 'user', 'content': r.observation}]
            if r.done:
                break
    assert min(checked.values()) > 20  # both answers were exercised
    assert not dominated_guess([{'role': 'user', 'content': 'no opening line'}], "5")
