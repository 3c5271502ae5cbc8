"""Own byte-level BPE against Hugging Face `tokenizers`, side by side on the same corpus: training and
encoding throughput (MB/s of UTF-8 text), their ratio, and whether the merges agree.

    python benchmarks/tokenizer.py --vocab-size 4096 --documents 100000
"""

from __future__ import annotations

import argparse

from labcourse import results
from labkit import bench
from labkit.bpe import hf_merges, train_bpe, train_hf_bpe
from labkit.data import load_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--documents", type=int, default=100_000, help="train-split documents (all by default)")
    parser.add_argument("--repeats", type=int, default=3, help="encoding repeats (the median is reported)")
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()

    texts = load_corpus("wiki", "train")[: args.documents]
    held_out = load_corpus("wiki", "validation")
    mb_train = sum(len(t.encode("utf-8")) for t in texts) / 1e6
    mb_eval = sum(len(t.encode("utf-8")) for t in held_out) / 1e6

    with bench.stopwatch() as own_train:
        own = train_bpe(texts, args.vocab_size, progress=False)
    with bench.stopwatch() as lib_train:
        lib = train_hf_bpe(texts, args.vocab_size)
    same = own.merges == hf_merges(lib)

    def own_encode():
        own._cache.clear()  # time real work, not the pre-token cache of the previous repeat
        for t in held_out:
            own.encode(t)

    own_enc = bench.time_fn(own_encode, warmup=0, repeats=args.repeats)
    lib_enc = bench.time_fn(lambda: lib.encode_batch(held_out), warmup=1, repeats=args.repeats)
    lib_enc_1 = bench.time_fn(lambda: [lib.encode(t) for t in held_out], warmup=1, repeats=args.repeats)

    rows = {
        "train MB/s": (mb_train / own_train.seconds, mb_train / lib_train.seconds),
        "encode MB/s (one text at a time)": (mb_eval / own_enc.median, mb_eval / lib_enc_1.median),
        "encode MB/s (library batch, all cores)": (None, mb_eval / lib_enc.median),
    }
    print(
        f"corpus: {len(texts)} documents, {mb_train:.2f} MB to train, {mb_eval:.2f} MB to encode; "
        f"vocab {args.vocab_size}; merges identical: {same}; on {bench.device_name('cpu')}"
    )
    print(f"{'':<40} {'labkit':>10} {'tokenizers':>11} {'ratio':>8}")
    for name, (mine, theirs) in rows.items():
        ratio = f"{theirs / mine:>7.1f}x" if mine else "       -"
        print(f"{name:<40} {mine or float('nan'):>10.3f} {theirs:>11.3f} {ratio}")
    results.save_run(
        "tokenizer",
        {
            "vocab_size": args.vocab_size,
            "documents": len(texts),
            "merges_identical": same,
            **{k: list(v) for k, v in rows.items()},
        },
        root=args.results,
    )


if __name__ == "__main__":
    main()
