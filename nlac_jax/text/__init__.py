"""Text: tokenizers and the chat format, the one prompt-fitting rule, and the static-shape rules for token arrays.

    from nlac_jax import text
    tok = text.load_tokenizer(model_dir)                         # checked: a chat template, a turn-end token
    ids = text.encode_chat(tok, messages)                        # the model's own chat template, generation prompt
    fitter = text.PromptFitter(tok, budgets, max_len)            # elide whole middle messages to fit a budget
    T = text.bucket_length(n, maximum=max_len, fine=True)        # the one bucketing rule (prompts, batches)

Files: `tokenizer.py` (loading, chat rendering and encoding, stop and turn-end tokens), `fitting.py` (`PromptFitter`,
`elide_messages`, `PromptTooLongError`), `shapes.py` (`bucket_length`, `bucket_floor`, `common_prefix_length`, `left_pad`). This module holds
only these notes and the re-exports. Examples and their packing into train batches are the train step's input
contract: `training/batching.py`.
"""

from nlac_jax.text.fitting import (ELISION_MARKER, FIT_HINT, FitCounters, PromptFitter, PromptTooLongError,
                                   elide_messages, elision_cuts)
from nlac_jax.text.shapes import bucket_floor, bucket_length, common_prefix_length, left_pad
from nlac_jax.text.tokenizer import (TURN_END_TOKENS, check_tokenizer_json, encode_chat, encode_text, load_tokenizer,
                                     render_chat, stop_token_ids, turn_end_token_id)

__all__ = ["ELISION_MARKER", "FIT_HINT", "FitCounters", "PromptFitter", "PromptTooLongError", "elide_messages",
           "elision_cuts", "bucket_floor", "bucket_length", "common_prefix_length", "left_pad", "TURN_END_TOKENS", "check_tokenizer_json",
           "encode_chat", "encode_text", "load_tokenizer", "render_chat", "stop_token_ids", "turn_end_token_id"]
