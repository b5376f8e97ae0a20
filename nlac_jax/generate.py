"""Command-line sampling from a local HF model directory.

    python -m nlac_jax.generate --model_dir DIR (--prompt TEXT | --prompt_file FILE) [--chat] \
        --max_new_tokens N --temperature T [--top_p P] [--top_k K] [--seed S] [--stop STR ...] [--output_json OUT]

--prompt_file: a .jsonl/.json file (each entry a string, {"prompt": str} or {"messages": [...]}) or a plain text file
with one prompt per non-empty line. --chat wraps each prompt as one user turn in the tokenizer's chat template
(entries with "messages" always use it). Prints the generated texts; --output_json writes, per prompt, the prompt,
its ids, the generated ids, the text, per-token logprobs, the length and the stop reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    path = args.prompt_file
    if not os.path.isfile(path):
        raise SystemExit(f"--prompt_file {path}: no such file")
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    if path.endswith(".json"):
        entries = json.loads(raw)
        entries = entries if isinstance(entries, list) else [entries]
    elif path.endswith(".jsonl"):
        entries = [json.loads(line) for line in raw.splitlines() if line.strip()]
    else:
        entries = [line for line in raw.splitlines() if line.strip()]
    if not entries:
        raise SystemExit(f"--prompt_file {path}: no prompts found")
    return entries


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m nlac_jax.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_dir", required=True, help="local HF directory (config.json, safetensors, tokenizer)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompt_file", help=".jsonl/.json of prompts, or a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--top_k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--overflow", default="truncate_left", choices=["truncate_left", "error", "stop"])
    p.add_argument("--output_json", help="write ids, texts, logprobs and stop reasons here")
    args = p.parse_args(argv)

    from nlac_jax import models, sampling, text

    m = models.load_pretrained(args.model_dir, dtype=args.dtype)
    tok = m.tokenizer
    if tok is None:
        raise SystemExit(f"{args.model_dir}: no tokenizer files; this CLI needs a tokenizer to encode text prompts")
    entries = _read_prompts(args)
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
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(records, f, indent=1, ensure_ascii=False)
            f.write("\n")
    return records


if __name__ == "__main__":
    main()
