"""Statistics as text: the side panel, the line under each answer, histograms."""

from __future__ import annotations

from collections import Counter

from mlx_glimmer.generate import GenerationStats

from .session import Turn

BAR = "█"
EIGHTHS = " ▁▂▃▄▅▆▇█"


def draft_share(stats: GenerationStats) -> float:
    total = stats.draft_s + stats.verify_s
    return stats.draft_s / total if total > 0 else 0.0


def prefill_line(stats: GenerationStats) -> str:
    return f"prefilled {stats.prefill_tokens} of {stats.prompt_tokens} prompt tokens"


def stats_rows(stats: GenerationStats | None) -> list[tuple[str, str]]:
    if stats is None:
        return [("no answer yet", "")]
    share = draft_share(stats)
    return [
        ("decode", f"{stats.decode_tokens_per_second:.1f} tok/s"),
        ("prefill", f"{stats.prefill_tokens_per_second:.1f} tok/s"),
        ("TTFT", f"{stats.ttft_s * 1000:.0f} ms"),
        ("tokens", f"{stats.generated_tokens} in {stats.target_forwards} rounds"),
        ("accept", f"{stats.mean_acceptance:.2f} tok/round"),
        (
            "drafter",
            f"{stats.drafter_kind}, block {'auto ≤' if stats.block_policy == 'auto' else ''}{stats.block_size}",
        ),
        *(
            [("widths", " ".join(f"{w}×{n}" for w, n in stats.verify_width_histogram.items()))]
            if stats.block_policy == "auto"
            else []
        ),
        *(tree_rows(stats) if stats.drafter_kind != "none" else []),
        ("draft", f"{share:4.0%} {bar(share, 10)}"),
        ("verify", f"{1 - share:4.0%} {bar(1 - share, 10)}" if stats.verify_s else "–"),
        ("memory", f"{stats.peak_memory_gb:.2f} GB peak"),
    ]


SOURCES = ("model", "lookup", "both")  # who proposed a round's accepted path, in the order shown


def tree_rows(stats: GenerationStats) -> list[tuple[str, str]]:
    """Tokens verified and drafts kept per round, rounds that verified a tree, and who proposed the accepted
    paths (the drafter's model, n-gram lookup, or both)."""
    sources = sorted(stats.accepted_from.items(), key=lambda kv: (SOURCES + (kv[0],)).index(kv[0]))
    return [
        ("verified", f"{stats.mean_tokens_verified:.1f} tok/round, depth {stats.mean_accepted_depth:.1f}"),
        ("trees", f"{stats.tree_rounds}/{stats.target_forwards} rounds"),
        ("from", " ".join(f"{name} {n}" for name, n in sources) or "–"),
    ]


def bar(fraction: float, width: int) -> str:
    return BAR * round(max(0.0, min(1.0, fraction)) * width)


def sparkline(values: list[int], top: int, width: int, height: int = 3) -> list[str]:
    """The last `width` values as columns scaled to 0..top, `height` rows, top row first."""
    values = values[-width:]
    eighths = [round(min(max(v, 0), top) / max(top, 1) * height * 8) for v in values]
    return ["".join(EIGHTHS[min(max(e - row * 8, 0), 8)] for e in eighths) for row in reversed(range(height))]


def histogram(lengths: list[int], width: int = 12) -> list[str]:
    """One line per committed-tokens count k: `k │█████ n`."""
    if not lengths:
        return []
    counts = Counter(lengths)
    top = max(counts.values())
    return [f"{k:>2} │{bar(counts[k] / top, width):<{width}} {counts[k]}" for k in range(1, max(counts) + 1)]


def turn_summary(stats: GenerationStats) -> str:
    """The dim line under an answer."""
    parts = [
        f"{stats.generated_tokens} tokens",
        f"{stats.decode_tokens_per_second:.1f} tok/s",
    ]
    if stats.target_forwards:
        parts.append(f"{stats.mean_acceptance:.2f} tok/round")
    parts += [prefill_line(stats), stats.finish_reason or ""]
    return " · ".join(p for p in parts if p)


def last_stats(turns: list[Turn]) -> GenerationStats | None:
    """The statistics of the last answer that has them (the stats panel's)."""
    return next((t.stats for t in reversed(turns) if t.stats is not None), None)


def session_report(turns: list[Turn]) -> str:
    """`/stats`: the last answer's figures, then the whole conversation's."""
    last = last_stats(turns)
    rows = stats_rows(last)
    width = max(len(k) for k, _ in rows)
    lines = ["last answer:"] + [f"  {k:<{width}}  {v}" for k, v in rows]
    if last is not None:
        lines.append(f"  {prefill_line(last)}")
    done = [t.stats for t in turns if t.stats is not None]
    rounds = [n for st in done for n in st.acceptance_lengths]
    tokens = sum(st.generated_tokens for st in done)
    mean = sum(rounds) / len(rounds) if rounds else 0.0
    prompt = sum(st.prompt_tokens for st in done)
    prefilled = sum(st.prefill_tokens for st in done)
    lines.append(
        f"session: {len(done)} answers, {tokens} tokens, {mean:.2f} tok/round over {len(rounds)} rounds, "
        f"prefilled {prefilled} of {prompt} prompt tokens"
    )
    return "\n".join(lines)
