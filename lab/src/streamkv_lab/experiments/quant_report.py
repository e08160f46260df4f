"""``streamkv quant``'s targets (each issue target, met or not, with its numbers), table and plot."""

from __future__ import annotations

from typing import Any

__all__ = ["targets", "print_quant", "plot_quant"]


def _row(rows: list[dict], **match: Any) -> dict | None:
    for r in rows:
        if all(r.get(k) == v for k, v in match.items()):
            return r
    return None


def targets(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [r for r in doc.get("rows", []) if "error" not in r]
    out: list[dict[str, Any]] = []

    def add(name: str, value: Any, goal: str, met: bool | None, **extra: Any) -> None:
        out.append({"target": name, "value": value, "goal": goal, "met": met, **extra})

    for ds in ("smollm2", "toy-video"):
        bf = _row(rows, dataset=ds, kind="full" if ds == "toy-video" else "ring", format="bf16",
                  memory_tokens=max((r["memory_tokens"] for r in rows if r["dataset"] == ds), default=0))
        for fmt, goal in (("int8", 0.52), ("int4", 0.28)):
            r = _row(rows, dataset=ds, format=fmt, memory_tokens=bf["memory_tokens"] if bf else None)
            if bf and r:
                ratio = r["bytes_per_token"] / bf["bytes_per_token"]
                add(f"bytes per token {fmt} / bf16 ({ds})", round(ratio, 4), f"<= {goal}", ratio <= goal)
    lm = [r for r in rows if r["dataset"] == "smollm2"]
    if lm:
        T = max(r["memory_tokens"] for r in lm)
        full = {r["format"]: r for r in lm if r["kind"] == "ring" and r["memory_tokens"] == T}
        bf = full.get("bf16")
        for fmt, goal in (("int8", 0.001), ("int4", 0.01)):
            if bf and fmt in full:
                rel = full[fmt]["perplexity"] / bf["perplexity"] - 1
                peer = _row(lm, cache="transformers quanto int4") if fmt == "int4" else _row(lm, cache="transformers hqq int8")
                add(f"SmolLM2 perplexity {fmt} vs bf16", round(rel, 5), f"<= {goal:+.1%}", rel <= goal,
                    perplexity=full[fmt]["perplexity"], bf16=bf["perplexity"],
                    peer=None if peer is None else {"cache": peer["cache"], "perplexity": peer["perplexity"],
                                                    "vs_bf16": peer["perplexity"] / bf["perplexity"] - 1})
        quarter = doc.get("smollm2", {}).get("quarter_bytes")
        if quarter and bf:
            small = [r for r in lm if r["memory_tokens"] < T and r.get("device_bytes", 1e30) <= quarter]
            evict = [r for r in small if r["format"] == "bf16"]
            quant = [r for r in small if r["format"] != "bf16"]
            if evict and quant:
                be, bq = min(evict, key=lambda r: r["perplexity"]), min(quant, key=lambda r: r["perplexity"])
                add("SmolLM2 at 1/4 of the bf16 full cache's bytes: best quantised beats best bf16 eviction",
                    {"best_quantised": bq["cache"], "perplexity": bq["perplexity"], "tokens": bq["memory_tokens"],
                     "best_bf16": be["cache"], "bf16_perplexity": be["perplexity"], "bf16_tokens": be["memory_tokens"]},
                    "quantised < bf16 eviction", bq["perplexity"] < be["perplexity"])
                rel = bq["perplexity"] / bf["perplexity"] - 1
                add("SmolLM2 at 1/4 bytes: best quantised within 1% of the full cache", round(rel, 5), "<= +1%",
                    rel <= 0.01, full_bf16=bf["perplexity"], full_fp32=full.get("fp32", {}).get("perplexity"))
    read = doc.get("read")
    if read:
        ratio = read.get("transient_ratio_transformers_over_streamkv")
        add(f"transient bytes per read at {read['tokens']} tokens: transformers' QuantizedCache / streamkv's",
            None if ratio is None else round(ratio, 2), ">= 10x", None if ratio is None else ratio >= 10,
            streamkv_max=max((r["transient_bytes"] for k, r in read["rows"].items()
                              if k.startswith("streamkv ") and "dense" not in k and "fp32" not in k
                              and "transient_bytes" in r), default=None))
        for fmt in ("int8", "int4"):
            r = read["rows"].get(f"streamkv {fmt}")
            if r and "time_vs_bf16_dense" in r:
                add(f"attention time {fmt} / bf16 (this CPU)", round(r["time_vs_bf16_dense"], 3), "<= 2x",
                    r["time_vs_bf16_dense"] <= 2, vs_fp32=round(r["time_vs_fp32"], 3))
    certs = [r for r in rows if r["dataset"] == "smollm2-certified"]
    if certs:
        n = sum(r["certificate_rows"] for r in certs)
        v = sum(r["certificate_violations"] for r in certs)
        add("certificates below the float64 truth", v, "0 over >= 1e5 (query, head) rows", v == 0 and n >= 10**5,
            rows=n)
        worst = max(r["tightness_median"] for r in certs)
        add("certificate tightness median (m_hat / m), worst format", round(worst, 3), "<= 2", worst <= 2,
            per_format={r["format"]: r["tightness_median"] for r in certs})
    return out


def print_quant(doc: dict[str, Any]) -> None:
    cols = ("dataset", "cache", "bits", "memory_tokens", "bytes_per_token", "device_bytes", "transient_bytes",
            "error_mean", "error_p99", "perplexity", "certificate_violations", "tightness_median", "ms_per_chunk")
    print(" | ".join(cols))
    for r in doc.get("rows", []):
        if "error" in r:
            print(f"{r['dataset']} | {r['cache']} | not run: {r['error']}")
            continue
        cells = []
        for c in cols:
            x = r.get(c)
            cells.append(f"{x:.4g}" if isinstance(x, float) else str(x))
        print(" | ".join(cells))
    print("targets:")
    for t in doc.get("targets", []):
        mark = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        print(f"  [{mark}] {t['target']}: {t['value']} (goal {t['goal']})")


def plot_quant(doc: dict[str, Any], path: str) -> None:
    from streamkv_lab.plotting import pyplot, save

    plt = pyplot()
    rows = [r for r in doc.get("rows", []) if "error" not in r and r.get("device_bytes")]
    panels = [("smollm2", "perplexity", "SmolLM2-135M perplexity (Moby-Dick)"),
              ("toy-video", "error_mean", "toy video: error vs full-history rollout")]
    fig, axes = plt.subplots(1, 2, figsize=(14, 6))
    for ax, (ds, key, title) in zip(axes, panels):
        sel = [r for r in rows if r["dataset"] == ds and r.get(key)]  # (the float32 reference's error is 0)
        for r in sel:
            peer = r["cache"].startswith("transformers")
            marker = "s" if peer else ("o" if r["kind"] in ("ring", "full") else "^")
            ax.scatter(r["device_bytes"] / 2**20, r[key], marker=marker, s=40,
                       c="tab:red" if peer else ("tab:blue" if r.get("format") in ("bf16", "fp32") else "tab:green"))
            ax.annotate(f"{r['cache'].replace('streamkv ', '')}@{r['memory_tokens']}", (r["device_bytes"] / 2**20, r[key]),
                        fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("device bytes of the cache (MiB, log)")
        ax.set_ylabel(key + " (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    fig.suptitle("streamkv quant: quantised storage (green), full-precision / bf16 eviction (blue), "
                 "transformers QuantizedCache (red squares)", fontsize=10)
    save(fig, path)
