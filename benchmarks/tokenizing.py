"""Tokenizing a corpus: meshwise's worker processes against the tokenizers library's threads.

Both sides encode the same documents (by default the standard library's ``.py``
sources, the default training corpus) with the same ``tokenizer.json``:

- meshwise: ``meshwise.data.corpus.build_token_file`` with N worker processes, the
  path of ``meshwise data prepare`` (plan, encode, write the file in order);
- tokenizers: ``Tokenizer.encode_batch_fast`` over every document at once, with
  its Rayon pool of N threads (``RAYON_NUM_THREADS``), in a fresh process per N;
  it writes nothing.

Times are medians of ``--repeats`` runs taken in turn, measured inside each
process (interpreter start-up excluded, meshwise's pool start-up included).
The last line holds the ratios (meshwise / tokenizers time; below 1 is faster).

    python benchmarks/tokenizing.py                  # trains an 8,000-token BPE first
    python benchmarks/tokenizing.py --tokenizer tokenizer.json --workers 1,2,4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from benchmarks.common import median, print_json
from meshwise.data.bpe import save_tokenizer, train_bpe
from meshwise.data.corpus import build_token_file
from meshwise.data.files import list_files
from meshwise.data.tokenizer import load_tokenizer

# Runs in a fresh process, so RAYON_NUM_THREADS sizes the pool it creates.
_REFERENCE = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
texts = [open(p, "rb").read().decode("utf-8", "replace") for p in json.load(open(sys.argv[2]))]
start = time.perf_counter()
ids = tok.encode_batch_fast(texts, add_special_tokens=False)
print(time.perf_counter() - start, sum(len(e.ids) for e in ids))
"""


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [root / rel for rel in list_files(root, ".py", frozenset({"site-packages",
                                                                     "__pycache__"}))]


def _reference(tokenizer: Path, files_json: Path, threads: int) -> tuple[float, int]:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    out = subprocess.run([sys.executable, "-c", _REFERENCE, str(tokenizer), str(files_json)],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: a BPE trained here)")
    parser.add_argument("--workers", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    files = _stdlib_files()
    mbytes = sum(f.stat().st_size for f in files) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = Path(args.tokenizer or Path(tmp) / "tokenizer.json")
        if not args.tokenizer:
            modules = [f for f in files if f.name in ("typing.py", "inspect.py", "argparse.py")]
            save_tokenizer(train_bpe([f.read_text() for f in modules], 8000), tok_path)
        files_json = Path(tmp) / "files.json"
        files_json.write_text(json.dumps([str(f) for f in files]))
        tokenizer = load_tokenizer(tok_path)
        summary = {"corpus_mb": round(mbytes, 1), "files": len(files), "workers": {}}
        for n in [int(w) for w in args.workers.split(",")]:
            ours, theirs = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                stats = build_token_file(Path(tmp) / "out.bin", files, tokenizer, "bench", n)
                ours.append(time.perf_counter() - start)
                seconds, num_tokens = _reference(tok_path, files_json, n)
                theirs.append(seconds)
            # The file also holds one separator between each two documents.
            same = stats["num_tokens"] == num_tokens + len(files) - 1
            row = {"meshwise_s": round(median(ours), 2), "tokenizers_s": round(median(theirs), 2),
                   "meshwise_mb_s": round(mbytes / median(ours), 2),
                   "tokenizers_mb_s": round(mbytes / median(theirs), 2),
                   "ratio": round(median(ours) / median(theirs), 2), "same_tokens": same}
            print(f"{n} worker(s): meshwise {row['meshwise_s']} s ({row['meshwise_mb_s']} MB/s), "
                  f"tokenizers threads {row['tokenizers_s']} s ({row['tokenizers_mb_s']} MB/s), "
                  f"ratio {row['ratio']}, same tokens: {same}", flush=True)
            summary["workers"][n] = row
    print_json(summary)


if __name__ == "__main__":
    main()
