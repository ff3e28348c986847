"""Tokenizing a corpus: meshwise's worker processes against the tokenizers library's threads.

Both sides encode the same documents with the same ``tokenizer.json`` (by
default an 8,000-token BPE trained here first):

- ``--corpus stdlib`` (default): the standard library's ``.py`` sources, each
  file a document. meshwise: ``meshwise.data.corpus.build_token_file`` with N
  worker processes (plan, encode, write the file in order); tokenizers:
  ``Tokenizer.encode_batch_fast`` over every document at once. Times measured
  inside each process (interpreter start-up excluded).
- ``--corpus jsonl``: a JSON-lines file of ``--jsonl-gb`` GB (made once at
  ``--jsonl-path`` from the standard library's sources, each record a few KB of
  text under ``"text"``), each record a document. meshwise: the whole
  ``meshwise data prepare FILE --workers N`` command, timed from outside, its
  process tree's memory sampled from ``/proc`` every 250 ms (peak resident set of
  the main process and of the largest worker, and the peak of the tree's summed
  proportional set: shared pages counted once); tokenizers: the texts parsed
  first (not timed), then ``encode_batch_fast`` over batches of 4,096 records.

tokenizers runs its Rayon pool of N threads (``RAYON_NUM_THREADS``) in a fresh
process per N and writes nothing. Times are medians of ``--repeats`` runs taken
in turn; the last line holds the ratios (meshwise / tokenizers time; below 1 is
faster).

    python benchmarks/tokenizing.py
    python benchmarks/tokenizing.py --tokenizer tokenizer.json --workers 1,2,4
    python benchmarks/tokenizing.py --corpus jsonl --jsonl-gb 1 --workers 2
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.common import median, print_json  # noqa: E402
from meshwise.data.bpe import save_tokenizer, train_bpe  # noqa: E402
from meshwise.data.corpus import build_token_file  # noqa: E402
from meshwise.data.files import list_files  # noqa: E402
from meshwise.data.tokenizer import load_tokenizer  # noqa: E402

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


_REFERENCE_JSONL = """
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
with open(sys.argv[2], "rb") as f:
    texts = [json.loads(line)["text"] for line in f if line.strip()]
start, num_tokens = time.perf_counter(), 0
for i in range(0, len(texts), 4096):
    num_tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 4096],
                                                                add_special_tokens=False))
print(time.perf_counter() - start, num_tokens, len(texts))
"""
_SAMPLE_S = 0.25  # /proc/PID/smaps_rollup walks the page tables: not too often


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        root / rel for rel in list_files(root, ".py", frozenset({"site-packages", "__pycache__"}))
    ]


def _reference(tokenizer: Path, data: Path, threads: int, script: str = _REFERENCE) -> tuple:
    """The seconds tokenizers took, and the counts it printed, in a fresh process."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    out = subprocess.run(
        [sys.executable, "-c", script, str(tokenizer), str(data)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return (float(out[0]), *map(int, out[1:]))


def _write_jsonl(path: Path, size_bytes: int) -> None:
    """Records of a few KB cut from the standard library's sources at blank lines, the
    sources repeated (each round numbered) until ``size_bytes``."""
    chunks = [c for f in _stdlib_files() for c in f.read_text(errors="replace").split("\n\n\n")]
    tmp = path.with_name(path.name + ".tmp")
    written, round_ = 0, 0
    with open(tmp, "w") as out:
        while written < size_bytes:
            for i, chunk in enumerate(chunks):
                line = json.dumps({"id": f"{round_}-{i}", "text": chunk}) + "\n"
                out.write(line)
                written += len(line)
                if written >= size_bytes:
                    break
            round_ += 1
    tmp.replace(path)


def _tree(pid: int) -> list[int]:
    """``pid`` and every descendant (``/proc/PID/task/PID/children``)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            todo += [
                int(c) for c in Path(f"/proc/{current}/task/{current}/children").read_text().split()
            ]
        except OSError:
            pass
    return found


def _kib(path: str, field: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _measured(command: list[str]) -> dict:
    """Run ``command``; its wall time and its process tree's peak memory (MiB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    main_hwm = worker_hwm = tree_pss = 0
    while proc.poll() is None:
        pids = _tree(proc.pid)
        hwms = [_kib(f"/proc/{pid}/status", "VmHWM") for pid in pids]
        main_hwm = max(main_hwm, hwms[0])
        worker_hwm = max([worker_hwm] + hwms[1:])
        tree_pss = max(tree_pss, sum(_kib(f"/proc/{pid}/smaps_rollup", "Pss") for pid in pids))
        time.sleep(_SAMPLE_S)
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(command)} failed: {err.strip()}")
    return {
        "seconds": time.perf_counter() - start,
        "main_rss_mib": main_hwm / 1024,
        "worker_rss_mib": worker_hwm / 1024,
        "tree_pss_mib": tree_pss / 1024,
        "output": out.strip(),
    }


def _jsonl_bench(args, tok_path: Path, tmp: str) -> dict:
    path = Path(args.jsonl_path or f"/tmp/meshwise-bench-{args.jsonl_gb:g}gb.jsonl")
    size = int(args.jsonl_gb * 1e9)
    if not path.exists() or path.stat().st_size < size:
        print(f"writing {path} ({args.jsonl_gb:g} GB) ...", flush=True)
        _write_jsonl(path, size)
    mbytes = path.stat().st_size / 1e6
    summary = {"corpus": str(path), "corpus_mb": round(mbytes, 1), "workers": {}}
    for n in [int(w) for w in args.workers.split(",")]:
        ours, theirs = [], []
        for _ in range(args.repeats):
            out = Path(tmp) / "out.bin"
            ours.append(
                _measured(
                    [
                        sys.executable,
                        "-m",
                        "meshwise",
                        "data",
                        "prepare",
                        str(path),
                        "--out",
                        str(out),
                        "--tokenizer",
                        str(tok_path),
                        "--workers",
                        str(n),
                    ]
                )
            )
            seconds, num_tokens, records = _reference(tok_path, path, n, _REFERENCE_JSONL)
            theirs.append(seconds)
        written = out.stat().st_size // 2  # uint16: an 8,000-token vocabulary
        same = written == num_tokens + records - 1  # and a separator between two records
        t_ours, t_theirs = median(r["seconds"] for r in ours), median(theirs)
        row = {
            "meshwise_s": round(t_ours, 1),
            "tokenizers_s": round(t_theirs, 1),
            "meshwise_mb_s": round(mbytes / t_ours, 1),
            "tokenizers_mb_s": round(mbytes / t_theirs, 1),
            "ratio": round(t_ours / t_theirs, 2),
            "same_tokens": same,
            **{
                key: round(max(r[key] for r in ours))
                for key in ("main_rss_mib", "worker_rss_mib", "tree_pss_mib")
            },
        }
        print(
            f"{n} worker(s): meshwise data prepare {row['meshwise_s']} s "
            f"({row['meshwise_mb_s']} MB/s; peak RSS main {row['main_rss_mib']} MiB, "
            f"largest worker {row['worker_rss_mib']} MiB, tree PSS {row['tree_pss_mib']} "
            f"MiB), tokenizers threads {row['tokenizers_s']} s ({row['tokenizers_mb_s']} "
            f"MB/s), ratio {row['ratio']}, same tokens: {same}",
            flush=True,
        )
        summary["workers"][n] = row
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", help="a tokenizer.json (default: a BPE trained here)")
    parser.add_argument("--workers", default="1,2", help="comma-separated process counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--corpus", choices=("stdlib", "jsonl"), default="stdlib")
    parser.add_argument("--jsonl-gb", type=float, default=1.0, help="--corpus jsonl: its size")
    parser.add_argument(
        "--jsonl-path",
        help="--corpus jsonl: where it is (made if missing; "
        "default /tmp/meshwise-bench-SIZEgb.jsonl)",
    )
    args = parser.parse_args()
    files = _stdlib_files()
    mbytes = sum(f.stat().st_size for f in files) / 1e6
    with tempfile.TemporaryDirectory() as tmp:
        tok_path = Path(args.tokenizer or Path(tmp) / "tokenizer.json")
        if not args.tokenizer:
            modules = [f for f in files if f.name in ("typing.py", "inspect.py", "argparse.py")]
            save_tokenizer(train_bpe([f.read_text() for f in modules], 8000), tok_path)
        if args.corpus == "jsonl":
            print_json(_jsonl_bench(args, tok_path, tmp))
            return
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
            row = {
                "meshwise_s": round(median(ours), 2),
                "tokenizers_s": round(median(theirs), 2),
                "meshwise_mb_s": round(mbytes / median(ours), 2),
                "tokenizers_mb_s": round(mbytes / median(theirs), 2),
                "ratio": round(median(ours) / median(theirs), 2),
                "same_tokens": same,
            }
            print(
                f"{n} worker(s): meshwise {row['meshwise_s']} s ({row['meshwise_mb_s']} MB/s), "
                f"tokenizers threads {row['tokenizers_s']} s ({row['tokenizers_mb_s']} MB/s), "
                f"ratio {row['ratio']}, same tokens: {same}",
                flush=True,
            )
            summary["workers"][n] = row
    print_json(summary)


if __name__ == "__main__":
    main()
