"""Reading several ranks' ledgers side by side: who diverged, who is behind (pure).

Input: per rank a ledger dump (channel summaries and recent entries). A channel
names the ends that must agree (``dp[0,2]``; ``pp[0,1] 0->1``); ``mismatched``
compares summaries, ``explain`` writes the one line a person reads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_CHANNEL = re.compile(r"^(?P<name>[^\[]+)\[(?P<ranks>[\d,]*)\](?: (?P<src>\d+)->(?P<dst>\d+))?$")


def participants(channel: str) -> list[int]:
    """The global ranks that must agree on ``channel``."""
    m = _CHANNEL.match(channel)
    if m is None:
        return []
    if m["src"] is not None:
        return [int(m["src"]), int(m["dst"])]
    return [int(r) for r in m["ranks"].split(",") if r]


def describe_channel(channel: str) -> str:
    m = _CHANNEL.match(channel)
    if m is None:
        return channel
    ranks = m["ranks"].replace(",", ", ")
    if m["src"] is not None:
        return f"group {m['name']} (ranks [{ranks}]), transfers {m['src']} -> {m['dst']}"
    return f"group {m['name']} (ranks [{ranks}])"


def mismatched(summaries: dict[int, dict[str, list[int]]]) -> list[str]:
    """Channels whose participants (among ``summaries``' ranks) disagree on
    (count, checksum); a participant that never used the channel counts (0, 0)."""
    channels = sorted({c for s in summaries.values() for c in s})
    found = []
    for channel in channels:
        ends = [r for r in participants(channel) if r in summaries]
        values = {tuple(summaries[r].get(channel, (0, 0))) for r in ends}
        if len(values) > 1:
            found.append(channel)
    return found


@dataclass(frozen=True)
class Finding:
    """What the ledgers show: ``kind`` is ``diverged`` (an operation some rank issued
    that its peers did not: wrong at once) or ``behind`` (peers wait for a rank that
    has not reached an operation yet: wrong only once it lasts too long)."""

    kind: str
    message: str

    def __str__(self) -> str:
        return self.message


def explain(
    dumps: dict[int, dict], channels: list[str] | None = None, settled: bool = False
) -> Finding | None:
    """The rank that diverged or is behind, the group and both call sites, in one
    line; None when the ledgers agree and nobody waits on an absent peer.

    ``settled``: every rank has stopped issuing (the per-step check), so an
    operation some ranks issued and others did not is a divergence, not a lag."""
    entries = {rank: dump.get("entries", []) for rank, dump in dumps.items()}
    by_channel: dict[str, dict[int, dict[int, dict]]] = {}
    for rank, items in entries.items():
        for e in items:
            by_channel.setdefault(e["channel"], {}).setdefault(rank, {})[e["seq"]] = e
    candidates = channels if channels is not None else sorted(by_channel)
    for channel in candidates:
        found = _divergence(channel, by_channel.get(channel, {}), entries)
        if found:
            return found
    if settled:
        for channel in candidates:
            found = _unmatched(channel, by_channel.get(channel, {}), entries)
            if found:
                return found
    return _behind(by_channel, entries)


def _unmatched(channel: str, ranks: dict[int, dict[int, dict]], entries) -> Finding | None:
    """An operation some participants issued and the others never did."""
    ends = [r for r in participants(channel) if r in entries]
    last = {r: max(ranks.get(r, {}), default=0) for r in ends}
    if len(set(last.values())) <= 1:
        return None
    extra = max(ends, key=lambda r: last[r])
    short = min(ends, key=lambda r: last[r])
    e = ranks[extra][last[short] + 1] if last[short] + 1 in ranks[extra] else None
    if e is None:
        return None
    tail = ranks.get(short, {}).get(last[short])
    theirs = (
        f"its last there is {_what(tail)} #{tail['seq']} at {tail['site']}"
        if tail
        else "it issued none there"
    )
    return Finding(
        "diverged",
        (
            f"rank {extra} diverged on {describe_channel(channel)}: it issued {_what(e)} "
            f"#{e['seq']} at {e['site']}, which rank {short} never issued ({theirs})"
        ),
    )


def _divergence(channel: str, ranks: dict[int, dict[int, dict]], entries) -> Finding | None:
    ends = [r for r in participants(channel) if r in ranks]
    if len(ends) < 2:
        return None
    common = sorted(set.union(*(set(ranks[r]) for r in ends)))
    for seq in common:
        here = {r: ranks[r][seq] for r in ends if seq in ranks[r]}
        if len({e["signature"] for e in here.values()}) <= 1:
            continue
        culprit = _culprit(ranks, ends, seq, entries)
        if culprit is None or culprit not in here:
            culprit = min(here)
        other = next(r for r in here if here[r]["signature"] != here[culprit]["signature"])
        bad, good = here[culprit], here[other]
        return Finding(
            "diverged",
            (
                f"rank {culprit} diverged on {describe_channel(channel)} at operation #{seq}: "
                f"rank {culprit} issued {_what(bad)} at {bad['site']}, while rank {other} issued "
                f"{_what(good)} at {good['site']}"
            ),
        )
    return None


def _culprit(ranks, ends, seq: int, entries) -> int | None:
    # At fault: the rank whose later operations match the others' once its odd one is
    # skipped (it issued an extra operation), else the minority, else (two ranks) the
    # one whose call site the other rank's ledger never shows.
    sigs = {r: [ranks[r][s]["signature"] for s in sorted(ranks[r]) if s >= seq] for r in ends}
    for r in ends:
        others = [sigs[o] for o in ends if o != r]
        extra = sigs[r][1:]  # r issued one operation the others did not
        if extra and all(o and _prefix_equal(extra, o) for o in others):
            return r
    votes: dict[str, list[int]] = {}
    for r in ends:
        if sigs[r]:
            votes.setdefault(sigs[r][0], []).append(r)
    if len(votes) > 1:
        ranked = sorted(votes.values(), key=len)
        if len(ranked[0]) < len(ranked[-1]):
            return ranked[0][0]
    for r in ends:  # two ranks: the call site the other never shows
        site = ranks[r][seq]["site"] if seq in ranks[r] else None
        other_sites = {e["site"] for o in ends if o != r for e in entries[o]}
        if site is not None and site not in other_sites:
            return r
    return None


def _prefix_equal(a: list, b: list) -> bool:
    n = min(len(a), len(b))
    return n > 0 and a[:n] == b[:n]


def _behind(by_channel, entries) -> Finding | None:
    """The longest-waiting operation whose peers have not issued it yet."""
    worst = None
    for channel, ranks in by_channel.items():
        for rank, items in ranks.items():
            for seq, e in items.items():
                if e["done"]:
                    continue
                missing = [
                    p
                    for p in participants(channel)
                    if p != rank and p in entries and not _issued(ranks.get(p, {}), seq)
                ]
                if missing and (worst is None or e["age_s"] > worst[0]["age_s"]):
                    worst = (e, rank, missing, channel)
    if worst is None:
        return None
    e, waiter, missing, channel = worst
    laggard = missing[0]
    last = entries[laggard][-1] if entries[laggard] else None
    doing = (
        "no operation recorded"
        if last is None
        else (
            f"its last operation is {_what(last)} #{last['seq']} on "
            f"{describe_channel(last['channel'])} at {last['site']}"
            f" ({'done' if last['done'] else 'in flight'})"
        )
    )
    return Finding(
        "behind",
        (
            f"rank {laggard} is behind on {describe_channel(channel)}: rank {waiter} waits in "
            f"{_what(e)} #{e['seq']} at {e['site']} since {e['age_s']:.1f}s, which rank {laggard} "
            f"has not issued; {doing}"
        ),
    )


def _issued(items: dict[int, dict], seq: int) -> bool:
    """Whether a peer issued operation ``seq`` (its window may have dropped it since)."""
    return bool(items) and max(items) >= seq


def _what(e: dict) -> str:
    sig = e["signature"]
    return sig if sig.startswith(e["op"]) else f"{e['op']} {sig}"
