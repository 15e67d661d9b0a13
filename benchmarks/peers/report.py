"""peers.md and peers.png from the harness's raw results (peers.json): per workload and stage, each side's seconds
(minimum over repetitions), the ratio to ours, GFLOP/s by the flop model, the share of the GEMM rate, peak RSS,
agreement; the W2 end-to-end choice, the pipeline rows, and whether each target holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import execute
import flops

STAGES = ("fit", "query_factors", "pairwise", "scoring", "total")
GB = 2.0**30


def summarise(run: dict[str, Any]) -> dict[str, Any]:
    """Minimum seconds per stage over the finished repetitions (scoring = query factors + pairwise when both are
    timed; total = fit + scoring, and the index when the library built one), peak RSS (maximum over repetitions), and the last repetition's info."""
    good = [r for r in run["reps"] if execute.ok(r)]
    if not good:
        return {"ok": False, "outcome": execute.outcome(run["reps"][-1]) if run["reps"] else "not run"}
    seconds = {s: min(r["stages"][s] for r in good) for s in good[0]["stages"]}
    if "query_factors" in seconds and "pairwise" in seconds:
        seconds["scoring"] = seconds["query_factors"] + seconds["pairwise"]
    if "fit" in seconds and "scoring" in seconds:
        seconds["total"] = seconds["fit"] + seconds.get("index", 0.0) + seconds["scoring"]
    rss = {s: max(r.get("stage_peak_rss_bytes", {}).get(s, 0) for r in good) for s in good[0]["stages"]}
    peak = max(r["peak_rss_bytes"] for r in good)
    rss["scoring"] = rss.get("pairwise", rss.get("scoring", peak))
    rss["total"] = peak
    return {"ok": True, "seconds": seconds, "rss": rss, "peak": peak, "reps": len(good), "info": good[-1]}


def stage_gflop(run: dict[str, Any], spec: dict[str, Any], stage: str, info: dict[str, Any]) -> float | None:
    c = run["config"]
    if stage == "total":
        parts = [flops.stage_flops(s, c["method"], c["matrix"], spec, c["options"], info) for s in ("fit", "scoring")]
        parts = [0.0 if s == "fit" and v is None and c["method"] in ("cg", "lissa") else v for s, v in zip(("fit", "scoring"), parts)]
        return None if None in parts else sum(parts) / 1e9  # type: ignore[arg-type]
    value = flops.stage_flops(stage, c["method"], c["matrix"], spec, c["options"], info)
    return None if value is None else value / 1e9


def gemm_ceiling(results: dict[str, Any], threads: int) -> float | None:
    """The best float32 GEMM rate seen at `threads` threads, at the start or the end of the run."""
    rates = [g["best"][str(threads)] for g in results.get("gemm", {}).values() if execute.ok(g)]
    return max(rates) if rates else None


def _f(value: float | None, fmt: str = "{:.2f}", none: str = "—") -> str:
    return none if value is None else fmt.format(value)


def workload_description(s: dict[str, Any]) -> tuple[str, str]:
    """The data and the model of a workload, in words."""
    if s.get("model") == "gpt":
        return (f"windows of {s['features']} bytes of the standard library's docstrings",
                f"byte-level GPT: {s['blocks']} pre-norm blocks, d_model {s['d_model']}, {s['heads']} heads, vocabulary {s['vocab']}, Adam")
    data = "scikit-learn digits" if s["source"] == "digits" else f"synthetic, {s['features']} features, {s['classes']} classes"
    return data, f"MLP {s['features']}-{'-'.join(map(str, s['hidden']))}-{s['classes']} ({s['activation']}), Adam"


def stage_table(results: dict[str, Any], workload: str, ceiling: float | None) -> list[str]:
    spec = results["workloads"][workload]["spec"]
    lines = [
        "| row | side | configuration | stage | seconds | × ours | GFLOP | GFLOP/s | % of GEMM | peak RSS GB | reps |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in (r for r in results["rows"] if r["workload"] == workload and r["kind"] == "compare"):
        ours = summarise(results["runs"][row["configs"][0]])
        for key in row["configs"]:
            run = results["runs"][key]
            c, s = run["config"], summarise(run)
            if not s["ok"]:
                lines.append(f"| {row['title']} | {c['side']} | {c['label']} | — | {s['outcome']} | | | | | | 0 |")
                continue
            for stage in STAGES:
                if stage not in s["seconds"]:
                    continue
                sec = s["seconds"][stage]
                ratio = ours["seconds"].get(stage) if ours["ok"] else None
                gflop = stage_gflop(run, spec, stage, s["info"])
                rate = gflop / sec if gflop is not None and sec > 0 else None
                share = 100 * rate / ceiling if rate is not None and ceiling else None
                lines.append(
                    f"| {row['title']} | {c['side']} | {c['label']} | {stage} | {sec:.2f} | {_f(sec / ratio if ratio else None)} | {_f(gflop, '{:.1f}')} | "
                    f"{_f(rate, '{:.1f}')} | {_f(share, '{:.0f}%')} | {s['rss'].get(stage, s['peak']) / GB:.2f} | {s['reps']} |"
                )
    return lines


APPROXIMATES = {"ekfac": "ggn", "kfac": "ggn"}  # the matrix a Kronecker-factored side is compared with: the true Fisher = the GGN


def agreement_table(results: dict[str, Any], workload: str) -> list[str]:
    refs = results["references"].get(workload, {})
    lines = ["| row | side | configuration | solves | Pearson vs ours | Spearman vs ours | scale vs ours | Pearson vs exact | Spearman vs exact | scale vs exact | exact answer |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in (r for r in results["rows"] if r["workload"] == workload and r["kind"] == "compare"):
        for key in row["configs"]:
            run = results["runs"][key]
            c = run["config"]
            ours = next(iter(run.get("vs_ours", {}).values()), None)
            matrix = next((m for m in (c["matrix"], APPROXIMATES.get(c["matrix"])) if m in refs), None)
            exact = run.get("vs_exact", {}).get(matrix) if matrix else None
            where = f"{matrix}, {refs[matrix].get('solver')}, first {refs[matrix]['queries']} queries" if matrix else "none fits"
            me = "ours" if key == row["configs"][0] else "—"
            lines.append(
                f"| {row['title']} | {c['side']} | {c['label']} | {c['matrix']} | {_f(ours and ours['pearson'], '{:.4f}', me)} | "
                f"{_f(ours and ours['spearman'], '{:.4f}', me)} | {_f(ours and ours['scale'], '{:.3f}', me)} | {_f(exact and exact['pearson'], '{:.4f}')} | "
                f"{_f(exact and exact['spearman'], '{:.4f}')} | {_f(exact and exact['scale'], '{:.3f}')} | {where} |"
            )
    return lines


def end_to_end(results: dict[str, Any], threshold: float) -> tuple[list[str], dict[str, Any]]:
    """Every W2 path with its total time and agreement with the converged answer of its own matrix; per side,
    the fastest path whose Pearson reaches `threshold`."""
    keys = [k for row in results["rows"] if row["workload"] == "W2" for k in row["configs"]]
    keys = list(dict.fromkeys(keys))
    lines = ["| side | path | solves | total s (fit + factors + pairwise) | Pearson vs exact (its matrix) | Pearson vs exact GGN | ≥ threshold |", "|---|---|---|---|---|---|---|"]
    best: dict[str, tuple[float, str]] = {}
    for key in keys:
        run = results["runs"][key]
        c, s = run["config"], summarise(run)
        own = run.get("vs_exact", {}).get(c["matrix"])
        ggn = run.get("vs_exact", {}).get("ggn")
        if not s["ok"] or "total" not in s["seconds"]:
            lines.append(f"| {c['side']} | {c['label']} | {c['matrix']} | {s.get('outcome', '—')} | | | |")
            continue
        total = s["seconds"]["total"]
        meets = own is not None and own["pearson"] >= threshold
        if meets and (c["side"] not in best or total < best[c["side"]][0]):
            best[c["side"]] = (total, c["label"])
        lines.append(f"| {c['side']} | {c['label']} | {c['matrix']} | {total:.1f} | {_f(own and own['pearson'], '{:.4f}')} | {_f(ggn and ggn['pearson'], '{:.4f}')} | {'yes' if meets else 'no'} |")
    return lines, best


def pipeline_section(results: dict[str, Any]) -> tuple[list[str], dict[str, dict[str, float]]]:
    lines: list[str] = []
    measured: dict[str, dict[str, float]] = {}
    pairs = [("fit_preconditioner", "fit"), ("index_training", "index"), ("compute_test_factors", "query_factors"), ("compute_influences", "pairwise")]
    for entry in results["pipelines"]:
        lines += ["", f"### {entry['workload']}: {entry['title']}", ""]
        if "skipped" in entry:
            lines.append(f"Not run: {entry['skipped']}.")
            continue
        good = [r for r in entry["reps"] if execute.ok(r)]
        if not good:
            lines.append(f"Not measured: {execute.outcome(entry['reps'][-1])}.")
            continue
        lib = summarise({"reps": entry["library_reps"]} if entry.get("library_reps") else results["runs"][entry["library"]])  # alternated with the pipeline when recorded
        stages = {name: min(r["stages"][name] for r in good) for name in good[0]["stages"]}
        flow = min(r["flow_wall"] for r in good)
        lines += ["| pipeline stage | pipeline s | library stage | library s | pipeline / library |", "|---|---|---|---|---|"]
        for name, seconds in stages.items():
            match = dict(pairs).get(name)
            libs = lib["seconds"].get(match) if match and lib["ok"] else None
            lines.append(f"| {name} | {seconds:.2f} | {match or '—'} | {_f(libs)} | {_f(seconds / libs if libs else None)} |")
        same = sum(stages.get(name, 0.0) for name, _ in pairs)  # index_training: the library's own index pass, or its pairwise's training gradients
        library_total = lib["seconds"]["total"] if lib["ok"] else None
        self_note = " (includes self-influence for every training example: this version cannot switch it off)" if good[-1].get("self_influence") else ""
        lines += [
            "",
            f"- the library's stages{' and index_training' if 'index_training' in stages else ''}: pipeline {same:.2f} s vs library {_f(library_total)} s: "
            f"**{_f(same / library_total if library_total else None)}×**{self_note}",
            f"- whole flow (all six stages, Prefect and Dask start-up included): {flow:.2f} s; orchestration overhead = flow / library total − 1 = "
            f"**{_f(100 * (flow / library_total - 1) if library_total else None, '{:.0f}%')}**",
            f"- stage seconds summed: {sum(stages.values()):.2f} s; peak RSS of driver + workers {max(r['peak_rss_bytes'] for r in good) / GB:.2f} GB; "
            f"repetitions {len(good)}; agreement with the library's scores: Pearson {_f(entry.get('vs_library', {}).get('pearson'), '{:.6f}')}",
        ]
        if entry.get("compute", {}).get("index_budget_gb") == 0 or entry["workload"] not in measured:  # the library's own work, where both ran
            measured[entry["workload"]] = {"same_stages": same, "flow": flow, "library": library_total or float("nan"), "self_influence": float(bool(good[-1].get("self_influence")))}
    return lines, measured


def targets(results: dict[str, Any], ceiling: float | None, best: dict[str, tuple[float, str]], pipes: dict[str, dict[str, float]], threshold: float) -> list[str]:
    def verdict(ok: bool | None) -> str:
        return "not measured" if ok is None else ("**holds**" if ok else "**missed**")

    lines = ["| target | measured | verdict |", "|---|---|---|"]
    w3 = next((r for r in results["rows"] if r["workload"] == "W3" and r["kind"] == "compare"), None)
    if w3:
        ours, theirs = (summarise(results["runs"][k]) for k in w3["configs"][:2])
        spec = results["workloads"]["W3"]["spec"]
        if ours["ok"] and theirs["ok"]:
            speedup = theirs["seconds"]["scoring"] / ours["seconds"]["scoring"]
            lines.append(f"| W3 scoring (query factors + pairwise) ≥ 1.5× faster than Kronfluence | ours {ours['seconds']['scoring']:.2f} s, Kronfluence {theirs['seconds']['scoring']:.2f} s: {speedup:.2f}× | {verdict(speedup >= 1.5)} |")
        else:
            lines.append(f"| W3 scoring ≥ 1.5× faster than Kronfluence | ours {ours.get('outcome', 'ok')}, Kronfluence {theirs.get('outcome', 'ok')} | {verdict(None)} |")
        if ours["ok"] and ceiling:
            rate = stage_gflop(results["runs"][w3["configs"][0]], spec, "scoring", ours["info"]) / ours["seconds"]["scoring"]  # type: ignore[operator]
            lines.append(f"| W3 scoring ≥ 60% of the GEMM rate | {rate:.1f} GFLOP/s of {ceiling:.1f} = {100 * rate / ceiling:.0f}% | {verdict(rate >= 0.6 * ceiling)} |")
    lines += w4_targets(results, pipes, verdict)
    w2_rows = [r for r in results["rows"] if r["workload"] == "W2" and r["kind"] == "compare"]
    if w2_rows and ceiling:
        spec = results["workloads"]["W2"]["spec"]
        parts, holds = [], []
        for row in w2_rows:
            run = results["runs"][row["configs"][0]]
            s = summarise(run)
            rate = stage_gflop(run, spec, "scoring", s["info"]) if s["ok"] else None
            if rate is not None:
                rate /= s["seconds"]["scoring"]
                parts.append(f"{run['config']['label']}: {rate:.1f} GFLOP/s = {100 * rate / ceiling:.0f}%")
                holds.append(rate >= 0.7 * ceiling)
        lines.append(f"| W2 scoring ≥ 70% of the GEMM rate (ours, each row) | {'; '.join(parts) or 'no rate'} | {verdict(all(holds) if holds else None)} |")
    if "W2" in pipes:
        p = pipes["W2"]
        ratio = p["same_stages"] / p["library"]
        note = " (pipeline includes self-influence)" if p["self_influence"] else ""
        lines.append(f"| W2 pipeline within 1.2× of the library on the same rows | {p['same_stages']:.1f} s vs {p['library']:.1f} s = {ratio:.2f}×{note} | {verdict(ratio <= 1.2)} |")
    elif any(e["workload"] == "W2" for e in results["pipelines"]):
        lines.append("| W2 pipeline within 1.2× of the library on the same rows | not run (see Pipeline rows) | not measured |")
    if any(r["workload"] == "W2" for r in results["rows"]):
        if "ours" in best and "pydvl" in best:
            ratio = best["pydvl"][0] / best["ours"][0]
            lines.append(f"| W2 end to end ≥ 5× faster than pyDVL's best path at Pearson ≥ {threshold} with the converged answer | ours {best['ours'][1]} {best['ours'][0]:.1f} s, pyDVL {best['pydvl'][1]} {best['pydvl'][0]:.1f} s: {ratio:.2f}× | {verdict(ratio >= 5)} |")
        else:
            missing = [s for s in ("ours", "pydvl") if s not in best]
            lines.append(f"| W2 end to end ≥ 5× faster than pyDVL's best path | no path of {', '.join(missing)} reached Pearson ≥ {threshold} | not measured |")
    return lines


def w4_targets(results: dict[str, Any], pipes: dict[str, dict[str, float]], verdict: Any) -> list[str]:
    """Issue 26's targets on the GPT: fit ≥ 10× and scoring ≥ 1.5× faster than Kronfluence, agreement with the
    converged CG answer at least Kronfluence's, and the pipeline within 1.3× of the library."""
    row = next((r for r in results["rows"] if r["workload"] == "W4" and r["kind"] == "compare"), None)
    if row is None:
        return []
    runs = [results["runs"][k] for k in row["configs"][:2]]
    ours, theirs = (summarise(run) for run in runs)
    if not (ours["ok"] and theirs["ok"]):
        return [f"| W4 fit, scoring, agreement | ours {ours.get('outcome', 'ok')}, Kronfluence {theirs.get('outcome', 'ok')} | {verdict(None)} |"]
    lines = []
    for stage, factor in (("fit", 10.0), ("scoring", 1.5)):
        speedup = theirs["seconds"][stage] / ours["seconds"][stage]
        lines.append(f"| W4 {stage} ≥ {factor:g}× faster than Kronfluence | ours {ours['seconds'][stage]:.2f} s, Kronfluence {theirs['seconds'][stage]:.2f} s: "
                     f"{speedup:.2f}× | {verdict(speedup >= factor)} |")
    exact = [run.get("vs_exact", {}).get("ggn", {}).get("pearson") for run in runs]
    if None in exact:
        ref = results["references"].get("W4", {}).get("ggn")
        why = "not computed: it needs a GPU (see Not run)" if ref is None else execute.outcome(ref)
        lines.append(f"| W4 agreement with the converged CG answer ≥ Kronfluence's | no converged answer ({why}) | {verdict(None)} |")
    else:
        lines.append(f"| W4 agreement with the converged CG answer ≥ Kronfluence's | Pearson ours {exact[0]:.4f}, Kronfluence {exact[1]:.4f} | {verdict(exact[0] >= exact[1])} |")
    if "W4" in pipes:
        p = pipes["W4"]
        ratio = p["same_stages"] / p["library"]
        lines.append(f"| W4 pipeline within 1.3× of the library on the same rows | {p['same_stages']:.1f} s vs {p['library']:.1f} s = {ratio:.2f}× | {verdict(ratio <= 1.3)} |")
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 5), squeeze=False)
    colours = {"fit": "#4c72b0", "query_factors": "#dd8452", "pairwise": "#55a868", "scoring": "#c44e52"}
    for ax, workload in zip(axes[0], names):
        labels, bottoms = [], []
        rows = [r for r in results["rows"] if r["workload"] == workload and r["kind"] == "compare"]
        pipes = [e for e in results["pipelines"] if e["workload"] == workload and any(execute.ok(r) for r in e["reps"])]
        bars: list[tuple[str, dict[str, float]]] = []
        for row in rows:
            for key in row["configs"]:
                s = summarise(results["runs"][key])
                if s["ok"]:
                    c = results["runs"][key]["config"]
                    bars.append((f"{row['title']}\n{c['side']}", {k: s["seconds"][k] for k in colours if k in s["seconds"] and not (k == "scoring" and "pairwise" in s["seconds"])}))
        for e in pipes:
            good = [r for r in e["reps"] if execute.ok(r)]
            st = {k: min(r["stages"][k] for r in good) for k in good[0]["stages"]}
            bars.append((f"pipeline\n{e['title']}", {"fit": st["fit_preconditioner"], "query_factors": st["compute_test_factors"], "pairwise": st["compute_influences"] + st.get("index_training", 0.0)}))
        for i, (label, parts) in enumerate(bars):
            bottom = 0.0
            for stage, colour in colours.items():
                if stage in parts:
                    ax.bar(i, parts[stage], bottom=bottom, color=colour, label=stage if stage not in bottoms else None)
                    bottoms.append(stage)
                    bottom += parts[stage]
            labels.append(label)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("seconds (min over repetitions)")
        ax.set_title(f"{workload} (p = {results['workloads'][workload]['spec']['n_params']:,})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def duration(results: dict[str, Any]) -> str:
    """How long the run took, or that it was interrupted (then only the rows before the interruption are here)."""
    runs = "".join(
        f"{'' if i == 0 else ';'} `{' '.join(m['argv'])}` at commit {m.get('commit', 'unknown')} started {m['started']}"
        f"{'' if m['complete'] else ' (**interrupted**)'}"
        for i, m in enumerate(results.get("merged_from", []))
    )
    merged = f", merged from separate runs:{runs}" if runs else ""
    if "total_seconds" in results:
        return f" in {results['total_seconds'] / 60:.1f} min{merged}"
    return f"{merged}, **interrupted** after the rows below (rows, sweeps and pipelines not listed were not run)"


def write(results: dict[str, Any], out: Path, suffix: str, threshold: float, threads: int) -> str:
    """Write peers{suffix}.md and .png under `out`; returns the markdown."""
    ceiling = gemm_ceiling(results, threads)
    md = [
        f"# Peer benchmark{' (quick smoke run)' if suffix else ''}: this project vs pyDVL 0.10 and Kronfluence 1.0.1",
        "",
        f"Generated by `{' '.join(results['argv'])}`{'' if suffix else ' (`make bench`)'} on {results['machine']['started']} at commit {results['machine'].get('commit', 'unknown')}"
        f"{duration(results)}; "
        f"{results['machine']['cpus']} CPUs, {results['machine']['platform']}, Python {results['machine']['python']}. "
        "Every side runs as its own subprocess in its own virtualenv with 2 torch threads, on the same data and the same trained "
        "model; sides alternate (ours, peer, ours, peer) and each stage keeps its minimum over the repetitions. "
        "Seconds are wall-clock seconds of the stage; peak RSS is ru_maxrss of the side's process (+ waited-for children) "
        "at the end of the stage. The machine is shared: the load average is recorded beside the GEMM rate.",
        "",
        "## Machine: float32 GEMM rate (torch.mm, square matrices, best of 5)",
        "",
        "| when | threads | " + " | ".join(f"n = {n}" for n in next((g["rates"]["1"] for g in results["gemm"].values() if execute.ok(g)), {})) + " | best | load average (1, 5, 15 min) |",
        "|---|---|" + "---|" * (len(next((g["rates"]["1"] for g in results["gemm"].values() if execute.ok(g)), {})) + 2),
    ]
    for when, g in results["gemm"].items():
        if execute.ok(g):
            for t, rates in g["rates"].items():
                md.append(f"| {when} | {t} | " + " | ".join(f"{v:.1f}" for v in rates.values()) + f" | {g['best'][t]:.1f} | {', '.join(f'{x:.1f}' for x in g['load_average'])} |")
    md += ["", f"The ceiling used for '% of GEMM' is the best {threads}-thread rate seen: **{_f(ceiling, '{:.1f}')} GFLOP/s**.", "", "## Workloads", "",
           "| workload | data | model | p | n_train | n_test | λ | train / test accuracy | prepared in s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, w in results["workloads"].items():
        s = w["spec"]
        data, model = workload_description(s)
        md.append(f"| {name} | {data} | {model} | {s['n_params']:,} | {s['n_train']:,} | {s['n_test']:,} | {s['regularization']:g} | {s['train_accuracy']:.3f} / {s['test_accuracy']:.3f} | {w['prepare_seconds']:.1f} |")
    for name in results["workloads"]:
        md += ["", f"## {name}", "", "### Seconds per stage", "", *stage_table(results, name, ceiling), "", "### Agreement", "", *agreement_table(results, name)]
        refs = results["references"].get(name, {})
        if refs:
            md += ["", "Exact answers (float64, `benchmarks/peers/reference.py`): " + "; ".join(
                f"{m}: {r.get('solver', '?')} on the first {r['queries']} queries"
                + (f", {r['iterations']} iterations to relative residual {r['max_relative_residual']:.1e}" if "iterations" in r else "")
                + (f" ({r['product_dtype']} products, the residual in float64)" if r.get("product_dtype", "float64") != "float64" else "")
                + (f", smallest eigenvalue of C + λI {r['smallest_eigenvalue_with_lambda']:.3g}" if "smallest_eigenvalue_with_lambda" in r else "")
                + (f", {r['seconds']:.0f} s" if "seconds" in r else f" ({execute.outcome(r)})")
                for m, r in refs.items())]
        low_rank = [(run["config"], run["vs_full_rank"]) for run in results["runs"].values() if run["workload"] == name and "vs_full_rank" in run]
        if low_rank:
            md += ["", "Low-rank query factors against the same side's full-rank scores: " + "; ".join(
                f"{c['side']} rank {c['options']['query_rank']}: Pearson {v['pearson']:.4f}, Spearman {v['spearman']:.4f}" for c, v in low_rank)]
    best: dict[str, tuple[float, str]] = {}
    if any(r["workload"] == "W2" for r in results["rows"]):
        e2e, best = end_to_end(results, threshold)
        md += ["", "## W2 end to end: time against agreement with the converged answer", "",
               f"Each path's total (fit + query factors + pairwise, minimum over its repetitions) and its Pearson with the exact float64 answer of the matrix it "
               f"solves (and with the exact GGN, the matrix EK-FAC approximates). A side's best path is its fastest with Pearson ≥ {threshold}.", "", *e2e, ""]
        for side, (seconds, label) in best.items():
            md.append(f"- {side}: fastest path reaching {threshold}: {label}, {seconds:.1f} s")
    pipe_lines, pipes = pipeline_section(results)
    md += ["", "## Pipeline rows (the whole Prefect flow on the same data and model)", "",
           "`flows/influence_run.py:influence_run` in its own process (ephemeral Prefect API, local Dask cluster of 2 single-threaded workers, "
           "2 torch threads in the flow process, dataset source `npz`, `model.checkpoint` = the workload's state_dict), seconds per stage from "
           "its `summary.json`, beside the library row with the same configuration.", *pipe_lines]
    md += ["", "## Targets", "", *targets(results, ceiling, best, pipes, threshold)]
    md += ["", "## What each side solves", "",
           "- Score convention on every side: +∇ℓ_testᵀ (C + λI)⁻¹ ∇ℓ_train, positive = helpful, C the curvature of the **mean** training loss, "
           "λ absolute and the same number on every side. pyDVL's \"up\" influence has this sign and scale; Kronfluence's pairwise score too, with "
           "its task's loss summed over the batch (per-example gradients of each example's own loss) and its EK-FAC covariances and eigenvalue "
           "corrections averaged over examples. Kronfluence's `damping_factor` is added to the corrected eigenvalues as an absolute number "
           "(`Ekfac.prepare`; its heuristic 0.1·mean eigenvalue applies only when it is None), as ours adds λ.",
           "- `hessian`: the Hessian on both sides. `ggn`: ours' `gauss_newton` is the generalised Gauss-Newton Jᵀ H_ℓ J. `ef`: pyDVL 0.10's "
           "`GAUSS_NEWTON` is the empirical Fisher (1/n) Σ ∇ℓ_i ∇ℓ_iᵀ with the true labels (`GaussNewtonBatchOperation._rank_one_mvp`), a different "
           "matrix, so its agreement is taken against the exact empirical-Fisher answer. `ekfac`: EK-FAC of the Fisher with labels sampled from the "
           "model on both sides (different random labels, so the two are not bit-identical); no exact answer fits W3 (p ≈ 1.16M).",
           "- pyDVL's CG stops at ‖r‖ < rtol²·‖b‖ (so rtol = √(ours' rtol) is passed; per-vector CG takes ‖b‖ as a column norm of the right-hand-side "
           "matrix) and starts from x₀ = b; LiSSA on both sides runs exactly its steps (rtol 1e-12), with the same batch, scale and no damping.",
           "- Kronfluence times query factors and pairwise products in one call (`compute_pairwise_scores`), reported as `scoring`; its factors "
           "and scores pass through its output directory (safetensors) as its API does."]
    md += ["", "## Flop model", "", flops.__doc__.strip().split("\n\n")[0].replace("\n", " ") if flops.__doc__ else "", "",
           "| quantity | flops |", "|---|---|", *[f"| {what} | {formula} |" for what, formula in flops.FORMULAS]]
    if results.get("skipped"):
        md += ["", "## Not run", "", *[f"- {s}" for s in results["skipped"]]]
    md += ["", "## Commands", "", "Harness: `" + " ".join(results["argv"]) + "`. Every subprocess it ran (first repetition of each):", "", "```"]
    seen: set[str] = set()
    for c in results["commands"]:
        if c["command"] not in seen:
            seen.add(c["command"])
            md.append(c["command"])
    md += ["```", "", f"![seconds per stage](peers{suffix}.png)", ""]
    text = "\n".join(md)
    (out / f"peers{suffix}.md").write_text(text)
    plot(results, out / f"peers{suffix}.png")
    return text


def summary(text: str, path: Path) -> str:
    """What the harness prints at the end: where the report is, the per-side bests of W2 and the targets."""
    def section(title: str) -> str:
        start = text.find(f"\n## {title}")
        if start < 0:
            return ""
        end = text.find("\n## ", start + 4)
        return text[start : end if end > 0 else len(text)].strip()

    best = [line for line in text.splitlines() if line.startswith("- ") and "fastest path reaching" in line]
    return "\n".join([f"Report: {path}", *best, "", section("Targets")])
