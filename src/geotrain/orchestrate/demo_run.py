"""`geotrain demo`: the whole story on the built-in default, in a few minutes on a laptop-class CPU.

1. plan the tiny Llama across two emulated datacenters (pp=2 x dp=2);
2. simulate that plan (timeline, bubbles);
3. measure this machine (`geotrain profile --quick`), so the prediction of step 5 is calibrated;
4. train it for real -- ranks in emulated DCs joined by a WAN with latency and rate limits --
   while a client sends prompts to the BubbleTea endpoint, whose prefill runs in the ranks'
   bubbles; print what came back;
5. draw the measured timeline beside the (calibrated) predicted one.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from geotrain.calibrate.profile_run import profile_machine
from geotrain.errors import GeotrainError
from geotrain.orchestrate.plan_run import plan_command
from geotrain.orchestrate.simulate_run import simulate_command
from geotrain.orchestrate.training_run import train
from geotrain.report.run_report import report_run
from geotrain.runtime.train_config import ElasticConfig, ServeConfig, TrainConfig, WanConfig

DEFAULT_SPEC = "examples/tiny_2dc.toml"
# The model BubbleTea serves: a small Llama geotrain trained on the built-in corpus (see its README).
SERVED_MODEL = "examples/models/py-tiny/geotrain-py-tiny"
# Each ends inside a line: the served model is small, and after a bare newline or indentation its
# likeliest continuation is more indentation.
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return ", "import os\nimport sys\n\ndef main(",
           "class Stack:\n    def push(self, x):\n        self.", "for i in range(10):\n    print(",
           "# Return the sum of a list\ndef total(xs):\n    return sum(", "with open(path) as f:\n    data = f."]


def demo(spec: str | None = None, out: str = "runs/demo", steps: int | None = None, requests: int = 6,
         profile: bool = True, wan: str = "auto", cut_dc: str | None = None, say=print) -> None:
    """The five steps of the module docstring, into OUT (plan.json, sim/, profile.json, train/)."""
    # Checked here, not by `train` at step 4 after planning and simulating (and 0 was taken as "unset").
    if steps is not None and steps < 1:
        raise GeotrainError(f"--steps must be at least 1 (got {steps})")
    if requests < 0:
        raise GeotrainError(f"--requests must be >= 0 (got {requests})")
    spec = spec or _default_spec()
    out_dir = Path(out)
    say(f"== 1/5  plan: {spec}")
    plan_command(spec, out=str(out_dir / "plan.json"), say=say)
    say(f"\n== 2/5  simulate the plan -> {out_dir / 'sim'}")
    simulate_command(spec, str(out_dir / "sim"), plan_path=str(out_dir / "plan.json"), compare=False, say=say)
    profile_path = None
    if profile:
        profile_path = out_dir / "profile.json"
        say(f"\n== 3/5  measure this machine for a calibrated prediction -> {profile_path}")
        # The calibration run uses the training run's WAN (its message overhead is measured there).
        profile_machine(spec, str(profile_path), quick=True, mode=wan if wan in ("kernel", "shaper") else "auto",
                        say=say)
    say(f"\n== 4/5  train for real across emulated datacenters, BubbleTea prefill in the bubbles "
        f"-> {out_dir / 'train'}")
    port = _free_port()
    results: list = []
    stop = threading.Event()
    client = threading.Thread(target=_client, args=(f"http://127.0.0.1:{port}", (PROMPTS * 10)[:requests], results,
                                                    stop), daemon=True)
    client.start()
    config = TrainConfig(
        out=str(out_dir / "train"), steps=steps, profile=str(profile_path) if profile_path else None,
        serve=ServeConfig(port=port, model=_shipped(SERVED_MODEL, "the demo's served model",
                                                    "restore examples/models/py-tiny")),
        wan=WanConfig(mode=wan), elastic=ElasticConfig(enabled=bool(cut_dc), cut_dc=cut_dc),
        checkpoint_every=2 if cut_dc else None)
    try:
        train(str(out_dir / "plan.json"), config, say=say)
    finally:
        stop.set()
        client.join(timeout=5)
    _say_answers(results, say)
    say(f"\n== 5/5  report: measured vs predicted -> {out_dir / 'train' / 'report.html'}")
    report_run(out_dir / "train", say=say)


def _say_answers(results: list, say) -> None:
    say("\nBubbleTea answers received while training (prompt -> completion sampled at temperature 0.6 from "
        f"{SERVED_MODEL}, a 0.8 M-parameter model geotrain trained for a few CPU minutes on the standard "
        "library's sources: Python-looking, not correct code):")
    for prompt, status, doc in results:
        shown = prompt.replace("\n", "\\n")[-36:]
        if status == 200:
            say(f"  {shown!r:40} -> TTFT {doc['ttft_ms']:7.0f} ms on {doc['prefill_on']:>8}, "
                f"{len(doc['token_ids'])} tokens {doc['text'][:40]!r}")
        else:
            say(f"  {shown!r:40} -> HTTP {status} {doc.get('message', '')}")
    if not results:
        say("  (none: training ended before the first request; use --steps to train longer)")


def _default_spec() -> str:
    return _shipped(DEFAULT_SPEC, "the built-in demo spec", "pass a SPEC")


def _shipped(rel: str, what: str, hint: str) -> str:
    """A file shipped in the repository: relative to the working directory, else to the checkout."""
    here = Path(__file__).resolve().parents[3] / rel
    if Path(rel).exists():
        return rel
    if here.exists():
        return str(here)

    raise GeotrainError(f"cannot find {what} {rel}; {hint}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(url: str, prompts: list[str], results: list, stop) -> None:
    """Send prompts one after another while training runs; keep every answer."""
    u = urlparse(url)
    deadline = time.time() + 120
    while not stop.is_set() and time.time() < deadline:  # wait until a training rank has joined
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=2)
            c.request("GET", "/healthz")
            ready = json.loads(c.getresponse().read()).get("ready")
            c.close()
            if ready:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.5)
    time.sleep(2)  # let training warm up: the ranks learn their bubbles in the first iterations
    for p in prompts:
        if stop.is_set():
            return
        try:
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=300)
            c.request("POST", "/v1/completions", json.dumps({"prompt": p, "max_tokens": 40, "temperature": 0.6,
                                                             "top_p": 0.9, "seed": len(results)}))
            r = c.getresponse()
            doc = json.loads(r.read())
            results.append((p, r.status, doc["choices"][0] if r.status == 200 else doc.get("error", {})))
            c.close()
        except (OSError, ValueError) as e:
            results.append((p, 0, {"message": str(e)}))
        time.sleep(0.6)   # all six land while training runs (about 8 s of steps here)
