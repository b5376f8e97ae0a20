"""What one `generate` call returns: `GenerateOutput`, and `finish_rows`, which turns the decode's per-row buffers
into it (stop reasons named, texts decoded without their stop token, stop strings the device could not see cut on
the host).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from nlac_jax.sampling.decode import STOP_REASONS
from nlac_jax.sampling.stop_strings import cut_text, decode_text, host_stop_string_cut

__all__ = ["GenerateOutput", "finish_rows"]


@dataclasses.dataclass
class GenerateOutput:
    """Result of one `generate` call (NumPy; B = number of prompts, N = max_new_tokens).

    tokens [B, N] int32 (0 after the stop), logprobs [B, N] float32 (log π of each token under the model's unmodified
    distribution, 0 after the stop), lengths [B] (generated tokens, stop token included), stop_reason list[str]
    ('stop_token' | 'stop_string' | 'length' | 'context_full'), texts list[str] | None (decoded, without the stop
    token or stop string), prompt_lengths [B] (tokens actually used), prompt_tokens_dropped [B] (truncate_left).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stop_reason: list
    texts: list | None = None
    prompt_lengths: np.ndarray | None = None
    prompt_tokens_dropped: np.ndarray | None = None
    num_steps: int = 0  # token-selection rounds actually run (early exit when every row is done)
    token_slots: int = 0  # row-rounds the compiled code ran (rows x rounds, filler and finished rows included)
    shared_prefix: int = 0  # tokens of the prompts' common prefix, prefilled once for the whole call (0: none)
    prefill_tokens: int = 0  # real prompt tokens prefilled: the shared prefix once, each prompt's rest once
    # prompt slots the prefill executables ran (rows x width: padding, the D data-parallel copies of the shared
    # prefix and filler rows included): the work behind prefill_tokens
    prefill_slots: int = 0

    @property
    def useful_token_fraction(self) -> float:
        """Kept tokens / token slots: 1.0 when no row ever idled (the continuous-batching target)."""
        return float(np.sum(self.lengths)) / max(self.token_slots, 1)

    def token_lists(self) -> list[list[int]]:
        """Generated ids per row, without the masked tail."""
        return [self.tokens[b, : self.lengths[b]].tolist() for b in range(len(self.lengths))]


def finish_rows(tokens, logprobs, lengths, reason, tokenizer=None, stop_strings=(), host_check: bool = False
                ) -> GenerateOutput:
    """A GenerateOutput (tokens, logprobs, lengths, stop_reason, texts) from the decode's rows: tokens [B, N] int32,
    logprobs [B, N] float32, lengths [B], reason [B] (indices into decode.STOP_REASONS). Without a tokenizer, texts
    is None. With one, each row's text is decoded without its stop token; host_check (stop strings the device table
    cannot match) cuts a row at the first stop string found in its decoded text, zeroing its tail."""
    tokens, logprobs, lengths = np.array(tokens), np.array(logprobs), np.array(lengths)
    reasons = [STOP_REASONS[int(r)] for r in reason]
    texts = None
    if tokenizer is not None:
        texts = []
        for b in range(len(reasons)):
            n = int(lengths[b])
            if host_check and reasons[b] != "stop_token":
                cut = host_stop_string_cut(tokenizer, tokens[b, :n].tolist(), stop_strings)
                if cut is not None:
                    n, txt = cut
                    tokens[b, n:] = 0
                    logprobs[b, n:] = 0.0
                    lengths[b] = n
                    reasons[b] = "stop_string"
                    texts.append(txt)
                    continue
            body = tokens[b, : n - 1] if reasons[b] == "stop_token" else tokens[b, :n]
            txt = decode_text(tokenizer, body.tolist())
            texts.append(cut_text(txt, stop_strings) if reasons[b] == "stop_string" else txt)
    return GenerateOutput(tokens=tokens, logprobs=logprobs, lengths=lengths, stop_reason=reasons, texts=texts)
