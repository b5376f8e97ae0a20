"""In-process KV-cache sampler: every NLAC role (policy, successor M_θ̄, evaluator, refiner) samples through here.

    from nlac_jax import sampling
    out = sampling.generate(model, prompts, max_new_tokens=64, temperature=0.0, stop_token_ids=..., seed=0)
    out.tokens [B, N] int32 (0 after the stop), out.logprobs [B, N] float32 (0 after the stop), out.lengths [B],
    out.stop_reason list[str], out.texts list[str] (with a tokenizer)

    sampler = sampling.Sampler(cfg, mesh=mesh)           # the trainer keeps one and calls it with θ or θ̄:
    out = sampler.generate(params_theta, prompts, ...)   # same compiled functions for any params of these shapes

Files
-----
One concern per module; this one holds only these notes and the re-exports.
* `sampler.py`: the public host-side API: `Sampler`, `get_sampler`, `generate` (the jitted functions, run-layout
  weights, buckets and padding, and the start of a call: one batch or continuous batching, from a shared prefix).
* `slots.py`: the decode's host-side slot schedule: refills of free slots, collection of finished rows, the drain's
  compaction to smaller batches (`run_slots`, `half_batch`, `compile_drain`).
* `output.py`: `GenerateOutput`, and `finish_rows` (stop reasons, texts, host-side stop-string cuts).
* `requests.py`: what one call asks for, checked and prepared before anything compiles: argument checks and the
  seed, prompt encoding, the context-overflow policy (`OVERFLOW_POLICIES`), the stop-string table, the shared
  prefix (`shared_prefix_length`, `prefix_to_share`).
* `decode.py`: the compiled decode loop: `DecodeState`, `controls` (the traced settings), `prefill_impl`,
  `decode_impl` (what a Sampler jits), `STOP_REASONS`, `TRACE_COUNTS`.
* The model itself (`models.decoder`) owns the forward pass: `prefill`, `decode_step`, `init_cache`, `lm_head`.
* `select.py`: token selection rules: `select_tokens`, `filter_logits`, `top_k_mask`, `top_p_mask`.
* `stop_strings.py`: stop strings: `token_bytes`, `stop_string_table` (Aho-Corasick -> token-level table),
  `device_stop_table` (cached), `host_stop_string_cut`, `cut_text`, `decode_text`.

Design
------
* Two jitted functions per `Sampler`: `prefill` (the whole left-padded prompt batch in one call, writes the KV cache,
  picks the first token) and `decode` (one `lax.while_loop`; one token per iteration for the whole batch; exits when
  every row is done or the budget is spent; no host sync inside). Parameters are ARGUMENTS of both, never closed
  over. `decode` donates its state, so the cache is updated in place.
* Compile cache: jit's own cache, per Sampler. Static: the model config, mesh and rules (the Sampler), and the bucketed
  shapes (batch bucket, prompt bucket, new-token bucket, number of stop-id slots, stop-string automaton size).
  Traced (changing them never recompiles): parameter values, temperature, top_k, top_p, max_new_tokens (within its
  bucket), stop token ids, stop-string tables (within their size bucket), the PRNG key, the prompts. Greedy is
  `temperature <= 0`, chosen inside the compiled code by `lax.cond` (no second compilation). `TRACE_COUNTS` counts
  traces (tests assert no retrace).
* Layer loop: a model option (`ModelConfig.scan_layers`). On CPU (default `layer_loop='auto'`) the sampler runs the
  model with scan_layers=False: a Python loop over the same `DecoderLayer` modules with a per-layer KV cache; the
  scanned weights are sliced per layer, and gate/up (and q/k/v without tensor parallelism) fused into one matmul
  each, once per parameter tree (`Sampler.run_params`, the last four trees kept), and each layer's cache buffer is
  updated in place. With `nn.scan`, XLA:CPU copies every layer's weights out of the stack on every decode step (2-3x
  the memory traffic). On GPU/TPU 'auto' keeps the scanned decoder; `layer_loop='unrolled'|'scan'` forces either.
* Inference weights: either loop reads the matmul weights in the compute dtype (`decoder.inference_weights`: a bf16
  copy of float32 master weights, made in the same once-per-tree step, sharded as the tree is; bit-identical
  outputs, half the weight bytes a decode step streams). `Sampler.release()` drops the cached trees (the loop does,
  before its train step); `Sampler(weights='master')` reads the trees as given.
* Continuous batching (`generate(..., slots=S)` with more than S prompts): S slots (bucketed); the host refills the
  rows that finished with waiting prompts, R at a time (default S // 8), between decode calls (`decode` returns once
  R more rows are done: `return_when_done`). `refill` prefills R prompts straight into R slots of the running state
  (a scatter into the cache rows); every row keeps its own cache index (`models.decoder.write_slots`) and its own
  column (`lengths`). Executables: `empty`, `refill`, `decode`, whatever the number of prompts. Row randomness
  follows the prompt index (`row_id`), so greedy outputs equal the one-batch path's and sampled ones are
  reproducible for a seed. `GenerateOutput.token_slots` counts row-rounds run; `useful_token_fraction` = kept
  tokens / token_slots. R is its own bucket (not `min_batch_bucket`).
* Drain compaction (`Sampler(compact_levels=L)`, the loop's `LoopConfig.sampler_compact_levels`): once no prompt
  waits (the one-batch path, or the end of a continuous call), `decode` returns when half the rows are done and
  `compact` gathers the running rows (cache rows included) into a batch half as large, up to L times. One `compact`
  and one `decode` executable per level; all levels of a bucket are compiled the first time the bucket is seen, since
  which levels a call reaches depends on its data (no recompilation later).
* n samples per prompt (`generate(..., n=k)`, the NLAC successor's k futures): rows i*k + j, the same rows and
  randomness as the prompt repeated k times, but each prompt is prefilled once and its cache rows copied to its k
  rows (`prefill_impl`/`refill_impl` with `src`); a refill then places whole prompts (k slots each).
* Buckets: batch -> power of two (and a multiple of the data-parallel mesh size); prompt length -> a power of two
  or 1.5x one (`text.bucket_length(fine=True)`: at most a third padding), >= 16; max_new_tokens -> power of two
  >= 16. Filler rows are marked done from the start and dropped. The cache holds prompt bucket + new-token bucket
  slots. Positions come from the attention mask (left padding never shifts RoPE): token c of row b sits at position
  prompt_len[b] + c.
* Shared-prefix cache (`Sampler(min_shared_prefix=64)`, on by default): when a call's prompts (two or more) share a
  common prefix of at least that many tokens (the system prompt and tool schemas of every role's prompt), `prefix`
  prefills `prefix_to_share` of it once (P tokens, unpadded, on D = data-parallel rows) into the first P slots of
  the usual T + N cache, and `prefill` / `refill` start every prompt from a copy of those rows and prefill only its
  rest, left-padded into the next R slots (`models.decoder.extend`; positions continue from the prefix's real
  tokens, so the padded gap never shifts RoPE). R (`Sampler.rest_width`) is the power of two that holds the
  longest rest, capped at T - P: a call whose prompts share 1,536 of 1,600 tokens prefills 64-token rests in 64
  slots, not in the 512 its 2,048-token bucket leaves (the cache keeps its T + N slots, so the decode executables
  do not change; the last T - P - R are never written). R depends on the call's data alone, so a resumed process
  picks what the uninterrupted one did; each new R compiles one prefill (with trunks, their grid fixes the widths
  instead). Greedy outputs equal the unshared path's; sampled rows keep following their prompt's index. P is
  rounded down to 8 lengths per power of two and reuses a length already compiled at the same buckets when one is
  within 3/4 of the common prefix: few, sticky shapes (the loop's no-recompilation test holds). The decode
  executables are the unshared path's (same cache length). Not for sliding-window configs (their window is measured in slots). `GenerateOutput.shared_prefix` / `prefill_tokens` /
  `prefill_slots` say what a call shared, which prompt tokens it computed, and how many slots its prefills ran
  (padding included).
* Across calls (`Sampler(prefix_store=4)`, the default): the last 4 common prefixes (and, with trunks, trunk
  sets) are kept with the parameter tree they were computed under, at their filled slots. A later call with the
  same common prefix under the same tree (an NLAC targets phase: every role's call starts with the environment's
  system prompt; a rollout: every turn) prefills none of it, and one whose prompts share more with kept trunks
  than its own trunks would save (another role over the same episodes' states) starts from them
  (`requests.plan_from_trunks`). Kept caches are fitted to each call's cache length (`decode.fit_impl`, a copy),
  whether kept or just computed, so hits never change what is compiled. `release()` empties the store (the loop
  does, before each train step).
* A rollout's turns (`StartCaches.keep_prompts`, with trunks and the store): a one-batch call that prefilled no trunks
  of its own (one prompt per episode: nothing beyond the common prefix is shared, so no trunk forms) keeps up to
  `trunk_rows` of its prompts (the longest) as a trunk set: their prefilled cache rows, each row's real slots
  moved to the left (`decode.pack_impl`: keys are stored after RoPE and attention reads the mask only, so this
  changes nothing they compute), cut to the common prefix plus the smallest grid width that holds them. The next
  turn's prompts extend these (the action, the new observation), so the next call starts each from its episode's
  row and prefills only what the turn added; it then keeps its own prompts in turn. τ2 retail's gold-script
  rollout (`benchmarks/bench_targets.py`): 38.4% of the prompt tokens presented prefilled with the common prefix
  kept across calls, 12.5% with the turns kept (a perfect prefix cache: 9.9%). A call of one prompt (a single
  episode still runs: nothing to share within the call) starts from the kept trunk set or common prefix it extends
  that holds the most of it (`StartCaches.one_prompt_start`). `pack` compiles once per prefilled-cache shape, the
  first time it is seen. Continuous batching keeps them too: each refill's kept prompts are packed into a G-row set right after the refill
  prefilled them (`decode.keep_into_impl`, before the next decode donates the state).
* Trunks (`Sampler(trunk_rows=8)`, off by default): a prefix tree of depth two per call. `requests.plan_trunks`
  groups the prompts whose rests share at least `min_trunk` more tokens (in an RL targets phase: one episode's
  states), `trunk` prefills each group's longest prompt once after the common prefix (`trunk_rows` rows), and
  every prompt starts from its trunk's row with the row's later tokens masked (`decode.prefix_rows`), keeping its
  common prefix with the trunk; its rest is prefilled in the call's own prompt bucket minus a width of the grid
  (two widths per power of two, `requests.trunk_grid`): the widest grid value from the trunks' width up that still
  holds every rest (`starts._widest`), so short rests take few slots, and only widths whose prefill the grid
  compiled (trunk rows no group takes go to the longest prompts in no group, as groups of one, so that a long lone
  prompt does not cap every trunk's width). Equal outputs as above. The width a call takes
  depends on its data, so the first call of two or more prompts at a bucket compiles the trunk and prefill
  executables of every grid width there (lowered only; one trunk run on placeholder rows): no later call at that
  bucket compiles, and a plan never depends on what the process compiled before. Continuous batching's refills
  compile every rest width of the grid the first time a call's slot and refill shapes are seen
  (`StartCaches.compile_refills`; the loop runs continuous calls whenever a call has more prompts than
  `LoopConfig.sampler_max_batch`, e.g. a pod's 256-episode rollouts through 32-row calls).
* Sampling (`select_tokens`): greedy = argmax (first index on ties, like torch). Otherwise logits / temperature,
  then top-k, then top-p on the renormalised top-k distribution (transformers' order), then Gumbel-max with a key
  folded from (call key, column, row): reproducible for a given key, independent of the batch bucket.
  top-k and top-p never sort the vocabulary. Fast path: `lax.top_k` (a partial selection) of the 128 best logits;
  the top-k cut-off is the k-th of them and the top-p cut-off is the first candidate whose cumulative probability
  (normalised over the whole top-k-filtered row) reaches p. It is used only when it is provably the exact answer
  for every row (k <= 128 and the candidates' mass reaches p); otherwise that step falls back (lax.cond) to exact
  32-step bisections over the float32 bit patterns of the logits (order-preserving uint32 keys; one [B, V]
  compare+reduce per step). Semantics: top-k keeps every token whose logit is >= the k-th largest (ties at the k-th
  all kept); top-p keeps the smallest set of most-likely tokens whose probability mass reaches p (ties at the edge
  all kept; masses are float32 sums). At least one token always survives. Nothing is computed when both filters are
  off.
* log-probabilities: `out.logprobs` are log π(token) under the model's UNMODIFIED distribution (temperature 1, no
  top-k/top-p), i.e. what the trainer recomputes for the policy; 0 after the stop.
* Stop tokens: any of `stop_token_ids`; the stop token is kept in `tokens` (and counted in `lengths`) but not in
  `texts`. Default: the tokenizer's `text.stop_token_ids` (eos, <|im_end|>, <|endoftext|>...), else the config's eos.
* Stop strings are detected ON DEVICE, exactly, so a row stops at the token that completes a stop string and the
  loop exits early when all rows are done: for byte-level BPE tokenizers (Qwen2, Llama 3, SmolLM, GPT-2) the decoded
  text is the concatenation of the tokens' bytes (special tokens decode to nothing), so an Aho-Corasick automaton over
  the stop strings' UTF-8 bytes is precomputed on the host into a token-level table `next_state[state, token]`
  (+ a "matched" bit) — one gather per row per step. For other tokenizers (no verified byte-level decoder) the check
  runs on the host after generation (binary search for the shortest token prefix whose text contains a stop string;
  exact, but no early exit). Either way: tokens up to and including the completing token are kept, `texts` are cut
  before the stop string, and stop_reason is 'stop_string'.
* stop_reason per row: 'stop_token', 'stop_string', 'length' (max_new_tokens reached), 'context_full' (the row
  reached the model context, overflow='stop' only). Priority when several hold at one token: that order.
* Context overflow (prompt + max_new_tokens > context = cfg.max_position_embeddings unless `max_context` is given):
    overflow='truncate_left' (default): drop the oldest prompt tokens so that prompt + max_new_tokens == context;
        `out.prompt_tokens_dropped[b]` says how many (and a warning is logged). Refused if max_new_tokens >= context.
    overflow='error': ValueError naming the prompt, its length, max_new_tokens and the context.
    overflow='stop': keep the prompt (refused if it alone fills the context) and end that row with 'context_full'
        when prompt + generated reaches the context.
"""

from nlac_jax.sampling.decode import (MIN_STOP_SLOTS, STOP_REASONS, TRACE_COUNTS, DecodeState, controls, decode_impl,
                                      prefill_impl)
from nlac_jax.sampling.requests import (OVERFLOW_POLICIES, TrunkPlan, plan_from_trunks, plan_trunks, prefix_to_share,
                                        shared_prefix_length, trunk_grid)
from nlac_jax.sampling.output import GenerateOutput
from nlac_jax.sampling.sampler import Sampler, generate, get_sampler
from nlac_jax.sampling.select import filter_logits, select_tokens, top_k_mask, top_p_mask
from nlac_jax.sampling.stop_strings import (cut_text, decode_text, device_stop_table, host_stop_string_cut,
                                            stop_string_table, token_bytes)

__all__ = [
    "GenerateOutput", "Sampler", "generate", "get_sampler", "OVERFLOW_POLICIES", "shared_prefix_length", "prefix_to_share", "plan_trunks", "plan_from_trunks", "TrunkPlan", "trunk_grid",
    "STOP_REASONS", "TRACE_COUNTS", "DecodeState", "controls", "prefill_impl", "decode_impl", "MIN_STOP_SLOTS",
    "select_tokens", "filter_logits", "top_k_mask", "top_p_mask",
    "token_bytes", "stop_string_table", "device_stop_table", "host_stop_string_cut", "cut_text", "decode_text",
]
