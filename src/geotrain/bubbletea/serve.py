"""Start the prefill-as-a-service endpoint whose work runs in training ranks' bubbles."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from geotrain.bubbletea.bubble_executor import BubbleExecutor
from geotrain.bubbletea.executor import DecodeWorker
from geotrain.bubbletea.model_source import load_inference_model
from geotrain.bubbletea.service import PrefillService
from geotrain.process import private_dir
from geotrain.trace.schema import json_text
from geotrain.transport.auth import write_secret_file


@dataclass
class RunningService:
    service: PrefillService
    executor: BubbleExecutor
    url: str
    rank_config: dict          # what each rank needs to join (TrainConfig.serve's address, secret_file...)
    model: object = None       # the inference model, for requests left when training ends
    work_dir: str | None = None  # holds the Unix socket and the ranks' secret file; removed on close

    def close(self) -> int:
        """Stop taking requests (503), prefill what is still queued here, answer everyone, then
        shut down. Returns how many requests had to be finished after training."""
        self.service.stop_accepting()
        left = self.executor.finish_locally(self.model)
        self.service.wait_idle()
        self.service.close()
        self.executor.close()
        if self.service.run_dir:
            self._write_summary(left)
        if self.work_dir is not None:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return left


    def _write_summary(self, finished_after: int) -> None:
        """RUN_DIR/bubbletea.json: what the report's BubbleTea section shows (all measured)."""
        # lazy: prometheus_client only when called (importers that never call it stay free of it)
        from geotrain.bubbletea.prometheus import quantile

        s = self.service.stats
        with s.lock:
            ttfts, responses = sorted(s.ttfts), dict(s.responses)
        prefill_s, bubble_s = self.executor.bubble_seconds()
        doc = {"model": self.service.model_name, "responses": {str(k): v for k, v in sorted(responses.items())},
               "answered": len(ttfts), "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p99_s": quantile(ttfts, 0.99),
               "prefill_tokens": s.prefill_tokens, "completion_tokens": s.completion_tokens,
               "prefill_s": prefill_s, "bubble_s": bubble_s,
               "prefill_share_of_rank_time": self.executor.utilization_gained(),
               "finished_after_training": finished_after, "client_disconnects": s.disconnects}
        out = Path(self.service.run_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bubbletea.json").write_text(json_text(doc, indent=2) + "\n")


def start_service(host: str = "127.0.0.1", port: int = 0, inference_model: str = "tiny",  # a preset or HF dir
                  token: str | None = None, max_queue: int = 64, unix: bool = True,
                  priority: str = "auto", run_dir: str | None = None) -> RunningService:
    """HTTP API on host:port. Ranks fetch work from the executor (after proving they hold the secret
    in the folder's 0600 file, `rank_config["secret_file"]`) over a Unix socket in a
    private temporary folder (it reaches ranks inside the emulated DCs' network namespaces,
    and its path stays short), or over local TCP with unix=False. The decode worker runs here,
    on the launcher, as a separate decode machine would. A port in use is a GeotrainError, and
    nothing (temporary folder, executor socket) is left behind.

    priority: "idle" runs the ranks' prefill on a SCHED_IDLE thread and this service's HTTP
    threads (and decoding) at idle priority too (see idle_priority), "normal" runs both as usual,
    "auto" picks idle on CPU and normal with CUDA, where the service has host cores of its own.
    The executor threads that answer ranks keep normal priority."""

    if priority == "auto":
        priority = "normal" if torch.cuda.is_available() else "idle"
    work_dir = str(private_dir("bt"))       # 0700, swept if this process is killed: the socket and the ranks' secret
    executor = None
    try:
        if unix:
            executor = BubbleExecutor(unix_path=os.path.join(work_dir, "work.sock"))
        else:
            executor = BubbleExecutor(host="127.0.0.1")
        secret_file = write_secret_file(Path(work_dir) / "secret", executor.secret)
        served = load_inference_model(inference_model)
        model, spec = served.model, served.spec
        svc = PrefillService(executor, DecodeWorker(model), max_queue=max_queue, token=token, vocab=spec.vocab,
                             max_prompt_tokens=spec.seq_len - 1, model_name=served.name, run_dir=run_dir,
                             tokenizer=served.tokenizer)
        h, p = svc.serve(host, port, idle_priority=priority == "idle")
    except BaseException:
        if executor is not None:
            executor.close()
        shutil.rmtree(work_dir, ignore_errors=True)
        raise
    addr = executor.address if isinstance(executor.address, str) else list(executor.address)
    conf = {"address": addr, "inference_model": inference_model, "priority": priority,
            "secret_file": str(secret_file)}
    return RunningService(svc, executor, f"http://{h}:{p}", conf, model, work_dir)
