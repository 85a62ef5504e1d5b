"""Start the prefill-as-a-service endpoint whose work runs in training ranks' bubbles."""

from __future__ import annotations

from dataclasses import dataclass

from geotrain.bubbletea.bubble_executor import BubbleExecutor
from geotrain.bubbletea.executor import DecodeWorker
from geotrain.bubbletea.service import PrefillService


@dataclass
class RunningService:
    service: PrefillService
    executor: BubbleExecutor
    url: str
    rank_config: dict          # what each rank needs to join (RunConfig.bubbletea)
    model: object = None       # the inference model, for requests left when training ends
    work_dir: str | None = None  # holds the Unix socket; removed on close

    def close(self) -> int:
        """Stop taking requests (503), prefill what is still queued here, answer everyone, then
        shut down. Returns how many requests had to be finished after training."""
        self.service.stop_accepting()
        left = self.executor.finish_locally(self.model)
        self.service.wait_idle()
        self.service.close()
        self.executor.close()
        if self.work_dir is not None:
            import shutil

            shutil.rmtree(self.work_dir, ignore_errors=True)
        return left


def start_service(host: str = "127.0.0.1", port: int = 0, inference_model: str = "tiny",
                  token: str | None = None, max_queue: int = 64, unix: bool = True,
                  priority: str = "auto") -> RunningService:
    """HTTP API on host:port. Ranks fetch work from the executor over a Unix socket in a
    private temporary folder (it reaches ranks inside the emulated DCs' network namespaces,
    and its path stays short), or over local TCP with unix=False. The decode worker runs here,
    on the launcher, as a separate decode machine would.

    priority: "idle" runs the ranks' prefill on a SCHED_IDLE thread and this service's HTTP
    threads (and decoding) at idle priority too (see idle_priority), "normal" runs both as usual,
    "auto" picks idle on CPU and normal with CUDA, where the service has host cores of its own.
    The executor threads that answer ranks keep normal priority."""
    import os
    import tempfile

    from geotrain.models.llama import build_model
    from geotrain.models.presets import PRESETS

    work_dir = None
    if unix:
        work_dir = tempfile.mkdtemp(prefix="geotrain-bt-")
        executor = BubbleExecutor(unix_path=os.path.join(work_dir, "work.sock"))
    else:
        executor = BubbleExecutor(host="127.0.0.1")
    model = build_model(PRESETS[inference_model]).eval()
    svc = PrefillService(executor, DecodeWorker(model), max_queue=max_queue, token=token,
                         vocab=PRESETS[inference_model].vocab,
                         max_prompt_tokens=PRESETS[inference_model].seq_len - 16)
    if priority == "auto":
        import torch

        priority = "normal" if torch.cuda.is_available() else "idle"
    h, p = svc.serve(host, port, idle_priority=priority == "idle")
    addr = executor.address if isinstance(executor.address, str) else list(executor.address)
    conf = {"address": addr, "inference_model": inference_model, "priority": priority}
    return RunningService(svc, executor, f"http://{h}:{p}", conf, model, work_dir)
