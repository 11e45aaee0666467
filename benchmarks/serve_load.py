"""Load test for `mlx-glimmer serve`: concurrent multi-turn chats through the official openai client.

    python benchmarks/serve_load.py [BUNDLE | --tiny-muse DIR] [--clients 4] [--turns 3] [--max-tokens 32]
                                    [--context-words N] [--time-limit 600] [--compare] [--max-batch N]
                                    [--prompt-cache-bytes SIZE] [--url http://127.0.0.1:8080/v1]
                                    [--out benchmarks/results/serve_load.json]

Starts a server on a free loopback port (or uses --url), then runs `--clients`
conversations at once, each `--turns` streamed requests long (every follow-up
carries the whole chat, so the prefix cache is exercised), greedy. Bounded:
clients x turns requests at most, and no new request starts after
--time-limit seconds. Reports request latency and time to first token
percentiles, throughput (completion tokens and requests per second of wall
time), errors, the longest pause between a request's streamed pieces (what
a request already streaming waits while another one's prompt is prefilled),
and the server's own /metrics (acceptance, prefix cache, batched steps by
batch size).

`--context-words N`: each conversation's first question comes after notes of
about N words (sentences about the topics, in an order of the client's own,
its topic first, so clients share no more than the chat template): long
prompts, whose prefill weighs on a batch that requests join.

`--compare`: after a warm-up of both modes (other prompts), a fresh server,
started and warmed up the same way, serves the very requests the concurrent
clients sent one after another, so neither run finds the other's prompts in
its prefix cache (with `--url` the one server serves both runs, and the one
after another run gets whatever that cache gives); the summary's `compare`
reports both aggregate throughputs, their ratio, and whether every concurrent
output equals its one-at-a-time output. Where one does not, the first difference is explained
in-process once the server has stopped (`server.batch.explain_batched_divergence`:
the position and both kernels' logit margins; a floating-point tie or not).

`--tiny-muse DIR`: serve a random Muse Glimmer target (sliding-window layers)
instead of BUNDLE, built in DIR by `benchmarks/tiny_muse.py` unless DIR already
holds it: hidden 512, 8 layers, float32, a window of 16, no drafter.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai

TOPICS = [
    "the moon",
    "bread",
    "volcanoes",
    "chess",
    "bees",
    "rivers",
    "glass",
    "trains",
    "owls",
    "paper",
    "clouds",
    "copper",
    "tea",
    "whales",
    "maps",
    "salt",
]


NOTES = [
    "The moon keeps the same face toward the earth because its spin matches its orbit.",
    "Bakers once kept their sourdough starters alive for generations, feeding them flour and water every day.",
    "Volcanoes build new land where molten rock cools into basalt at the edge of the sea.",
    "Chess players study endgames with only a few pieces left, where every tempo decides the result.",
    "Bees find their way home by the angle of the sun and tell each other where flowers are by dancing.",
    "Rivers carve wide meanders across flat plains and leave oxbow lakes behind when they change course.",
    "Glass is made by melting sand with soda and lime, and it stays clear because it never crystallises.",
    "Early trains ran on wooden rails before iron made longer and faster journeys possible.",
    "Owls fly almost silently thanks to soft fringes on the edges of their feathers.",
    "Paper was first made from mulberry bark and hemp before wood pulp became cheap.",
    "Clouds form when rising air cools until its water vapour condenses on tiny grains of dust.",
    "Copper turns green over the years as a thin layer of carbonate protects the metal underneath.",
    "Tea leaves are withered, rolled and dried, and how long they oxidise decides their colour.",
    "Whales sing songs that change slowly from one season to the next across a whole ocean.",
    "Old maps left blank spaces where surveyors had never been, and sailors filled them with guesses.",
    "Salt was so valuable in the ancient world that roads were built to carry it inland.",
]


def first_question(index: int, context_words: int) -> str:
    """The client's first question; with `context_words`, after notes of about that many words, the client's
    own topic first."""
    topic = TOPICS[index % len(TOPICS)]
    question = f"Tell me something interesting about {topic}."
    if not context_words:
        return question
    notes, words, k = [], 0, index
    while words < context_words:
        notes.append(NOTES[k % len(NOTES)])
        words += len(notes[-1].split())
        k += 1
    return f"My notes on {topic} and other things:\n" + " ".join(notes) + "\n\n" + question


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def start_server(
    bundle: str | None, max_queue: int, max_batch: int | None = None, prompt_cache_bytes: str | None = None
) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "mlx_glimmer.cli",
        "serve",
        *([bundle] if bundle else []),
        "--port",
        "0",
        "--max-queue",
        str(max_queue),
        *(["--max-batch", str(max_batch)] if max_batch else []),
        *(["--prompt-cache-bytes", prompt_cache_bytes] if prompt_cache_bytes else []),
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if " at http://" in line:
            return proc, line.split(" at ")[-1].strip()
    raise SystemExit("serve exited before it was ready")


def one_request(client, index: int, turn: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request; its record (text and messages kept, for the comparison)."""
    start = time.perf_counter()
    first, text, usage, stats, error = None, [], None, {}, None
    last, max_gap = None, 0.0
    try:
        stream = client.chat.completions.create(
            model="default",
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                now = time.perf_counter()
                first = first or now
                max_gap = max(max_gap, now - last) if last is not None else max_gap
                last = now
                text.append(chunk.choices[0].delta.content)
            if chunk.model_extra.get("glimmer"):
                stats = chunk.model_extra["glimmer"]
            if chunk.usage:
                usage = chunk.usage
    except openai.APIError as e:
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    return {
        "client": index,
        "turn": turn,
        "latency_s": end - start,
        "ttft_s": (first - start) if first else None,
        "max_gap_s": max_gap,  # the longest pause between two streamed pieces of its text
        "completion_tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "prefill_tokens": stats.get("prefill_tokens"),
        "queue_wait_s": stats.get("queue_wait_s"),
        "batch_size": stats.get("batch_size"),
        "batched_tokens": stats.get("batched_tokens"),
        "error": error,
        "text": "".join(text),
        "messages": messages,
    }


def run_conversation(
    client, index: int, turns: int, max_tokens: int, deadline: float, context_words: int = 0
) -> list[dict]:
    messages = [{"role": "user", "content": first_question(index, context_words)}]
    records = []
    for turn in range(turns):
        if time.monotonic() > deadline:
            break
        record = one_request(client, index, turn, list(messages), max_tokens)
        records.append(record)
        if record["error"]:
            break
        messages += [{"role": "assistant", "content": record["text"]}, {"role": "user", "content": "Tell me more."}]
    return records


def concurrently(
    client, clients: int, turns: int, max_tokens: int, deadline: float, context_words: int = 0
) -> tuple[list[dict], float]:
    """`clients` conversations at once; their records and the wall time."""
    wall = time.perf_counter()

    def converse(i: int) -> list[dict]:
        return run_conversation(client, i, turns, max_tokens, deadline, context_words)

    with ThreadPoolExecutor(clients) as pool:
        records = [r for rs in pool.map(converse, range(clients)) for r in rs]
    return records, time.perf_counter() - wall


def one_after_another(client, records: list[dict], max_tokens: int) -> tuple[list[dict], float]:
    """The requests of `records` again, each sent when the one before it has finished."""
    wall = time.perf_counter()
    out = [one_request(client, r["client"], r["turn"], r["messages"], max_tokens) for r in records]
    return out, time.perf_counter() - wall


def warm_up(client, clients: int) -> None:
    """Both modes once on other prompts: a batch of `clients` short requests, then one alone."""
    asks = [[{"role": "user", "content": f"Name a colour, {i}."}] for i in range(clients)]
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda m: one_request(client, -1, 0, m, 8), asks))
    one_request(client, -1, 0, [{"role": "user", "content": "Say hello."}], 8)


def scrape(root: str) -> dict[str, float]:
    text = httpx.get(root + "/metrics").text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def batched_steps(before: dict, after: dict) -> dict[str, float]:
    """Batched target forwards by batch size between two scrapes of /metrics."""
    key = "glimmer_batched_steps_total"
    out = {k[len(key) :]: after[k] - before.get(k, 0) for k in after if k.startswith(key + "{")}
    return {k.split('"')[1]: v for k, v in out.items() if v}


def phase(records: list[dict], wall: float, before: dict, after: dict) -> dict:
    ok = [r for r in records if not r["error"]]
    tokens = sum(r["completion_tokens"] for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall,
        "completion_tokens": tokens,
        "completion_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "prefill_tokens": sum(r["prefill_tokens"] or 0 for r in ok),
        "max_gap_s": max((r["max_gap_s"] for r in ok), default=0.0),
        "batched_steps": batched_steps(before, after),
        "largest_batch": max((r["batch_size"] or 1 for r in ok), default=1),
    }


def explain(bundle: str | None, pairs: list[tuple[dict, dict]], max_tokens: int) -> list[dict]:
    """Where each concurrent output parts from its one-at-a-time one, explained in-process: the solo greedy
    reference regenerated, the reply's tokens re-encoded from its text, and at the first difference both
    kernels' margins (a 1-row step, a batched step of the reply's batch size)."""
    import mlx_glimmer
    from mlx_glimmer.demo import demo_bundle
    from mlx_glimmer.divergence import mlx_dtype
    from mlx_glimmer.generate import encode_prompt
    from mlx_glimmer.server.batch import explain_batched_divergence

    pair = mlx_glimmer.load(bundle or demo_bundle())
    out = []
    for together, alone in pairs:
        prompt = encode_prompt(pair.tokenizer, together["messages"], {})
        ref = mlx_glimmer.generate(pair, prompt, max_tokens=max_tokens)
        tokens = list(pair.tokenizer.encode(together["text"], add_special_tokens=False))
        rows = max(2, together["batch_size"] or 2)
        d = explain_batched_divergence(pair.target, mlx_dtype(pair), prompt, ref.token_ids, tokens, rows)
        out.append(
            {
                "client": together["client"],
                "turn": together["turn"],
                "reference_equals_one_after_another": ref.text == alone["text"],
                "divergence": d,
            }
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?")
    ap.add_argument(
        "--tiny-muse", type=Path, default=None, metavar="DIR", help="serve a random Muse target (see above)"
    )
    ap.add_argument("--url", default=None, help="an already running server's /v1 URL")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--context-words", type=int, default=0, metavar="N", help="first questions after notes of ~N words (see above)"
    )
    ap.add_argument("--time-limit", type=float, default=600, help="no request starts after this many seconds")
    ap.add_argument(
        "--compare", action="store_true", help="then serve the same requests one after another and compare (see above)"
    )
    ap.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: its own)")
    ap.add_argument(
        "--prompt-cache-bytes",
        default=None,
        metavar="SIZE",
        help="the server's --prompt-cache-bytes (default: its own); 0 keeps no conversation, so both runs of "
        "--compare prefill every prompt",
    )
    ap.add_argument("--note", default="", help="free text stored with the results (machine, load)")
    ap.add_argument("--out", default="benchmarks/results/serve_load.json")
    args = ap.parse_args()
    if args.tiny_muse is not None:
        from tiny_muse import ensure_built

        args.bundle = str(ensure_built(args.tiny_muse))

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.bundle, max(32, args.clients), args.max_batch, args.prompt_cache_bytes)
    root = url.removesuffix("/v1")
    sequential = None
    try:
        client = openai.OpenAI(base_url=url, api_key="not-needed", max_retries=0, timeout=600)
        if args.compare:
            warm_up(client, args.clients)
        before = scrape(root)
        deadline = time.monotonic() + args.time_limit
        records, wall = concurrently(client, args.clients, args.turns, args.max_tokens, deadline, args.context_words)
        after = scrape(root)
        if args.compare:
            seq_before = after
            if proc is not None:  # a server of its own, warmed up alike: no prompt of the first run is cached
                proc.terminate()
                proc.wait(timeout=30)
                proc, url = start_server(args.bundle, max(32, args.clients), args.max_batch, args.prompt_cache_bytes)
                root = url.removesuffix("/v1")
                client = openai.OpenAI(base_url=url, api_key="not-needed", max_retries=0, timeout=600)
                warm_up(client, args.clients)
                seq_before = scrape(root)
            sequential, seq_wall = one_after_another(client, records, args.max_tokens)
            seq_after = scrape(root)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)

    ok = [r for r in records if not r["error"]]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    gaps = [r["max_gap_s"] for r in ok]
    prompts = [r["prompt_tokens"] for r in ok]
    tokens = sum(r["completion_tokens"] for r in ok)
    follow = [r for r in ok if r["turn"] > 0 and r["prompt_tokens"]]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.endswith("_total")}
    summary = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "clients": args.clients,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "context_words": args.context_words,
        "prompt_cache_bytes": args.prompt_cache_bytes,
        "prompt_tokens": {"min": min(prompts, default=0), "max": max(prompts, default=0)},
        "wall_s": wall,
        "latency_s": {
            "p50": percentile(lat, 0.5),
            "p90": percentile(lat, 0.9),
            "p99": percentile(lat, 0.99),
            "max": max(lat, default=float("nan")),
        },
        "ttft_s": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "p99": percentile(ttft, 0.99)},
        "max_gap_s": {"p50": percentile(gaps, 0.5), "max": max(gaps, default=float("nan"))},
        "throughput": {
            "completion_tokens_per_s": tokens / wall,
            "requests_per_s": len(ok) / wall,
            "completion_tokens": tokens,
        },
        "follow_up_prefill_fraction": statistics.mean(r["prefill_tokens"] / r["prompt_tokens"] for r in follow)
        if follow
        else None,
        "server": {
            "mean_acceptance": after.get("glimmer_mean_acceptance"),
            "prefix_cache_hits": delta.get("glimmer_prefix_cache_hits_total"),
            "prefix_cache_misses": delta.get("glimmer_prefix_cache_misses_total"),
            "reused_tokens": delta.get("glimmer_reused_tokens_total"),
            "prefill_tokens": delta.get("glimmer_prefill_tokens_total"),
            "peak_memory_bytes": after.get("glimmer_peak_memory_bytes"),
            "batched_steps": batched_steps(before, after),
            "solo_tokens_per_second": after.get("glimmer_solo_tokens_per_second"),
        },
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "note": args.note,
    }
    lines = [
        f"mlx-glimmer serve load test: {args.clients} clients x {args.turns} turns, {args.max_tokens} tokens max, "
        f"prompts of {summary['prompt_tokens']['min']}-{summary['prompt_tokens']['max']} tokens, "
        f"greedy, streamed ({summary['machine']}{'; ' + args.note if args.note else ''})",
        f"requests {summary['requests']} (errors {summary['errors']}) in {wall:.1f} s",
        "latency s   p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}  max {max:.2f}".format(**summary["latency_s"]),
        "ttft s      p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}".format(**summary["ttft_s"]),
        "longest pause between streamed pieces s   p50 {p50:.2f}  max {max:.2f}".format(**summary["max_gap_s"]),
        f"throughput  {summary['throughput']['completion_tokens_per_s']:.2f} completion tokens/s, "
        f"{summary['throughput']['requests_per_s']:.3f} requests/s ({tokens} tokens)",
        f"prefix cache: {summary['server']['prefix_cache_hits']:.0f} hits, {summary['server']['prefix_cache_misses']:.0f} "
        f"misses; follow-ups prefilled {100 * (summary['follow_up_prefill_fraction'] or 0):.0f}% of their prompt",
        f"mean acceptance {summary['server']['mean_acceptance']:.2f} tokens per target forward",
        f"batched steps by batch size: {summary['server']['batched_steps'] or 'none'}",
    ]
    failed = summary["errors"] > 0
    if sequential is not None:
        together, alone = phase(records, wall, before, after), phase(sequential, seq_wall, seq_before, seq_after)
        pairs = [(a, b) for a, b in zip(records, sequential) if not a["error"] and not b["error"]]
        differ = [(a, b) for a, b in pairs if a["text"] != b["text"]]
        explained = (
            explain(args.bundle, differ, args.max_tokens) if differ and (args.url is None or args.bundle) else []
        )
        ties = sum(bool(e["divergence"] and e["divergence"]["tie"]) for e in explained)
        compare = {
            "requests": len(records),
            "concurrent": together,
            "one_after_another": alone,
            "speedup": together["completion_tokens_per_s"] / alone["completion_tokens_per_s"]
            if alone["completion_tokens_per_s"]
            else None,
            "identical_outputs": len(pairs) - len(differ),
            "compared_outputs": len(pairs),
            "differences": explained if explained else [{"client": a["client"], "turn": a["turn"]} for a, _ in differ],
            "all_equal_or_ties": len(differ) == ties,
        }
        summary["compare"] = compare
        failed = failed or alone["errors"] > 0 or not compare["all_equal_or_ties"]
        lines += [
            f"compare: the same {len(records)} requests concurrently {together['completion_tokens_per_s']:.2f} "
            f"completion tokens/s (wall {together['wall_s']:.1f} s, largest batch {together['largest_batch']}, "
            f"{together['prefill_tokens']} prompt tokens prefilled, longest pause {together['max_gap_s']:.2f} s) vs "
            f"one after another {alone['completion_tokens_per_s']:.2f} tokens/s (wall {alone['wall_s']:.1f} s, "
            f"{alone['prefill_tokens']} prompt tokens prefilled): {compare['speedup'] or 0:.2f}x",
            f"outputs: {compare['identical_outputs']}/{compare['compared_outputs']} identical"
            + (f"; {ties} of {len(differ)} differences are floating-point ties" if differ else ""),
        ]
        for e in explained:
            d = e["divergence"]
            if d is None:
                lines.append(f"  client {e['client']} turn {e['turn']}: one output is a prefix of the other")
                continue
            kernels = "; ".join(
                f"{name}: top1-top2 {k['margin']:.3g}, |gap| {k['gap']:.3g} (tol {k['tolerance']:.3g})"
                for name, k in d["kernels"].items()
            )
            verdict = "floating-point tie" if d["tie"] else "DISAGREE"
            lines.append(
                f"  client {e['client']} turn {e['turn']}: first difference at token {d['position']} "
                f"{d['tokens'][0]} vs {d['tokens'][1]}; {kernels}: {verdict}"
            )
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        keep = [{k: v for k, v in r.items() if k != "messages"} for r in records]
        result = {"summary": summary, "records": keep}
        if sequential is not None:
            result["sequential_records"] = [{k: v for k, v in r.items() if k != "messages"} for r in sequential]
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
