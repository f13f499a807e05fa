"""Tool-calling accuracy, side by side: 50 tool-use prompts against kvseal and llama.cpp's llama-server --jinja on
the same GGUF, through the openai client, greedy, with tool_choice auto and required.

    python -m benchmarks.tools_accuracy [--model FILE.gguf] [--systems kvseal,llama-server] [--out FILE.json]

For each system and tool_choice: `called` is the share of prompts answered with a tool call; `valid` the share whose
first call parses as JSON and matches its function's parameters schema (jsonschema); `right` the share whose first
call picks the function the prompt asks for. Every share is over all 50 prompts: a prompt answered in text counts
as neither valid nor right. llama-server is the one scripts/setup_baselines.sh builds (~/.cache/kvseal-peers);
without it only kvseal runs and the report says why.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import ManagedServer, ServerProc, free_port


def fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


S = {"type": "string"}
TOOLS = [
    fn("get_weather", "Get the current weather in a city",
       {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    fn("get_time", "Get the current local time in an IANA time zone such as Europe/Paris", {"timezone": S},
       ["timezone"]),
    fn("convert_currency", "Convert an amount of money from one currency to another",
       {"amount": {"type": "number"}, "from_currency": S, "to_currency": S},
       ["amount", "from_currency", "to_currency"]),
    fn("send_email", "Send an email", {"to": S, "subject": S, "body": S}, ["to", "subject", "body"]),
    fn("search_web", "Search the web and return the top results", {"query": S}, ["query"]),
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS: list[tuple[str, str]] = [(p, "get_weather") for p in [
    "What's the weather like in Paris today?", "Is it raining in London right now?", "How hot is it in Cairo?",
    "Weather in Tokyo, in fahrenheit please.", "Do I need a coat in Oslo today?", "What's the temperature in Lima?",
    "Is it sunny in Madrid?", "Tell me the weather for Nairobi.", "How cold is it in Montreal in celsius?",
    "Check the weather in Sydney."]] + [(p, "get_time") for p in [
    "What time is it in Tokyo?", "What's the current time in Europe/Berlin?", "Tell me the time in New York.",
    "What time is it now in America/Los_Angeles?", "Current local time in Asia/Kolkata?",
    "Is it morning in Australia/Sydney right now? Check the time.", "What's the time in London?",
    "Give me the current time in Africa/Cairo.", "What hour is it in America/Sao_Paulo?",
    "Time in Asia/Singapore, please."]] + [(p, "convert_currency") for p in [
    "Convert 100 US dollars to euros.", "How many yen is 50 euros?", "Convert 2500 GBP to USD.",
    "What is 10 CHF in Swedish kronor?", "How much is 75.5 Canadian dollars in US dollars?",
    "Convert 1000 INR to EUR.", "Exchange 20 USD into Mexican pesos.", "How many British pounds is 300 euros?",
    "Convert 12 AUD to NZD.", "What's 5000 JPY in USD?"]] + [(p, "send_email") for p in [
    "Email bob@example.com with the subject 'Lunch' and say I'll be late.",
    "Send an email to alice@example.org titled 'Report' saying the report is attached.",
    "Write to team@corp.com, subject 'Standup', body: standup moves to 10am.",
    "Send carol@example.com an email with subject 'Thanks' thanking her for the help.",
    "Email hr@company.com with subject 'Vacation' asking for Friday off.",
    "Send an email to dave@example.net, subject 'Invoice 42', saying it is paid.",
    "Mail support@shop.com with subject 'Refund' asking about my refund.",
    "Email ops@example.com subject 'Outage' body 'The site is down'.",
    "Send erin@example.com an email titled 'Party' inviting her on Saturday.",
    "Email frank@example.com with subject 'Code review' asking him to review PR 7."]] + [(p, "search_web") for p in [
    "Search the web for the latest Python release.", "Look up who won the 2018 World Cup.",
    "Find recent news about solar panels.", "Search for a good banana bread recipe.",
    "Search online for the population of Canada.", "Find reviews of the Framework laptop.",
    "Look up the height of Mount Kilimanjaro on the web.", "Search for tutorials on Rust lifetimes.",
    "Find the opening hours of the Louvre online.", "Search the web for cheap flights to Rome."]]
assert len(PROMPTS) == 50


def ask(client: Any, model: str, prompt: str, choice: str, max_tokens: int) -> dict[str, Any]:
    try:
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                                           tool_choice=choice, temperature=0, max_tokens=max_tokens)
    except Exception as exc:  # noqa: BLE001  (a server's refusal is a result to record, not a crash)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    m = r.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    return {"calls": calls, "content": m.content, "finish": r.choices[0].finish_reason}


def score(answers: list[dict[str, Any]]) -> dict[str, float]:
    import jsonschema

    called = valid = right = 0
    for (_, want), a in zip(PROMPTS, answers):
        if not a.get("calls"):
            continue
        called += 1
        first = a["calls"][0]
        right += first["name"] == want
        try:
            jsonschema.validate(json.loads(first["arguments"]), SCHEMAS[first["name"]])
            valid += 1
        except (ValueError, KeyError, jsonschema.ValidationError):
            pass
    n = len(answers)
    return {"called": called / n, "valid": valid / n, "right": right / n}


def run_system(url: str, model: str, choices: list[str], max_tokens: int, concurrency: int) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    out: dict[str, Any] = {}
    for choice in choices:
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda p, c=choice: ask(client, model, p[0], c, max_tokens), PROMPTS))
        out[choice] = {**score(answers), "seconds": round(time.monotonic() - t0, 1), "answers": answers}
    return out


def llama_server(model: str, peers: str, concurrency: int) -> ManagedServer | str:
    binary = Path(peers) / "bin" / "llama-server"
    if not os.access(binary, os.X_OK):
        return f"not built: no executable {binary} (run `bash scripts/setup_baselines.sh llama-server`)"
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False) as log:
        pass
    return ManagedServer([str(binary), "-m", model, "--jinja", "--host", "127.0.0.1", "--port", str(port),
                          "-np", str(concurrency), "-c", str(4096 * concurrency), "--alias", "model"],
                         f"http://127.0.0.1:{port}", "/health", log.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(Path.home() / ".cache/kvseal/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--systems", default="kvseal,llama-server")
    p.add_argument("--choices", default="auto,required")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--peers", default=os.environ.get("PEERS", str(Path.home() / ".cache/kvseal-peers")))
    p.add_argument("--out", default=None, help="write the whole report (with every answer) as JSON here")
    a = p.parse_args(argv)
    choices = a.choices.split(",")
    report: dict[str, Any] = {"model": a.model, "prompts": len(PROMPTS), "cpu": _cpu(), "systems": {}}
    for system in a.systems.split(","):
        server: ManagedServer | str
        if system == "kvseal":
            server = ServerProc(["--unified", a.model, "--max-model-len", "4096", "--kv-pool-tokens", "32768"])
        elif system == "llama-server":
            server = llama_server(a.model, a.peers, a.concurrency)
        else:
            print(f"unknown system {system!r}", file=sys.stderr)
            return 2
        if isinstance(server, str):
            report["systems"][system] = {"skipped": server}
            continue
        try:
            server.wait_ready(600)
            model = "model" if system == "llama-server" else str(server.ready().model)  # type: ignore[attr-defined]
            report["systems"][system] = run_system(server.url, model, choices, a.max_tokens, a.concurrency)
        finally:
            server.stop()
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(table(report))
    return 0


def table(report: dict[str, Any]) -> str:
    rows = [f"{len(PROMPTS)} tool-use prompts, {report['model'].rsplit('/', 1)[-1]}, greedy; CPU: {report['cpu']}",
            "", "| system | tool_choice | called | parse + schema | right function | seconds |",
            "|---|---|---|---|---|---|"]
    for system, res in report["systems"].items():
        if "skipped" in res:
            rows.append(f"| {system} | - | {res['skipped']} | | | |")
            continue
        for choice, r in res.items():
            rows.append(f"| {system} | {choice} | {r['called']:.0%} | {r['valid']:.0%} | {r['right']:.0%} | "
                        f"{r['seconds']} |")
    return "\n".join(rows)


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")


if __name__ == "__main__":
    sys.exit(main())
