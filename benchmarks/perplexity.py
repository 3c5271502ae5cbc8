"""Perplexity of a model on a whole corpus split, with time and peak memory: the README's reference figure.

python benchmarks/perplexity.py                       # default model, wiki validation, window 512
python benchmarks/perplexity.py --model path/or/hub-id --max-length 1024 --device cuda
"""

from __future__ import annotations

import argparse

from labcourse import results
from labkit import bench
from labkit.data import load_corpus
from labkit.evaluate import perplexity
from labkit.models import DEFAULT_MODEL, load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--corpus", default="wiki")
    parser.add_argument("--split", default="validation")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()

    device = bench.as_device(args.device)
    model, tokenizer = load_model(args.model, device=device)
    texts = load_corpus(args.corpus, args.split)
    with bench.track_peak_memory(device) as mem, bench.stopwatch(device) as elapsed:
        result = perplexity(model, tokenizer, texts, max_length=args.max_length)
    saved = results.save_run(
        "perplexity",
        {
            "model": args.model,
            "corpus": args.corpus,
            "split": args.split,
            "documents": len(texts),
            "max_length": args.max_length,
            "perplexity": result.perplexity,
            "tokens": result.tokens,
            "seconds": elapsed.seconds,
            "peak_bytes": mem.peak_bytes,
            "memory_kind": mem.kind,
        },
        root=args.results,
    )
    print(f"{args.model} on {args.corpus}/{args.split} ({len(texts)} documents, window {args.max_length}): {result}")
    print(
        f"{elapsed.seconds:.1f} s, {bench.tokens_per_second(result.tokens, elapsed.seconds):,.0f} tokens/s, "
        f"{mem} on {bench.device_name(device)}"
    )
    print(f"saved {saved}")


if __name__ == "__main__":
    main()
