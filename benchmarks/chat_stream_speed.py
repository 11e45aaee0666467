"""Decode speed inside the chat app vs `mlx-glimmer generate`, on the same 512-token answer.

Same bundle, same prompt (one user message through the chat template), greedy,
the same speculative settings. Runs alternate in ABBA order (generate, app, app,
generate, ...) so background load and its trends hit both alike; the ratio is the
median of the per-pair ratios (the ratio of the medians is reported too).

- generate: `mlx-glimmer generate BUNDLE --chat --prompt P --max-tokens 512 --json`
- app:      `mlx-glimmer chat BUNDLE --max-tokens 512` in a real terminal (tmux,
            120x40); once it has loaded and settled, P is typed and sent, and the
            answer streams into its Markdown view; its decode tok/s is read from the
            conversation it saved (XDG_DATA_HOME set to a temp dir).

    python benchmarks/chat_stream_speed.py [--bundle DIR | --tiny] [--no-spec] [--pairs 3] [--out FILE]

`--tiny` uses the tests' tiny Muse pair (random weights, one character per token),
built into a temp dir: it decodes ~15x faster than the demo pair on a CPU, so the
app's per-token UI work weighs much more in the ratio (the harsher case).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPT = (
    "Write a long, detailed essay on the history of the Roman Empire, from its founding to its fall, "
    "with many sections."
)
APP = Path(sys.executable).parent / "mlx-glimmer"


def run_generate(bundle: str | None, tokens: int, prompt: str, flags: list[str]) -> dict:
    cmd = [
        str(APP),
        "generate",
        *([bundle] if bundle else []),
        "--chat",
        "--prompt",
        prompt,
        "--max-tokens",
        str(tokens),
        "--json",
        *flags,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    d = json.loads(out.stdout)
    return {k: d[k] for k in ("generated_tokens", "decode_tokens_per_second", "mean_acceptance", "finish_reason")}


def tmux(socket: str, *args: str, env=None) -> str:
    return subprocess.run(
        ["tmux", "-L", socket, "-f", "/dev/null", *args], capture_output=True, text=True, env=env, timeout=30
    ).stdout


APP_ENV: dict[str, str] = {}  # --app-env: extra environment for the app's runs only


def run_app(bundle: str | None, tokens: int, prompt: str, flags: list[str], timeout: float = 1800) -> dict:
    with tempfile.TemporaryDirectory() as data:
        env = {**os.environ, "XDG_DATA_HOME": data, "TERM": "xterm-256color", **APP_ENV}
        db = Path(data) / "mlx-glimmer" / "chats.db"
        socket = f"glimmer-bench-{os.getpid()}"
        args = [str(APP), "chat", *([bundle] if bundle else []), "--max-tokens", str(tokens), *flags]
        command = "exec " + " ".join("'" + a.replace("'", "'\\''") + "'" for a in args)
        env_args = [a for k, v in APP_ENV.items() for a in ("-e", f"{k}={v}")]
        tmux(socket, "new-session", "-d", "-s", "bench", "-x", "120", "-y", "40", *env_args, command, env=env)
        tmux(socket, "set-option", "-t", "bench", "remain-on-exit", "on", env=env)
        try:
            deadline = time.monotonic() + timeout
            while "Loaded " not in tmux(socket, "capture-pane", "-p", "-t", "bench", env=env):
                if time.monotonic() > deadline:
                    raise RuntimeError("the app did not load")
                time.sleep(0.3)
            time.sleep(2.0)  # let the first frames settle, as a person would before typing
            tmux(socket, "send-keys", "-t", "bench", "-l", prompt, env=env)
            tmux(socket, "send-keys", "-t", "bench", "Enter", env=env)
            while True:
                stats = saved_stats(db)
                if stats is not None:
                    break
                if (
                    time.monotonic() > deadline
                    or tmux(socket, "display-message", "-p", "-t", "bench", "#{pane_dead}", env=env).strip() == "1"
                ):
                    screen = tmux(socket, "capture-pane", "-p", "-t", "bench", env=env)
                    raise RuntimeError(f"the app did not save an answer:\n{screen}")
                time.sleep(0.5)
            tmux(socket, "send-keys", "-t", "bench", "C-q", env=env)
            time.sleep(1.0)
        finally:
            tmux(socket, "kill-server", env=env)
    return {k: stats[k] for k in ("generated_tokens", "decode_tokens_per_second", "mean_acceptance", "finish_reason")}


def tiny_pair(root: Path) -> tuple[str, str]:
    """The tests' tiny Muse target (readable tokenizer) and its DFlash assistant, written under `root`."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import tiny_checkpoints as tc
    from test_tui import readable_target

    target = tc.build_muse_target(root / "muse-src", max_shard_size="200KB")
    assistant = tc.build_assistant(root / "assistant", target_layer_ids=[1, 3, 5])
    return str(readable_target(target, root / "muse", tc.CHAT_TEMPLATE)), str(assistant)


def saved_stats(db: Path) -> dict | None:
    if not db.exists():
        return None
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5)
    try:
        row = con.execute("SELECT stats FROM turns ORDER BY id DESC LIMIT 1").fetchone()
    except sqlite3.OperationalError:
        return None
    finally:
        con.close()
    return json.loads(row[0]) if row else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bundle", default=None, help="bundle directory (default: the demo pair)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny pair instead of a bundle")
    ap.add_argument("--no-spec", action="store_true", help="plain decoding in both (default: speculative)")
    ap.add_argument(
        "--prompt",
        default=None,
        help="the user message (default: a long-essay request; "
        "with --tiny 'Tell me more', which it answers with > 512 tokens)",
    )
    ap.add_argument("--pairs", type=int, default=3, help="alternating generate/app pairs (default 3)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument(
        "--app-env",
        action="append",
        default=[],
        metavar="K=V",
        help="environment for the app's runs only (e.g. OPENBLAS_NUM_THREADS=1)",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_stream_speed.json"))
    args = ap.parse_args()
    APP_ENV.update(kv.split("=", 1) for kv in args.app_env)
    flags = ["--no-spec"] if args.no_spec else []
    bundle, prompt = args.bundle, args.prompt or PROMPT
    tmp = tempfile.TemporaryDirectory()
    if args.tiny:
        bundle, drafter = tiny_pair(Path(tmp.name))
        flags += ["--drafter", drafter]
        prompt = args.prompt or "Tell me more"

    runs = []
    for i in range(args.pairs):
        if i % 2 == 0:
            g = run_generate(bundle, args.tokens, prompt, flags)
            a = run_app(bundle, args.tokens, prompt, flags)
        else:
            a = run_app(bundle, args.tokens, prompt, flags)
            g = run_generate(bundle, args.tokens, prompt, flags)
        ratio = a["decode_tokens_per_second"] / g["decode_tokens_per_second"]
        runs.append({"generate": g, "app": a, "ratio": ratio})
        print(
            f"pair {i + 1}: generate {g['decode_tokens_per_second']:.1f} tok/s ({g['generated_tokens']} tokens), "
            f"app {a['decode_tokens_per_second']:.1f} tok/s ({a['generated_tokens']} tokens), ratio {ratio:.3f}",
            flush=True,
        )
        if g["generated_tokens"] != args.tokens or a["generated_tokens"] != args.tokens:
            print(f"  warning: the answer stopped before {args.tokens} tokens", flush=True)
    result = {
        "what": "decode tok/s of one 512-token greedy answer: chat app in tmux vs mlx-glimmer generate",
        "bundle": "tiny test pair (tests/tiny_checkpoints.py, readable tokenizer)"
        if args.tiny
        else args.bundle or "demo pair",
        "speculative": not args.no_spec,
        "prompt": prompt,
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ},
        "app_env": APP_ENV,
        "pairs": runs,
        "median_generate_tok_s": statistics.median(r["generate"]["decode_tokens_per_second"] for r in runs),
        "median_app_tok_s": statistics.median(r["app"]["decode_tokens_per_second"] for r in runs),
        "median_ratio": statistics.median(r["ratio"] for r in runs),
    }
    result["ratio_of_medians"] = result["median_app_tok_s"] / result["median_generate_tok_s"]
    print(
        f"median: generate {result['median_generate_tok_s']:.1f} tok/s, app {result['median_app_tok_s']:.1f} tok/s, "
        f"ratio {result['median_ratio']:.3f} (median of per-pair ratios; ratio of medians "
        f"{result['ratio_of_medians']:.3f})"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
