"""Tokenizers and the chat format: loading a model directory's tokenizer (checked before use), rendering and
encoding chats with the model's own template, and the tokens that end an assistant turn."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any
from nlac_jax.storage import fs

# The chat tokens that close an assistant turn in the supported families' templates (ChatML: Qwen2/3; Llama 3;
# Gemma 3), in lookup order; tests check that every family's `turn_end_token` is here or is its eos.
TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
_STOP_TOKENS = TURN_END_TOKENS + ("<|endoftext|>",)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: str | os.PathLike):
    """Load the tokenizer stored in a model directory (HF layout, local or gs://), never touching the hub.

    Returns a `transformers.PreTrainedTokenizerFast` (transformers 5: `TokenizersBackend`).
    Raises FileNotFoundError naming `model_dir` if it holds no tokenizer files.
    """
    model_dir = os.fspath(model_dir)
    if fs.is_remote(model_dir):  # transformers reads local files only: copy the directory's small files once
        return load_tokenizer(fs.local_copy_of_small_files(model_dir))
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"tokenizer directory {model_dir!r} does not exist")
    present = [f for f in _TOKENIZER_FILES if os.path.isfile(os.path.join(model_dir, f))]
    # tokenizer_config.json alone cannot build a tokenizer: require a vocabulary file too.
    if not any(f != "tokenizer_config.json" for f in present):
        raise FileNotFoundError(
            f"no tokenizer files in {model_dir!r} (expected tokenizer.json, or vocab.json + merges.txt, "
            f"or tokenizer.model)"
        )
    if "tokenizer.json" in present:
        check_tokenizer_json(os.path.join(model_dir, "tokenizer.json"))
    from transformers import AutoTokenizer  # local import: keep `import nlac_jax.text` light

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except OSError as e:
        raise OSError(f"could not load the tokenizer from {model_dir!r}: {e}") from e
    except (ValueError, TypeError, KeyError, AttributeError) as e:  # transformers reading a file it did not expect
        raise ValueError(f"could not load the tokenizer from {model_dir!r} ({type(e).__name__}: {e})") from e


def check_tokenizer_json(path: str) -> None:
    """Refuse a tokenizer.json of the wrong shape with one line naming the file and the field, before transformers
    reads it (it indexes fields directly: a missing 'added_tokens' is a bare KeyError there).

    Checks the fields transformers reads itself ('added_tokens': a list of {id: int, content: str}; 'model': an
    object), then parses the whole file with the tokenizers library, the format's own reader (its message gives the
    line and column)."""
    try:
        with open(path, "rb") as f:
            raw = f.read().decode("utf-8")
        spec = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    def kind(v) -> str:  # JSON's name for a parsed value's type
        return {dict: "an object", list: "a list", str: "a string", bool: "a bool", type(None): "null"}.get(
            type(v), "a number")

    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a JSON object, got {kind(spec)}")
    added = spec.get("added_tokens")
    if not isinstance(added, list):
        what = "is missing" if "added_tokens" not in spec else f"is {kind(added)}"
        raise ValueError(f"{path}: field 'added_tokens' {what}; expected a list of {{id, content}} ([] for none)")
    for i, tok in enumerate(added):
        if not isinstance(tok, dict) or not isinstance(tok.get("id"), int) or isinstance(tok.get("id"), bool) \
                or not isinstance(tok.get("content"), str):
            raise ValueError(f"{path}: added_tokens[{i}]={str(tok)[:60]!s} must be an object with an integer 'id' "
                             f"and a string 'content'")
    if not isinstance(spec.get("model"), dict):
        what = "is missing" if "model" not in spec else f"is {kind(spec['model'])}"
        raise ValueError(f"{path}: field 'model' {what}; expected an object (the tokenizer model: type, vocab, ...)")
    import tokenizers  # transformers' own dependency
    try:
        tokenizers.Tokenizer.from_str(raw)
    except Exception as e:  # noqa: BLE001  the Rust parser raises a bare Exception
        raise ValueError(f"{path}: not a tokenizer.json the tokenizers library can read ({e})") from None


def _require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template (tokenizer.chat_template is empty); "
            f"use an instruct/chat model directory or set tokenizer.chat_template"
        )


def render_chat(tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool) -> str:
    """Render `messages` ([{'role': ..., 'content': ...}, ...]) with the tokenizer's own chat template.

    With `add_generation_prompt=True` the string ends with the assistant header (ChatML: `<|im_start|>assistant\\n`),
    ready for the model to write the next turn.
    """
    _require_chat_template(tokenizer)
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    if not isinstance(text, str):  # defensive: some versions return a list for batched input
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, expected str")
    return text


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with no BOS/EOS added (special-token strings inside `text` map to their ids)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_chat(tokenizer, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the rendered chat ([len] ints).

    Rendered to a string first, then encoded with `add_special_tokens=False`: the template already writes every
    special token, and this sidesteps transformers 5's dict return from `apply_chat_template(tokenize=True)`.
    """
    return encode_text(tokenizer, render_chat(tokenizer, messages, add_generation_prompt))


def _token_id(tokenizer, token: str) -> int | None:
    """Id of `token` if it is a single token of this vocabulary (regular or added), else None."""
    tid = tokenizer.get_vocab().get(token)
    return None if tid is None else int(tid)


def stop_token_ids(tokenizer) -> tuple[int, ...]:
    """Ids that end a generation: eos first, then the turn-end tokens (TURN_END_TOKENS) and `<|endoftext|>` where
    present (dedup)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in _STOP_TOKENS:
        if tok in vocab and int(vocab[tok]) not in ids:
            ids.append(int(vocab[tok]))
    return tuple(ids)


def turn_end_token_id(tokenizer) -> int:
    """The token that closes an assistant turn: the first of TURN_END_TOKENS the tokenizer has (`<|im_end|>` ChatML,
    `<|eot_id|>` Llama 3, `<end_of_turn>` Gemma), else eos."""
    for tok in TURN_END_TOKENS:
        tid = _token_id(tokenizer, tok)
        if tid is not None:
            return tid
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer has none of {list(TURN_END_TOKENS)} and no eos token to end a turn")
    return int(tokenizer.eos_token_id)
