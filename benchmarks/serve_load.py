"""Load test for `mlx-glimmer serve`: concurrent multi-turn chats through the official openai client.

    python benchmarks/serve_load.py [BUNDLE] [--clients 4] [--turns 3] [--max-tokens 32] [--time-limit 600]
                                    [--url http://127.0.0.1:8080/v1] [--out benchmarks/results/serve_load.json]

Starts a server on a free loopback port (or uses --url), then runs `--clients`
conversations at once, each `--turns` streamed requests long (every follow-up
carries the whole chat, so the prefix cache is exercised), greedy. Bounded:
clients x turns requests at most, and no new request starts after
--time-limit seconds. Reports request latency and time to first token
percentiles, throughput (completion tokens and requests per second of wall
time), errors, and the server's own /metrics (acceptance, prefix cache).
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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def start_server(bundle: str | None, max_queue: int) -> tuple[subprocess.Popen, str]:
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
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if " at http://" in line:
            return proc, line.split(" at ")[-1].strip()
    raise SystemExit("serve exited before it was ready")


def run_conversation(client, index: int, turns: int, max_tokens: int, deadline: float) -> list[dict]:
    topic = TOPICS[index % len(TOPICS)]
    messages = [{"role": "user", "content": f"Tell me something interesting about {topic}."}]
    records = []
    for turn in range(turns):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        first, text, usage, stats, error = None, [], None, {}, None
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
                    first = first or time.perf_counter()
                    text.append(chunk.choices[0].delta.content)
                if chunk.model_extra.get("glimmer"):
                    stats = chunk.model_extra["glimmer"]
                if chunk.usage:
                    usage = chunk.usage
        except openai.APIError as e:
            error = f"{type(e).__name__}: {e}"
        end = time.perf_counter()
        records.append(
            {
                "client": index,
                "turn": turn,
                "latency_s": end - start,
                "ttft_s": (first - start) if first else None,
                "completion_tokens": usage.completion_tokens if usage else 0,
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "prefill_tokens": stats.get("prefill_tokens"),
                "queue_wait_s": stats.get("queue_wait_s"),
                "error": error,
            }
        )
        if error:
            break
        messages += [{"role": "assistant", "content": "".join(text)}, {"role": "user", "content": "Tell me more."}]
    return records


def scrape(root: str) -> dict[str, float]:
    text = httpx.get(root + "/metrics").text
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("bundle", nargs="?")
    ap.add_argument("--url", default=None, help="an already running server's /v1 URL")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--time-limit", type=float, default=600, help="no request starts after this many seconds")
    ap.add_argument("--note", default="", help="free text stored with the results (machine, load)")
    ap.add_argument("--out", default="benchmarks/results/serve_load.json")
    args = ap.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args.bundle, max_queue=max(32, args.clients))
    root = url.removesuffix("/v1")
    try:
        client = openai.OpenAI(base_url=url, api_key="not-needed", max_retries=0, timeout=600)
        before = scrape(root)
        deadline = time.monotonic() + args.time_limit
        wall = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            records = [
                r
                for rs in pool.map(
                    lambda i: run_conversation(client, i, args.turns, args.max_tokens, deadline), range(args.clients)
                )
                for r in rs
            ]
        wall = time.perf_counter() - wall
        after = scrape(root)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)

    ok = [r for r in records if not r["error"]]
    lat = [r["latency_s"] for r in ok]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["completion_tokens"] for r in ok)
    follow = [r for r in ok if r["turn"] > 0 and r["prompt_tokens"]]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.endswith("_total")}
    summary = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "clients": args.clients,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "latency_s": {
            "p50": percentile(lat, 0.5),
            "p90": percentile(lat, 0.9),
            "p99": percentile(lat, 0.99),
            "max": max(lat, default=float("nan")),
        },
        "ttft_s": {"p50": percentile(ttft, 0.5), "p90": percentile(ttft, 0.9), "p99": percentile(ttft, 0.99)},
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
        },
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "note": args.note,
    }
    lines = [
        f"mlx-glimmer serve load test: {args.clients} clients x {args.turns} turns, {args.max_tokens} tokens max, "
        f"greedy, streamed ({summary['machine']}{'; ' + args.note if args.note else ''})",
        f"requests {summary['requests']} (errors {summary['errors']}) in {wall:.1f} s",
        "latency s   p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}  max {max:.2f}".format(**summary["latency_s"]),
        "ttft s      p50 {p50:.2f}  p90 {p90:.2f}  p99 {p99:.2f}".format(**summary["ttft_s"]),
        f"throughput  {summary['throughput']['completion_tokens_per_s']:.2f} completion tokens/s, "
        f"{summary['throughput']['requests_per_s']:.3f} requests/s ({tokens} tokens)",
        f"prefix cache: {summary['server']['prefix_cache_hits']:.0f} hits, {summary['server']['prefix_cache_misses']:.0f} "
        f"misses; follow-ups prefilled {100 * (summary['follow_up_prefill_fraction'] or 0):.0f}% of their prompt",
        f"mean acceptance {summary['server']['mean_acceptance']:.2f} tokens per target forward",
    ]
    print("\n".join(lines))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"summary": summary, "records": records}, indent=2) + "\n")
        out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
