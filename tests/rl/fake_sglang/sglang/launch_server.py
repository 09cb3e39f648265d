"""Stand-in for ``python -m sglang.launch_server`` (SGLang 0.5.23's flags, no GPU, no model).

Used by tests/rl/test_servers.py to test how a run starts, waits for and stops SGLang servers.
It parses the flags the launcher passes with SGLang's types and choices (an unknown flag exits
with argparse's error 2, as SGLang's own parser does), forks a child process as SGLang forks
its scheduler (so stopping must reach the whole process group), answers ``/health_generate``
(and ``/health``) 503 a few times before 200, and serves ``/generate`` with token ids only
when started with ``--skip-tokenizer-init``: ``output_ids[i] = 10 + (5 * i + prompt) % 100``.
"""

import argparse
import base64
import json
import os
import struct
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

p = argparse.ArgumentParser(prog="sglang.launch_server")
p.add_argument("--model-path", required=True)
p.add_argument("--host", default="127.0.0.1")
p.add_argument("--port", type=int, default=30000)
for flag in ("--tp-size", "--dp-size", "--ep-size", "--base-gpu-id", "--random-seed"):
    p.add_argument(flag, type=int)
p.add_argument("--max-running-requests", type=int)
p.add_argument("--context-length", type=int)
p.add_argument("--mem-fraction-static", type=float)
p.add_argument("--dtype", choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
p.add_argument("--weight-version", default="default")
p.add_argument("--served-model-name")
p.add_argument("--log-level")
for flag in (
    "--skip-server-warmup",
    "--skip-tokenizer-init",
    "--enable-return-routed-experts",
    "--trust-remote-code",
):
    p.add_argument(flag, action="store_true")
args = p.parse_args()
print("args", json.dumps(vars(args)), flush=True)
if args.base_gpu_id is not None and args.base_gpu_id >= 64:
    print(f"RuntimeError: CUDA error: invalid device ordinal {args.base_gpu_id}", flush=True)
    sys.exit(1)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
print("scheduler pid", child.pid, flush=True)
config = json.load(open(os.path.join(args.model_path, "config.json")))
polls = {"n": 0}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _json(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health_generate":  # 503 while "starting", as SGLang
            polls["n"] += 1
            self._json(200 if polls["n"] > 3 else 503, {})
        elif self.path == "/health":
            self._json(200 if polls["n"] > 3 else 503, {})
        elif self.path == "/model_info":
            self._json(
                200,
                {
                    "model_path": args.model_path,
                    "weight_version": args.weight_version,
                    "is_generation": True,
                },
            )
        elif self.path == "/server_info":
            env = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB")
            self._json(200, {**vars(args), "SGLANG_RETURN_ORIGINAL_LOGPROB": env})
        else:
            self._json(404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ids = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        out = [10 + (5 * i + len(ids)) % 100 for i in range(n)]
        meta = {
            "id": body.get("rid"),
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": args.weight_version,
            "output_token_logprobs": [[-0.5, t, None] for t in out],
            "input_token_logprobs": [],
        }
        if body.get("return_routed_experts"):
            rows = len(ids) + n - 1 - body.get("routed_experts_start_len", 0)
            per = config["num_hidden_layers"] * config["num_experts_per_tok"]
            meta["routed_experts"] = base64.b64encode(
                struct.pack(f"<{rows * per}i", *[0] * (rows * per))
            ).decode()
        reply = {"output_ids": out, "meta_info": meta}
        if not args.skip_tokenizer_init:
            reply["text"] = "text from the server"
        self._json(200, reply)


ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()
