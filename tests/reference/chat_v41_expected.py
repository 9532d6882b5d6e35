#!/usr/bin/env python3
"""Renders tests/data/chat/v41_cases.json with DeepSeek-V4.1's reference chat
encoder and writes tests/data/chat/v41_expected.json, which chat_format_test
compares the server's deepseek-v4.1 format against.

The encoder is not part of this repository. It is the `encoding/` module of
the DeepSeek-V4.1-Flash release; SGLang carries it unchanged as
python/sglang/srt/entrypoints/openai/encoding_dsv41.py. Put that file in a
directory and pass the directory:

  /usr/bin/python3 tests/reference/chat_v41_expected.py --encoder DIR

A case's request becomes the encoder's input the way the server builds its
prompt: with tools (and tool_choice not "none"), the first message carries
them when it is a system or developer message, otherwise an empty system
message is put first; "thinking" picks the encoder's thinking_mode;
"reasoning_effort" is passed on. A case the encoder refuses is written as
{"error": ...}; the server must refuse it too.
"""
import argparse
import copy
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data", "chat")


def encoder_input(body):
    messages = copy.deepcopy(body["messages"])
    tools = body.get("tools") or []
    if tools and body.get("tool_choice", "auto") != "none":
        if messages[0]["role"] not in ("system", "developer"):
            messages.insert(0, {"role": "system", "content": ""})
        messages[0]["tools"] = tools
    thinking = body.get("thinking", False)
    if isinstance(thinking, dict):
        thinking = thinking.get("type") == "enabled"
    return messages, ("thinking" if thinking else "chat"), body.get("reasoning_effort")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--encoder", required=True, help="directory holding encoding_dsv41.py")
    args = ap.parse_args()
    path = os.path.join(args.encoder, "encoding_dsv41.py")
    sha = hashlib.sha256(open(path, "rb").read()).hexdigest()
    sys.path.insert(0, args.encoder)
    import encoding_dsv41 as enc  # noqa: E402

    cases = json.load(open(os.path.join(DATA, "v41_cases.json"), encoding="utf-8"))
    out = {"encoder_sha256": sha, "render": {}, "parse": {}}
    for case in cases["render"]:
        messages, mode, effort = encoder_input(case["body"])
        try:
            out["render"][case["name"]] = {"text": enc.encode_messages(messages, thinking_mode=mode,
                                                                       reasoning_effort=effort)}
        except (ValueError, AssertionError, NotImplementedError, KeyError, TypeError) as e:
            out["render"][case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    for case in cases["parse"]:
        msg = enc.parse_message_from_completion_text(case["text"], "thinking" if case["thinking"] else "chat")
        out["parse"][case["name"]] = {
            "reasoning": msg["reasoning_content"],
            "content": msg["content"],
            "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in msg["tool_calls"]],
        }
    dst = os.path.join(DATA, "v41_expected.json")
    with open(dst + ".tmp", "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    os.replace(dst + ".tmp", dst)
    errors = sum("error" in v for v in out["render"].values())
    print(f"{len(out['render'])} renders ({errors} refused), {len(out['parse'])} parses -> {dst}")


if __name__ == "__main__":
    main()
