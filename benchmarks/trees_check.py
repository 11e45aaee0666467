"""The acceptance bars of `benchmarks/trees.sh`, read from the results files it wrote (README: "Draft trees").

    python benchmarks/trees_check.py [--dir benchmarks/results]

Prints one line per bar (the figure, the bar, PASS / FAIL / MISSING) and exits 1 if any bar fails or a file is
missing. Speed-ups are per prompt (method tok/s over plain tok/s on the same prompt, in the same repeat of the
same run, averaged over repeats), then the median; a bench file with any output mismatch fails its bar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# bench's names: the default settings, chains only, prompt lookup alone (`--with-lookup`)
DEFAULT, CHAINS, LOOKUP = "spec_bauto_tauto", "spec_bauto_toff", "lookup"


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def ratios(report: dict, method: str) -> list[float]:
    """Per prompt: method tok/s over plain tok/s in the same repeat, averaged over the repeats (bench lists
    tok/s per repeat, then per prompt)."""
    res, n = report["results"], report["prompts"]
    runs = [m / p if p > 0 else 0.0 for m, p in zip(res[method]["per_prompt_tokens_per_second"],
                                                    res["plain"]["per_prompt_tokens_per_second"])]  # fmt: skip
    return [statistics.mean(runs[i::n]) for i in range(n)]


def mismatches(report: dict) -> int:
    return sum(r["mismatches"] for r in report["results"].values())


def line(name: str, figure: str, ok: bool | None) -> tuple[str, bool | None]:
    verdict = {True: "PASS", False: "FAIL", None: "MISSING"}[ok]
    return f"{verdict:7} {name}: {figure}", ok


def check_tree_vs_chain(r: dict | None) -> tuple[str, bool | None]:
    name = "tree of 8 >= 1.12x chain tokens/forward, all equal plain"
    if r is None:
        return line(name, "tree_vs_chain_demo.json not found", None)
    t = r["totals"]
    ratio = t["tree_over_chain_tokens_per_forward"] or 0.0
    eq = {m: t["methods"][m]["equal_to_plain"] for m in ("chain", "tree")}
    figure = (
        f"{ratio:.3f}x ({t['methods']['tree']['tokens_per_forward']:.3f} / "
        f"{t['methods']['chain']['tokens_per_forward']:.3f}); equal to plain: chain {eq['chain']}, tree {eq['tree']}"
    )
    return line(name, figure, ratio >= 1.12 and t["all_equal_to_plain"])


def check_median(r: dict | None, file: str, name: str, bar: float) -> tuple[str, bool | None]:
    if r is None:
        return line(name, f"{file} not found", None)
    med = statistics.median(ratios(r, DEFAULT))
    figure = f"median {med:.3f}x over {r['prompts']} prompts x {r['repeats']}; mismatches {mismatches(r)}"
    return line(name, figure, med >= bar and mismatches(r) == 0)


def check_copy_heavy(r: dict | None) -> list[tuple[str, bool | None]]:
    out = [check_median(r, "trees_copy_heavy.json", "copy-heavy default >= 1.6x plain", 1.6)]
    name = "copy-heavy default within 5% of max(DFlash chains, prompt lookup), every prompt, same run"
    if r is None or LOOKUP not in r["results"]:
        return out + [line(name, "trees_copy_heavy.json with a 'lookup' method (bench --with-lookup) not found", None)]
    default, chains, alone = ratios(r, DEFAULT), ratios(r, CHAINS), ratios(r, LOOKUP)
    shares = [d / max(c, a) if max(c, a) > 0 else 0.0 for d, c, a in zip(default, chains, alone)]
    worst = min(range(len(shares)), key=shares.__getitem__)
    figure = (
        f"{sum(s >= 0.95 for s in shares)}/{len(shares)} prompts; worst prompt {worst + 1}: {shares[worst]:.3f} "
        f"(default {default[worst]:.2f}x, chains {chains[worst]:.2f}x, lookup {alone[worst]:.2f}x); "
        f"medians: chains {statistics.median(chains):.2f}x, lookup {statistics.median(alone):.2f}x"
    )
    return out + [line(name, figure, all(s >= 0.95 for s in shares) and mismatches(r) == 0)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="The acceptance bars of benchmarks/trees.sh, from its results files.")
    ap.add_argument("--dir", default="benchmarks/results", help="where trees.sh wrote (default benchmarks/results)")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    results = [
        check_tree_vs_chain(load(d / "tree_vs_chain_demo.json")),
        check_median(load(d / "trees_bench_full.json"), "trees_bench_full.json", "bench --full default >= 1.2x plain", 1.2),
        *check_copy_heavy(load(d / "trees_copy_heavy.json")),
        check_median(load(d / "trees_scrambled.json"), "trees_scrambled.json", "scrambled drafter >= 0.97x plain", 0.97),
        check_median(load(d / "trees_long_context.json"), "trees_long_context.json", "~3.5k-token prompt >= 0.97x plain", 0.97),
    ]  # fmt: skip
    for text, _ in results:
        print(text)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
