"""The validation tables: per case the prediction (made before the runs, so one number) beside
each run's measurement, then mean and worst |error| per run and over all runs.

Errors are (predicted - measured) / measured. Bubble time is per rank and iteration (time with no
training compute); a case's bubble error is that of the ranks' mean (= the total), and the worst
single rank's error is given as well.
"""

from __future__ import annotations

from geotrain.calibrate.case_rows import CaseRow


def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def _ranks(d: dict[int, float]) -> str:
    return " ".join(f"{1e3 * d[r]:.0f}" for r in sorted(d))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def stats(rows: list[CaseRow]) -> dict[str, float]:
    """Mean and worst |error| over `rows`: iteration time, bubble time (per case and its worst
    rank), and the post-hoc prediction that used the run's measured CPU share."""
    it = [abs(r.iteration_error) for r in rows]
    bub = [abs(r.bubble_error) for r in rows]
    ph = [abs(r.posthoc_error) for r in rows if r.posthoc_iteration_s is not None]
    nan = float("nan")
    return {"iteration_mean": _mean(it), "iteration_worst": max(it, default=nan),
            "bubble_mean": _mean(bub), "bubble_worst": max(bub, default=nan),
            "bubble_rank_worst": max((r.worst_rank_bubble_error for r in rows), default=nan),
            "posthoc_mean": _mean(ph), "posthoc_worst": max(ph, default=nan)}


def _pair(s: dict, key: str) -> str:
    return f"{100 * s[key + '_mean']:.1f} / {100 * s[key + '_worst']:.1f}"


def validation_markdown(all_runs: list[dict], modes, conditions: dict) -> str:
    head_mode, others = modes[0], modes[1:]
    runs = len(all_runs)
    cases = [r.case for r in all_runs[0][head_mode]["rows"]]
    rk = "runs 1-" + str(runs) if runs > 1 else "run"
    cols = ["case", "setup", "iteration pred (ms)", f"iteration meas (ms), {rk}", "error",
            "bubble per rank pred (ms)", f"bubble per rank meas (ms), mean of {runs}", "bubble error"]
    cols += [f"{m}: iteration error" for m in others] + [f"{m}: bubble error" for m in others]
    cols += ["post-hoc iteration error", f"training compute meas / pred, {rk}"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, name in enumerate(cases):
        rows = [r[head_mode]["rows"][i] for r in all_runs]
        r0 = rows[0]
        meas_bub = {rank: _mean([r.measured_bubble_rank.get(rank, 0.0) for r in rows])
                    for rank in r0.measured_bubble_rank}
        cells = [name, r0.description, _ms(r0.predicted_iteration_s),
                 " / ".join(_ms(r.measured_iteration_s) for r in rows),
                 " / ".join(_pct(r.iteration_error) for r in rows),
                 _ranks(r0.predicted_bubble_rank), _ranks(meas_bub),
                 " / ".join(_pct(r.bubble_error) for r in rows)]
        for m in others:
            cells.append(" / ".join(_pct(r[m]["rows"][i].iteration_error) for r in all_runs if m in r))
        for m in others:
            cells.append(" / ".join(_pct(r[m]["rows"][i].bubble_error) for r in all_runs if m in r))
        cells.append(" / ".join(_pct(r.posthoc_error) for r in rows))
        ratios = [r[head_mode]["details"].get(name, {}).get("compute_ratio") for r in all_runs]
        cells.append(" / ".join(f"{x:.2f}" if x else "-" for x in ratios))
        lines.append("| " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"

    scol = ["run"] + [f"{m}: iteration mean / worst (%)" for m in modes] + \
        [f"{m}: bubble mean / worst (%)" for m in modes] + \
        [f"{head_mode}: worst rank's bubble (%)", f"{head_mode} post-hoc iteration mean / worst (%)",
         "other runnable threads (mean)", "other sessions runnable (mean; autogroup)",
         "CPU stolen by the host (cores, mean)",
         "block time before each case / profile's (mean)"]
    slines = ["| " + " | ".join(scol) + " |", "|" + "---|" * len(scol)]

    def srow(label: str, picked: list[dict]) -> str:
        st = {m: stats([x for r in picked if m in r for x in r[m]["rows"]]) for m in modes}
        bg = _mean([d["background_runnable"] for r in picked for m in r for d in r[m]["details"].values()])

        def pair(m: str, key: str) -> str:
            return _pair(st[m], key) if any(m in r for r in picked) else "-"

        cells = [label] + [pair(m, "iteration") for m in modes] + [pair(m, "bubble") for m in modes]
        steal = _mean([d.get("steal_cores", 0.0) for r in picked for m in r for d in r[m]["details"].values()])
        speed = [d["unit_time_vs_profile"] for r in picked for m in r for d in r[m]["details"].values()
                 if d.get("unit_time_vs_profile")]
        sess = [d["background_sessions"] for r in picked for m in r for d in r[m]["details"].values()
                if d.get("background_sessions") is not None]
        cells += [f"{100 * st[head_mode]['bubble_rank_worst']:.1f}", _pair(st[head_mode], "posthoc"), f"{bg:.1f}",
                  f"{_mean(sess):.1f}" if sess else "-",
                  f"{steal:.2f}", f"{_mean(speed):.2f}" if speed else "-"]
        return "| " + " | ".join(cells) + " |"

    for k, r in enumerate(all_runs, 1):
        slines.append(srow(str(k), [r]))
    if runs > 1:
        slines.append(srow("**all**", all_runs))
    summary = "\n".join(slines) + "\n"
    overall = stats([x for r in all_runs for x in r[head_mode]["rows"]])
    foot = (f"\nPredictive CPU set on this drifting 2-core VM ({head_mode} WAN, {runs} run(s) x {len(cases)} cases): "
            f"mean |iteration-time error| "
            f"{100 * overall['iteration_mean']:.1f}%, worst {100 * overall['iteration_worst']:.1f}%; mean "
            f"|bubble-time error| {100 * overall['bubble_mean']:.1f}%, worst {100 * overall['bubble_worst']:.1f}%.\n\n"
            f"Predictions were made from the profile alone (profile-<mode>.json, taken once before the runs) and "
            f"written before each run started; \"post-hoc\" is a second prediction made after the run with each "
            f"stage's compute scaled by its ranks' measured CPU share (run-queue wait), for diagnosis only; "
            f"\"training compute meas / pred\" is the ranks' forward/backward/optimizer time per iteration in the "
            f"run over the prediction's (diagnosis: above 1, compute ran slower than the profile said). "
            f"Machine: {conditions['cores']} CPU cores ({conditions['cpu']}), one CPU thread per rank; "
            f"{conditions['steps']} steps per case, the first {conditions['warmup']} discarded; "
            f"{conditions['wall_s']:.0f} s in all."
            + (f" The {', '.join(others)} column(s) were measured in the first {conditions['other_mode_runs']} "
               "run(s) only." if others and conditions.get('other_mode_runs', runs) < runs else "") + "\n")
    return table + "\n" + summary + foot



def replay_stats(rows: list[CaseRow]) -> dict[str, float]:
    """Mean and worst |error| of the replays (calibrate.replay) in `rows`: iteration time, the
    ranks' bubble time, and the worst single rank's bubble."""
    rows = [r for r in rows if r.replay_iteration_s is not None]
    it = [abs(r.replay_error) for r in rows]
    bub = [abs(r.replay_bubble_error) for r in rows]
    nan = float("nan")
    return {"iteration_mean": _mean(it), "iteration_worst": max(it, default=nan), "bubble_mean": _mean(bub),
            "bubble_worst": max(bub, default=nan),
            "rank_worst": max((r.replay_worst_rank_error for r in rows), default=nan), "cases": len(rows)}


def replay_markdown(all_runs: list[dict], mode: str) -> str:
    """Replay vs measurement per case (each run's own replay), then per run and over all runs."""
    runs = [r for r in all_runs if mode in r]
    if not runs:
        return ""
    cases = [r.case for r in runs[0][mode]["rows"]]
    rk = "runs 1-" + str(len(runs)) if len(runs) > 1 else "run"
    cols = ["case", "setup", f"iteration meas (ms), {rk}", "replay (ms)", "error", "bubble per rank meas (ms), run 1",
            "replay (ms)", "bubble error (ranks' mean)", "worst rank's bubble error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, name in enumerate(cases):
        rows = [r[mode]["rows"][i] for r in runs]
        r0 = rows[0]
        lines.append("| " + " | ".join([
            name, r0.description, " / ".join(_ms(r.measured_iteration_s) for r in rows),
            " / ".join(_ms(r.replay_iteration_s) if r.replay_iteration_s else "-" for r in rows),
            " / ".join(_pct(r.replay_error) for r in rows), _ranks(r0.measured_bubble_rank),
            _ranks(r0.replay_bubble_rank), " / ".join(_pct(r.replay_bubble_error) for r in rows),
            " / ".join(f"{100 * r.replay_worst_rank_error:.1f}%" for r in rows)]) + " |")
    scol = ["run", "iteration mean / worst (%)", "bubble mean / worst (%)", "worst rank's bubble (%)"]
    slines = ["| " + " | ".join(scol) + " |", "|" + "---|" * len(scol)]
    for label, picked in [(str(k), [r]) for k, r in enumerate(runs, 1)] + ([("**all**", runs)] if len(runs) > 1
                                                                                 else []):
        st = replay_stats([x for r in picked for x in r[mode]["rows"]])
        slines.append(f"| {label} | {_pair(st, 'iteration')} | {_pair(st, 'bubble')} | {100 * st['rank_worst']:.1f} |")
    st = replay_stats([x for r in runs for x in r[mode]["rows"]])
    foot = (f"\nReplay ({mode} WAN, {len(runs)} run(s) x {len(cases)} cases): mean |iteration-time error| "
            f"{100 * st['iteration_mean']:.1f}%, worst {100 * st['iteration_worst']:.1f}%; bubble "
            f"{100 * st['bubble_mean']:.1f}% / {100 * st['bubble_worst']:.1f}%. A replay is NOT a prediction: each "
            "case's measured compute durations (per op, per rank) are put back into the model of everything else.\n")
    return "\n".join(lines) + "\n\n" + "\n".join(slines) + "\n" + foot
