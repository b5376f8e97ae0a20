"""Command-line sampling from a local HF model directory.

    python -m nlac_jax.generate --model_dir DIR (--prompt TEXT | --prompt_file FILE) [--chat]
        --max_new_tokens N --temperature T [--top_p P] [--top_k K] [--seed S] [--stop STR ...] [--output_json OUT]

--prompt_file: a .jsonl/.json file (each entry a string, {"prompt": str} or {"messages": [...]}) or a plain text file
with one prompt per non-empty line. --chat wraps each prompt as one user turn in the tokenizer's chat template
(entries with "messages" always use it). Prints the generated texts; --output_json writes, per prompt, the prompt,
its ids, the generated ids, the text, per-token logprobs, the length and the stop reason.

Exit codes: 0 done; 2 usage error (a bad flag value, no such --model_dir or --prompt_file, a malformed prompt file,
a tokenizer that does not fit the model); 1 any other error; --debug shows the full traceback instead of one line.
"""

from __future__ import annotations

import json
import sys
import time

from nlac_jax.cli import common as cli
from nlac_jax.storage import fs

PROG = "python -m nlac_jax.generate"


def _read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    path = cli.require_file(args.prompt_file, "--prompt_file")
    raw = fs.read_text(path)
    try:
        if path.endswith(".json"):
            entries = json.loads(raw)
            entries = entries if isinstance(entries, list) else [entries]
        elif path.endswith(".jsonl"):
            entries = []
            for n, line in enumerate(raw.splitlines(), 1):
                if line.strip():
                    entries.append(json.loads(line))
        else:
            entries = [line for line in raw.splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        where = f"line {n}" if path.endswith(".jsonl") else f"line {e.lineno}"
        raise cli.UsageError(f"--prompt_file {path}: {where}: not valid JSON ({e.msg})") from None
    if not entries:
        raise cli.UsageError(f"--prompt_file {path}: no prompts found")
    for i, e in enumerate(entries):
        if not (isinstance(e, str) or (isinstance(e, dict) and ("prompt" in e or "messages" in e))):
            raise cli.UsageError(f"--prompt_file {path}: entry {i} is {type(e).__name__} {str(e)[:60]!r}; expected "
                                 f"a string, {{\"prompt\": str}} or {{\"messages\": [...]}}")
    return entries


def build_parser() -> cli.ArgumentParser:
    """The generate CLI's parser (values are range-checked here: a bad one is refused before the model loads)."""
    p = cli.ArgumentParser(prog=PROG, description=__doc__)
    p.add_argument("--model_dir", required=True, metavar="DIR",
                   help="local HF model directory (config.json, *.safetensors, tokenizer files)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (text)")
    src.add_argument("--prompt_file", metavar="FILE",
                     help=".jsonl/.json of prompts (strings, {\"prompt\": ...} or {\"messages\": [...]}), or a text "
                          "file with one prompt per non-empty line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as one user turn in the chat template")
    p.add_argument("--max_new_tokens", type=cli.int_at_least(1), default=64, metavar="N",
                   help="tokens to generate per prompt at most (>= 1; default 64)")
    p.add_argument("--temperature", type=cli.finite_at_least(0.0), default=0.0, metavar="T",
                   help="sampling temperature (>= 0; 0 = greedy, the default)")
    p.add_argument("--top_p", type=cli.float_in(0.0, 1.0, lo_open=True), default=1.0, metavar="P",
                   help="nucleus sampling mass in (0, 1] (1 = off, the default)")
    p.add_argument("--top_k", type=cli.int_at_least(0), default=0, metavar="K",
                   help="sample among the K most likely tokens (>= 0; 0 = off, the default)")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed of the sampler (default 0)")
    p.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop string: a row ends where it appears (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute and weight dtype (default float32)")
    p.add_argument("--overflow", default="truncate_left", choices=["truncate_left", "error", "stop"],
                   help="a prompt that leaves no room for max_new_tokens in the context: drop its first tokens "
                        "(default), refuse it, or generate until the context is full")
    p.add_argument("--output_json", metavar="OUT",
                   help="write, per prompt, the prompt, its ids, the generated ids, text, logprobs, length and stop "
                        "reason here")
    return p


def parse_flags(argv=None):
    """The generate CLI's flags."""
    return build_parser().parse_args(argv)


def main(argv=None) -> list[dict]:
    """The generate CLI (see the module docstring); returns the records. Errors propagate (run through `cli.run`
    for one-line errors)."""
    args = parse_flags(argv)
    cli.require_dir(args.model_dir, "--model_dir")
    if not fs.isfile(fs.join(args.model_dir, "tokenizer.json")):  # load_pretrained's tokenizer rule
        raise cli.UsageError(f"--model_dir {args.model_dir}: no tokenizer.json; this CLI needs the tokenizer to "
                             f"encode text prompts")
    if args.output_json:  # fail now, not after the generation
        out_dir = fs.dirname(fs.abspath(args.output_json))
        if not fs.is_remote(out_dir):  # a gs:// prefix exists as soon as the file is written
            cli.require_dir(out_dir, "--output_json (its directory)")
    entries = _read_prompts(args)

    from nlac_jax import models, sampling, text

    m = models.load_pretrained(args.model_dir, dtype=args.dtype)  # refuses a tokenizer that does not fit
    tok = m.tokenizer
    prompt_ids, shown = [], []
    for e in entries:
        if isinstance(e, dict) and "messages" in e:
            prompt_ids.append(text.encode_chat(tok, e["messages"]))
            shown.append(e["messages"])
            continue
        s = e["prompt"] if isinstance(e, dict) else str(e)
        ids = text.encode_chat(tok, [{"role": "user", "content": s}]) if args.chat else text.encode_text(tok, s)
        prompt_ids.append(ids)
        shown.append(s)

    t0 = time.perf_counter()
    out = sampling.generate(m, prompt_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, stop_strings=tuple(args.stop), seed=args.seed,
                            tokenizer=tok, overflow=args.overflow)
    dt = time.perf_counter() - t0
    records = []
    for b, ids in enumerate(out.token_lists()):
        records.append({"prompt": shown[b], "prompt_ids": prompt_ids[b], "ids": ids, "text": out.texts[b],
                        "logprobs": [float(x) for x in out.logprobs[b, : len(ids)]], "length": int(out.lengths[b]),
                        "stop_reason": out.stop_reason[b],
                        "prompt_tokens_dropped": int(out.prompt_tokens_dropped[b])})
        print(f"--- [{b}] ({out.stop_reason[b]}, {len(ids)} tokens)\n{out.texts[b]}")
    print(f"--- {sum(len(r['ids']) for r in records)} tokens in {dt:.2f}s (including compilation)", file=sys.stderr)
    if args.output_json:
        fs.write_atomic(args.output_json, json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    return records
