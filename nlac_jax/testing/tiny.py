"""A tiny Qwen2-style tokenizer trained in-process: tests and demos without any download.

`make_tiny_tokenizer()` trains a byte-level BPE (the Qwen2 pre-tokenizer regex + GPT-2 byte alphabet) on a small
built-in English corpus, adds the Qwen2 special tokens and a ChatML chat template, and returns a
`transformers.PreTrainedTokenizerFast`. Training is deterministic (fixed corpus, no RNG; the `tokenizers` BPE trainer
breaks ties on token ids), so ids are identical across runs and machines for the pinned `tokenizers` version.

Layout, as in Qwen2: ids 0..255 are the byte alphabet, then the BPE merges, then the special tokens
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as the last three ids (`len(tokenizer) == vocab_size`).
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

if TYPE_CHECKING:
    import transformers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# The Qwen2 pre-tokenizer split (digits are single tokens, which keeps arithmetic regular).
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Gemma-style turns (the same three special ids, renamed; see make_tiny_tokenizer(chat_format='gemma')). Gemma has no
# system role: a leading system message is folded into the first user turn, and roles must alternate.
GEMMA_TOKENS = {ENDOFTEXT: "<eos>", IM_START: "<start_of_turn>", IM_END: "<end_of_turn>"}
GEMMA_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}"
    "{%- endif -%}"
    "{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n'"
    " + (prefix if loop.first else '') + message['content'] + '<end_of_turn>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}"
)

# Qwen2-style ChatML without a default system message.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

_MIN_VOCAB = 256 + len(SPECIAL_TOKENS) + 1  # byte alphabet + specials + at least one merge
_MODEL_MAX_LENGTH = 32768


def _corpus() -> list[str]:
    """A deterministic corpus (no RNG) covering NLAC prompt words, 20 Questions, guess-the-number and math."""
    lines: list[str] = []
    roles = ["system", "user", "assistant", "tool"]
    instructions = [
        "You are a helpful assistant.",
        "You are an agent playing a game. Think step by step and give your final answer.",
        "You are the successor model. Given the state and the action, describe how the rest of the episode unfolds.",
        "Summarize the future: describe the near future in detail and the far future briefly.",
        "End the summary with the final outcome and the reward.",
        "You are the evaluator. Read the state, the action and the predicted futures.",
        "Write a critique that says whether the action is optimal and why, then give a clear verdict.",
        "Verdict: the action is optimal.",
        "Verdict: the action is not optimal.",
        "You are the refiner. Given the state, the action and the critique, write a better action.",
        "Refined action:",
        "Combine what happened next with the summary of the future into one compact summary.",
        "The episode ended. The final reward was 1.",
        "The episode ended. The final reward was 0.",
        "The task failed and the reward is 0.",
        "The task succeeded and the reward is 1.",
        "State: the interaction so far.",
        "Action: the next utterance, tool call or answer.",
        "Respond with only the action, nothing else.",
        "Let's play 20 Questions. I am thinking of an object. Ask yes/no questions to guess it.",
        "Let's play a game: guess the number between 1 and 100. After each guess I will say higher or lower.",
        "Solve the following math problem. Put the final answer in \\boxed{}.",
        "Please reason step by step, and put your final answer within \\boxed{}.",
    ]
    lines += instructions
    for role in roles:
        lines.append(f"{role}\nHello, how can I help you today?")
        lines.append(f"The {role} said: please answer the question.")

    questions = [
        "Is it an animal?", "Is it alive?", "Is it a person?", "Is it a place?", "Is it bigger than a car?",
        "Is it smaller than a box?", "Can you eat it?", "Is it made of metal?", "Is it found at home?",
        "Does it have legs?", "Can it fly?", "Is it used for work?", "Is it a tool?", "Is it a fruit?",
        "Is it a vehicle?", "Is it an object?", "Is it red?", "Does it live in the water?", "Is it a dog?",
        "Is it a cat?", "Is it a car?", "Is it an apple?", "Is it a computer?", "Is it a book?",
    ]
    answers = ["Yes.", "No.", "Yes, it is.", "No, it is not.", "Sometimes.", "I don't know."]
    for i, q in enumerate(questions):
        # ChatML-shaped turns (without the special tokens) so role names become single tokens.
        lines.append(f"user\n{q}\nassistant\n{answers[i % len(answers)]}\n")
        lines.append(f"Question {i + 1}: {q} Answer: {answers[i % len(answers)]}")
        lines.append(f"{q} {answers[(i * 5 + 1) % len(answers)]}")
    objects = ["dog", "cat", "car", "apple", "computer", "book", "chair", "table", "bird", "fish", "phone", "tree"]
    for i, obj in enumerate(objects):
        lines.append(f"Is it a {obj}? Yes! You guessed it. The answer was {obj}. You win, reward 1.")
        lines.append(f"My guess is: {obj}. {'Correct' if i % 3 == 0 else 'Wrong'}.")

    # Guess the number: deterministic sequences of guesses with higher/lower feedback.
    for secret in range(3, 100, 7):
        lo, hi, turn = 1, 100, 1
        while turn <= 8:
            guess = (lo + hi) // 2
            if guess == secret:
                lines.append(f"Turn {turn}: I guess {guess}. Correct! The number was {secret}. Reward: 1.")
                break
            word = "higher" if guess < secret else "lower"
            lines.append(f"Turn {turn}: I guess {guess}. The number is {word}. Guess {word} than {guess}.")
            lo, hi = (guess + 1, hi) if guess < secret else (lo, guess - 1)
            turn += 1

    # Arithmetic and algebra.
    for a in range(0, 40, 3):
        for b in range(1, 30, 4):
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
            lines.append(f"{a} * {b} = {a * b}, {a} - {b} = {a - b}, {a * b} / {b} = {a}.")
    for k in range(1, 20):
        lines.append(f"Solve for x: {k}x + {2 * k} = {5 * k}. Then x = 3. The final answer is \\boxed{{3}}.")
        lines.append(f"If x = {k}, then x^2 = {k * k} and 2x + 1 = {2 * k + 1}. So the answer is {k * k}.")
    lines += [
        "Step 1: compute the sum. Step 2: check the result. Therefore the final answer is 42.",
        "The probability is 1/2, the ratio is 3:4 and the percentage is 25%.",
        "Let f(x) = x^2 - 3x + 2. The roots are x = 1 and x = 2.",
        "The area of a circle is pi * r^2 and its circumference is 2 * pi * r.",
        "(a + b)^2 = a^2 + 2ab + b^2; sqrt(16) = 4; 10 mod 3 = 1.",
    ]

    # Tool calls / JSON-ish text (tau-bench style).
    for i, tool in enumerate(["get_order", "cancel_order", "find_user", "update_address", "return_item"]):
        lines.append(f'{{"name": "{tool}", "arguments": {{"order_id": "#W{1000 + 37 * i}", "user_id": "user_{i}"}}}}')
        lines.append(f"<tool_call>\n{{\"name\": \"{tool}\"}}\n</tool_call>")
    lines += [
        "Thank you! Your order has been cancelled. Is there anything else I can help you with?",
        "I'm sorry, I can't do that. Could you please confirm your user id and email address?",
        "The customer wants to return the item and get a refund to the original payment method.",
    ]

    # Short general English so that common words get merged.
    words = [
        "the", "a", "an", "and", "or", "not", "is", "was", "are", "be", "it", "this", "that", "what", "which",
        "who", "why", "how", "when", "where", "you", "your", "I", "we", "they", "he", "she", "of", "to", "in",
        "on", "for", "with", "by", "from", "as", "at", "if", "then", "else", "so", "because", "good", "bad",
        "best", "better", "more", "less", "first", "next", "last", "before", "after", "question", "answer",
        "game", "player", "turn", "guess", "number", "value", "reward", "episode", "future", "summary",
        "action", "state", "policy", "critic", "critique", "refine", "refined", "optimal", "verdict", "correct",
        "wrong", "higher", "lower", "yes", "no", "true", "false", "win", "lose", "final", "outcome",
    ]
    n = len(words)
    for i in range(160):
        # A fixed walk through the word list (stride coprime with n): deterministic, varied word pairs.
        sent = " ".join(words[(i * 7 + j * 13) % n] for j in range(6 + i % 5))
        lines.append(sent[0].upper() + sent[1:] + ("." if i % 4 else "?"))

    # More vocabulary (headroom for larger vocab sizes): nouns and verbs in simple sentences.
    nouns = [
        "animal", "elephant", "horse", "rabbit", "mouse", "lion", "tiger", "monkey", "snake", "spider", "banana",
        "orange", "bread", "cheese", "water", "coffee", "kitchen", "garden", "school", "hospital", "airport",
        "restaurant", "country", "city", "river", "mountain", "ocean", "island", "desert", "forest", "bicycle",
        "airplane", "train", "boat", "pencil", "paper", "window", "door", "bottle", "camera", "guitar", "piano",
        "clock", "shoe", "shirt", "hat", "ball", "doctor", "teacher", "student", "customer", "manager", "order",
        "payment", "refund", "address", "email", "account", "reservation", "flight", "ticket", "baggage",
        "product", "item", "price", "discount", "problem", "solution", "equation", "function", "variable",
        "integer", "fraction", "triangle", "square", "circle", "angle", "length", "height", "weight", "money",
    ]
    verbs = [
        "ask", "think", "know", "want", "need", "find", "give", "take", "make", "look", "help", "tell", "try",
        "call", "use", "check", "return", "cancel", "update", "change", "confirm", "compute", "multiply",
        "divide", "add", "subtract", "simplify", "explain", "describe", "predict", "evaluate", "improve",
    ]
    for i, noun in enumerate(nouns):
        verb = verbs[i % len(verbs)]
        lines.append(f"Did you {verb} the {noun}? We should {verbs[(i * 3 + 1) % len(verbs)]} it first.")
        lines.append(f"The {noun}s are {['larger', 'smaller', 'heavier', 'lighter', 'older'][i % 5]} than {i + 2}.")
    return lines


def tiny_corpus() -> list[str]:
    """The built-in training corpus (a copy; useful for tests and demos)."""
    return list(_corpus())


@functools.lru_cache(maxsize=None)
def _trained_tokenizer_json(vocab_size: int, extra_corpus: tuple[str, ...] = ()) -> str:
    """Train the BPE once per (vocab size, extra corpus); cached as the serialized `tokenizers` JSON (immutable)."""
    if vocab_size < _MIN_VOCAB:
        raise ValueError(f"vocab_size={vocab_size} is too small: need >= {_MIN_VOCAB} (256 bytes + 3 specials + 1)")
    tok = Tokenizer(models.BPE())
    # No NFC normalizer (Qwen2 has one): without it every string, NFC or not, round-trips exactly.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=0,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus() + list(extra_corpus), trainer=trainer)
    n_bpe = tok.get_vocab_size()
    if n_bpe != vocab_size - len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too large for the built-in corpus (it supports at most "
            f"{n_bpe + len(SPECIAL_TOKENS)})"
        )
    # Specials last, as in Qwen2; normalized=False so they are matched verbatim in any text.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def make_tiny_tokenizer(out_dir: str | None = None, vocab_size: int = 512,
                        chat_format: str = "chatml",
                        extra_corpus: tuple[str, ...] = ()) -> transformers.PreTrainedTokenizerFast:
    """Return a fresh Qwen2-style tokenizer with `len(tokenizer) == vocab_size`, trained in-process (cached).

    Special tokens: `<|endoftext|>` is eos and pad (as in a Qwen2 base model); `<|im_start|>` / `<|im_end|>` delimit
    ChatML turns. `tokenizer.chat_template` is ChatML (no default system message). Byte-level: for any str `s`,
    `tokenizer.decode(tokenizer.encode(s)) == s`.

    If `out_dir` is given, also write a complete HF tokenizer directory there (tokenizer.json, tokenizer_config.json
    including the chat template, special_tokens_map.json) that `AutoTokenizer.from_pretrained(out_dir)` loads offline
    with identical ids.

    chat_format='gemma': the same ids with Gemma's special tokens (`<eos>`, `<start_of_turn>`, `<end_of_turn>`) and
    a Gemma-style template (no system role: folded into the first user turn; alternating roles enforced).

    extra_corpus: more training text (e.g. a τ-bench domain's policy and tool schemas), so that a larger vocabulary
    spends about as many tokens per character on that text as a real model's tokenizer does (benchmarks).
    """
    if chat_format not in ("chatml", "gemma"):
        raise ValueError(f"chat_format={chat_format!r} is not one of chatml|gemma")
    names = GEMMA_TOKENS if chat_format == "gemma" else {t: t for t in SPECIAL_TOKENS}
    spec = json.loads(_trained_tokenizer_json(int(vocab_size), tuple(extra_corpus)))
    for added in spec["added_tokens"]:
        added["content"] = names.get(added["content"], added["content"])
    # A new wrapper per call: callers may mutate their tokenizer (padding side, added tokens) without affecting others.
    backend = Tokenizer.from_str(json.dumps(spec))
    # local import: transformers costs ~0.4 s, and every CLI imports this module (runner.building) even when it
    # stops at a configuration error before any tokenizer is built
    import transformers
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=names[ENDOFTEXT],
        pad_token=names[ENDOFTEXT],
        unk_token=None,
        extra_special_tokens=[names[IM_START], names[IM_END]],
        model_max_length=_MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    tokenizer.chat_template = GEMMA_TEMPLATE if chat_format == "gemma" else CHATML_TEMPLATE
    if out_dir is not None:
        save_tiny_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tiny_tokenizer(tokenizer: transformers.PreTrainedTokenizerBase, out_dir: str) -> None:
    """Write `tokenizer` as an HF directory with the chat template inside tokenizer_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    # save_jinja_files=False: keep the template in tokenizer_config.json (what older loaders and Qwen repos use).
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    # transformers 5 no longer writes special_tokens_map.json; write it for older tooling that reads it.
    special = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token,
               "additional_special_tokens": [t for t in tokenizer.all_special_tokens if t != tokenizer.eos_token]}
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump(special, f, indent=2)
        f.write("\n")
