"""Sample text from a trained run (nanoGPT's sample.py, for ballast runs).

    python -m sample runs/<run> --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 50 \
        --top-p 0.9 --seed 1 --num-samples 2 [--checkpoint runs/<run>/checkpoints/step_000400]

The run's config.yaml rebuilds the model and its tokenizer (data=text: byte, char or BPE, rebuilt from the
run's data exactly as training built it); the weights are the latest complete checkpoint, or --checkpoint.
Synthetic data has no text: its vocabulary is id 0 = PAD, then per source a BOS id followed by that
source's alphabet; the prompt is space-separated ids or a source name (its BOS), and samples print as ids.

Decoding uses a KV cache (model/generate.py; per layer it holds B·T·2·n_kv_heads·head_dim numbers, T =
model.seq_len; only attention is cached, dense and MoE MLPs act per token). Same seed, same samples:
draws come from one seeded CPU generator, and --no-cache gives the same ids (checked by the tests).
"""
from __future__ import annotations

import argparse
import sys


def encode_prompt(dataset, prompt: str) -> list[int]:
    if hasattr(dataset, "tokenizer"):
        try:
            ids = dataset.tokenizer.encode(prompt).tolist()
        except ValueError as e:  # a char vocabulary without one of the prompt's characters
            raise ValueError(f"--prompt: {str(e).removeprefix('data.tokenizer=char: ')} "
                             f"(the run's char vocabulary has {dataset.vocab_size} characters)") from None
        if not ids:
            raise ValueError("--prompt: empty (give at least one character)")
        return ids
    names = list(dataset.source_names)
    if prompt in names:
        return [int(dataset.bos_ids[names.index(prompt)])]
    try:
        ids = [int(t) for t in prompt.split()]
    except ValueError:
        raise ValueError(f"--prompt={prompt!r}: synthetic data has no text; give space-separated token ids "
                         f"or a source name ({', '.join(names)})") from None
    bad = [i for i in ids if not 0 <= i < dataset.vocab_size]
    if not ids or bad:
        raise ValueError(f"--prompt={prompt!r}: ids must be in [0, {dataset.vocab_size})")
    return ids


def decode(dataset, ids: list[int]) -> str:
    if hasattr(dataset, "tokenizer"):
        return dataset.tokenizer.decode(ids)
    return " ".join(map(str, ids))


def vocabulary_note(dataset) -> str:
    if hasattr(dataset, "tokenizer"):
        return f"tokenizer {dataset.tokenizer.name}, vocab {dataset.vocab_size}"
    ranges = ", ".join(f"{n}: BOS {r.start}, alphabet {r.start + 1}..{r.stop - 1}"
                       for n, r in zip(dataset.source_names, dataset.token_ranges()))
    return f"synthetic ids (0 = PAD; {ranges})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sample", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--prompt", default=None, help="default: a newline (text) or the first source's BOS (synthetic)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: the run's latest)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole prefix every token")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.max_new_tokens < 0 or args.num_samples < 1:
        print("sample: --max-new-tokens must be >= 0 and --num-samples >= 1", file=sys.stderr)
        return 2
    try:
        import torch

        from checkpoint.load import load_model
        from model.generate import generate

        model, ds, path, _ = load_model(args.run_dir, args.checkpoint, args.device)
        prompt = args.prompt if args.prompt is not None else ("\n" if hasattr(ds, "tokenizer") else ds.source_names[0])
        ids = encode_prompt(ds, prompt)
        prompt_BT = torch.tensor([ids] * args.num_samples, dtype=torch.int64, device=model.tok_emb.weight.device)
        out_BT = generate(model, prompt_BT, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                          args.seed, use_cache=not args.no_cache)
    except ValueError as e:
        print(f"sample: {e}", file=sys.stderr)
        return 2
    print(f"# {path} | {vocabulary_note(ds)} | seed {args.seed}, temperature {args.temperature}, "
          f"top_k {args.top_k}, top_p {args.top_p}")
    for i, row in enumerate(out_BT.tolist()):
        print(f"--- sample {i}\n{decode(ds, row)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
