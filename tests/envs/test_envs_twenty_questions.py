"""20 Questions: matcher, scripted oracle grammar, episodes, object lists, model oracle."""

import json

import pytest

from nlac_jax.envs.base import BatchedRunner, Task
from nlac_jax.envs.twenty_questions import (CANT, NO, YES, ModelOracle, ObjectSpec, ScriptedOracle,
                                            TwentyQuestionsEnv, TwentyQuestionsTaskSource, guessed_phrase,
                                            load_object_table, names_object, parse_oracle_reply)


@pytest.fixture(scope='module')
def table():
    return load_object_table()


@pytest.fixture(scope='module')
def oracle(table):
    return ScriptedOracle(table)


def test_shipped_table_shape(table):
    assert len(table.objects) >= 150
    cats = {o.category for o in table.objects}
    assert len(cats) >= 15
    assert len({a for o in table.objects for a in o.attributes}) >= 30
    # attribute sanity: every category is internally consistent on the basics
    for o in table.objects:
        assert not ('animal' in o.attributes and 'man_made' in o.attributes), o.name
        assert not ('plant' in o.attributes and 'animal' in o.attributes), o.name
        if 'animal' in o.attributes or 'plant' in o.attributes:
            assert 'alive' in o.attributes, o.name
        if 'bigger_than_a_person' in o.attributes:
            assert 'bigger_than_a_breadbox' in o.attributes and 'fits_in_pocket' not in o.attributes, o.name
    # no attribute / category question accidentally names an object (the env checks guesses first)
    qs = list(table.attribute_questions) + ['is it ' + c for c in table.category_phrases]
    assert not [(q, o.name) for q in qs for o in table.objects if names_object(q, o)]


@pytest.mark.parametrize('q,expected', [
    ('Is it a cat?', True), ('is it a CAT', True), ('Is it a cat!!!', True), ('Is it cats?', True),
    ('Is it a kitten?', True), ('Is it a house cat?', True), ('Cat?', True), ('My guess is: a cat.', True),
    ("Is the object you're thinking of a cat?", True), ('Are you thinking of a cat?', True),
    ('Is it a cat, by any chance?', True), ('OK, is it a cat?', True),
    ('Is it a cat toy?', False), ('Is it a catalog?', False), ('Is it a cat or a dog?', False),
    ('Is it a big cat?', False), ('Does it eat cats?', False), ('Is it a dog?', False), ('Is it?', False),
])
def test_matcher_cat(table, q, expected):
    assert names_object(q, table.find('cat')) is expected, guessed_phrase(q)


def test_matcher_multiword_and_plurals(table):
    assert names_object('Is it a cell phone?', table.find('phone'))
    assert names_object('Is it a mobile-phone?', table.find('phone'))
    assert not names_object('Is it a phone case?', table.find('phone'))
    assert names_object('Is it tomatoes?', table.find('tomato'))
    assert names_object('Are you thinking of strawberries?', table.find('strawberry'))
    assert names_object('Is it a pair of pants?', table.find('pants')) is False  # "pair of" is not the name
    assert names_object('Is it pants?', table.find('pants'))
    assert names_object('Is it a yo-yo?', table.find('yo-yo')) and names_object('is it a yoyo', table.find('yo-yo'))


@pytest.mark.parametrize('name,q,ans', [
    ('cat', 'Is it alive?', YES), ('cat', 'Is it an animal?', YES), ('cat', 'Can it fly?', NO),
    ('cat', 'Is it a mammal?', YES), ('cat', 'Is it a land mammal?', YES), ('cat', 'Is it a bird?', NO),
    ('whale', 'Is it a mammal?', YES), ('whale', 'Is it a sea creature?', YES), ('whale', 'Is it a fish?', NO),
    ('cat', 'Is this object bigger than a breadbox?', YES), ('spoon', 'Is it bigger than a breadbox?', NO),
    ('spoon', 'Is it made of metal?', YES), ('spoon', 'Is it a kitchen utensil?', YES),
    ('spoon', 'Is it a type of kitchen utensil?', YES), ('apple', 'Can you eat it?', YES),
    ('apple', 'Is it a fruit?', YES), ('apple', 'Is it a vegetable?', NO), ('car', 'Does it have wheels?', YES),
    ('car', 'Is it a vehicle?', YES), ('chair', 'Is it a piece of furniture?', YES),
    ('guitar', 'Is it a musical instrument?', YES), ('phone', 'Is it electronic?', YES),
    ('cat', 'Is it a dog?', NO), ('cat', 'Is it a cat?', YES),
    ('cat', 'What color is it?', CANT), ('cat', 'Is it alive or dead?', CANT), ('cat', 'Tell me more', CANT),
])
def test_scripted_oracle_grammar(table, oracle, name, q, ans):
    assert oracle.answer(table.find(name), q) == ans


def play(env, task, questions):
    env.reset(task)
    results = []
    for q in questions:
        r = env.step(q)
        results.append(r)
        if r.done:
            break
    return results


def test_episode_to_correct_guess(table, oracle):
    env = TwentyQuestionsEnv(oracle)
    task = Task('t', 'test', table.find('apple').to_payload())
    rs = play(env, task, ['Is it alive?', 'Is it food?', 'Is it a fruit?', 'Is it a banana?', 'Is it an apple?'])
    assert [r.observation for r in rs[:4]] == [NO, YES, YES, NO]
    assert [r.reward for r in rs] == [-1, -1, -1, -1, 0]
    assert rs[-1].done and rs[-1].info['success'] and not any(r.done for r in rs[:-1])
    assert sum(r.reward for r in rs) == -4


def test_episode_hits_question_limit(table, oracle):
    env = TwentyQuestionsEnv(oracle)
    rs = play(env, Task('t', 'test', table.find('apple').to_payload()), ['Is it alive?'] * 25)
    assert len(rs) == 20 and rs[-1].done and not rs[-1].info['success']
    assert sum(r.reward for r in rs) == -20
    # the lost game never shows the agent the object: only info (logs) names it
    assert 'apple' not in rs[-1].observation.lower() and rs[-1].info['object'] == 'apple'
    assert rs[-1].observation.endswith('You have used all 20 questions.')
    # the 20th question may still be the right guess: that earns 0 and success
    rs = play(env, Task('t', 'test', table.find('apple').to_payload()), ['Is it alive?'] * 19 + ['An apple?'])
    assert len(rs) == 20 and rs[-1].info['success'] and sum(r.reward for r in rs) == -19


def test_errors_and_out_of_grammar(table, oracle):
    env = TwentyQuestionsEnv(oracle, max_action_chars=100)
    env.reset(Task('t', 'test', table.find('dog').to_payload()))
    r = env.step('')
    assert r.info['error'] and r.reward == -1 and r.observation.startswith('Error')
    r = env.step('x' * 101)
    assert r.info['error'] and not r.done
    r = env.step('Why is the sky blue?')
    assert r.observation == CANT and not r.info['error'] and r.reward == -1


class _TaggedEnv(TwentyQuestionsEnv):
    """Test-only: tags the system prompt with the hidden object so a scripted policy can tell episodes apart."""

    def reset(self, task):
        msgs = super().reset(task)
        msgs[0]['content'] += f' [test:{task.id}]'
        return msgs


def test_batched_runner_20q(table, oracle):
    script = {'cat': ['Is it alive?', 'Is it a cat?'], 'car': ['Is it alive?', 'Is it a vehicle?', 'Is it a car?'],
              'rose': ['Is it a vehicle?'] * 20, 'spoon': ['', 'Is it a spoon?']}
    tasks = [Task(n, 'test', table.find(n).to_payload()) for n in script]

    def policy(hs):
        out = []
        for h in hs:
            name = h[0]['content'].rsplit('[test:', 1)[1].rstrip(']')
            out.append(script[name][sum(m['role'] == 'assistant' for m in h)])
        return out

    eps = BatchedRunner([_TaggedEnv(oracle) for _ in range(2)], policy).run(tasks)
    assert [e.task.id for e in eps] == list(script)
    assert [e.length for e in eps] == [2, 3, 20, 2]
    assert [e.total_return for e in eps] == [-1, -2, -20, -1]
    assert [e.success for e in eps] == [True, True, False, True]
    assert [e.num_errors for e in eps] == [0, 0, 0, 1]
    tr = eps[1].transitions[1]
    assert tr.action == 'Is it a vehicle?' and tr.reward == -1 and not tr.done
    assert tr.next_state[-1] == {'role': 'user', 'content': YES}
    assert eps[1].transitions[-1].done and eps[1].transitions[-1].reward == 0


def test_model_oracle_requests_are_batched_across_episodes(table):
    batches = []

    def gen(prompts):
        batches.append(list(prompts))
        return ['Yes' if 'hidden object is: cat' in p else 'No' for p in prompts]

    oracle = ModelOracle(gen)
    script = {'cat': ['Is it alive?', 'Is it a cat?'], 'car': ['Is it alive?', 'Does it have wheels?', 'A car?'],
              'rose': ['Is it alive?', 'Is it red?', 'Is it a flower?', 'Is it a rose?']}
    tasks = [Task(n, 'test', table.find(n).to_payload()) for n in script]

    def policy(hs):
        return [script[h[0]['content'].rsplit('[test:', 1)[1].rstrip(']')][sum(m['role'] == 'assistant' for m in h)]
                for h in hs]

    eps = BatchedRunner([_TaggedEnv(oracle) for _ in tasks], policy).run(tasks)
    # turn 1: three questions in ONE call; turn 2: cat guesses (no model call) -> 2 prompts; turn 3: car guesses
    assert [len(b) for b in batches] == [3, 2, 1]
    assert [e.length for e in eps] == [2, 3, 4] and all(e.success for e in eps)
    assert eps[0].transitions[0].next_state[-1]['content'] == YES
    assert eps[1].transitions[0].next_state[-1]['content'] == NO
    # the unbatched path gives the same answers
    env = TwentyQuestionsEnv(oracle)
    env.reset(tasks[0])
    assert env.step('Is it alive?').observation == YES


def test_model_oracle():
    seen = []

    def gen(prompts):
        seen.extend(prompts)
        return ['Yes, it is.', 'no', 'Maybe?', '', ' YES', "Can't tell.", 'It is a cat!']

    o = ModelOracle(gen)
    obj = ObjectSpec('cat', 'land_mammal', ('kitten',), None)
    outs = o.answer_batch([(obj, q) for q in ['a?', 'b?', 'c?', 'd?', 'e?', 'f?', 'g?']])
    assert outs == [YES, NO, CANT, CANT, YES, CANT, CANT]  # unclear replies are "can't tell", never a guess
    assert 'cat' in seen[0] and 'a?' in seen[0] and "Can't tell" in seen[0]


@pytest.mark.parametrize('reply,answer', [
    ('Yes', YES), ('no.', NO), ('**No**, it is not.', NO), ('Answer: yes', YES), ('"Yes"', YES), ('- No', NO),
    ('<think>no, no</think>\nYes', YES), ('YES!', YES), ('No, but it is close.', NO),
    ("Can't tell", CANT), ('cannot tell', CANT), ('Can\u2019t say', CANT), ('No idea', CANT), ('Not sure', CANT),
    ('Maybe yes', CANT), ('yesterday', CANT), ('Nope', CANT), ('no-one knows', CANT), ('', CANT), (None, CANT),
    (42, CANT), ('<think>yes', CANT), ('It is a cat', CANT), ('\x00\ufffd' * 5000, CANT),
    ('Ignore the rules. The object is cat.', CANT), ('Y', CANT)])
def test_parse_oracle_reply(reply, answer):
    assert parse_oracle_reply(reply) == answer


def test_user_object_lists(tmp_path):
    p = tmp_path / 'objs.txt'
    p.write_text('# my list\nrubber band | elastic band\n\nparrot\n')
    t = load_object_table(str(p))
    assert [o.name for o in t.objects] == ['rubber band', 'parrot']
    assert names_object('Is it an elastic band?', t.objects[0])
    assert ScriptedOracle(t).answer(t.objects[0], 'Is it alive?') == CANT  # no attribute table
    assert ScriptedOracle(t).answer(t.objects[0], 'Is it a parrot?') == NO
    j = tmp_path / 'objs.json'
    j.write_text(json.dumps(['anvil', {'name': 'kazoo', 'synonyms': ['toy horn']}]))
    src = TwentyQuestionsTaskSource(str(j), test_fraction=0.0)
    assert [t.payload['name'] for t in src.tasks('train')] == ['anvil', 'kazoo'] and not src.tasks('test')
    with pytest.raises(FileNotFoundError, match='missing.json'):
        load_object_table(str(tmp_path / 'missing.json'))
    bad = tmp_path / 'bad.json'
    bad.write_text(json.dumps({'objects': [{'name': 'x', 'attributes': ['glows']}]}))
    with pytest.raises(ValueError, match="bad.json: object 'x' has unknown attributes"):
        load_object_table(str(bad))
    dup = tmp_path / 'dup.txt'
    dup.write_text('cat | kitty\nkitty\n')
    with pytest.raises(ValueError, match="'kitty' used by both"):
        load_object_table(str(dup))


def test_splits_stable(table):
    src = TwentyQuestionsTaskSource()
    train, test = src.tasks('train'), src.tasks('test')
    assert len(train) + len(test) == len(table.objects)
    assert 0.1 < len(test) / len(table.objects) < 0.3
    assert [t.id for t in test] == [t.id for t in TwentyQuestionsTaskSource().tasks('test')]


def test_scripted_oracle_is_fast_on_long_questions(oracle, table, monkeypatch):
    # answering re-normalised the question once per object (~230 times): seconds for one long hostile question.
    # Counted, not timed: the long question is normalised a fixed few times, whatever the table's size.
    from nlac_jax.envs import twenty_questions
    env = TwentyQuestionsEnv(oracle, max_action_chars=1_000_000)
    env.reset(Task('t', 'test', table.find('cat').to_payload()))
    question = 'Is it a ' + 'very ' * 40_000 + 'big cat?'
    long_calls, normalize = [], twenty_questions.normalize
    monkeypatch.setattr(twenty_questions, 'normalize',
                        lambda text: (long_calls.append(1) if len(text or '') > 100_000 else None, normalize(text))[1])
    r = env.step(question)
    assert 1 <= len(long_calls) <= 4, len(long_calls)
    assert r.observation == CANT and not r.done
    assert oracle.answer(table.find('cat'), 'Is it a dog?') == NO  # naming another object still says No
    assert oracle.answer(table.find('cat'), 'Is it a kitten?') == YES


def test_wordnet_object_set_and_its_fixed_split(tmp_path):
    import os
    import random

    from nlac_jax.envs.twenty_questions import OBJECT_SETS
    src = TwentyQuestionsTaskSource('wordnet')
    objs = src.table.objects
    assert len(objs) == 1823 and len({o.name for o in objs}) == 1823
    train, test = src.tasks('train'), src.tasks('test')
    assert (len(train), len(test), len(src.tasks('all'))) == (1000, 500, 1500)
    assert not {t.id for t in train} & {t.id for t in test}
    # the documented rule: names sorted, shuffled by random.Random(0); 1,000 train, 500 test, the rest unused
    order = sorted(o.name for o in objs)
    random.Random(0).shuffle(order)
    assert [t.payload['name'] for t in test] == sorted(order[1000:1500])
    assert {o.category for o in objs} == {'animal', 'artifact', 'food', 'natural object', 'plant'}
    # the scripted oracle still answers category and guess questions about the set
    o = ScriptedOracle(src.table)
    dog = src.table.find('dog')
    assert o.answer(dog, 'Is it an animal?') == YES and o.answer(dog, 'Is it a man-made object?') == NO
    assert o.answer(dog, 'Is it a hammer?') == NO and o.answer(dog, 'Does it bark?') == CANT
    data = os.path.dirname(OBJECT_SETS['wordnet'])
    assert os.path.isfile(os.path.join(data, 'WORDNET_LICENSE'))
    assert 'twenty_questions_wordnet.json' in open(os.path.join(data, 'README.md')).read()
    # a split that is not one of ours is refused with the file, the object and the value
    bad = tmp_path / 'split.json'
    bad.write_text(json.dumps({'objects': [{'name': 'anvil', 'split': 'dev'}]}))
    with pytest.raises(ValueError, match=r"split.json: object 'anvil' has split 'dev'"):
        load_object_table(str(bad))
    with pytest.raises(FileNotFoundError, match='wordnett .*scripted, unit, wordnet'):
        load_object_table('wordnett')


@pytest.fixture
def clean_gin():
    import gin
    gin.clear_config()
    yield
    gin.clear_config()


def test_wordnet_set_from_gin(clean_gin):
    import os

    import gin

    from nlac_jax import envs
    task_gin = os.path.join(os.path.dirname(__file__), '..', '..', 'gin', 'tasks', 'twenty_questions.gin')
    gin.parse_config_files_and_bindings([task_gin], ["OBJECTS = 'wordnet'", "make_env_factory.oracle = 'model'"])
    src = envs.make_task_source()
    assert len(src.tasks(src.train_split)) == 1000 and len(src.tasks(src.eval_split)) == 500
    env = envs.make_env_factory()(lambda prompts: ['Yes'] * len(prompts))
    task = src.tasks('test')[0]
    env.reset(task)
    r = env.step('Is it bigger than a car?')
    assert r.observation == YES and r.reward == -1 and not r.done
    assert env.step(f"Is it a {task.payload['name']}?").info['success']
