"""`geotrain profile`: measure this machine for a job, write the profile file, say what was measured."""

from __future__ import annotations

import time

from geotrain.calibrate.measure import measure_profile
from geotrain.calibrate.profile_file import MeasuredProfile, save_profile
from geotrain.errors import GeotrainError
from geotrain.spec.load import load_spec


def profile_machine(spec_path: str, out: str, quick: bool = False, micro_batches: list[int] | None = None,
                    mode: str = "shaper", say=print) -> MeasuredProfile:
    """Measure (`measure.measure_profile`) for `spec_path`'s model and job, save to `out`, and say the
    numbers; returns the profile."""
    spec = load_spec(spec_path)
    if micro_batches and min(micro_batches) < 1:
        raise GeotrainError("--micro-batch must be at least 1")
    t0 = time.time()
    prof = measure_profile(spec, quick=quick, micro_batches=micro_batches, mode=mode,
                           progress=lambda msg: say(f"  {time.time() - t0:5.1f} s  {msg}"))
    save_profile(prof, out)
    typed = MeasuredProfile.of(prof)
    for line in summary_lines(typed, spec.model.name, time.time() - t0, out):
        say(line)
    return typed


def summary_lines(profile: MeasuredProfile, model: str, seconds: float, out: str) -> list[str]:
    """What a profile measured, a line each (`geotrain profile`'s output)."""
    rt, cal = profile.runtime, profile.runtime.calibration_run
    mb = rt.micro_batches[0]
    lines = [f"profile of {model} ({rt.precision}, micro-batch {mb}) in {seconds:.0f} s -> {out}"]
    for kind in ("embedding", "block", "head"):
        f, b = getattr(profile, kind)[str(mb)][:2]
        lines.append(f"  {kind:<9} forward {1e3 * f:7.3f} ms  backward {1e3 * b:7.3f} ms")
    opt = rt.optimizer
    lines.append(f"  optimizer {1e3 * opt.fixed_s:.3f} ms + {1e9 * opt.per_param_s:.2f} ns/param; "
                 f"per-action overhead {1e6 * rt.per_action_s:.0f} us; start-up {rt.startup_s:.1f} s")
    for n, fit in rt.allreduce.items():
        lines.append(f"  all-reduce dp={n}: {1e3 * fit.alpha_s:.3f} ms + {fit.per_byte_s * 1e9:.3f} ns/byte")
    lines.append("  contention (slow-down with k ranks computing): "
                 + ", ".join(f"k={k} x{v:.2f}" for k, v in rt.contention.items())
                 + f" (other runnable threads meanwhile: {rt.background_runnable:.1f})")
    lines.append("  runtime compute factor: " + ", ".join(
        f"{k} x{v:.2f}" for k, v in rt.compute_factor.model_dump(exclude_unset=True).items()))
    lines.append(f"  calibration run ({cal.wan_mode} WAN): WAN message overhead "
                 f"{1e3 * rt.wan_message_overhead_s:.2f} ms, "
                 f"global loss/overflow all-reduce {1e3 * (cal.global_sync_s or 0.0):.2f} ms, "
                 f"iteration {1e3 * (cal.measured_iteration_s or 0.0):.1f} ms")
    if rt.wan_messages is not None:
        wm = rt.wan_messages
        lines.append("  WAN message probe (isolated, receiver waiting): overhead "
                     + ", ".join(f"{1e3 * v:.2f} ms at {k} ms" for k, v in wm.overhead_s.items())
                     + f"; back-to-back gap {1e3 * wm.gap_s:.2f} ms per message")
    if rt.wan is not None:
        lines.append("  WAN achieved: " + ", ".join(f"{n} conn {g * 1000:.0f} Mb/s"
                                                    for n, g in rt.wan.achieved_gbps.items()))
    return lines
