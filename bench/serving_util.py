"""What the serving benchmarks share (bench/serve_bench.py, bench/prefix_cache_bench.py):
the program, a model (the one given, or a random `small` checkpoint), and a
`deepseek serve` on a free port."""
import os
import re
import subprocess
import sys
import time


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
