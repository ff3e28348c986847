"""Every rank must run the same job: under torchrun each node parses its own command line,
so ranks compare fingerprints of their configuration, run state, token file and
meshwise's source (contents, not paths) and stop naming the first key that differs.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from pathlib import Path

from meshwise.checkpoint.store import complete_checkpoints
from meshwise.comm import ops
from meshwise.train.run_state import record

# Fields that may differ between nodes: where things are, how much is printed.
PER_NODE = {
    "data.path",
    "data.cache_dir",
    "data.tokenizer",
    "runtime.metrics",
    "runtime.quiet",
    "runtime.log_every",
    "checkpoint.save",
    "checkpoint.resume",
    "model.init_from",
    "checkpoint.run_id",
    # only the logging rank logs; each rank profiles for itself
    "runtime.log_to",
    "runtime.log_dir",
    "runtime.run_name",
    "runtime.project",
    "runtime.profile_steps",
    "runtime.profile_dir",
}
_SAMPLE_BYTES = 1 << 20


class ConfigMismatch(RuntimeError):
    """Ranks were started with different configurations, data or code."""


def fingerprint(cfg, run, data_path: str | Path) -> dict:
    """Flat ``section.field -> value`` of ``cfg`` with ``run``'s facts (a ``RunState``),
    plus digests of the data and the code."""
    flat = {}
    for section, values in record(cfg, run)["config"].items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if name not in PER_NODE:
                flat[name] = value
    flat["data file"] = _file_digest(str(data_path))
    flat["meshwise code"] = _code_digest()
    save = cfg.checkpoint.save
    flat["--save holding"] = [p.name for p in complete_checkpoints(save)] if save else None
    return flat


def check_same_job(cfg, run, data_path, world: ops.Group) -> None:
    """Raise ``ConfigMismatch`` on every rank if any rank's fingerprint differs from rank 0's."""
    everyone = ops.all_gather_object(fingerprint(cfg, run, data_path), world, category="check")
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        for key, value in reference.items():
            if theirs.get(key) != value:
                raise ConfigMismatch(
                    f"rank {rank} was started with {key} = {theirs.get(key)!r}"
                    f" but rank 0 with {value!r}; every rank must run the "
                    "same job"
                )


def _file_digest(path: str) -> str:
    """Size and the first and last MiB: cheap, and different for any other corpus."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        digest.update(str(size).encode())
        for offset in (0, max(0, size - _SAMPLE_BYTES)):
            f.seek(offset)
            digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


@lru_cache(maxsize=1)
def _code_digest() -> str:
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
