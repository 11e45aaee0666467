"""`mlx-glimmer serve`: an OpenAI-compatible HTTP server on the speculative loop.

cli.py           the subcommand's flags and `cmd_serve` (imports no FastAPI, so the CLI starts fast)
app.py           the FastAPI app: routes, request handling, SSE, `serve()`
protocol.py      the OpenAI wire format: request bodies in, `GenerationSettings` and response bodies out
tools.py         tools / tool_choice, and replies split into reasoning, content and tool calls (mlx-lm's parsers)
worker.py        the one generation thread and its bounded queue; stop strings
prompt_cache.py  conversations' decode states, reused by follow-up requests (LRU, bounded by bytes)
metrics.py       running totals and the Prometheus text of /metrics
"""
