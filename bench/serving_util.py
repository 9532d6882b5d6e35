"""What the serving benchmarks share (bench/serve_bench.py, bench/prefix_cache_bench.py):
the program, a model (the one given, or a random `small` checkpoint), and a
`deepseek serve` on a free port."""
import json
import os
import re
import subprocess
import sys
import time
import urllib.request


def program(build):
    """The built `deepseek`, or exit with an error."""
    binary = os.path.join(build, "deepseek")
    if not os.access(binary, os.X_OK):
        sys.exit(f"error: {binary} not found; build the project first (or pass --build)")
    return binary


def model_or_small(binary, model, tmp):
    """`model`, or a random `small` checkpoint (`deepseek init`) made in tmp."""
    if model:
        return model
    model = os.path.join(tmp, "small")
    root = os.path.join(os.path.dirname(__file__), "..")
    subprocess.run([binary, "init", "--config", os.path.join(root, "configs", "small.yml"), "--seed", "1",
                    "--out", model], check=True, stdout=subprocess.DEVNULL)
    return model


def start_server(binary, model, log_path, extra):
    """`deepseek serve --model MODEL --port 0 EXTRA...`, once it says its port:
    (the process, the port); exits with its log if it never does."""
    log = open(log_path, "w+")
    server = subprocess.Popen([binary, "serve", "--model", model, "--port", "0"] + extra, stderr=log)
    for _ in range(1200):
        log.seek(0)
        m = re.search(r"127\.0\.0\.1:(\d+)", log.read())
        if m:
            return server, int(m.group(1))
        if server.poll() is not None:
            break
        time.sleep(0.05)
    log.seek(0)
    server.terminate()
    sys.exit("error: deepseek serve did not start: " + log.read().strip())


def stream_completion(port, prompt, max_tokens):
    """One streamed greedy completion of token ids (`ignore_eos`): (time to the
    first token in s, the whole request's time in s, the token ids)."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, ids = None, []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            got = chunk["choices"][0].get("token_ids", [])
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            ids += got
    return ttft, time.perf_counter() - t0, ids
