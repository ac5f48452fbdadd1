"""The serving benchmark's output: the side-by-side table, the PNG plot, and targets of one endpoint against
a peer (issue 12's targets against the llama.cpp server on the 32-chat workload)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

RUN_LABELS = {"pass1": "chats, first time", "pass2": "chats, repeated", "single": "single stream"}


def run_label(run: str) -> str:
    if run in RUN_LABELS:
        return RUN_LABELS[run]
    return f"chats, pass {run.removeprefix('pass')}" if run.startswith("pass") else run


def _p(d: dict[str, float] | None, key: str = "p50") -> str:
    return "-" if not d else f"{d[key]:.0f}"


def table(results: dict[str, Any]) -> str:
    """One line per (run, endpoint): throughput, TTFT / TPOT percentiles (ms), cached prompt tokens."""
    head = (f"{'run':<20}{'endpoint':<14}{'ok/n':>7}{'tok/s':>9}{'dec tok/s':>10}{'TTFT p50':>10}{'p90':>8}"
            f"{'p99':>8}{'TPOT p50':>10}{'p99':>7}{'tok/req':>8}{'cached':>10}")
    lines = [head]
    runs: list[str] = []
    for ep in results["endpoints"].values():
        runs += [r for r in ep.get("runs", {}) if r not in runs]
    for run in runs:
        for name, ep in results["endpoints"].items():
            s = ep.get("runs", {}).get(run)
            if s is None:
                continue
            ok = f"{s['requests'] - s['failed']}/{s['requests']}"
            if "completion_tok_per_s" not in s:
                lines.append(f"{run_label(run):<20}{name:<14}{ok:>7}  all failed: {s['errors'][:1]}")
                continue
            cached = "-" if s["cached_tokens"] is None else f"{s['cached_tokens']}/{s['prompt_tokens']}"
            dec = "-" if s["decode_tok_per_s"] is None else f"{s['decode_tok_per_s']:.1f}"
            lines.append(f"{run_label(run):<20}{name:<14}{ok:>7}{s['completion_tok_per_s']:>9.1f}{dec:>10}"
                         f"{_p(s['ttft_ms']):>10}{_p(s['ttft_ms'], 'p90'):>8}{_p(s['ttft_ms'], 'p99'):>8}"
                         f"{_p(s['tpot_ms']):>10}{_p(s['tpot_ms'], 'p99'):>7}{s['mean_completion_tokens']:>8.1f}"
                         f"{cached:>10}")
    return "\n".join(lines)


def engine_table(results: dict[str, Any]) -> str:
    """The chunkserve endpoints' engine threads per run (`tools/engine_clock.py`): seconds in steps, their CPU
    time, and their wait for a core other processes held; "" when no endpoint reported a step clock."""
    lines = []
    for name, ep in results["endpoints"].items():
        for run, s in ep.get("runs", {}).items():
            c = s.get("engine_clock")
            if not c:
                continue
            share = "-" if c.get("runqueue_share") is None else f"{100 * c['runqueue_share']:.0f} %"
            lines.append(f"{run_label(run):<20}{name:<14}{c['busy_s']:>10.2f}{c['cpu_s']:>10.2f}"
                         f"{c['runqueue_s']:>12.2f}{share:>9}")
    if not lines:
        return ""
    head = f"{'engine threads':<20}{'endpoint':<14}{'in steps':>10}{'CPU':>10}{'run queue':>12}{'share':>9}"
    return "\n".join([head, *lines])


def plot(results: dict[str, Any], path: Path) -> None:
    """Bars per run and endpoint: completion tok/s, TTFT p50 (with p90 whiskers), TPOT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = list(results["endpoints"])
    runs: list[str] = []
    for ep in results["endpoints"].values():
        runs += [r for r in ep.get("runs", {}) if r not in runs]
    panels = (("completion tokens / s", "completion_tok_per_s", None), ("TTFT p50 (ms, whisker p90)", "ttft_ms", "p90"),
              ("TPOT p50 (ms)", "tpot_ms", None))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    width = 0.8 / max(1, len(eps))
    for ax, (title, key, hi) in zip(axes, panels, strict=True):
        for j, name in enumerate(eps):
            xs, ys, errs = [], [], []
            for i, run in enumerate(runs):
                s = results["endpoints"][name].get("runs", {}).get(run) or {}
                v = s.get(key)
                if v is None:
                    continue
                xs.append(i + (j - (len(eps) - 1) / 2) * width)
                ys.append(v["p50"] if isinstance(v, dict) else v)
                errs.append(max(0.0, v[hi] - v["p50"]) if hi and isinstance(v, dict) else 0.0)
            ax.bar(xs, ys, width, yerr=[[0.0] * len(errs), errs] if hi else None, label=name, capsize=3)
        ax.set_xticks(range(len(runs)), [run_label(r) for r in runs], rotation=15, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    wl = results["workload"]
    fig.suptitle(f"chunkserve bench serve: {wl['tenants']} tenants x {wl['requests_per_tenant']} requests, "
                 f"~{wl['system_prompt_tokens']}-token system prompts, {results['sampling']['max_tokens']} "
                 f"tokens, T={results['sampling']['temperature']}; {results['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@dataclasses.dataclass(frozen=True)
class Target:
    run: str
    metric: str  # "tok/s", "ttft_p50" or "decode tok/s"
    op: str  # ">=" or "<=" on ours / peer
    bound: float
    text: str


ISSUE12_TARGETS = (
    Target("pass1", "tok/s", ">=", 8.0, "first time: completion tok/s >= 8x"),
    Target("pass1", "ttft_p50", "<=", 1 / 15, "first time: TTFT p50 <= 1/15"),
    Target("pass2", "tok/s", ">=", 1.5, "repeated: completion tok/s >= 1.5x"),
    Target("pass2", "ttft_p50", "<=", 1.0, "repeated: TTFT p50 <= 1x"),
    Target("single", "decode tok/s", ">=", 1.0, "single stream: decode tok/s >= 1x"),
)


def _metric(s: dict[str, Any] | None, metric: str) -> float | None:
    if not s or "completion_tok_per_s" not in s:
        return None
    if metric == "tok/s":
        return s["completion_tok_per_s"]
    if metric == "decode tok/s":
        return s["decode_tok_per_s"]
    return s["ttft_ms"]["p50"] if s["ttft_ms"] else None


def check_targets(results: dict[str, Any], ours: str, peer: str,
                  targets: tuple[Target, ...] = ISSUE12_TARGETS) -> list[dict[str, Any]]:
    """Each target's figures, ratio ours/peer and verdict (MISSING when a run or figure is absent)."""
    eps = results["endpoints"]
    for name in (ours, peer):
        if name not in eps:
            raise ValueError(f"--vs names {name!r}, which is not an endpoint ({', '.join(eps)})")
    out = []
    for t in targets:
        a = _metric(eps[ours].get("runs", {}).get(t.run), t.metric)
        b = _metric(eps[peer].get("runs", {}).get(t.run), t.metric)
        ratio = a / b if a is not None and b else None
        verdict = "MISSING" if ratio is None else (
            "PASS" if (ratio >= t.bound if t.op == ">=" else ratio <= t.bound) else "FAIL")
        out.append({"target": t.text, "run": t.run, "metric": t.metric, ours: a, peer: b,
                    "ratio": None if ratio is None else round(ratio, 4), "need": f"{t.op} {t.bound:.3g}",
                    "verdict": verdict})
    return out


def targets_table(rows: list[dict[str, Any]], ours: str, peer: str) -> str:
    lines = [f"{'target':<38}{ours[:12]:>13}{peer[:12]:>13}{'ratio':>9}{'need':>12}  verdict"]
    for r in rows:
        a, b = r[ours], r[peer]
        fa = "-" if a is None else f"{a:.1f}"
        fb = "-" if b is None else f"{b:.1f}"
        fr = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"{r['target']:<38}{fa:>13}{fb:>13}{fr:>9}{r['need']:>12}  {r['verdict']}")
    return "\n".join(lines)
